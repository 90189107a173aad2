"""``POST /v1/embeddings`` (OpenAI): vectors from a served model's mean-pooled hidden states, or
from the MiniLM that vector memory uses (``model: "all-minilm-l6-v2"``), so a client can compare
its own vectors with the memory's."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from fastapi import APIRouter, Request

from sits.api.context import context_of, new_request_id
from sits.api.metering import metered_prompts
from sits.api.errors import ErrorResponse
from sits.api.protocol import MINILM, EmbeddingRequest
from sits.engine.errors import ContextLengthExceededError, InvalidRequestError
from sits.engine.tokenizer import check_text

router = APIRouter(tags=["openai"])

MAX_INPUTS = 256


def _inputs(body: EmbeddingRequest) -> list[str | list[int]]:
    x = body.input
    items: list = [x] if isinstance(x, str) else ([x] if x and all(isinstance(t, int) for t in x) else list(x))
    if not items or any(not i for i in items):
        raise InvalidRequestError("input must be non-empty (and so must each of its items)", param="input",
                                  code="invalid_input")
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(f"{len(items)} inputs; at most {MAX_INPUTS} per request", param="input",
                                  code="invalid_input")
    check_text(items, "input")
    return items


@router.post("/v1/embeddings", responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
async def create_embeddings(body: EmbeddingRequest, request: Request):
    ctx = context_of(request)
    items = _inputs(body)
    if body.model == MINILM:
        if not all(isinstance(i, str) for i in items):
            raise InvalidRequestError(f"{MINILM} takes text, not token ids", param="input", code="invalid_input")
        from sits.memory.embedder import shared_embedder
        embedder = await asyncio.to_thread(shared_embedder)
        lengths = [len(e.ids) for e in embedder.tokenizer.encode_batch(items)]
        async with metered_prompts(MINILM, new_request_id(), lengths):
            vectors = (await asyncio.to_thread(embedder.embed, items)).numpy()
        tokens = sum(lengths)
    else:
        backend = ctx.registry.get(body.model)
        if backend.features.message_prompts:
            raise InvalidRequestError(f"{backend.name} reaches its model through an endpoint or a mesh of units: "
                                      "it serves no embeddings", param="model", code="embeddings_unsupported")
        ids = []
        for i, item in enumerate(items):
            toks = backend.tokenizer.encode(item, max_tokens=backend.max_model_len) if isinstance(item, str) else item
            if len(toks) > backend.max_model_len:
                raise ContextLengthExceededError(f"input[{i}] has {len(toks)} tokens; this model reads at most "
                                                 f"{backend.max_model_len}", param="input")
            if not all(0 <= t < backend.tokenizer.vocab_size for t in toks):
                raise InvalidRequestError(f"input[{i}]: token ids must be in [0, {backend.tokenizer.vocab_size})",
                                          param="input", code="invalid_token_id")
            ids.append(toks)
        async with metered_prompts(backend.name, new_request_id(), [len(t) for t in ids], backend.features.pricing,
                                   backend.features.shape):
            vectors = np.asarray(await backend.embed(ids), dtype=np.float32)
        tokens = sum(len(t) for t in ids)
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise InvalidRequestError(f"{body.model} gives {vectors.shape[1]} dimensions; it cannot shorten them",
                                  param="dimensions", code="invalid_parameter")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if body.encoding_format == "base64"
             else v.tolist()} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
