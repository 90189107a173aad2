"""The request state machine: every legal path, every illegal transition, one event per transition."""

from __future__ import annotations

import itertools

import pytest

from sits.api.sits.lifecycle import TRANSITIONS, IllegalTransitionError, RequestLifecycle, RequestState

S = RequestState
LEGAL_PATHS = [
    [S.PENDING, S.VALIDATING, S.EXECUTING, S.RESOLVED],
    [S.PENDING, S.VALIDATING, S.EXECUTING, S.REJECTED],
    [S.PENDING, S.VALIDATING, S.REJECTED],
    [S.PENDING, S.REJECTED],
]


def _walk(lc: RequestLifecycle, path: list[RequestState]) -> None:
    for state in path[1:]:
        lc.advance(state, {"done": True} if state.terminal else None)


@pytest.mark.parametrize("path", LEGAL_PATHS, ids=lambda p: "->".join(s.value for s in p))
def test_every_legal_path_emits_one_event_per_transition(path):
    seen = []
    lc = RequestLifecycle("r1", [seen.append])
    _walk(lc, path)
    assert [e.state for e in seen] == path
    assert [e.state for e in lc.history] == path
    assert all(e.request_id == "r1" for e in seen)
    stamps = [e.timestamp_ns for e in seen]
    assert stamps == sorted(stamps)
    assert all((e.payload is not None) == e.state.terminal for e in seen)
    assert lc.terminal and lc.state is path[-1]


def test_the_legal_paths_are_exactly_the_table():
    walked = {(a, b) for p in LEGAL_PATHS for a, b in itertools.pairwise(p)}
    table = {(a, b) for a, tos in TRANSITIONS.items() for b in tos}
    assert walked == table


ILLEGAL = [(a, b) for a in S for b in S if b not in TRANSITIONS[a]]


@pytest.mark.parametrize("edge", ILLEGAL, ids=lambda e: f"{e[0].value}->{e[1].value}")
def test_every_illegal_transition_raises(edge):
    src, dst = edge
    path = next(p for p in LEGAL_PATHS if src in p)
    lc = RequestLifecycle("r2")
    _walk(lc, path[:path.index(src) + 1])
    assert lc.state is src
    before = list(lc.history)
    with pytest.raises(IllegalTransitionError) as e:
        lc.advance(dst, {"x": 1} if dst.terminal else None)
    assert e.value.code == "illegal_transition"
    assert lc.state is src and lc.history == before     # nothing changed, nothing emitted


def test_payload_only_on_terminal_states():
    lc = RequestLifecycle("r3")
    with pytest.raises(ValueError):
        lc.advance(S.VALIDATING, {"nope": 1})


def test_reject_is_idempotent_on_terminal_requests():
    lc = RequestLifecycle("r4")
    ev = lc.reject("cancelled", "by the client")
    assert ev.payload == {"error": {"code": "cancelled", "message": "by the client"}}
    assert lc.reject("timeout", "late") is None
    assert lc.state is S.REJECTED and len(lc.history) == 2
    assert ev.to_dict()["state"] == "REJECTED" and "payload" in ev.to_dict()
