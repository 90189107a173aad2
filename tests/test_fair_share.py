"""Fair share between tenants in the pfsd scheduler: a tenant that floods the queue waits behind
another tenant's requests (the virtual token counter), and without tenants nothing changes."""

from __future__ import annotations

from sits.engine.fair_share import DECODE_WEIGHT, FairShare
from sits.engine.messages import EngineRequest
from sits.engine.sampling_params import SamplingParams


def test_counter_lifts_a_returning_tenant_and_charges_by_weight():
    f = FairShare()
    f.arrived("a")
    f.charge("a", 100, 10, weight=1.0)
    assert f.lead("a") == 0 and f.counters["a"] == 100 + DECODE_WEIGHT * 10
    f.arrived("b")                                  # b starts level with the least-served active tenant
    assert f.counters["b"] == f.counters["a"] and f.lead("a") == 0
    f.charge("a", 50, 0, weight=1.0)
    f.charge("b", 50, 0, weight=2.0)                # twice the share: half the charge
    assert f.lead("a") == 25 and f.lead("b") == 0
    f.left("b")
    assert f.lead("a") == 0                         # alone again
    f.left("a")
    assert f.floor() is None and f.lead("a") == 0


def _first_scheduled_order(engine, tenants: list[str | None], flood: int, prompt_len: int = 24) -> list[str]:
    """``flood`` requests of tenant a arrive first, then one of each tenant in ``tenants``; the order in
    which the late ones and the flood's backlog get their first token."""
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = list(range(5, 5 + prompt_len))
    for i in range(flood):
        engine.add(EngineRequest(f"a{i}", prompt, params, tenant="a"))
    for _ in range(2):          # the flood is being served before the others arrive
        engine.step()
    for i, t in enumerate(tenants):
        engine.add(EngineRequest(f"late{i}", prompt, params, tenant=t))
    first: list[str] = []
    while engine.has_unfinished:
        for ev in engine.step():
            if ev.index == 0 and ev.token_id is not None:
                first.append(ev.request_id)
    return first


def test_a_flood_waits_behind_another_tenants_request(make_engine):
    kw = dict(policy="pfsd", max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128)
    fair = _first_scheduled_order(make_engine(**kw), ["b"], flood=12)
    unfair = _first_scheduled_order(make_engine(fair_share=False, **kw), ["b"], flood=12)
    # with fair share, b's request starts among the first few; without it, after most of the backlog
    assert fair.index("late0") <= 4, fair
    assert unfair.index("late0") > fair.index("late0") + 3, (fair, unfair)


def test_one_tenant_alone_is_scheduled_as_before(make_engine):
    kw = dict(policy="pfsd", max_num_batched_tokens=32, max_num_seqs=4, max_model_len=128)
    with_fair = _first_scheduled_order(make_engine(**kw), ["a"], flood=8)
    without = _first_scheduled_order(make_engine(fair_share=False, **kw), ["a"], flood=8)
    assert with_fair == without
