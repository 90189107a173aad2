"""ModelRunner: turns a ScheduledBatch into one fused forward pass over the paged KV cache.

All new tokens of all scheduled sequences are flattened into one [T] batch, so every linear layer
runs once per step. Attention is split by shape: 1-token decodes are batched into one padded
attention call; prefill chunks attend one sequence each through their block tables.
"""

from __future__ import annotations

import torch

from sits.engine.kv_cache import KVCache
from sits.engine.models.llama import AttentionMetadata, LlamaForCausalLM, PrefillSpan
from sits.engine.scheduler import ScheduledBatch
from sits.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, device: torch.device, adapters=None):
        """``adapters``: the engine's ``AdapterManager`` when it serves LoRA adapters."""
        self.model = model
        self.adapters = adapters
        self.kv = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.window = model.config.sliding_window or None

    def _to(self, data: list[int]) -> torch.Tensor:
        return torch.tensor(data, dtype=torch.long).to(self.device, non_blocking=True)

    def prepare(self, seqs: list[Sequence], num_new: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                         AttentionMetadata,
                                                                         tuple[list[int], list[int]]]:
        """Flat input ids, positions, attention metadata, and for each sequence that samples this
        step: its position in ``seqs`` and the flat index of its last token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSpan] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        sample_rows: list[int] = []
        sample_idx: list[int] = []
        for row, (seq, n) in enumerate(zip(seqs, num_new)):
            start = len(input_ids)
            begin = seq.num_computed_tokens
            end = begin + n
            input_ids.extend(seq.token_slice(begin, end))
            positions.extend(range(begin, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
            if n == 1:
                decode_idx.append(start)
                decode_tables.append(table[:(end + bs - 1) // bs])
                decode_lens.append(end)
            else:
                prefills.append(PrefillSpan(start, start + n, end, self._to(table[:(end + bs - 1) // bs])))
            if end == seq.num_tokens:
                sample_rows.append(row)
                sample_idx.append(start + n - 1)

        d_index = d_tables = d_mask = d_window = None
        if decode_idx:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            d_index = self._to(decode_idx)
            d_tables = self._to([b for row in padded for b in row]).view(len(padded), width)
            lens = self._to(decode_lens)
            k_pos = torch.arange(width * bs, device=self.device)[None, :]
            d_mask = (k_pos < lens[:, None])[:, None, None, :]
            if self.window is not None:     # the new token at lens-1 sees keys with (lens-1) - k < window
                d_window = (d_mask & (k_pos >= lens[:, None] - self.window)[:, None, None, :])
        meta = AttentionMetadata(self._to(slots), prefills, d_index, d_tables, d_mask, d_window)
        return self._to(input_ids), self._to(positions), meta, (sample_rows, sample_idx)

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
        logits = self.model.compute_logits(hidden[self._to(sample_idx)])
        return logits.cpu() if logits.device.type != "cpu" else logits, rows
