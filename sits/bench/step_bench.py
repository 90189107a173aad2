"""``sits bench step``: what one decode step costs, per kernel path, against transformers' ``generate``.

For each batch size, ``n`` sequences are prefilled with a ``context``-token prompt, then ``steps``
decode steps are timed one by one (each step ends with the sampled ids on the host, so its time is
the whole step). The engine runs once per path available on the device, in the same run:

- ``reference``: torch's operators throughout (``attention``, ``linear`` and ``elementwise`` "torch");
- ``cpp_attention`` (CPU): decodes read the paged cache in place through the C++ kernel
  (``attention="cpp"``), the rest by torch;
- ``cpp`` (CPU): every C++ kernel the dtype allows, the few-row matmuls and the norms and RoPE too for
  fp32 (``linear`` and ``elementwise`` "auto": what an engine takes by default for a safetensors model);
- ``cpp_blocks`` (CPU, a GGUF file in fp32): ``cpp`` with the file's block-quantized weights served as
  their blocks (``gguf_weights="blocks"``: what an engine takes by default for such a file; the other
  paths dequantize it at load);
- ``cpp_blocks_int8``: ``cpp_blocks`` with its decode rows quantized to 8 bits per block and multiplied
  by integer dot products (``block_activations="int8"``, llama.cpp's arithmetic; approximate);
- ``paged``: the paged Triton kernels, eager;
- ``paged+graphs``: the paged kernels with decode steps replayed from CUDA graphs.

The paths take turns within each repeat (the order reversed every repeat), so a host's drift lands on
all of them alike.

The baseline is Hugging Face ``generate`` on the same weights and dtype: one sequence at batch 1,
left-padded batched generation above. Tokens per second are ``n / step time`` for the engine and
new tokens over wall time for ``generate``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from sits.bench.common import add_bench_command, grouped_bars, print_summary, publish
from sits.bench.common import log as _log
from sits.bench.engine_bench import Hardware
from sits.bench.hf_baseline import hf_decode_tok_s, load_hf_causal_lm, vocab_size
from sits.engine.sampling_params import SamplingParams

DOC_BEGIN = "<!-- sits bench step: begin -->"
DOC_END = "<!-- sits bench step: end -->"

_DENSE = dict(gguf_weights="dequantize")
PATHS = {"reference": dict(attention="torch", linear="torch", elementwise="torch", decode_graphs=False, **_DENSE),
         "cpp_attention": dict(attention="cpp", linear="torch", elementwise="torch", decode_graphs=False, **_DENSE),
         "cpp": dict(attention="cpp", linear="auto", elementwise="auto", decode_graphs=False, **_DENSE),
         "cpp_blocks": dict(attention="cpp", linear="auto", elementwise="auto", decode_graphs=False,
                            gguf_weights="blocks"),
         "cpp_blocks_int8": dict(attention="cpp", linear="auto", elementwise="auto", decode_graphs=False,
                                 gguf_weights="blocks", block_activations="int8"),
         "paged": dict(attention="triton", decode_graphs=False),
         "paged+graphs": dict(attention="triton", decode_graphs=True)}


def available_paths(device: str, model: str | None = None, dtype: str = "float32") -> list[str]:
    import torch

    from sits.engine.config import ModelConfig, resolve_dtype
    from sits.engine.gguf_model import gguf_file
    from sits.engine.layers import cpu_kernels, paged_attention

    dev = torch.device(device)
    if dev.type == "cuda" and paged_attention.available(dev):
        return ["reference", "paged", "paged+graphs"]
    if dev.type == "cpu" and cpu_kernels.kernel(build=False) is not None:   # what `make install` built
        blocks = (model is not None and gguf_file(model) is not None
                  and resolve_dtype(dtype, dev, ModelConfig.from_dir(model).torch_dtype) == torch.float32)
        return ["reference", "cpp_attention", "cpp"] + ["cpp_blocks", "cpp_blocks_int8"] * blocks
    return ["reference"]


def decode_step_times(model: str, hw: Hardware, path: str, batch: int, context: int, steps: int, seed: int) -> dict:
    """One engine on ``path``: ``batch`` sequences prefilled with ``context`` random tokens, then
    ``steps`` decode steps timed one by one: the median step (ms), ``batch`` over it (tok/s) and what
    capturing decode graphs added to the start (ms)."""
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=model, device=hw.device, dtype=hw.dtype, threads=hw.threads,
                                 max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, context),
                                 enable_prefix_caching=False,
                                 kv_cache_memory_mb=_kv_mb(model, hw, batch, context + steps),
                                 **PATHS[path]))
    rng = random.Random(seed)
    vocab = vocab_size(model)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        eng.add_request([rng.randrange(5, vocab) for _ in range(context)], params)
    while any(not s.output_token_ids for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()                                   # prefills (and their first tokens)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    times = times[len(times) // 4:]                  # the first steps still page in and size pools
    ms = statistics.median(times) * 1e3
    return {"step_ms": ms, "tok_s": batch / (ms / 1e3), "capture_ms": eng.report.phases_ms.get("graphs", 0.0)}


def _kv_mb(model: str, hw: Hardware, batch: int, length: int) -> int:
    """A KV pool just big enough for the batch (at least 64 MB)."""
    import torch

    from sits.engine.config import ModelConfig, resolve_dtype
    from sits.engine.kv_cache import bytes_per_block

    mc = ModelConfig.from_dir(model)
    dtype = resolve_dtype(hw.dtype, torch.device(hw.device), mc.torch_dtype)
    blocks = batch * (-(-length // 16) + 1)
    return max(64, -(-blocks * bytes_per_block(mc, 16, dtype) // 2**20) + 16)


def run_step_bench(model: str, device: str = "cpu", dtype: str = "bfloat16", batch_sizes: tuple[int, ...] = (1, 32),
                   context: int = 128, steps: int = 64, repeats: int = 3, hf: bool = True, threads: int | None = None,
                   json_out: str | None = None, docs_out: str | None = None, only: tuple[str, ...] = ()) -> dict:
    """``only``: these of the available paths (all when empty)."""
    hw = Hardware(device, dtype, threads)
    paths = available_paths(device, model, dtype)
    if only:
        if set(only) - set(paths):
            raise ValueError(f"paths {', '.join(sorted(set(only) - set(paths)))} are not available here "
                             f"(available: {', '.join(paths)})")
        paths = [p for p in paths if p in only]
    _log(f"step: {model} on {hw.describe()}; paths {', '.join(paths)}")
    rows: dict[str, dict] = {}
    for batch in batch_sizes:
        row: dict[str, float] = {}
        by_path: dict[str, list[dict]] = {p: [] for p in paths}
        for r in range(repeats):
            for path in (paths if r % 2 == 0 else paths[::-1]):
                by_path[path].append(decode_step_times(model, hw, path, batch, context, steps, seed=r))
                _log(f"step: batch {batch}, run {r + 1}/{repeats}: {path} {by_path[path][-1]['step_ms']:.2f} ms/step")
        for path in paths:
            runs = by_path[path]
            row[f"{path}_step_ms"] = statistics.median(r["step_ms"] for r in runs)
            row[f"{path}_tok_s"] = statistics.median(r["tok_s"] for r in runs)
            if path == "paged+graphs":      # what capturing the decode graphs adds to a start
                row["graph_capture_ms"] = statistics.median(r["capture_ms"] for r in runs)
            _log(f"step: batch {batch}: {path} {row[f'{path}_step_ms']:.2f} ms/step, {row[f'{path}_tok_s']:.0f} tok/s")
        rows[str(batch)] = row
    if hf:
        import torch

        from sits.engine.config import ModelConfig, resolve_dtype
        torch_dtype = resolve_dtype(dtype, torch.device(device), ModelConfig.from_dir(model).torch_dtype)
        model_hf = load_hf_causal_lm(model, torch_dtype, torch.device(device))
        rng = random.Random(7)
        vocab = vocab_size(model)
        for batch in batch_sizes:
            prompts = [[rng.randrange(5, vocab) for _ in range(context)] for _ in range(batch)]
            tok_s = statistics.median(hf_decode_tok_s(model_hf, prompts, steps, batch > 1, 2, hw)
                                      for _ in range(repeats))
            row = rows[str(batch)]
            row["hf_tok_s"] = tok_s
            for path in paths:
                row[f"{path}_vs_hf"] = row[f"{path}_tok_s"] / tok_s
            _log(f"step: batch {batch}: HF generate {tok_s:.0f} tok/s")
        del model_hf
    for row in rows.values():
        others = [row[f"{p}_step_ms"] for p in paths if p != "reference"]
        if others and "reference" in paths:      # the fastest of the other paths
            row["speedup_vs_reference"] = row["reference_step_ms"] / min(others)
    result = {"model": model, "hardware": hw.describe(), "context": context, "steps": steps, "repeats": repeats,
              "paths": paths, "batches": rows}
    result["summary"] = {b: {k: round(v, 3) for k, v in r.items()} for b, r in rows.items()}
    return publish(result, "step", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out, plot=_plot)


def _markdown(result: dict, command: str, plot: str | None) -> str:
    paths = result["paths"]
    head = "| batch | " + " | ".join(f"{p} ms/step" for p in paths) + " | " + " | ".join(
        f"{p} tok/s" for p in paths) + " | HF generate tok/s | best / HF | fastest path vs reference |"
    lines = [DOC_BEGIN, "## Decode step (`sits bench step`)", "", f"Command: `{command}`  ",
             f"Host: {result['hardware']}; model: `{result['model']}`; {result['context']}-token context; median "
             f"over the last {result['steps'] - result['steps'] // 4} of {result['steps']} steps, median of "
             f"{result['repeats']} runs.", "", head,
             "|" + "---|" * (len(paths) * 2 + 4)]
    for batch, r in result["batches"].items():
        best = max(r[f"{p}_tok_s"] for p in paths)
        hf = r.get("hf_tok_s")
        lines.append(f"| {batch} | " + " | ".join(f"{r[f'{p}_step_ms']:.2f}" for p in paths) + " | "
                     + " | ".join(f"{r[f'{p}_tok_s']:.0f}" for p in paths)
                     + (f" | {hf:.0f} | {best / hf:.2f}×" if hf else " | – | –")
                     + (f" | {r['speedup_vs_reference']:.2f}× |" if "speedup_vs_reference" in r else " | – |"))
    if plot:
        lines += ["", f"![decode step]({plot})"]
    return "\n".join(lines + ["", DOC_END])


def _plot(result: dict, path) -> None:
    batches = list(result["batches"])
    series = {p: [result["batches"][b][f"{p}_step_ms"] for b in batches] for p in result["paths"]}
    grouped_bars(path, [f"batch {b}" for b in batches], series, ylabel="ms per decode step",
                 title=f"Decode step, {result['hardware']}")


def _cli(args: argparse.Namespace) -> int:
    return print_summary("step", lambda: run_step_bench(
        args.model, device=args.device, dtype=args.dtype,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")), context=args.context, steps=args.steps,
        repeats=args.repeats, hf=not args.no_hf, threads=args.threads,
        json_out=args.json, docs_out=args.write_docs, only=tuple(p for p in args.paths.split(",") if p)))


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "step", "decode step time per kernel path (reference, cpp, paged, +graphs) vs HF",
                          _cli, threads="CPU threads", repeats="runs per figure, median reported (default: 3)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (paged paths need CUDA and Triton)")
    p.add_argument("--dtype", default="bfloat16", help="weights and KV cache (float32, bfloat16, float16)")
    p.add_argument("--batch-sizes", default="1,32", help="comma-separated sequences per step")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the timed steps")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per run")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers generate baseline")
    p.add_argument("--paths", default="", help="comma-separated paths to time, of those available (default: all)")
