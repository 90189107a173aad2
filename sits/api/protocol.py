"""Request and response bodies of both dialects, as pydantic models (they are the OpenAPI schema).

Requests are strict about types (``"max_tokens": "5"`` is a 400, not a silent coercion) and
lenient about unknown fields: those are accepted, ignored and named in a ``Warning`` header, as
vLLM does, so clients that send parameters SITS does not implement keep working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from sits.engine.sampling_params import MAX_LOGPROBS, MIN_REPETITION_PENALTY
from sits.engine.tokenizer import join_text_parts

MAX_N = 16
MEMORY_SET = r"^[a-z0-9][a-z0-9._-]{0,63}$"
MAX_STOP = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Body(BaseModel):
    """A part of a request body: strict types, unknown fields accepted (and ignored)."""

    model_config = ConfigDict(strict=True, extra="allow")


class _Request(_Body):
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def warning_header(self) -> str | None:
        """``Warning: 299`` naming the ignored fields (ASCII-escaped, bounded), or None."""
        names = self.ignored_fields()
        if not names:
            return None
        shown = ", ".join(n.encode("ascii", "backslashreplace").decode().replace('"', "'") for n in names[:20])
        shown = "".join(ch if 0x20 <= ord(ch) < 0x7F else "?" for ch in shown)[:512]
        more = f" (+{len(names) - 20} more)" if len(names) > 20 else ""
        return f'299 sits "ignored unknown field(s): {shown}{more}"'


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Request):
    """What completions and chat completions share."""

    model: str = Field(..., min_length=1, description="a served model (GET /v1/models)")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 means greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1_000_000, description="-1 or 0 disables top-k")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} stop strings")
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=10.0)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    priority: int = Field(0, ge=-1000, le=1000, description="higher is served sooner (pfsd scheduler)")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="a string, a list of strings, token ids, or a list of token-id lists")
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="the prompt's text in front of each choice's (not with logprobs)")
    best_of: int | None = Field(None, ge=1, description="must equal n when given (vLLM V1 does not rank extra "
                                                         "samples either)")
    add_special_tokens: bool = Field(True, description="a text prompt gets the tokenizer's special tokens (its BOS, "
                                                       "when the tokenizer adds one), as in vLLM")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str = Field(..., min_length=1, max_length=64)
    arguments: str = Field("{}", description="the arguments, JSON-encoded (as OpenAI sends them)")


class ToolCallMessage(_Body):
    """One call in an assistant turn the client sends back (the model's earlier answer)."""

    id: str = Field(..., min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = Field(None, max_length=64, description="assistant turns: its calls")
    tool_call_id: str | None = Field(None, max_length=128, description="tool turns: the call this answers")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return join_text_parts([p.text for p in self.content])

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (tool calls and the call a tool turn answers kept)."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text() if self.content is not None else None}
        if self.name:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class FunctionDefinition(_Body):
    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=8192)
    parameters: dict[str, Any] | None = Field(None, description="JSON Schema of the arguments (default: no arguments)")
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[ChatTool] | None = Field(None, max_length=128, description="functions the model may call")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without; calls are grammar-constrained")
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = Field(None, description="json_object / json_schema: grammar-constrained")
    memory_ref: str | None = Field(None, pattern=MEMORY_SET,
                                   description="SITS extension: a memory set whose closest memories join the "
                                               "system prompt (returned as citations)")
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1, description="alias of max_tokens (newer clients)")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = Field(False, description="also add the tokenizer's special tokens to the rendered "
                                                        "conversation (its template usually spells them out)")


MINILM = "all-minilm-l6-v2"    # the memory embedder, servable by name from /v1/embeddings


class EmbeddingRequest(_Request):
    model: str = Field(..., min_length=1, description=f'a served model, or "{MINILM}" (the memory embedder)')
    input: str | list[str] | list[int] | list[list[int]] = Field(..., description="text(s) or token ids")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)


# -- responses (documented in the OpenAPI schema) -----------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    tool_call_errors: list[dict[str, Any]] | None = Field(
        None, description="tool-call blocks the model wrote that are not valid calls (kept in content)")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "sits"
    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None       # a LoRA adapter's base model (its id is ``<parent>:<adapter>``)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- the SITS dialect ---------------------------------------------------------------------------
class Constraints(_Body):
    max_tokens: int = Field(64, ge=1)
    timeout_ms: int | None = Field(None, ge=1, le=24 * 3600 * 1000,
                                   description="from acceptance to the end; REJECTED `timeout` when it runs out")
    priority: int = Field(0, ge=-1000, le=1000, description="higher is served sooner")


class SitsRequest(_Request):
    """``POST /v1/requests``: work submitted now, followed through its states, answered later."""

    unit: str | None = Field(None, min_length=1, description="the unit (served model); default: the only one")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    memory_ref: str | None = Field(None, pattern=MEMORY_SET,
                                   description="a memory set: its closest memories go in front of the question")
    allowed_tools: list[Annotated[str, StringConstraints(min_length=1, max_length=128)]] | None = Field(
        None, max_length=64, description='tool contracts with semver constraints, e.g. "file.read@^1.2"; '
                                         "the runtime runs the calls and gives the results back to the model")
    tool_choice: str = Field("auto", min_length=1, max_length=128,
                             description='first step: "auto", "required", "none", or a tool id (e.g. "math.eval")')
    max_tool_steps: int = Field(4, ge=1, le=16, description="model turns that may call tools before it must answer")
    constraints: Constraints = Field(default_factory=Constraints)
    callback_url: str | None = Field(None, max_length=2048, description="receives every transition as a POST")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    interactive: bool = Field(False, description="a user watches the stream (vs a batch job)")
    remember: bool = Field(False, description="with memory_ref: write the question and answer into that set")


class SitsRequestView(BaseModel):
    """What ``GET /v1/requests/{id}`` answers: state, timings, and the result once terminal."""

    id: str
    object: Literal["sits.request"] = "sits.request"
    unit: str | None = None
    state: Literal["PENDING", "VALIDATING", "EXECUTING", "RESOLVED", "REJECTED"]
    created_ns: int
    updated_ns: int
    transitions: list[dict[str, Any]]
    output: str | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    timings: dict[str, float | None] = {}
    error: dict[str, Any] | None = None
    events_url: str
    citations: list[dict[str, Any]] | None = Field(None, description="memories retrieved for it (memory_ref)")
    memories_written: list[str] | None = None
    tool_steps: list[dict[str, Any]] | None = Field(None, description="the tool loop's steps: text, calls, results")
