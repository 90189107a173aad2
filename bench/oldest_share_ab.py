"""The bursty workload of ``sits bench engine`` replayed with pfsd at several ``oldest_prefill_share``
values (and fcfs), the variants taking turns run by run (order reversed every round): what a budget
share for the longest-waiting prefill does to the TTFT tail and median.

    .venv/bin/python bench/oldest_share_ab.py MODEL_DIR [DTYPE] [ROUNDS] [SHARES]
"""

import gc
import statistics
import sys

from sits.bench.engine_bench import Hardware, _engine, bursty_workload, replay
from sits.bench.hf_baseline import vocab_size


def main(model: str, dtype: str = "float32", rounds: int = 2, shares: str = "0,0.25,0.5") -> None:
    hw = Hardware(dtype=dtype)
    arrivals = bursty_workload(vocab_size(model))
    variants = [("fcfs", 0.0)] + [("pfsd", float(x)) for x in shares.split(",")]
    runs: dict[tuple, list[dict]] = {v: [] for v in variants}
    for r in range(rounds):
        for policy, share in (variants if r % 2 == 0 else list(reversed(variants))):
            eng = _engine(model, hw, policy=policy, enable_prefix_caching=False, oldest_prefill_share=share)
            res = replay(eng, arrivals)
            runs[(policy, share)].append(res)
            print(f"round {r + 1} {policy} share {share}: ttft p50 {res['ttft_p50_ms']:.0f} ms, "
                  f"p99 {res['ttft_p99_ms']:.0f} ms, {res['throughput_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
            del eng
            gc.collect()
    print("| policy | oldest_prefill_share | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | tok/s |\n|---|---|---|---|---|---|")
    for (policy, share), rs in runs.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                                                  "throughput_tok_s")}
        print(f"| {policy} | {share if policy == 'pfsd' else '-'} | {med['ttft_p50_ms']:.0f} | {med['ttft_p99_ms']:.0f} | "
              f"{med['itl_p50_ms']:.0f} | {med['throughput_tok_s']:.1f} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], *(args[1:2] or []), *(int(a) for a in args[2:3]), *args[3:4])
