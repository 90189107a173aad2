"""Multi-level warm-up (MGW): pay every one-time cost before the first request does.

- model level: the memory-mapped weights are faulted in (one strided read per page);
- operator level: dummy forward passes over the prefill-chunk and decode-batch shapes the scheduler
  will produce, so kernels, allocator pools and (on GPU) autotuning are ready; then the decode
  steps' CUDA graphs are captured (the ``graphs`` phase; only with the paged kernels on CUDA; a
  minimal warm-up leaves them to the engine's idle moments);
- hardware level: the intra-op thread pool is started and the KV pool (allocated and touched when
  the engine starts) is exercised end to end through a block table.
Each level is timed into the ColdStartReport.
"""

from __future__ import annotations

import mmap

import torch

from sits.engine.block_pool import BlockPool
from sits.engine.cold_start import ColdStartReport
from sits.engine.model_runner import ModelRunner
from sits.engine.sampling_params import SamplingParams
from sits.engine.sequence import Sequence


def prefill_buckets(max_batched_tokens: int, max_model_len: int) -> list[int]:
    sizes = {16, 64, max_batched_tokens}
    return sorted(s for s in sizes if 1 < s <= min(max_batched_tokens, max_model_len))


def decode_buckets(max_num_seqs: int) -> list[int]:
    return sorted({b for b in (1, 4, 16, max_num_seqs) if b <= max_num_seqs})


def _page_in(model: torch.nn.Module) -> None:
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        step = max(1, mmap.PAGESIZE // p.element_size())
        flat[::step].sum()


def _dummy_batch(pool: BlockPool, lengths: list[int], vocab: int) -> list[Sequence] | None:
    seqs = []
    for i, n in enumerate(lengths):
        need = pool.blocks_needed(n)
        if need > pool.num_free:
            break
        s = Sequence(f"warmup-{i}", [(7 * j + i) % vocab for j in range(n)], SamplingParams(max_tokens=1))
        s.block_table = pool.allocate(need)
        seqs.append(s)
    return seqs or None


def run_warmup(runner: ModelRunner, pool: BlockPool, report: ColdStartReport, *, max_batched_tokens: int,
               max_num_seqs: int, max_model_len: int, threads: int, minimal: bool = False) -> None:
    """``minimal``: one small prefill and one single decode instead of every bucket (for cold starts,
    where the first request is waiting; the other shapes then pay their one-time cost on first use)."""
    vocab = runner.model.config.vocab_size
    with report.phase("warmup_model"):
        _page_in(runner.model)
    with report.phase("warmup_hardware"):
        torch.set_num_threads(threads)
        a = torch.randn(256, 256)
        (a @ a).sum()                                   # spins up the intra-op thread pool
    with report.phase("warmup_operator"), torch.inference_mode():
        prefills = prefill_buckets(max_batched_tokens, max_model_len)
        decodes = decode_buckets(max_num_seqs)
        if minimal:
            prefills, decodes = prefills[:1], decodes[:1]
        for n in prefills:
            seqs = _dummy_batch(pool, [n], vocab)
            if seqs:
                runner.model.compute_logits(runner.model(*_flat(runner, seqs, [n]))[-1:])   # sampled: the last
                pool.release(seqs[0].block_table)
        for b in decodes:
            # Decode shape: one new token after a short context already in the cache.
            seqs = _dummy_batch(pool, [17] * b, vocab)
            if not seqs:
                continue
            for s in seqs:
                s.num_computed_tokens = 16
            runner.model.compute_logits(runner.model(*_flat(runner, seqs, [1] * len(seqs))))
            for s in seqs:
                pool.release(s.block_table)
    if not minimal:       # a cold start's first request is not kept waiting: captured when idle instead
        with report.phase("graphs"):
            runner.capture_graphs()


def _flat(runner: ModelRunner, seqs: list[Sequence], num_new: list[int]):
    input_ids, positions, meta, _ = runner.prepare(seqs, num_new)
    return input_ids, positions, runner.kv.layers, meta
