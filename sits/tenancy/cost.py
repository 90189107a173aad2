"""What a request computed, from the model's shape: FLOPs and KV-cache memory-time.

FLOPs count what the engine runs: each position it computes (the prompt past its cached prefix,
then one per generated token but the last) costs 2 × the layers' matmul parameters, plus the
attention over its context (QKᵀ and AV: 4 × heads × head_dim per key per layer, keys capped by a
sliding window), and each position that yields a token (the prompt's last, every decode step) also
the LM head (2 × hidden × vocab). The embedding lookup is free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    sliding_window: int | None = None       # None: every layer attends to the whole context
    windowed_layers: int = 0                # how many layers the window applies to
    kv_bytes_per_elem: int = 2
    tied_embeddings: bool = False

    @classmethod
    def of(cls, mc, kv_bytes_per_elem: int = 2) -> "ModelShape":
        """From a ``sits.engine.config.ModelConfig``."""
        windowed = sum(1 for i in range(mc.num_hidden_layers) if mc.layer_window(i) is not None)
        return cls(layers=mc.num_hidden_layers, hidden=mc.hidden_size, intermediate=mc.intermediate_size,
                   heads=mc.num_attention_heads, kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim,
                   vocab=mc.vocab_size, sliding_window=mc.sliding_window if windowed else None,
                   windowed_layers=windowed, kv_bytes_per_elem=kv_bytes_per_elem,
                   tied_embeddings=bool(mc.tie_word_embeddings))

    @property
    def layer_params(self) -> int:
        """Matmul parameters of the decoder layers (q, k, v, o; gate, up, down)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.layers * (self.hidden * q + 2 * self.hidden * kv + q * self.hidden
                              + 3 * self.hidden * self.intermediate)

    @property
    def weight_params(self) -> int:
        """All parameters: the layers' matmuls, the embedding and (untied) the LM head; norms are noise."""
        return self.layer_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem

    def _keys(self, start: int, stop: int) -> tuple[int, int]:
        """Sum over positions p in [start, stop) of p + 1 (full layers) and of min(p + 1, window)."""
        if stop <= start:
            return 0, 0
        full = (stop * (stop + 1) - start * (start + 1)) // 2
        w = self.sliding_window
        if not w:
            return full, full
        # positions below w - 1 see p + 1 keys, the rest see w
        lo_stop = min(stop, max(start, w - 1))
        windowed = (lo_stop * (lo_stop + 1) - start * (start + 1)) // 2 + (stop - lo_stop) * w
        return full, windowed

    def flops(self, prompt: int, cached: int, completion: int, lm_head: bool = True) -> int:
        """FLOPs the engine ran for one sequence: ``prompt`` tokens of which ``cached`` came from
        the prefix cache, and ``completion`` generated tokens (``lm_head`` false: hidden states
        only, as an embedding reads them)."""
        if completion <= 0 and prompt <= cached:
            return 0
        end = prompt + max(completion - 1, 0)          # the last generated token is never fed back
        positions = end - cached
        full_keys, windowed_keys = self._keys(cached, end)
        per_key = 4 * self.heads * self.head_dim
        attention = per_key * ((self.layers - self.windowed_layers) * full_keys + self.windowed_layers * windowed_keys)
        logits = max(completion, 1 if prompt > cached else 0) if lm_head else 0
        return 2 * self.layer_params * positions + attention + 2 * self.hidden * self.vocab * logits


def kv_block_seconds(prompt: int, completion: int, block_size: int, scheduled_at: float | None,
                     first_token_at: float | None, finished_at: float | None) -> float:
    """Blocks held × time for one sequence: the prompt's blocks from its first step to its first
    token, then growing linearly to the final length until the end (the trapezoid of the decode)."""
    if scheduled_at is None or finished_at is None:
        return 0.0
    ftt = first_token_at if first_token_at is not None else finished_at
    start_blocks = -(-prompt // block_size)
    end_blocks = -(-(prompt + completion) // block_size)
    return start_blocks * max(ftt - scheduled_at, 0.0) + (start_blocks + end_blocks) / 2 * max(finished_at - ftt, 0.0)
