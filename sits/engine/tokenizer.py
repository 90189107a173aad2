"""The model directory's tokenizer: ``tokenizer.json`` plus the Hugging Face metadata around it.

Only the Rust ``tokenizers`` library and jinja2 are used (no ``transformers`` at runtime). Chat
templates come from untrusted model repositories, so they render in jinja2's immutable sandbox
with the same globals and filters Hugging Face provides, which is what the templates expect.
"""

from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import tokenizers

from sits.engine.errors import ContextLengthExceededError, InvalidRequestError, ModelLoadError
from sits.engine.tool_format import ToolSpec, messages_without_tool_support, template_supports_tools

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(value: Any, param: str) -> None:
    """400 ``invalid_text`` if a string in ``value`` (or in its lists and dicts, keys included) holds
    a lone UTF-16 surrogate. JSON can spell one (``"\\ud800"``), UTF-8 cannot: a tokenizer, an
    embedder, or a later JSON answer that echoes it would fail as a 500. Every route that hands
    client text to one of those checks it here first (iteratively: client JSON may nest deeply)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _LONE_SURROGATE.search(v):
                raise InvalidRequestError("the text contains a lone UTF-16 surrogate (U+D800..U+DFFF), which is not "
                                          "valid Unicode; send well-formed UTF-8", param=param, code="invalid_text")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, ``{}`` when the file is absent (every metadata file is optional)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """``tokenizer_config.json`` stores a special token as a string or as a serialized AddedToken."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _load_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """Newer transformers save the template as ``chat_template.jinja`` / ``chat_template.json``;
    older ones inline it in ``tokenizer_config.json``, possibly as a list of named templates."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) and template else None


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant spans for training masks in HF;
    for inference it only has to render its body, but templates using it must still compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> NoReturn:
    raise InvalidRequestError(f"chat template rejected the messages: {message}", param="messages",
                              code="invalid_messages")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and ', which would change the rendered prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str, origin: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"{origin}: chat template has a syntax error at line {e.lineno}: {e.message}") from None


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI-style messages and flatten text content parts into one string.

    Templates index ``message['content']`` as a string, so a list of ``{"type": "text"}`` parts is
    joined with newlines (as vLLM does); any other part type is not something a text model takes.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages",
                                  code="invalid_messages")
    normalized = []
    call_ids: set[str] = set()      # tool turns answer calls made earlier in the conversation
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object, got {type(message).__name__}",
                                      param=where, code="invalid_messages")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {', '.join(sorted(CHAT_ROLES))}, "
                                      f"got {role!r}", param=f"{where}.role", code="invalid_messages")
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequestError(
                        f"{where}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                        param=f"{where}.content", code="invalid_messages")
                texts.append(part["text"])
            content = join_text_parts(texts)
        elif content is None:
            if role != "assistant":
                raise InvalidRequestError(f"{where}.content is required for role {role!r}",
                                          param=f"{where}.content", code="invalid_messages")
            content = ""        # e.g. an assistant turn that only called tools
        elif not isinstance(content, str):
            raise InvalidRequestError(f"{where}.content must be a string or a list of text parts, "
                                      f"got {type(content).__name__}", param=f"{where}.content",
                                      code="invalid_messages")
        out = {**message, "content": content}
        if role == "assistant" and message.get("tool_calls") is not None:
            out["tool_calls"] = _normalize_tool_calls(message["tool_calls"], where)
            call_ids.update(str(c.get("id")) for c in out["tool_calls"] if c.get("id") is not None)
        if role == "tool" and str(message.get("tool_call_id")) not in call_ids:
            raise InvalidRequestError(f"{where}: a tool message must answer a call of a preceding assistant "
                                      f"message (tool_call_id {message.get('tool_call_id')!r} matches none)",
                                      param=f"{where}.tool_call_id", code="invalid_messages")
        normalized.append(out)
    return normalized


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls``, with JSON-string arguments parsed (templates print
    them with ``tojson``, and an already-encoded string would be quoted twice)."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls",
                                  code="invalid_messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]):
            raise InvalidRequestError(f"{where}.tool_calls[{j}] must be {{'type': 'function', 'function': "
                                      "{'name': ..., 'arguments': ...}}", param=f"{where}.tool_calls",
                                      code="invalid_messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass        # rendered as the string it is
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


_LENGTH_SLACK = 4     # normalizers may drop characters: refuse only text far beyond the bound


def join_text_parts(texts: list[str]) -> str:
    """A message's text content parts as one string, the way vLLM joins them (one place for the
    Python API and HTTP, so both send the model the same prompt)."""
    return "\n".join(texts)


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as -> the byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF_CHAR = _gpt2_byte_alphabet()


class Tokenizer:
    """Encode, decode and chat-format for one model.

    ``vocab_size`` counts added tokens; the model's logits may be wider (padded embeddings).
    ``eos_token_ids`` merges every source of end-of-sequence ids (generation_config.json,
    config.json, the tokenizer's eos token), because chat models often end turns with a token
    other than the base model's eos; it may be empty when a model declares none.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_token_ids: list[int],
                 bos_token_id: int | None, pad_token_id: int | None = None,
                 bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, chat_template: str | None = None,
                 source: str = "tokenizer"):
        self.backend = backend
        self._encode_fast = getattr(backend, "encode_batch_fast", None)    # tokenizers >= 0.21
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self._template_origin = source
        self._compiled_template = (_compile_chat_template(chat_template, source)
                                   if chat_template is not None else None)
        self._template_renders_tools = template_supports_tools(chat_template)

    def __getstate__(self) -> dict:
        """Picklable (a zygote's loader process sends one): the compiled template is compiled again."""
        state = dict(self.__dict__)
        del state["_compiled_template"], state["_encode_fast"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._encode_fast = getattr(self.backend, "encode_batch_fast", None)
        self._compiled_template = (_compile_chat_template(self.chat_template, self._template_origin)
                                   if self.chat_template is not None else None)

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        """Load ``tokenizer.json`` (required) and the optional HF metadata files beside it; or the
        tokenizer a GGUF file describes."""
        from sits.engine.gguf_model import open_gguf

        gguf = open_gguf(model_dir)
        if gguf is not None:
            tok = gguf.tokenizer()
            tok.max_token_chars  # noqa: B018 - computed at load, as below
            return tok
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: not found; SITS needs a fast-tokenizer tokenizer.json in the "
                                 "model directory (convert a slow tokenizer with transformers' "
                                 "AutoTokenizer.from_pretrained(...).save_pretrained(...))", param="model")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any parse failure
            raise ModelLoadError(f"{path}: cannot be loaded by the tokenizers library: {e}") from None

        config = _read_json(root / "tokenizer_config.json")
        generation_config = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        def token_id(token: str | None) -> int | None:
            return backend.token_to_id(token) if token is not None else None

        bos_token = _token_content(config.get("bos_token"))
        eos_token = _token_content(config.get("eos_token"))
        pad_token = _token_content(config.get("pad_token"))
        eos_ids: list[int] = []
        tokenizer_eos = token_id(eos_token)
        for candidate in (_id_list(generation_config.get("eos_token_id"))
                          + _id_list(model_config.get("eos_token_id"))
                          + ([tokenizer_eos] if tokenizer_eos is not None else [])):
            if candidate not in eos_ids:
                eos_ids.append(candidate)
        bos_id = token_id(bos_token)
        if bos_id is None:
            bos_id = next(iter(_id_list(generation_config.get("bos_token_id"))
                               or _id_list(model_config.get("bos_token_id"))), None)
        pad_id = token_id(pad_token)
        tok = cls(backend, eos_token_ids=eos_ids, bos_token_id=bos_id, pad_token_id=pad_id,
                  bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                  chat_template=_load_chat_template(root, config), source=str(root))
        tok.max_token_chars  # noqa: B018 - computed at load (a vocabulary scan), not on a first request
        return tok

    def encode(self, text: str, add_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text``; special-token strings in it (e.g. ``<|im_start|>``) map to their ids.

        ``add_special_tokens`` runs the tokenizer's post-processor (e.g. Llama's BOS). Leave it off
        for rendered chat templates, which already spell out their special tokens. ``max_tokens``:
        text that cannot possibly fit in that many tokens is refused before it is tokenized (a 10 MB
        prompt would otherwise hold the caller for seconds just to be told it is too long).
        """
        if max_tokens is not None and len(text) > _LENGTH_SLACK * max_tokens * self.max_token_chars:
            raise ContextLengthExceededError(
                f"the text has {len(text)} characters; at most {self.max_token_chars} characters per token, "
                f"it cannot fit in this model's {max_tokens} tokens", param="prompt")
        try:
            if self._encode_fast is not None:     # no character offsets: ~20 % less per call
                return self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            check_text(text, "prompt")      # the tokenizer's TypeError for a lone surrogate, said plainly
            raise

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text, in characters (bounds how much text a token count can hold)."""
        return max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1) or 1

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE piece may be half a UTF-8 character, which
        decoding the token alone would turn into U+FFFD): byte-level pieces through GPT-2's byte
        alphabet, SentencePiece byte tokens ``<0xNN>`` and ``▁`` as a space, special tokens as written."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id not in self._special_ids:
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes((int(piece[3:5], 16),))
                except ValueError:
                    pass
            return piece.replace("\u2581", " ").encode()
        return piece.encode()

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _byte_level(self) -> bool:
        return "ByteLevel" in json.dumps(json.loads(self.backend.to_str()).get("decoder"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode_chat(self, messages: list[dict], *, tools: list[ToolSpec] | None = None,
                    add_generation_prompt: bool = True, add_special_tokens: bool = False,
                    max_tokens: int | None = None) -> list[int]:
        """The conversation rendered by the chat template and encoded. The template spells out its
        special tokens, so none are added unless asked (``add_special_tokens``)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools),
                           add_special_tokens=add_special_tokens, max_tokens=max_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[ToolSpec] | None = None) -> str:
        """Render OpenAI-style ``messages`` (and the ``tools`` on offer) into the prompt text the
        model was trained on. A template that does not render tools itself gets them, and any tool
        turns, rewritten in the Hermes format (see ``sits.engine.tool_format``)."""
        if self._compiled_template is None:
            raise InvalidRequestError("this model has no chat template; send a plain prompt to the "
                                      "completions endpoint instead", param="messages",
                                      code="no_chat_template")
        normalized = _normalize_messages(messages)
        has_tool_turns = any(m.get("tool_calls") or m["role"] in ("tool", "function") for m in normalized)
        offered = None
        if tools or has_tool_turns:
            if self._template_renders_tools:
                offered = [t.openai() for t in tools] if tools else None
            else:
                normalized = messages_without_tool_support(normalized, tools)
        try:
            return self._compiled_template.render(
                messages=normalized, add_generation_prompt=add_generation_prompt, tools=offered,
                documents=None, bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                pad_token=self.pad_token or "")
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed to render these messages: {e}",
                                      param="messages", code="chat_template_error") from None
