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

from sits.api.protocol import ChatCompletionRequest
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


def tool_specs(body: ChatCompletionRequest) -> list[ToolSpec]:
    specs, seen = [], set()
    for i, t in enumerate(body.tools or []):
        fn = t.function
        if fn.name in seen:
            raise InvalidRequestError(f"tools[{i}]: a second function named {fn.name!r}", param=f"tools[{i}]",
                                      code="invalid_parameter")
        seen.add(fn.name)
        params = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        check_schema(params, f"tools[{i}].function.parameters")
        specs.append(ToolSpec(fn.name, fn.description, params))
    return specs


def chat_guidance(body: ChatCompletionRequest) -> Guidance:
    tools = tool_specs(body)
    choice = body.tool_choice
    name = choice if isinstance(choice, str) or choice is None else choice.function.name
    if name is None:
        name = "auto" if tools else "none"
    if name != "none" and not tools:
        raise InvalidRequestError(f"tool_choice {name!r} needs tools", param="tool_choice", code="invalid_parameter")
    if name not in ("none", "auto", "required") and name not in {t.name for t in tools}:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice",
                                  code="invalid_parameter")
    fmt = body.response_format
    wants_json = fmt is not None and fmt.type != "text"
    if wants_json and name != "none":
        raise InvalidRequestError("response_format asks for JSON and tool_choice for tool calls: use one "
                                  '(tool_choice: "none" to answer in JSON)', param="response_format",
                                  code="invalid_parameter")
    if name != "none":
        return Guidance(tool_call_grammar(tools, name, parallel=body.parallel_tool_calls), tools, name)
    if not wants_json:
        return Guidance(None, tools, "none")
    if fmt.type == "json_object":
        return Guidance(json_object_grammar(), tools, "none")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequestError('response_format {"type": "json_schema"} needs json_schema.schema',
                                  param="response_format", code="invalid_parameter")
    check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    return Guidance(json_schema_grammar(fmt.json_schema.schema_), tools, "none")


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
