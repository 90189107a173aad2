"""The tool contracts a runtime knows: the built-ins shipped in ``sits/tools/builtin`` plus any
directory of ``*.yaml`` contracts; ``resolve("file.read@^1.2")`` is the highest version matching.

A unit lists the tools it allows (``tools: ["file.read@^1.2"]``); a request's ``allowed_tools``
must each be satisfiable inside that list, or the request is REJECTED during VALIDATING.
"""

from __future__ import annotations

from pathlib import Path

from sits.tools.contract import ToolContract, ToolError
from sits.tools.semver import Constraint, SemverError, split_ref

BUILTIN_DIR = Path(__file__).parent / "builtin"


class ToolRegistry:
    def __init__(self, dirs: list[str | Path] | None = None, *, builtins: bool = True):
        self._by_id: dict[str, list[ToolContract]] = {}
        for d in ([BUILTIN_DIR] if builtins else []) + [Path(p) for p in dirs or []]:
            for path in sorted(Path(d).glob("*.yaml")):
                self.add(ToolContract.load(path))

    def add(self, contract: ToolContract) -> None:
        versions = self._by_id.setdefault(contract.id, [])
        versions[:] = [c for c in versions if c.version != contract.version] + [contract]
        versions.sort(key=lambda c: c.semver)

    def all(self) -> list[ToolContract]:
        return [c for vs in self._by_id.values() for c in vs]

    def matching(self, ref: str) -> list[ToolContract]:
        try:
            name, text = split_ref(ref)
            constraint = Constraint.parse(text)
        except SemverError as e:
            raise ToolError("invalid_tool_ref", str(e)) from None
        return [c for c in self._by_id.get(name, []) if constraint.allows(c.semver)]

    def resolve(self, ref: str) -> ToolContract:
        found = self.matching(ref)
        if not found:
            known = ", ".join(c.ref for c in self._by_id.get(split_ref(ref)[0], [])) or "none"
            raise ToolError("tool_not_found", f"no tool matches {ref!r} (versions known: {known})")
        return found[-1]

    def allowed(self, requested: list[str], unit_tools: list[str]) -> list[ToolContract]:
        """The contracts a request may use: each requested ref resolved among the unit's allowed versions."""
        unit_set = {c.ref: c for ref in unit_tools for c in self.matching(ref)}
        out = []
        for ref in requested:
            ok = [c for c in self.matching(ref) if c.ref in unit_set]
            if not ok:
                raise ToolError("tool_not_allowed", f"{ref!r} is not among this unit's tools "
                                                    f"({', '.join(unit_tools) or 'none'})")
            out.append(ok[-1])
        return out
