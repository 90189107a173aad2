"""The Responses API's request (``POST /v1/responses``) and how its input becomes a conversation.

The Responses API is what newer OpenAI SDKs and agent frameworks call: ``input`` is a string or a
list of items (messages with text parts, the model's earlier ``function_call`` items and the
client's ``function_call_output`` items), ``instructions`` is the system prompt, and a request may
continue a stored response by ``previous_response_id``. SITS reads the items into the chat messages
its templates render, so a conversation means the same through either API. Items SITS cannot read
(images, files, hosted tools) are refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from sits.api.protocol import FUNCTION_NAME, SEED_MAX, SEED_MIN, FunctionDefinition, _Body, _Request
from sits.engine.errors import InvalidRequestError
from sits.engine.sampling_params import MAX_LOGPROBS, MIN_REPETITION_PENALTY
from sits.engine.tokenizer import join_text_parts

MAX_INPUT_ITEMS = 4096
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = None


class ResponsesTool(_Body):
    """A function tool, flat as the Responses API spells it (``name`` beside ``type``)."""

    type: str = Field(..., max_length=64, description='"function"; hosted tools are not served')
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(_Body):
    type: Literal["function"]
    name: str = Field(..., pattern=FUNCTION_NAME)


class ResponsesRequest(_Request):
    model: str = Field(..., min_length=1, description="a served model (GET /v1/models)")
    input: str | list[dict[str, Any]] = Field(..., description="a string, or a list of input items")
    instructions: str | None = Field(None, description="the system prompt (not carried to later responses)")
    max_output_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1_000_000, description="vLLM extension")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM extension")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="vLLM extension")
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10.0, description="vLLM extension")
    stream: bool = False
    tools: list[ResponsesTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    store: bool = Field(True, description="keep the response (in this server's memory) for GET and "
                                          "previous_response_id")
    previous_response_id: str | None = Field(None, max_length=128)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    include: list[str] | None = Field(None, max_length=16, description=f'"{LOGPROBS_INCLUDE}" is served')
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    user: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256, description="accepted; SITS caches prefixes itself")
    priority: int = Field(0, ge=-1000, le=1000, description="SITS extension: higher is served sooner")

    def check_supported(self) -> None:
        """What the request asks for that SITS does not do is a 400 naming it, not a silent default."""
        if self.background:
            raise InvalidRequestError("background responses are not served; submit to /v1/requests for "
                                      "asynchronous work", param="background", code="unsupported_parameter")
        if self.truncation == "auto":
            raise InvalidRequestError('truncation "auto" is not served: SITS does not drop a conversation\'s '
                                      'items; a request longer than the context is refused', param="truncation",
                                      code="unsupported_parameter")
        for name in self.include or []:
            if name != LOGPROBS_INCLUDE:
                raise InvalidRequestError(f"include {name!r} is not served (only {LOGPROBS_INCLUDE!r})",
                                          param="include", code="unsupported_parameter")
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function":
                raise InvalidRequestError(f"tools[{i}]: {tool.type!r} tools are hosted by OpenAI, not served "
                                          "here; declare a function tool", param=f"tools[{i}].type",
                                          code="unsupported_parameter")
            if tool.name is None:
                raise InvalidRequestError(f"tools[{i}]: a function tool needs a name", param=f"tools[{i}].name",
                                          code="invalid_parameter")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    def functions(self) -> list[FunctionDefinition]:
        return [FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)
                for t in self.tools or []]


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from a Responses ``input``: messages keep their role (``developer`` reads as
    ``system``), consecutive ``function_call`` items become one assistant turn with its
    ``tool_calls``, a ``function_call_output`` becomes the ``tool`` turn answering its call."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise InvalidRequestError("input is empty", param="input", code="empty_prompt")
    if len(items) > MAX_INPUT_ITEMS:
        raise InvalidRequestError(f"input has {len(items)} items; at most {MAX_INPUT_ITEMS}", param="input",
                                  code="invalid_parameter")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise InvalidRequestError(f"{where}: items of type {kind!r} are not served (message, function_call, "
                                      "function_call_output)", param=f"{where}.type", code="unsupported_parameter")
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer", param=f"{where}.role",
                                  code="invalid_parameter")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _parts_text(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text parts", param=where,
                                  code="invalid_parameter")
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequestError(f"{where}[{k}]: parts of type {kind!r} are not served (input_text, "
                                      "output_text)", param=f"{where}[{k}].type", code="unsupported_parameter")
        texts.append(_string(part, "text", f"{where}[{k}]"))
    return join_text_parts(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(f"{where}.{key} must be a string", param=f"{where}.{key}", code="invalid_parameter")
    return value
