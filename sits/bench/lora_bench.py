"""``sits bench lora``: serving many LoRA adapters against one copy of the base weights.

The same requests (``--requests`` prompts of ``--prompt-len`` tokens, ``--max-tokens`` each, greedy,
EOS ignored) run four ways on one engine per round, the cases taking turns:

- base: no adapter (what the adapters' low-rank updates cost on top);
- one adapter: every request on the same adapter;
- 8 mixed: request i on adapter i % 8, all queued at once (one batch, per-row adapter groups);
- 8 one after another: each adapter's requests queued and run to the end before the next's, as a
  server that runs one adapter per batch (or per replica) would;
- base, 8 batches: the base model's requests in the same eight smaller batches: how much a batch 8×
  larger is worth on this host at all, the ceiling of "8 mixed" over "8 one after another".

Throughput is generated tokens per second of wall time. The adapters are random, rank ``--rank``,
on every projection (``sits.modelbuild.lora``); ratios are against "one adapter" and "one after
another" measured in the same round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from sits.bench.common import add_bench_command, grouped_bars, log, publish

DOC_BEGIN = "<!-- sits bench lora: begin -->"
DOC_END = "<!-- sits bench lora: end -->"
CASES = ("base", "base, 8 batches", "one adapter", "8 mixed", "8 one after another")
ADAPTERS = 8


def _run(engine, jobs: list[tuple[list[int], str | None]], max_tokens: int) -> int:
    from sits.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for prompt, lora in jobs:
        engine.add(engine.make_request(prompt, params, lora=lora))
    tokens = 0
    while engine.has_unfinished:
        tokens += sum(1 for ev in engine.step() if ev.token_id is not None)
    return tokens


def _case(engine, case: str, prompts: list[list[int]], max_tokens: int) -> float:
    t0 = time.perf_counter()
    if case == "base":
        tokens = _run(engine, [(p, None) for p in prompts], max_tokens)
    elif case == "base, 8 batches":
        tokens = sum(_run(engine, [(p, None) for i, p in enumerate(prompts) if i % ADAPTERS == k], max_tokens)
                     for k in range(ADAPTERS))
    elif case == "one adapter":
        tokens = _run(engine, [(p, "a0") for p in prompts], max_tokens)
    elif case == "8 mixed":
        tokens = _run(engine, [(p, f"a{i % ADAPTERS}") for i, p in enumerate(prompts)], max_tokens)
    else:
        tokens = sum(_run(engine, [(p, f"a{k}") for i, p in enumerate(prompts) if i % ADAPTERS == k], max_tokens)
                     for k in range(ADAPTERS))
    return tokens / (time.perf_counter() - t0)


def run_lora_bench(model: str, *, rounds: int = 3, requests: int = 32, prompt_len: int = 64, max_tokens: int = 32,
                   rank: int = 16, threads: int | None = None, json_out: str | None = None,
                   docs_out: str | None = None, device: str = "cpu", dtype: str = "auto") -> dict:
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine
    from sits.modelbuild.lora import build_random_adapter
    with tempfile.TemporaryDirectory(prefix="sits-lora-bench-") as tmp:
        adapters = tuple((f"a{k}", str(build_random_adapter(model, Path(tmp) / f"a{k}", rank=rank, seed=k)))
                         for k in range(ADAPTERS))
        engine = LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, threads=threads,
                                        lora_adapters=adapters,
                                        max_loras=ADAPTERS, max_lora_rank=rank, max_num_seqs=max(requests, 8),
                                        max_num_batched_tokens=max(256, requests), warmup=False))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(5, vocab) for _ in range(prompt_len)] for _ in range(requests)]
    _case(engine, "8 mixed", prompts[:ADAPTERS], 4)          # every adapter resident, shapes seen once
    runs: dict[str, list[float]] = {c: [] for c in CASES}
    for r in range(rounds):
        order = CASES if r % 2 == 0 else tuple(reversed(CASES))
        for case in order:     # a first token of its own per round and case: no prefix-cache hits between them
            first = 1 + r * len(CASES) + CASES.index(case)
            runs[case].append(_case(engine, case, [[first] + p[1:] for p in prompts], max_tokens))
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{c} {runs[c][-1]:.0f} tok/s" for c in CASES))
    median = {c: statistics.median(v) for c, v in runs.items()}
    result = {"model": model, "rounds": rounds, "requests": requests, "prompt_len": prompt_len,
              "max_tokens": max_tokens, "rank": rank, "threads": engine.threads, "dtype": str(engine.dtype),
              "device": str(engine.device),
              "tok_per_s": median, "runs": runs,
              "mixed_vs_one": median["8 mixed"] / median["one adapter"],
              "mixed_vs_sequential": median["8 mixed"] / median["8 one after another"],
              "one_vs_base": median["one adapter"] / median["base"],
              "batching_ceiling": median["base"] / median["base, 8 batches"]}
    return publish(result, "lora", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _plot(r: dict, path) -> None:
    grouped_bars(path, list(CASES), {"generated tok/s": [r["tok_per_s"][c] for c in CASES]},
                 ylabel="generated tokens / s", title=f"LoRA serving, {r['requests']} requests, rank {r['rank']}")


def _markdown(r: dict, command: str, plot: str) -> str:
    t = r["tok_per_s"]
    lines = [DOC_BEGIN, "## LoRA adapters in one batch (`sits bench lora`)", "", f"Command: `{command}`  ",
             f"Model `{r['model']}` ({r['dtype']}, {r.get('device', 'cpu')}, {r['threads']} threads), "
             f"{r['requests']} requests of "
             f"{r['prompt_len']} prompt tokens and {r['max_tokens']} generated each, random rank-{r['rank']} "
             f"adapters on every projection; medians of {r['rounds']} rounds with the cases taking turns.", "",
             "| case | generated tok/s | vs one adapter | vs one after another |", "|---|---|---|---|"]
    for c in CASES:
        lines.append(f"| {c} | {t[c]:.0f} | {t[c] / t['one adapter']:.2f}× | {t[c] / t['8 one after another']:.2f}× |")
    lines += ["", f"Targets (issue 20): 8 mixed ≥ 0.8× one adapter (here {r['mixed_vs_one']:.2f}×), ≥ 3× one after "
              f"another (here {r['mixed_vs_sequential']:.2f}×). One adapter runs at {r['one_vs_base']:.2f}× the base "
              f"model's throughput. The base model itself gains {r['batching_ceiling']:.2f}× from one batch of all "
              "requests over eight smaller ones on this host: the most that mixing adapters into one batch can win "
              "over serving them one after another here.", "", f"![LoRA throughput]({plot})", "", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_lora_bench(args.model, rounds=args.repeats, requests=args.requests, prompt_len=args.prompt_len,
                       max_tokens=args.max_tokens, rank=args.rank, threads=args.threads, json_out=args.json,
                       docs_out=args.write_docs, device=args.device, dtype=args.dtype)
    print(json.dumps({k: r[k] for k in ("tok_per_s", "mixed_vs_one", "mixed_vs_sequential", "one_vs_base",
                                        "batching_ceiling")}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "lora", "8 LoRA adapters in one batch vs one adapter vs one after another",
                          _cli, threads="engine intra-op threads", repeats="rounds of every case, median reported",
                          repeats_default=3)
    p.add_argument("--requests", type=int, default=32, help="requests per case")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--max-tokens", type=int, default=32, help="generated tokens per request")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="weights, adapters and KV cache (auto follows the checkpoint)")
