"""What a chat request asks of the grammar: tool calls (``tools`` + ``tool_choice``) or a JSON
answer (``response_format``), and how the answer is read back into OpenAI's message shape.

Calls are grammar-constrained (``sits.engine.guided``), so a call the model starts is a call that
parses against its function's schema; the only malformed calls left are the ones cut off by
``max_tokens``, and those are reported in ``tool_call_errors``, never raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jsonschema

from sits.api.protocol import ChatCompletionRequest, FunctionDefinition
from sits.engine.errors import InvalidRequestError
from sits.engine.guided import json_object_grammar, json_schema_grammar
from sits.engine.tool_format import CALL_OPEN, ParsedOutput, ToolSpec, parse_tool_calls, tool_call_grammar


@dataclass(slots=True)
class Guidance:
    """The grammar for one chat request, and the tools whose calls its output may contain."""

    grammar: str | None = None
    tools: list[ToolSpec] = field(default_factory=list)
    choice: str = "none"

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    def parse(self, text: str) -> ParsedOutput:
        return parse_tool_calls(text, self.tools) if self.calls_tools else ParsedOutput(text, [], [])


def tool_specs(functions: list[FunctionDefinition], where: str = "tools[{i}].function") -> list[ToolSpec]:
    """The functions a request offers, checked: unique names, valid parameter schemas (``where``
    names a function's place in the request, for errors)."""
    specs, seen = [], set()
    for i, fn in enumerate(functions):
        if fn.name in seen:
            raise InvalidRequestError(f"tools[{i}]: a second function named {fn.name!r}", param=f"tools[{i}]",
                                      code="invalid_parameter")
        seen.add(fn.name)
        params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        check_schema(params, where.format(i=i) + ".parameters")
        specs.append(ToolSpec(fn.name, fn.description, params))
    return specs


def chat_guidance(body: ChatCompletionRequest) -> Guidance:
    choice = body.tool_choice
    fmt = body.response_format
    return make_guidance(tool_specs([t.function for t in body.tools or []]),
                         choice if isinstance(choice, str) or choice is None else choice.function.name,
                         fmt.type if fmt is not None else None,
                         fmt.json_schema.schema_ if fmt is not None and fmt.json_schema is not None else None,
                         parallel=body.parallel_tool_calls, format_param="response_format",
                         schema_param="response_format.json_schema.schema")


def make_guidance(tools: list[ToolSpec], choice: str | None, json_format: str | None, schema: dict | None, *,
                  parallel: bool, format_param: str, schema_param: str) -> Guidance:
    """The grammar for ``tool_choice`` over ``tools``, or for a JSON answer (``json_format``:
    json_object / json_schema with ``schema``), as both the chat and the Responses API ask for them."""
    name = choice
    if name is None:
        name = "auto" if tools else "none"
    if name != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {name!r} needs tools", param="tool_choice", code="invalid_parameter")
    if name not in ("none", "auto", "required") and name not in {t.name for t in tools}:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice",
                                  code="invalid_parameter")
    wants_json = json_format is not None and json_format != "text"
    if wants_json and name != "none":
        raise InvalidRequestError(f"{format_param} asks for JSON and tool_choice for tool calls: use one "
                                  '(tool_choice: "none" to answer in JSON)', param=format_param,
                                  code="invalid_parameter")
    if name != "none":
        return Guidance(tool_call_grammar(tools, name, parallel=parallel), tools, name)
    if not wants_json:
        return Guidance(None, tools, "none")
    if json_format == "json_object":
        return Guidance(json_object_grammar(), tools, "none")
    if schema is None:
        raise InvalidRequestError(f'{format_param} {{"type": "json_schema"}} needs {schema_param}',
                                  param=format_param, code="invalid_parameter")
    check_schema(schema, schema_param)
    return Guidance(json_schema_grammar(schema), tools, "none")


def check_schema(schema: dict[str, Any], param: str) -> None:
    """A JSON Schema that is not one (by its own metaschema) is the client's error, said plainly."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise InvalidRequestError(f"{param} is not a valid JSON Schema: at {where}: {e.message[:300]}", param=param,
                                  code="invalid_schema") from None


def assistant_message(guidance: Guidance, text: str, finish_reason: str | None) -> tuple[dict, str | None, list]:
    """The non-streamed ``message``, its finish reason (``tool_calls`` when it made any and was not
    cut off) and errors."""
    parsed = guidance.parse(text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [c.openai() for c in parsed.calls]
        if finish_reason != "length":     # an answer cut off by max_tokens says so, calls or not
            finish_reason = "tool_calls"
    return message, finish_reason, parsed.errors


class ToolCallStream:
    """Streams one choice of a tool-calling request: prose goes out as it comes, except a tail that
    could be the start of ``<tool_call>``; from the first call on, text is held and read at the
    end into ``tool_calls`` deltas (one per call, with its whole arguments)."""

    def __init__(self, guidance: Guidance):
        self.guidance = guidance
        self.text = ""
        self.sent = 0              # characters of self.text already streamed as content
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """Content safe to stream now."""
        self.text += delta
        if self.in_calls:
            return ""
        at = self.text.find(CALL_OPEN, self.sent)
        if at >= 0:
            self.in_calls = True
            end = at
        else:
            end = len(self.text)
            for k in range(min(len(CALL_OPEN) - 1, end - self.sent), 0, -1):   # a partial tag at the end
                if CALL_OPEN.startswith(self.text[end - k:]):
                    end -= k
                    break
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[dict], list[dict]]:
        """(content still unsent, ``tool_calls`` deltas, errors) once the choice has ended."""
        parsed = self.guidance.parse(self.text[self.sent:])
        rest = parsed.content or ""
        deltas = [{"index": k, **c.openai()} for k, c in enumerate(parsed.calls)]
        return rest, deltas, parsed.errors
