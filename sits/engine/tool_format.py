"""How a model writes tool calls: the Hermes format (Qwen2/2.5, Hermes, many fine-tunes), as text.

A call is a JSON object between tags, one block per call::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

This module has the three sides of that format: the grammar that makes a model write it
(``tool_call_grammar``, for ``sits.engine.guided``), the parser that reads it back
(``parse_tool_calls``: valid calls, and each malformed one as a reported error, never an
exception), and the rendering of tools and tool turns for a chat template that knows nothing
of tools (``messages_without_tool_support``).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from sits.engine.guided import embedded_schema, lark_grammar

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
MAX_PARALLEL_CALLS = 8
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)


@dataclass(slots=True, frozen=True)
class ToolSpec:
    """One callable function: OpenAI's ``{"type": "function", "function": {...}}`` entry."""

    name: str
    description: str | None = None          # None: the client gave none, and none is rendered
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:        # as the model's own template renders a tool without one
            function["description"] = self.description
        return {"type": "function", "function": function | {"parameters": self.parameters}}

    def call_schema(self) -> dict[str, Any]:
        """The JSON of one call of this function, as the model writes it. The parameters become a
        schema resource of their own (``$id``), so their ``#/$defs/...`` references (pydantic's,
        ``openai.pydantic_function_tool``'s) resolve against them, not against this wrapper."""
        arguments = self.parameters if "$id" in self.parameters else {"$id": f"urn:sits:tool:{self.name}",
                                                                      **self.parameters}
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": arguments},
                "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass(slots=True)
class ParsedOutput:
    """A completion split into its prose and its calls; ``errors`` are the blocks that did not make
    a valid call (``{"index", "code", "message", "text"}``), kept in ``content`` as written."""

    content: str | None
    calls: list[ToolCall]
    errors: list[dict[str, Any]]


def tool_call_grammar(tools: list[ToolSpec], choice: str = "auto", *, parallel: bool = True) -> str | None:
    """The grammar for ``tool_choice``: ``"auto"`` (prose, or calls after optional prose),
    ``"required"`` (one call or more, nothing else), a function name (one call of it), or
    ``"none"`` (no grammar: None)."""
    if choice == "none" or not tools:
        return None
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t.name == choice]
        if not tools:
            raise ValueError(f"no tool named {choice!r}")
        parallel = False
    schemas = [t.call_schema() for t in tools]
    body = embedded_schema(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    repeat = f'("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    rules = [f"calls: call {repeat}".rstrip(),
             f'call: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"',
             f"body: %json {body}"]
    if choice == "auto":
        # prose alone never spells the opening tag; prose before calls is lazy up to the tag (a greedy
        # prose lexeme would swallow "<tool_call" and then refuse the ">")
        more = f'more: body "\\n{CALL_CLOSE}" ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else \
            f'more: body "\\n{CALL_CLOSE}"'
        rules = ["start: TEXT | calls | prose more", _TEXT_RULE,
                 f"prose[lazy]: /(.|\\n)*{re.escape(CALL_OPEN)}\\n/", more] + rules
    else:
        rules = ["start: calls"] + rules
    return lark_grammar("\n".join(rules) + "\n")


_TEXT_RULE = f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{re.escape(CALL_OPEN)}(.|\\n)*/"


def prose_grammar() -> str:
    """Text that contains no tool call (a tool loop's last step, where the model must answer)."""
    return lark_grammar(f"start: TEXT\n{_TEXT_RULE}\n")


def _validator(tool: ToolSpec):
    cls = jsonschema.validators.validator_for(tool.parameters, default=jsonschema.Draft202012Validator)
    return cls(tool.parameters)


def parse_tool_calls(text: str, tools: list[ToolSpec]) -> ParsedOutput:
    """Read the calls out of ``text``; arguments are checked against the function's schema."""
    if CALL_OPEN not in text:
        return ParsedOutput(text, [], [])
    by_name = {t.name: t for t in tools}
    calls: list[ToolCall] = []
    errors: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for i, m in enumerate(_BLOCK.finditer(text)):
        kept.append(text[pos:m.start()])
        pos = m.end()
        raw = m.group(1).strip()

        def fail(code: str, message: str) -> None:
            errors.append({"index": i, "code": code, "message": message, "text": raw[:2000]})
            kept.append(m.group(0))

        if not m.group(0).endswith(CALL_CLOSE):
            fail("incomplete_tool_call", f"the call has no closing {CALL_CLOSE} (output cut off?)")
            continue
        try:
            obj = json.loads(raw)
        except ValueError as e:
            fail("invalid_tool_call_json", f"the call is not JSON: {e}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            fail("invalid_tool_call", 'a call is an object {"name": ..., "arguments": {...}}')
            continue
        tool = by_name.get(obj["name"])
        if tool is None:
            fail("unknown_tool", f"no tool named {obj['name']!r} was offered")
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):          # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        if not isinstance(args, dict):
            fail("invalid_tool_arguments", f"{tool.name}: arguments must be an object")
            continue
        problems = sorted(_validator(tool).iter_errors(args), key=lambda e: list(e.absolute_path))
        if problems:
            where = "/".join(str(p) for p in problems[0].absolute_path) or "(root)"
            fail("invalid_tool_arguments", f"{tool.name}: arguments at {where}: {problems[0].message}")
            continue
        calls.append(ToolCall(f"call_{uuid.uuid4().hex[:24]}", tool.name, args))
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return ParsedOutput(content or None, calls, errors)


# -- chat templates that know nothing of tools ----------------------------------------------------
def tools_system_prompt(tools: list[ToolSpec]) -> str:
    lines = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more of these functions to answer. Their signatures, one per "
            f"line:\n<tools>\n{lines}\n</tools>\n\nTo call one, write its name and arguments as JSON between "
            f'tags:\n{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CALL_CLOSE}')


def template_supports_tools(source: str | None) -> bool:
    """Whether a Jinja chat template renders ``tools`` and tool turns itself."""
    return bool(source) and "tools" in source and "tool_calls" in source


def render_call(call: dict[str, Any]) -> str:
    """An OpenAI ``tool_calls`` entry as the model would have written it."""
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    return f"{CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def messages_without_tool_support(messages: list[dict[str, Any]], tools: list[ToolSpec] | None) -> list[dict]:
    """Rewrite tool turns as plain ones: the tool list joins the system prompt, an assistant's calls
    become its text, and a tool's result becomes a user turn inside ``<tool_response>`` tags."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            text = "\n".join(([m["content"]] if m.get("content") else []) + [render_call(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": text})
        elif role in ("tool", "function"):
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if tools:
        prompt = tools_system_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


__all__ = ["ToolSpec", "ToolCall", "ParsedOutput", "tool_call_grammar", "prose_grammar", "parse_tool_calls",
           "messages_without_tool_support", "template_supports_tools", "tools_system_prompt", "CALL_OPEN",
           "CALL_CLOSE"]
