"""EngineCore through its messages only: what every driver (thread, instance process) relies on."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from sits.engine.core import EngineCore
from sits.engine.errors import ContextLengthExceededError, InvalidRequestError
from sits.engine.messages import (AbortRequest, EmbedRequest, Embedded, EngineRequest, EngineStats, FaultDirectives,
                                  Ping, Pong, RequestError, StepOutput)
from sits.engine.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def run(core: EngineCore, *msgs) -> tuple[dict[str, list[int]], list]:
    """Handle ``msgs``, step until idle; tokens per request id, and every other output."""
    tokens: dict[str, list[int]] = {}
    other = []
    for m in msgs:
        other += core.handle(m)
    while core.has_unfinished:
        out = core.step()
        assert isinstance(out, StepOutput)
        for ev in out.events:
            tokens.setdefault(ev.request_id, []).append(ev.token_id)
        other += out.errors
    return tokens, other


def test_requests_through_the_core_match_the_engine(make_engine):
    reference = make_engine().generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=6, **GREEDY))
    engine = make_engine()
    core = EngineCore(engine)
    a = engine.make_request([1, 2, 3], SamplingParams(max_tokens=6, **GREEDY), request_id="a")
    b = engine.make_request([4, 5], SamplingParams(max_tokens=6, **GREEDY), request_id="b")
    tokens, other = run(core, a, b)
    assert other == []
    assert tokens == {"a": reference[0]["token_ids"], "b": reference[1]["token_ids"]}
    assert isinstance(core.stats(), EngineStats) and core.stats().num_running == 0


def test_refusals_and_failures_come_back_as_request_errors(make_engine):
    engine = make_engine()
    core = EngineCore(engine)
    ok = engine.make_request([1, 2], SamplingParams(max_tokens=2, **GREEDY), request_id="x")
    # input is validated once, by the front end holding the engine's limits (here make_request);
    # the core refuses what only it can know: an id already in use
    with pytest.raises(ContextLengthExceededError):
        engine.make_request([1] * (engine.max_model_len + 1), SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.make_request([engine.model_config.vocab_size], SamplingParams(max_tokens=1))
    tokens, other = run(core, ok, ok)
    errors = {e.request_id: e.code for e in other}
    assert errors == {"x": "duplicate_request_id"}
    assert all(isinstance(e, RequestError) and 400 <= e.http_status < 500 for e in other)
    assert len(tokens["x"]) == 2


def test_abort_frees_the_blocks(make_engine):
    engine = make_engine()
    core = EngineCore(engine)
    core.handle(engine.make_request([1, 2, 3], SamplingParams(max_tokens=50, **GREEDY), request_id="r"))
    core.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    assert core.handle(AbortRequest("r")) == [] and not core.has_unfinished
    assert engine.pool.num_free == engine.pool.num_blocks
    assert core.handle(AbortRequest("unknown")) == []


def test_embed_ping_and_fault_directives(make_engine):
    core = EngineCore(make_engine())
    [emb] = core.handle(EmbedRequest("e", [[1, 2, 3], [4]]))
    assert isinstance(emb, Embedded) and emb.vectors.shape[0] == 2
    assert np.allclose(np.linalg.norm(emb.vectors, axis=1), 1.0, atol=1e-5)
    [err] = core.handle(EmbedRequest("e2", [[]]))
    assert isinstance(err, RequestError) and err.code == "invalid_input"
    assert core.handle(Ping(1)) == [Pong(1)]
    assert core.handle(FaultDirectives(drop_pings=True)) == []
    assert core.handle(Ping(2)) == []                           # silent while the fault holds
    assert core.handle(FaultDirectives()) == [Pong(2)]          # answered once it is cleared


def test_a_resumed_request_continues_where_it_stopped(make_engine):
    engine = make_engine()
    full = engine.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=8, **GREEDY))[0]["token_ids"]
    req = engine.make_request([3, 1, 4, 1, 5], SamplingParams(max_tokens=8, **GREEDY), request_id="r")
    resumed = req.resumed(full[:3])
    assert resumed.prompt_token_ids == [3, 1, 4, 1, 5] + full[:3] and resumed.params.max_tokens == 5
    assert req.prompt_token_ids == [3, 1, 4, 1, 5]                 # the original is untouched
    tokens, _ = run(EngineCore(engine), resumed)
    assert full[:3] + tokens["r"] == full


@pytest.mark.parametrize("msg", [
    EngineRequest("r", [1, 2], SamplingParams(max_tokens=3, stop=["x"], seed=5)), AbortRequest("r"), Ping(3),
    FaultDirectives((50.0, 700.0), 1.5, True), RequestError("r", "invalid_parameter", "no", "top_p", 400)])
def test_messages_cross_a_process_boundary_unchanged(msg):
    assert pickle.loads(pickle.dumps(msg)) == msg
