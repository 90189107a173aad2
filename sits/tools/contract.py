"""A tool contract: what a tool is, what it may touch, and how long and how much it may run.

    id: file.read
    version: 1.2.0
    description: Read a text file from the data directory.
    parameters: {type: object, properties: {path: {type: string}}, required: [path]}
    argv: [path]                    # how arguments reach the module (WASI argv, in this order)
    timeout_ms: 2000
    side_effects: ["read:fs:/data/*"]
    quotas: {fuel: 50000000, memory_mb: 16}
    module: file_read.wat           # next to this file (.wat or .wasm)

Side effects are the whole capability set: ``read:fs:<guest dir>/*`` pre-opens that directory
read-only, ``write:fs:<guest dir>/*`` read-write, ``net:none`` is the only network there is (WASI
preview 1 has no sockets). Which host directory backs a guest directory is the deployment's choice
(``tool_dirs`` of a unit, ``--dir`` of ``sits tool run``), never the tool's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sits.tools.semver import SemverError, Version

_EFFECT = re.compile(r"^(read|write):fs:(/[A-Za-z0-9._/-]*?)/\*$|^net:none$")


class ToolError(Exception):
    """A tool call that did not produce a result; ``code`` is stable."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Quotas(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fuel: int = Field(100_000_000, ge=1_000, le=100_000_000_000,
                      description="wasm instructions (roughly) the call may execute")
    memory_mb: int = Field(16, ge=1, le=4096, description="linear memory the module may grow to")


class ToolContract(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(..., pattern=r"^[a-z][a-z0-9_.-]{0,63}$")
    version: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    argv: list[str] = Field(default_factory=list, description="argument names passed as WASI argv, in order")
    timeout_ms: int = Field(2000, ge=1, le=600_000)
    side_effects: list[str] = Field(default_factory=lambda: ["net:none"])
    quotas: Quotas = Field(default_factory=Quotas)
    runtime: Literal["wasm", "python"] = "wasm"
    module: str | None = Field(None, description="the .wat/.wasm file (runtime wasm), relative to the contract")
    entry: str | None = Field(None, description="runtime python: 'package.module:function'")
    source_dir: str | None = Field(None, exclude=True)

    @field_validator("version")
    @classmethod
    def _semver(cls, v: str) -> str:
        try:
            Version.parse(v)
        except SemverError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("side_effects")
    @classmethod
    def _effects(cls, v: list[str]) -> list[str]:
        for e in v:
            if not _EFFECT.match(e):
                raise ValueError(f"side effect {e!r}: use read:fs:/dir/*, write:fs:/dir/* or net:none")
        return v

    @property
    def ref(self) -> str:
        return f"{self.id}@{self.version}"

    @property
    def semver(self) -> Version:
        return Version.parse(self.version)

    def mounts(self) -> list[tuple[str, bool]]:
        """(guest directory, writable) for each declared file-system side effect."""
        out = []
        for e in self.side_effects:
            m = _EFFECT.match(e)
            if m and m.group(1):
                out.append((m.group(2) or "/", m.group(1) == "write"))
        return out

    def module_path(self) -> Path:
        if self.module is None:
            raise ToolError("tool_misconfigured", f"tool {self.ref} names no module")
        return Path(self.source_dir or ".") / self.module

    def to_openai_tool(self) -> dict:
        """The OpenAI ``tools`` entry for this contract (function name = id with dots as underscores)."""
        return {"type": "function", "function": {"name": self.id.replace(".", "_"), "description": self.description,
                                                 "parameters": self.parameters}}

    @classmethod
    def load(cls, path: str | Path) -> "ToolContract":
        path = Path(path)
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        return cls.model_validate({**data, "source_dir": str(path.parent)})
