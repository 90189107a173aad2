"""ModelRunner: turns a ScheduledBatch into one fused forward pass over the paged KV cache.

All new tokens of all scheduled sequences are flattened into one [T] batch, so every linear layer
runs once per step. Attention takes one of three paths, chosen once when the engine starts
(``EngineConfig.attention``):

- ``torch``, the reference: 1-token decodes are batched into one padded attention call over a
  gathered copy of their blocks; prefill chunks attend one sequence each.
- ``cpp`` (the CPU's where it builds): the same, except that the decodes go to the C++ kernel of
  ``layers.cpu_attention``, which reads their blocks in place (no gathered copy, no padding mask).
- ``triton``: the paged kernels of ``layers.paged_attention`` read the cache in place for the whole
  step; its metadata are tensors (cu_seqlens, sequence lengths, block tables, slots). Decode-only
  steps replay a CUDA graph of their batch-size bucket (``decode_graphs``).

Logits stay on the model's device: the sampler runs there and only the sampled ids cross back.
"""

from __future__ import annotations

import torch

from sits.engine.decode_graphs import DecodeGraphs
from sits.engine.kv_cache import KVCache
from sits.engine.layers.paged_attention import PagedMetadata
from sits.engine.models.llama import AttentionMetadata, LlamaForCausalLM, PrefillSpan
from sits.engine.scheduler import ScheduledBatch
from sits.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, adapters=None,
                 attention: str = "torch", max_num_seqs: int = 64, max_model_len: int = 2048,
                 decode_graphs: bool = True):
        """``adapters``: the engine's ``AdapterManager`` when it serves LoRA adapters. ``attention``:
        ``torch`` or ``triton`` (resolved by the engine); ``decode_graphs``: with ``triton``, decode
        steps run over static buffers, replayed from CUDA graphs once ``capture_graphs`` ran."""
        self.model = model
        self.adapters = adapters
        self.kv = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.window = model.config.sliding_window or None
        self.attention = attention
        self._pin = device.type == "cuda"
        self.graphs = (DecodeGraphs(model, kv_cache.layers, device, max_num_seqs,
                                    -(-max_model_len // self.block_size))
                       if attention == "triton" and decode_graphs else None)

    def capture_graphs(self) -> int:
        """Capture the decode graphs (the operator-level warm-up calls it); how many were captured."""
        return self.graphs.capture() if self.graphs is not None else 0

    def _to(self, data: list[int], dtype: torch.dtype = torch.long) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, pin_memory=self._pin).to(self.device, non_blocking=True)

    def prepare(self, seqs: list[Sequence], num_new: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                         AttentionMetadata,
                                                                         tuple[list[int], list[int]]]:
        """Flat input ids, positions, attention metadata, and for each sequence that samples this
        step: its position in ``seqs`` and the flat index of its last token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu = [0]                        # offsets of each sequence's new tokens in the flat batch
        lens: list[int] = []            # tokens in the cache after the step
        tables: list[list[int]] = []    # each sequence's blocks up to its last token
        sample_rows: list[int] = []
        sample_idx: list[int] = []
        for row, (seq, n) in enumerate(zip(seqs, num_new)):
            begin = seq.num_computed_tokens
            end = begin + n
            input_ids.extend(seq.token_slice(begin, end))
            positions.extend(range(begin, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
            cu.append(cu[-1] + n)
            lens.append(end)
            tables.append(table[:(end + bs - 1) // bs])
            if end == seq.num_tokens:
                sample_rows.append(row)
                sample_idx.append(cu[-1] - 1)
        if self.attention == "triton":
            width = max(len(t) for t in tables)
            meta = AttentionMetadata(self._to(slots), paged=PagedMetadata(
                self._to(cu, torch.int32), self._to(lens, torch.int32),
                self._to([b for t in tables for b in t + [0] * (width - len(t))], torch.int32).view(len(tables), width),
                max(num_new)))
        else:
            meta = self._reference_metadata(self._to(slots), num_new, cu, lens, tables, self.attention == "cpp")
        return self._to(input_ids), self._to(positions), meta, (sample_rows, sample_idx)

    def _reference_metadata(self, slots: torch.Tensor, num_new: list[int], cu: list[int], lens: list[int],
                            tables: list[list[int]], in_place: bool) -> AttentionMetadata:
        """The reference path's metadata: a span per prefill chunk, the 1-token decodes' block tables
        padded together, with their padding masks (``in_place`` False) or their context lengths (for
        the C++ kernel)."""
        decodes = [i for i, n in enumerate(num_new) if n == 1]
        prefills = [PrefillSpan(cu[i], cu[i + 1], lens[i], self._to(tables[i]))
                    for i, n in enumerate(num_new) if n != 1]
        if not decodes:
            return AttentionMetadata(slots, prefills)
        bs = self.block_size
        width = max(len(tables[i]) for i in decodes)
        d_tables = self._to([b for i in decodes for b in tables[i] + [0] * (width - len(tables[i]))]).view(len(decodes),
                                                                                                         width)
        d_lens = self._to([lens[i] for i in decodes])
        if in_place:
            return AttentionMetadata(slots, prefills, self._to([cu[i] for i in decodes]), d_tables,
                                     decode_context_lens=d_lens)
        k_pos = torch.arange(width * bs, device=self.device)[None, :]
        d_mask = (k_pos < d_lens[:, None])[:, None, None, :]
        d_window = None
        if self.window is not None:     # the new token at lens-1 sees keys with (lens-1) - k < window
            d_window = (d_mask & (k_pos >= d_lens[:, None] - self.window)[:, None, None, :])
        return AttentionMetadata(slots, prefills, self._to([cu[i] for i in decodes]), d_tables, d_mask, d_window)

    def _graph_step(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """A decode-only step without adapters, through the decode graphs: its logits; else None."""
        seqs = batch.seqs
        if (self.graphs is None or len(seqs) > self.graphs.max_batch or any(n != 1 for n in batch.num_new)
                or any(s.lora is not None or s.num_computed_tokens + 1 != s.num_tokens for s in seqs)):
            return None
        bs = self.block_size
        positions = [s.num_computed_tokens for s in seqs]
        hidden = self.graphs.run(
            [s.token_slice(p, p + 1)[0] for s, p in zip(seqs, positions)], positions,
            [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)],
            [p + 1 for p in positions], [s.block_table[:p // bs + 1] for s, p in zip(seqs, positions)])
        return self.model.compute_logits(hidden)

    def _bind_adapters(self, seqs: list[Sequence], num_new: list[int]) -> None:
        """Each adapter of the step and the flat rows of its tokens."""
        rows_of: dict[str, list[int]] = {}
        start = 0
        for seq, n in zip(seqs, num_new):
            if seq.lora is not None:
                rows_of.setdefault(seq.lora, []).extend(range(start, start + n))
            start += n
        self.adapters.bind(rows_of, start)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Runs the step; returns float32 logits [S, vocab] for the S sequences that sample now,
        and their positions in ``batch.seqs``."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):   # Triton launches on the current device
                return self._execute(batch)
        return self._execute(batch)

    def _execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        logits = self._graph_step(batch)
        if logits is not None:        # a decode step: every sequence samples
            return logits, list(range(len(batch.seqs)))
        input_ids, positions, meta, (rows, sample_idx) = self.prepare(batch.seqs, batch.num_new)
        if self.adapters is not None:
            self._bind_adapters(batch.seqs, batch.num_new)
            try:
                hidden = self.model(input_ids, positions, self.kv.layers, meta)
            finally:
                self.adapters.unbind()
        else:
            hidden = self.model(input_ids, positions, self.kv.layers, meta)
        if not sample_idx:
            return torch.empty(0, self.model.config.vocab_size), rows
        return self.model.compute_logits(hidden[self._to(sample_idx)]), rows
