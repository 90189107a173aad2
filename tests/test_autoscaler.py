"""The scaling policy as a pure function: fast up, slow down, zero after keep-alive, bounds, reasons."""

from __future__ import annotations

from sits.runtime.autoscaler import Autoscaler, slo_health
from sits.runtime.unit_metrics import MetricsWindow, UnitMetrics
from sits.runtime.unit_spec import ScaleSpec, SloSpec

SLO = SloSpec(ttft_ms=1000, itl_ms=100, tps=100, target_health=0.75)


def test_health_score_weights_and_normalisation():
    assert slo_health(UnitMetrics(), SLO) is None
    assert slo_health(UnitMetrics(ttft_p95=500, itl_p95=50), SLO) == 1.0
    h = slo_health(UnitMetrics(ttft_p95=2000, itl_p95=50), SLO)           # TTFT twice the SLO
    assert abs(h - (0.4 * 0.5 + 0.3 + 0.3)) < 1e-9
    h = slo_health(UnitMetrics(ttft_p95=1000, itl_p95=400, queue_depth=3, tps=50), SLO)
    assert abs(h - (0.4 + 0.3 * 0.25 + 0.3 * 0.5)) < 1e-9


def test_cold_unit_scales_from_zero_on_a_waiting_request():
    a = Autoscaler(ScaleSpec(min_instances=0, max_instances=3), SLO)
    assert a.decide(UnitMetrics(), current=0, starting=0, now=0, idle_since=0).target == 0
    d = a.decide(UnitMetrics(queue_depth=2), current=0, starting=0, now=1, idle_since=None)
    assert d.target == 1 and "waiting" in d.reason and d.direction == "up"


def test_trigger_scales_up_one_at_a_time_never_while_starting_and_within_max():
    a = Autoscaler(ScaleSpec(max_instances=3, trigger="queue_depth > 4"), SLO)
    busy = UnitMetrics(queue_depth=10, ttft_p95=100, itl_p95=10)
    d = a.decide(busy, current=1, starting=0, now=10, idle_since=None)
    assert d.target == 2 and "trigger holds: queue_depth > 4" in d.reason
    assert a.decide(busy, current=2, starting=1, now=11, idle_since=None).target == 2     # wait for it
    assert a.decide(busy, current=2, starting=0, now=12, idle_since=None).target == 3
    d = a.decide(busy, current=3, starting=0, now=13, idle_since=None)
    assert d.target == 3 and "max_instances" in d.reason


def test_upscale_delay_and_health_pressure():
    a = Autoscaler(ScaleSpec(max_instances=2, upscale_delay_s=5), SLO)
    slow = UnitMetrics(ttft_p95=5000, itl_p95=500)            # health 0.4*0.2 + 0.3*0.2 + 0.3 = 0.44
    assert a.decide(slow, current=1, starting=0, now=0, idle_since=None).target == 1
    assert a.decide(slow, current=1, starting=0, now=4, idle_since=None).target == 1
    d = a.decide(slow, current=1, starting=0, now=5, idle_since=None)
    assert d.target == 2 and "slo_health 0.44" in d.reason


def test_scale_down_slowly_then_to_zero_after_keep_alive():
    a = Autoscaler(ScaleSpec(min_instances=0, max_instances=4, downscale_delay_s=30, keep_alive_s=300), SLO)
    calm = UnitMetrics(ttft_p95=100, itl_p95=10, inflight=1)
    assert a.decide(calm, current=3, starting=0, now=0, idle_since=None).target == 3
    assert a.decide(calm, current=3, starting=0, now=29, idle_since=None).target == 3
    assert a.decide(calm, current=3, starting=0, now=30, idle_since=None).target == 2
    assert a.decide(calm, current=2, starting=0, now=45, idle_since=None).target == 2     # one step per delay
    assert a.decide(calm, current=2, starting=0, now=60, idle_since=None).target == 1
    assert a.decide(calm, current=1, starting=0, now=200, idle_since=None).target == 1    # floor while busy
    d = a.decide(UnitMetrics(), current=1, starting=0, now=400, idle_since=100)
    assert d.target == 0 and "keep_alive_s=300" in d.reason


def test_bounds_are_enforced():
    a = Autoscaler(ScaleSpec(min_instances=2, max_instances=3), SLO)
    assert a.decide(UnitMetrics(), current=0, starting=0, now=0, idle_since=0).target == 2
    assert a.decide(UnitMetrics(), current=5, starting=0, now=0, idle_since=0).target == 3
    assert a.decide(UnitMetrics(), current=2, starting=0, now=10**6, idle_since=0).target == 2   # never below min


def test_metrics_window_forgets_old_observations():
    t = [0.0]
    w = MetricsWindow(window_s=10, clock=lambda: t[0])
    for i in range(20):
        t[0] = i * 0.5
        w.finished(ttft_ms=100 + i, e2e_ms=1000, output_tokens=10, itls_ms=[5, 6])
    s = w.snapshot(queue_depth=2)
    assert s.ttft_p95 == 118 and s.itl_p95 == 6 and s.queue_depth == 2
    assert abs(s.rps - 20 / 9.5) < 1e-6 and abs(s.tps - 200 / 9.5) < 1e-6
    t[0] = 100.0
    s = w.snapshot()
    assert s.ttft_p95 is None and s.rps == 0 and w.last_request_at == 9.5


def test_cpu_meter_reads_this_process():
    import os
    import time as _t

    from sits.runtime.unit_metrics import CpuMeter, process_cpu_seconds
    assert process_cpu_seconds(os.getpid()) > 0
    assert process_cpu_seconds(2**22 + 12345) is None
    m = CpuMeter()
    assert m.read([os.getpid()]) is None            # the first reading only sets the baseline
    t0 = _t.perf_counter()
    while _t.perf_counter() - t0 < 0.3:
        pass                                          # burn one core
    u = m.read([os.getpid()])
    assert 0.2 / (os.cpu_count() or 1) < u <= 1.0
