"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A one-token decode step of a small model is a few hundred kernel launches and almost no arithmetic:
launched one by one from Python, the step costs what the launches cost. Captured once into a CUDA
graph per batch size, a step is one replay. Every input the step reads lives in a static buffer the
graphs were captured over (token ids, positions, KV slots, context lengths, block tables); a step
copies its batch into the first rows and pads the rest of its bucket (slot -1: nothing stored; no
query: no attention work), so one graph serves every batch up to its size. Buckets are 1, 2, 4, 8,
then steps of 16 up to ``max_num_seqs`` (nano-vllm's choice). Prefill steps, steps with LoRA
rows and larger batches run eagerly.

Captured in the operator-level warm-up; after a minimal warm-up (a cold start with a request
waiting) the engine captures them in idle moments instead, one at a time, and decodes eagerly until
its bucket's graph exists. Where there is no CUDA (the paged kernels under Triton's
interpreter, in tests) the same buffers are filled and the same padded forward runs eagerly, so
everything but the capture itself is exercised there.
"""

from __future__ import annotations

import torch

from sits.engine.layers.paged_attention import PagedMetadata


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs} | set(range(16, max_num_seqs + 1, 16)) | {max_num_seqs}
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_layers: list[torch.Tensor], device: torch.device,
                 max_num_seqs: int, max_blocks_per_seq: int):
        self.model = model
        self.kv_layers = kv_layers
        self.device = device
        self.buckets = bucket_sizes(max_num_seqs)
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.cu_seqlens = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, model.config.hidden_size, dtype=model.model.embed_tokens.weight.dtype,
                                  device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.failed: str | None = None      # a capture that failed: the rest then run eagerly

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _forward(self, bucket: int) -> None:
        from sits.engine.models.llama import AttentionMetadata

        meta = AttentionMetadata(self.slot_mapping[:bucket], paged=PagedMetadata(
            self.cu_seqlens[:bucket + 1], self.seq_lens[:bucket], self.block_tables[:bucket], max_query_len=1))
        self.hidden[:bucket] = self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_layers, meta)

    @property
    def pending(self) -> bool:
        """Buckets still to capture (only on CUDA: elsewhere there is nothing to capture)."""
        return self.device.type == "cuda" and self.failed is None and len(self.graphs) < len(self.buckets)

    @torch.inference_mode()
    def capture(self, max_graphs: int | None = None) -> int:
        """Capture the buckets not captured yet (at most ``max_graphs``), largest first so the smaller
        ones reuse its memory pool. Between steps only: the capture runs over the static buffers
        (padding everywhere: nothing is stored in or read from the KV cache). Returns how many."""
        if not self.pending:
            return 0
        with torch.cuda.device(self.device):    # the calling thread's current device may be another
            return self._capture(max_graphs)

    def _capture(self, max_graphs: int | None) -> int:
        self._fill([], [], [], [], [])
        todo = [b for b in reversed(self.buckets) if b not in self.graphs][:max_graphs]
        for bucket in todo:
            self._forward(bucket)                     # compiles the kernels and sizes the allocator first
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self._pool):
                self._forward(bucket)
            self._pool = self._pool or graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        return len(todo)

    def _fill(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
              tables: list[list[int]]) -> None:
        """The batch into the first rows of the static buffers, the rest as padding (one host-to-device
        copy per buffer). Block tables are copied only as wide as the batch's longest: a padding row
        has no query and a sequence never reads its table past its length, so stale entries are inert."""
        n, size = len(input_ids), self.max_batch
        width = max((len(t) for t in tables), default=0)
        pin = self.device.type == "cuda"

        def put(dst: torch.Tensor, values: list, dtype: torch.dtype) -> None:
            dst.copy_(torch.tensor(values, dtype=dtype, pin_memory=pin), non_blocking=True)

        put(self.input_ids, input_ids + [0] * (size - n), torch.long)
        put(self.positions, positions + [0] * (size - n), torch.long)
        put(self.slot_mapping, slots + [-1] * (size - n), torch.long)
        put(self.cu_seqlens, list(range(n + 1)) + [n] * (size - n), torch.int32)
        put(self.seq_lens, seq_lens + [0] * (size - n), torch.int32)
        if n and width:
            put(self.block_tables[:n, :width], [t + [0] * (width - len(t)) for t in tables], torch.int32)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            tables: list[list[int]]) -> torch.Tensor:
        """One decode step of ``len(input_ids)`` sequences: their final hidden states [n, hidden]."""
        n = len(input_ids)
        bucket = self._bucket(n)
        self._fill(input_ids, positions, slots, seq_lens, tables)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._forward(bucket)
        return self.hidden[:n]
