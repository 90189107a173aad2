"""``sits bench dtype``: the same checkpoint served in each compute dtype (and with int8 weights),
prefill and decode speed, and the quality int8 costs.

This is the measurement behind ``dtype: auto`` on a CPU (bf16 where the CPU multiplies it
natively), behind ``--quantization int8`` and behind pre-packed bf16 weights. A variant is a dtype,
then ``+int8`` for int8 weights and ``+plain`` for weights not pre-packed (``pack_weights: false``).
Each variant runs in a child process of its own (weights, allocator and thread pool are
per process), the dtypes taking turns round by round, order reversed every round; figures are
medians over rounds. The baseline is the first variant, measured in the same run. With
``--quality-tokens N``, each variant's next-token distributions over N tokens of text (the end of
``sits/data/corpus.txt``, teacher-forced in windows) are compared with the reference variant's:
greedy agreement and mean KL(reference || variant).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from sits.bench.common import add_bench_command, grouped_bars, log, publish

DOC_BEGIN = "<!-- sits bench dtype: begin -->"
DOC_END = "<!-- sits bench dtype: end -->"
METRICS = {"prefill_ms": "prefill of {prompt} tokens, ms", "decode_b1_ms": "decode, 1 stream, ms per token",
           "decode_b8_ms": "decode, 8 streams, ms per step", "decode_b32_ms": "decode, 32 streams, ms per step"}

_CHILD = r"""
import json, statistics, sys, time
cfg = json.loads(sys.argv[1])
from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams
from sits.bench.dtype_bench import variant_config
eng = LLMEngine(EngineConfig(model=cfg["model"], device="cpu", warmup=False, threads=cfg["threads"],
                             kv_cache_memory_mb=256, max_num_batched_tokens=max(256, cfg["prompt"]),
                             **variant_config(cfg["variant"])))
vocab = eng.model_config.vocab_size
def run(prompts, n):
    t = time.perf_counter()
    eng.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _ in prompts])
    return time.perf_counter() - t
def ids(seed, n):
    return [(seed * 7919 + i * 104729) % (vocab - 10) + 5 for i in range(n)]
run([ids(1, 32)], 4)
steps = cfg["steps"]
out = {"prefill_ms": statistics.median(run([ids(10 + i, cfg["prompt"])], 1) for i in range(3)) * 1e3,
       "decode_b1_ms": statistics.median(run([ids(20 + i, 16)], steps) for i in range(3)) * 1e3 / steps,
       "decode_b8_ms": statistics.median(run([ids(30 + i * 8 + j, 16) for j in range(8)], steps)
                                         for i in range(3)) * 1e3 / steps,
       "decode_b32_ms": statistics.median(run([ids(60 + i * 32 + j, 16) for j in range(32)], steps)
                                          for i in range(2)) * 1e3 / steps,
       "resolved_dtype": str(eng.dtype).removeprefix("torch.") + "".join("+" + f for f in cfg["variant"].split("+")[1:])}
print(json.dumps(out))
"""


def variant_config(variant: str) -> dict:
    """``EngineConfig`` fields of a variant: ``dtype[+int8][+plain]``."""
    dtype, *flags = variant.split("+")
    unknown = set(flags) - {"int8", "plain"}
    if unknown:
        raise ValueError(f"variant {variant!r}: unknown flag(s) {sorted(unknown)} (int8, plain)")
    return {"dtype": dtype, "quantization": "int8" if "int8" in flags else None, "pack_weights": "plain" not in flags}


def _measure(model: str, variant: str, threads: int, prompt: int, steps: int) -> dict:
    child = json.dumps({"model": model, "variant": variant, "threads": threads, "prompt": prompt, "steps": steps})
    proc = subprocess.run([sys.executable, "-c", _CHILD, child], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"dtype child ({variant}) failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def quality(model: str, variants: list[str], reference: str, tokens: int, window: int = 512,
            threads: int | None = None) -> dict[str, dict]:
    """Greedy agreement and mean KL(reference || variant) per variant, teacher-forced over ``tokens``
    tokens of the end of the corpus, in windows of ``window``."""
    from importlib.resources import files

    import torch

    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine

    def engine(variant: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, device="cpu", warmup=False, threads=threads, kv_cache_memory_mb=16,
                                      **variant_config(variant)))

    ref = engine(reference)
    text = files("sits").joinpath("data/corpus.txt").read_text()
    ids = ref.tokenizer.encode(text[-tokens * 12:])[-tokens:]
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window)]
    out = {}
    for variant in variants:
        other = engine(variant)
        agree = kl = count = 0.0
        with torch.inference_mode():
            for w in windows:
                x = torch.tensor([w])
                p = torch.log_softmax(ref.model.forward_dense(x)[0].float(), -1)
                q = torch.log_softmax(other.model.forward_dense(x)[0].float(), -1)
                agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
                kl += (p.exp() * (p - q)).sum(-1).sum().item()
                count += len(w)
        out[variant] = {"greedy_agreement": agree / count, "mean_kl": kl / count, "tokens": int(count)}
        log(f"quality {variant} vs {reference}: agreement {agree / count:.4f}, mean KL {kl / count:.5f}")
        del other
    return out


def run_dtype_bench(model: str, *, dtypes: list[str], threads: int | None = None, rounds: int = 3,
                    prompt: int = 512, steps: int = 32, json_out: str | None = None,
                    docs_out: str | None = None, quality_tokens: int = 0,
                    quality_reference: str = "bfloat16") -> dict:
    threads = threads or os.cpu_count() or 1
    runs: dict[str, list[dict]] = {d: [] for d in dtypes}
    for r in range(rounds):
        for dtype in (dtypes if r % 2 == 0 else list(reversed(dtypes))):
            runs[dtype].append(_measure(model, dtype, threads, prompt, steps))
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{d} decode {runs[d][-1]['decode_b1_ms']:.1f} ms/token"
                                                    for d in dtypes))
    medians = {d: {m: statistics.median(run[m] for run in runs[d]) for m in METRICS} for d in dtypes}
    resolved = {d: runs[d][0]["resolved_dtype"] for d in dtypes}
    result = {"model": model, "threads": threads, "rounds": rounds, "prompt": prompt, "steps": steps,
              "dtypes": dtypes, "resolved": resolved, "median": medians, "runs": runs,
              "baseline": dtypes[0]}
    if quality_tokens:
        result["quality_reference"] = quality_reference
        result["quality"] = quality(model, [d for d in dtypes if d != quality_reference], quality_reference,
                                    quality_tokens, threads=threads)
    return publish(result, "dtype", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _markdown(r: dict, command: str, plot_path: str) -> str:
    base = r["baseline"]
    head = "| dtype | " + " | ".join(label.format(prompt=r["prompt"]) for label in METRICS.values()) + \
           f" | speed-up vs {base} (prefill / decode 1 / decode 8 / decode 32) |"
    lines = [DOC_BEGIN, "## Compute dtype and weight layout on this CPU (`sits bench dtype`)", "", f"Command: `{command}`  ",
             f"Model `{r['model']}`, {r['threads']} thread(s), each dtype in its own process, medians of "
             f"{r['rounds']} rounds taken in turn (order reversed every round), greedy, {r['steps']} decode steps.",
             "", head, "|" + "---|" * (head.count("|") - 1)]
    med = r["median"]
    for d in r["dtypes"]:
        ratio = " / ".join(f"{med[base][m] / med[d][m]:.2f}" for m in METRICS)
        name = d if r["resolved"][d] == d else f"{d} (= {r['resolved'][d]})"
        lines.append(f"| {name} | " + " | ".join(f"{med[d][m]:.1f}" for m in METRICS) + f" | {ratio} |")
    if r.get("quality"):
        lines += ["", f"Quality against `{r['quality_reference']}`: next-token distributions over the same "
                  f"{next(iter(r['quality'].values()))['tokens']} tokens of text (the end of `sits/data/corpus.txt`, "
                  "teacher-forced in windows of 512).", "",
                  "| variant | greedy agreement | mean KL (nats/token) |", "|---|---|---|"]
        lines += [f"| {v} | {q['greedy_agreement']:.4f} | {q['mean_kl']:.5f} |" for v, q in r["quality"].items()]
    lines += ["", f"![dtype benchmark]({plot_path})", "", DOC_END]
    return "\n".join(lines)


def _plot(r: dict, path) -> None:
    grouped_bars(path, [METRICS[m].format(prompt=r["prompt"]) for m in METRICS],
                 {d: [r["median"][d][m] for m in METRICS] for d in r["dtypes"]}, ylabel="ms (median)",
                 title=f"{os.path.basename(os.path.normpath(r['model']))}: compute dtype, {r['threads']} thread(s)")


def _cli(args: argparse.Namespace) -> int:
    r = run_dtype_bench(args.model, dtypes=[d.strip() for d in args.dtypes.split(",") if d.strip()],
                        threads=args.threads, rounds=args.repeats, prompt=args.prompt, steps=args.steps,
                        json_out=args.json, docs_out=args.write_docs, quality_tokens=args.quality_tokens,
                        quality_reference=args.quality_reference)
    print(json.dumps({"median": r["median"], "quality": r.get("quality")}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "dtype", "one checkpoint in each compute dtype: prefill and decode speed",
                          _cli, threads="CPU threads per dtype's process",
                          repeats="rounds of every dtype, median reported", repeats_default=3)
    p.add_argument("--dtypes", default="float32,bfloat16,auto",
                   help="comma-separated variants, each a dtype or dtype+int8; the first is the baseline "
                        "(default: float32,bfloat16,auto)")
    p.add_argument("--quality-tokens", type=int, default=0,
                   help="also compare each variant's next-token distributions with the reference's over this "
                        "many tokens of text (default: 0, off)")
    p.add_argument("--quality-reference", default="bfloat16", help="the variant quality is measured against")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill measurement")
    p.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
