"""``sits bench fairness``: one tenant floods while another sends interactive requests; the second
tenant's TTFT with the scheduler's fair share on vs off, in the same run (turns alternate, their
order reversing every round).

Tenant A sends long requests (long prompts and outputs) faster than the engine serves them, so its
backlog grows; tenant B sends short interactive requests at a steady pace. TTFT counts from each
request's scheduled arrival. Both variants replay the same seeded workload on a fresh engine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from sits.bench.common import add_bench_command, log, pct, publish

DOC_BEGIN = "<!-- sits bench fairness: begin -->"
DOC_END = "<!-- sits bench fairness: end -->"


@dataclass(slots=True)
class TenantArrival:
    at_s: float
    tenant: str
    prompt: list[int]
    max_tokens: int


def workload(vocab: int, duration_s: float, flood_rps: float, interactive_rps: float, seed: int = 0,
             flood_prompt: tuple[int, int] = (256, 768), flood_output: tuple[int, int] = (64, 128),
             interactive_prompt: tuple[int, int] = (32, 128), interactive_output: int = 16) -> list[TenantArrival]:
    rng = random.Random(seed)
    out: list[TenantArrival] = []
    for tenant, rps, prange, orange in (("a", flood_rps, flood_prompt, flood_output),
                                        ("b", interactive_rps, interactive_prompt, (interactive_output,) * 2)):
        t = rng.uniform(0, 0.2) if tenant == "a" else 1.0       # the flood has begun when b arrives
        while t < duration_s:
            plen = rng.randint(*prange)
            out.append(TenantArrival(t, tenant, [rng.randrange(5, vocab) for _ in range(plen)], rng.randint(*orange)))
            t += rng.expovariate(rps)
    return sorted(out, key=lambda a: a.at_s)


def replay(engine, arrivals: list[TenantArrival]) -> dict:
    """Drive the engine in real time; per tenant TTFT and output tokens."""
    from sits.engine.messages import EngineRequest
    from sits.engine.sampling_params import SamplingParams
    t0 = time.monotonic()
    pending = list(arrivals)
    ttft: dict[str, list[float]] = {"a": [], "b": []}
    tokens = {"a": 0, "b": 0}
    owner: dict[str, str] = {}
    ids = 0
    while pending or engine.has_unfinished:
        now = time.monotonic()
        while pending and t0 + pending[0].at_s <= now:
            a = pending.pop(0)
            ids += 1
            rid = f"{a.tenant}{ids}"
            owner[rid] = a.tenant
            engine.add(EngineRequest(rid, a.prompt, SamplingParams(max_tokens=a.max_tokens, temperature=0.0,
                                                                   ignore_eos=True),
                                     interactive=True, arrival_time=t0 + a.at_s, tenant=a.tenant))
        if not engine.has_unfinished:
            time.sleep(max(0.0, t0 + pending[0].at_s - time.monotonic()))
            continue
        for ev in engine.step():
            t = owner[ev.request_id]
            if ev.token_id is not None:
                tokens[t] += 1
            if ev.index == 0 and ev.token_id is not None:
                ttft[t].append(ev.first_token_time - ev.arrival_time)
    makespan = time.monotonic() - t0
    out: dict = {"makespan_s": makespan, "throughput_tok_s": (tokens["a"] + tokens["b"]) / makespan}
    for t in ("a", "b"):
        out[t] = {"requests": len(ttft[t]), "ttft_p50_ms": pct(ttft[t], 0.5) * 1e3,
                  "ttft_p99_ms": pct(ttft[t], 0.99) * 1e3, "ttft_mean_ms": statistics.fmean(ttft[t]) * 1e3,
                  "output_tokens": tokens[t]}
    return out


def run_fairness_bench(model: str, *, duration_s: float, flood_rps: float, interactive_rps: float, repeats: int,
                       threads: int | None, dtype: str, max_num_batched_tokens: int, json_out: str | None,
                       docs_out: str | None) -> dict:
    from sits.engine.config import EngineConfig, ModelConfig
    from sits.engine.llm_engine import LLMEngine
    vocab = ModelConfig.from_dir(model).vocab_size
    arrivals = workload(vocab, duration_s, flood_rps, interactive_rps)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(repeats):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for variant in order:
            eng = LLMEngine(EngineConfig(model=model, device="cpu", dtype=dtype, threads=threads, policy="pfsd",
                                         fair_share=variant == "on", max_num_batched_tokens=max_num_batched_tokens))
            res = replay(eng, arrivals)
            runs[variant].append(res)
            log(f"round {r + 1}/{repeats} fair share {variant}: b TTFT p50 {res['b']['ttft_p50_ms']:.0f} ms, "
                f"p99 {res['b']['ttft_p99_ms']:.0f} ms; a p50 {res['a']['ttft_p50_ms']:.0f} ms; "
                f"{res['throughput_tok_s']:.1f} tok/s")
            del eng

    def med(variant: str, *path: str) -> float:
        vals = []
        for res in runs[variant]:
            v = res
            for p in path:
                v = v[p]
            vals.append(v)
        return statistics.median(vals)

    summary = {v: {"b_ttft_p50_ms": med(v, "b", "ttft_p50_ms"), "b_ttft_p99_ms": med(v, "b", "ttft_p99_ms"),
                   "a_ttft_p50_ms": med(v, "a", "ttft_p50_ms"), "a_ttft_p99_ms": med(v, "a", "ttft_p99_ms"),
                   "throughput_tok_s": med(v, "throughput_tok_s"), "makespan_s": med(v, "makespan_s")}
               for v in ("off", "on")}
    summary["ratios"] = {k: summary["on"][k] / summary["off"][k] for k in summary["on"] if summary["off"][k]}
    n_a = sum(1 for a in arrivals if a.tenant == "a")
    result = {"model": model, "dtype": dtype, "threads": threads, "repeats": repeats, "duration_s": duration_s,
              "flood_rps": flood_rps, "interactive_rps": interactive_rps, "requests": {"a": n_a, "b": len(arrivals) - n_a},
              "max_num_batched_tokens": max_num_batched_tokens, "summary": summary, "runs": runs}
    return publish(result, "fairness", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = result["summary"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["B p50", "B p99", "A p50", "A p99"]
    keys = ["b_ttft_p50_ms", "b_ttft_p99_ms", "a_ttft_p50_ms", "a_ttft_p99_ms"]
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [s["off"][k] for k in keys], width=0.4, label="fair share off")
    ax.bar([i + 0.2 for i in x], [s["on"][k] for k in keys], width=0.4, label="fair share on")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("TTFT, ms")
    ax.set_yscale("log")
    ax.set_title("Tenant A floods, tenant B interactive")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _markdown(result: dict, command: str, plot: str) -> str:
    s = result["summary"]
    rows = [("tenant B (interactive) TTFT p50 ms", "b_ttft_p50_ms"), ("tenant B TTFT p99 ms", "b_ttft_p99_ms"),
            ("tenant A (flood) TTFT p50 ms", "a_ttft_p50_ms"), ("tenant A TTFT p99 ms", "a_ttft_p99_ms"),
            ("throughput, output tok/s", "throughput_tok_s"), ("makespan s", "makespan_s")]
    lines = [DOC_BEGIN, "## Fair share between tenants (`sits bench fairness`)", "",
             f"Command: `{command}`  ",
             f"Model `{result['model']}` ({result['dtype']}), pfsd, step budget {result['max_num_batched_tokens']} tokens; "
             f"tenant A: {result['requests']['a']} long requests at {result['flood_rps']:g}/s (prompts 256-768, "
             f"outputs 64-128), tenant B: {result['requests']['b']} interactive ones at {result['interactive_rps']:g}/s "
             f"(prompts 32-128, 16 tokens) over {result['duration_s']:g} s; medians of {result['repeats']} rounds, "
             "the two variants taking turns.", "",
             "| metric | fair share off | fair share on | on / off |", "|---|---|---|---|"]
    for label, k in rows:
        lines.append(f"| {label} | {s['off'][k]:.1f} | {s['on'][k]:.1f} | {s['ratios'].get(k, float('nan')):.2f} |")
    lines += ["", f"![fairness benchmark]({plot})", "", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    result = run_fairness_bench(args.model, duration_s=args.duration_s, flood_rps=args.flood_rps,
                                interactive_rps=args.interactive_rps, repeats=args.repeats, threads=args.threads,
                                dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                                json_out=args.json, docs_out=args.write_docs)
    print(json.dumps(result["summary"], indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "fairness", "one tenant floods, another is interactive: fair share on vs off",
                          _cli, threads="engine CPU threads", repeats="rounds (each runs both variants)",
                          repeats_default=3)
    p.add_argument("--duration-s", type=float, default=12.0, help="how long requests keep arriving, seconds")
    p.add_argument("--flood-rps", type=float, default=5.0, help="tenant A's long requests per second")
    p.add_argument("--interactive-rps", type=float, default=1.0, help="tenant B's short requests per second")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=256, help="the step's token budget")
