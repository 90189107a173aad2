"""Batched sampling: turn one step's logits into one token per running sequence.

This runs once per engine step, so the common cases stay cheap: a greedy batch with no penalties
and no logprobs is a single ``argmax`` and one device-to-host copy; penalties, logprobs and the
temperature / top-k / top-p / min-p pipeline only run when some row asks for them.

Reproducibility contract: a seeded request gets the same tokens for the same logits whatever
else is in the batch. Every tensor operation here is row-wise (the value of row ``i`` depends
only on row ``i``), and the one random draw is taken per row from that row's own generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from sits.engine.sampling_params import SamplingParams

# Candidates ranked to find a top-p nucleus without sorting the whole vocabulary.
TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class SampleResult:
    """What one sampling step produced, one entry per batch row.

    ``logprobs`` and ``top_logprobs`` are ``None`` unless some row set ``SamplingParams.logprobs``;
    then both cover every row (``top_logprobs[i]`` is ``[]`` for a row that asked for no
    alternatives). Like vLLM's default, they are ``log_softmax`` of the *raw* model logits: no
    penalties, temperature or truncation applied, so they describe the model, not the sampler.
    ``top_logprobs[i]`` is sorted by logprob, highest first.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    failed_rows: list[int] = field(default_factory=list)    # no finite distribution: their ids mean nothing


def _uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    output_token_ids: list[list[int]],
                    prompt_token_ids: list[list[int]]) -> torch.Tensor:
    """Return ``logits`` with each row's penalties applied, never modifying the input.

    Order and semantics follow vLLM: first the repetition penalty (HF style, over prompt and
    output tokens: a positive logit is divided by it, a negative one multiplied), then OpenAI's
    ``logit -= frequency * count + presence * (count > 0)`` over output tokens only. The work is
    sparse (only the logits of tokens that occurred are touched), and when no row has a penalty
    the input tensor itself is returned, so the greedy fast path pays nothing.
    """
    rows = [i for i, p in enumerate(params) if _uses_penalties(p)]
    if not rows:
        return logits
    vocab = logits.shape[1]

    def flat_positions(pairs: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Indices into the flattened [B * V] logits of each (row, token ids) pair's tokens."""
        tokens = torch.cat([torch.tensor(ids, dtype=torch.long) for _, ids in pairs])
        if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab):
            raise ValueError(f"token ids for penalties must be in [0, {vocab})")
        row_of = torch.cat([torch.full((len(ids),), i, dtype=torch.long) for i, ids in pairs])
        return row_of * vocab + tokens

    def per_row(values: list[float], positions: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=logits.dtype)[positions // vocab].to(logits.device)

    out = logits.clone()
    flat = out.view(-1)
    seen = [(i, ids) for i in rows if params[i].repetition_penalty != 1.0
            for ids in (prompt_token_ids[i], output_token_ids[i])]
    if seen:
        positions = torch.unique(flat_positions(seen))
        penalty = per_row([p.repetition_penalty for p in params], positions)
        positions = positions.to(logits.device)
        values = flat[positions]
        flat[positions] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [(i, output_token_ids[i]) for i in rows
               if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0]
    if counted:
        positions, counts = torch.unique(flat_positions(counted), return_counts=True)
        subtract = (per_row([p.frequency_penalty for p in params], positions) * counts.to(logits.device)
                    + per_row([p.presence_penalty for p in params], positions))
        positions = positions.to(logits.device)
        flat[positions] = flat[positions] - subtract
    return out


class Sampler:
    """Stateless apart from the fallback generator used by unseeded requests.

    Seeded requests bring their own ``torch.Generator`` (created by the caller from
    ``SamplingParams.seed`` and kept for the request's lifetime) so that their stream of draws is
    theirs alone. A row takes exactly one number from its generator per step. CPU generators are
    the cheap choice on any device (the draw is one number; only it is copied to the logits'
    device) and give the same stream whatever device serves the request. Unseeded rows share one
    CPU generator seeded from ``default_seed``: an engine run is reproducible, a single unseeded
    request is not.
    """

    def __init__(self, default_seed: int = 0):
        self._default_generator = torch.Generator().manual_seed(default_seed)

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               output_token_ids: list[list[int]], prompt_token_ids: list[list[int]],
               generators: list[torch.Generator | None],
               allowed: list[np.ndarray | None] | None = None) -> SampleResult:
        """Pick one token per row of ``logits`` ([B, V]; non-float32 is upcast, never mutated).

        Row ``i`` is governed by ``params[i]``, penalised by ``output_token_ids[i]`` /
        ``prompt_token_ids[i]`` and, when not greedy, drawn with ``generators[i]`` (``None``: the
        sampler's default generator). Greedy rows take the argmax of the penalised logits, the
        lowest id on ties. ``allowed[i]`` (a boolean mask over the vocabulary, from a grammar)
        leaves only those tokens to choose from; ``None`` rows are free.

        A row whose logits give no finite distribution (NaN or overflowing logits from the model, or
        a mask that leaves nothing) is listed in ``failed_rows`` with token id 0: the caller fails that
        request alone. No row ever gets an id outside the vocabulary.
        """
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits must be [batch, vocab] with batch == len(params) == {len(params)}, "
                             f"got shape {tuple(logits.shape)}")
        raw = logits.float()
        processed = apply_penalties(raw, params, output_token_ids, prompt_token_ids)
        if allowed is not None and any(a is not None for a in allowed):
            processed = _restrict(processed, allowed, copy=processed is raw)   # raw also feeds logprobs
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if len(random_rows) == len(params):
            tokens, ok = self._sample_random(processed, params, generators)
        else:
            best, tokens = processed.max(dim=-1)
            ok = best > float("-inf")       # false for a NaN (max propagates it) and an all -inf row
            if random_rows:
                row_index = torch.tensor(random_rows, dtype=torch.long, device=raw.device)
                tokens[row_index], ok[row_index] = self._sample_random(processed[row_index],
                                                                       [params[i] for i in random_rows],
                                                                       [generators[i] for i in random_rows])
        token_ids = torch.where(ok, tokens, -1).tolist()       # one device-to-host copy; -1 marks a failed row
        failed_rows = [i for i, token in enumerate(token_ids) if token < 0]
        for i in failed_rows:
            token_ids[i] = 0
        result = SampleResult(token_ids=token_ids, failed_rows=failed_rows)

        wanted = [p.logprobs for p in params]
        if any(n is not None for n in wanted):
            logprobs = torch.log_softmax(raw, dim=-1)
            chosen = torch.tensor(token_ids, dtype=torch.long, device=raw.device).unsqueeze(1)
            result.logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()
            top_n = min(max(n or 0 for n in wanted), raw.shape[1])
            if top_n > 0:
                values, ids = logprobs.topk(top_n, dim=-1, sorted=True)
                value_rows, id_rows = values.tolist(), ids.tolist()
                result.top_logprobs = [list(zip(id_rows[i][:n], value_rows[i][:n])) if n else []
                                       for i, n in enumerate(wanted)]
            else:
                result.top_logprobs = [[] for _ in params]
        return result

    def _sample_random(self, logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """Temperature, then top-k / top-p / min-p truncation, then one draw per row; also which rows
        had a distribution to draw from (a finite, positive total mass).

        The draw is inverse-CDF sampling: one uniform number from the row's generator, located in
        the cumulative distribution. That needs a single random number per row, where
        ``torch.multinomial`` draws one per vocabulary entry (tens of milliseconds per row on a
        CPU with a 150k vocabulary); everything else is vectorised over the rows.
        """
        device = logits.device
        probs = torch.softmax(logits / _column([p.temperature for p in params], logits), dim=-1)
        threshold = _truncation_threshold(probs, params)
        if threshold is not None:
            probs = probs.masked_fill(probs < threshold, 0.0)
        cdf = probs.cumsum(dim=-1)
        draws = [torch.rand(1, generator=gen, device=gen.device)
                 for gen in (g if g is not None else self._default_generator for g in generators)]
        # 1 - U[0, 1) lies in (0, 1]: the target is above 0 and at most the total mass, so the
        # search lands on a token with nonzero probability (a flat stretch of the CDF never wins).
        # A row with a finite, positive mass draws an id inside the vocabulary; NaN fails both tests.
        total = cdf[:, -1:]
        targets = (1.0 - torch.cat([d.cpu() for d in draws]).to(device, non_blocking=True)).unsqueeze(1) * total
        ok = ((total > 0) & (total < float("inf"))).squeeze(1)
        return torch.searchsorted(cdf, targets).squeeze(1), ok


def _restrict(logits: torch.Tensor, allowed: list[np.ndarray | None], copy: bool) -> torch.Tensor:
    """``logits`` with every token a row's mask forbids at -inf (masks narrower than the logits
    forbid the ids beyond them)."""
    rows = [i for i, a in enumerate(allowed) if a is not None]
    vocab = logits.shape[1]
    masks = np.zeros((len(rows), vocab), dtype=bool)
    for j, i in enumerate(rows):
        a = allowed[i]
        masks[j, :min(vocab, a.shape[0])] = a[:vocab]
    out = logits.clone() if copy else logits
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out[index] = out[index].masked_fill(~torch.from_numpy(masks).to(logits.device), float("-inf"))
    return out


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _truncation_threshold(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Per-row probability below which top-k, top-p and min-p cut a token ([N, 1]), or None.

    Each filter keeps the tokens at or above some probability, so their combination is the
    largest of the three thresholds. Top-p is measured on what top-k kept (as in vLLM); min-p is
    relative to the top probability, which no filter removes. A token tied with the threshold is
    kept, so a tie can let top-k keep more than k tokens. Thresholds come from a ``topk`` of the
    row, not a full sort: the nucleus almost always lies in the top ``TOP_P_CANDIDATES``, and a
    row whose nucleus does not falls back to sorting that row.
    """
    vocab = probs.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    use_p = [p.top_p < 1.0 for p in params]
    min_p = [p.min_p for p in params]
    if not (any(top_k) or any(use_p) or any(min_p)):
        return None
    threshold = torch.zeros(len(params), 1, dtype=probs.dtype, device=probs.device)
    if any(top_k) or any(use_p):
        width = min(vocab, max(max(top_k), TOP_P_CANDIDATES if any(use_p) else 0))
        ranked = probs.topk(width, dim=-1, sorted=True).values
        has_k = torch.tensor(top_k, device=probs.device).unsqueeze(1) > 0
        if any(top_k):
            kth_index = torch.tensor([k or width for k in top_k], device=probs.device).unsqueeze(1) - 1
            kth = torch.where(has_k, ranked.gather(1, kth_index), 0.0)
            ranked = ranked.masked_fill(ranked < kth, 0.0)
            threshold = torch.maximum(threshold, kth)
        if any(use_p):
            top_p = _column([p.top_p for p in params], probs)
            cumulative = ranked.cumsum(dim=-1)
            kept_mass = torch.where(has_k, cumulative[:, -1:], probs.sum(dim=-1, keepdim=True))
            needed = top_p * kept_mass
            nucleus = _nucleus_threshold(ranked, cumulative, needed)
            covered = (cumulative[:, -1:] >= needed).squeeze(1).tolist()
            for i in (i for i, (p, ok) in enumerate(zip(use_p, covered)) if p and not ok):
                ranked_row = probs[i].sort(descending=True).values.unsqueeze(0)
                cumulative_row = ranked_row.cumsum(dim=-1)
                nucleus[i] = _nucleus_threshold(ranked_row, cumulative_row,
                                                torch.minimum(needed[i:i + 1], cumulative_row[:, -1:]))[0]
            use_p_column = torch.tensor(use_p, device=probs.device).unsqueeze(1)
            threshold = torch.maximum(threshold, torch.where(use_p_column, nucleus, 0.0))
    if any(min_p):
        threshold = torch.maximum(threshold, _column(min_p, probs) * probs.amax(dim=-1, keepdim=True))
    return threshold


def _nucleus_threshold(ranked: torch.Tensor, cumulative: torch.Tensor, needed: torch.Tensor) -> torch.Tensor:
    """Probability of the last token of the nucleus: the first rank whose cumulative mass reaches
    ``needed`` (rows that never reach it get the last candidate; the caller redoes them)."""
    reached = cumulative >= needed
    last = torch.where(reached.any(dim=-1, keepdim=True), reached.int().argmax(dim=-1, keepdim=True),
                       ranked.shape[1] - 1)
    return ranked.gather(1, last)
