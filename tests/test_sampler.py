"""Sampler: greedy and seeded sampling, the filter pipeline, penalties and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from sits.engine.sampler import Sampler, apply_penalties
from sits.engine.sampling_params import SamplingParams

VOCAB = 32


def _logits(batch: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _sample(logits: torch.Tensor, params: list[SamplingParams], generators=None, outputs=None,
            prompts=None, sampler: Sampler | None = None):
    batch = len(params)
    return (sampler or Sampler()).sample(
        logits, params,
        outputs if outputs is not None else [[] for _ in range(batch)],
        prompts if prompts is not None else [[] for _ in range(batch)],
        generators if generators is not None else [None] * batch)


def _draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n tokens from one row, in one call (n copies of the row, each with its own generator)."""
    logits = logits_row.expand(n, -1).contiguous()
    return _sample(logits, [params] * n, [_gen(seed + i) for i in range(n)]).token_ids


def test_greedy_is_argmax_and_lowest_id_on_ties():
    logits = _logits(6)
    logits[2, 5] = logits[2, 9] = logits[2].max() + 1.0
    result = _sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.token_ids[2] == 5
    assert result.logprobs is None and result.top_logprobs is None


def test_input_logits_are_not_modified():
    logits = _logits(3)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.1, repetition_penalty=1.5,
                             presence_penalty=0.5, frequency_penalty=0.5, logprobs=2)] * 3
    _sample(logits, params, outputs=[[1, 2, 2]] * 3, prompts=[[3]] * 3)
    assert torch.equal(logits, before)


def test_seeded_sampling_reproducible_and_independent_of_batch_mates():
    logits = _logits(1, seed=1)[0]
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(batch_builder) -> list[int]:
        gen, sampler, tokens = _gen(42), Sampler(default_seed=7), []
        for step in range(8):
            rows, params, gens, index = batch_builder(step, gen)
            tokens.append(_sample(rows, params, gens, sampler=sampler).token_ids[index])
        return tokens

    def alone(step, gen):
        return logits.unsqueeze(0), [target], [gen], 0

    def crowded(step, gen):
        mates = _logits(4, seed=100 + step)
        rows = torch.cat([mates[:2], logits.unsqueeze(0), mates[2:]])
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.3, top_k=5), target,
                  SamplingParams(temperature=0.5, min_p=0.2, seed=1), SamplingParams(top_p=0.5)]
        return rows, params, [None, None, gen, _gen(1), None], 2

    first = run(alone)
    assert first == run(alone)
    assert first == run(crowded)
    assert len(set(first)) > 1  # it really sampled


def test_unseeded_rows_use_default_seed():
    logits = _logits(4)
    params = [SamplingParams(temperature=1.0)] * 4
    assert _sample(logits, params, sampler=Sampler(3)).token_ids == \
        _sample(logits, params, sampler=Sampler(3)).token_ids


def test_top_k_one_is_greedy():
    logits = _logits(16, seed=2)
    result = _sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 16,
                     [_gen(i) for i in range(16)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = _logits(16, seed=3)
    result = _sample(logits, [SamplingParams(temperature=1.5, top_p=1e-6)] * 16,
                     [_gen(i) for i in range(16)])
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_keep_the_right_set():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert set(_draw_many(logits, SamplingParams(top_k=2), 200)) == {0, 1}
    assert set(_draw_many(logits, SamplingParams(top_p=0.75), 200)) == {0, 1}
    assert set(_draw_many(logits, SamplingParams(top_p=0.85), 300)) == {0, 1, 2}
    # top-p measures the mass top-k kept (0.95): token 1 has 0.5 / 0.95 >= 0.51 before it, so
    # it goes, although the unrenormalised 0.5 < 0.51 would have kept it.
    assert set(_draw_many(logits, SamplingParams(top_k=3, top_p=0.51), 200)) == {0}


def test_each_row_keeps_its_own_filters_in_a_mixed_batch():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(5, -1).contiguous()
    params = [SamplingParams(top_k=2), SamplingParams(), SamplingParams(top_p=0.75),
              SamplingParams(min_p=0.25), SamplingParams(temperature=0.0)]
    drawn: list[set[int]] = [set() for _ in params]
    for seed in range(150):
        tokens = _sample(logits, params, [_gen(seed * 10 + i) for i in range(5)]).token_ids
        for row, token in zip(drawn, tokens):
            row.add(token)
    assert drawn == [{0, 1}, {0, 1, 2, 3}, {0, 1}, {0, 1, 2}, {0}]


def test_top_p_nucleus_wider_than_the_ranked_candidates():
    """A flat distribution puts the nucleus beyond the top-k shortcut; the full-sort path decides."""
    vocab = 3000
    logits = torch.linspace(0.0, -1.0, vocab)  # token id order is probability order
    probs = torch.softmax(logits, dim=-1)
    nucleus = int((probs.cumsum(0) < 0.6).sum()) + 1
    assert nucleus > 1024
    drawn = _draw_many(logits, SamplingParams(top_p=0.6), 400)
    assert max(drawn) < nucleus and max(drawn) > 1024


def test_min_p_is_relative_to_the_top_probability():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    drawn = set(_draw_many(probs.log(), SamplingParams(min_p=0.3), 300))
    assert drawn == {0, 1, 2}  # 0.15 >= 0.3 * 0.4 = 0.12 > 0.1


def test_sampling_follows_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 4000
    drawn = torch.tensor(_draw_many(logits, SamplingParams(temperature=0.5), n))
    freq = torch.bincount(drawn, minlength=4).float() / n
    expected = torch.softmax(logits / 0.5, dim=-1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_presence_and_frequency_penalties_match_hand_computation():
    logits = torch.zeros(2, 6)
    logits[0] = torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5, 0.0])
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams()]
    out = apply_penalties(logits, params, [[1, 1, 1, 4], [1]], [[0, 2], [0]])
    expected = torch.tensor([1.0, 2.0 - 0.5 - 0.75, 3.0, -1.0, 0.5 - 0.5 - 0.25, 0.0])
    assert torch.allclose(out[0], expected)
    assert torch.equal(out[1], logits[1])  # a row without penalties is untouched


def test_repetition_penalty_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 4.0, -4.0, 1.0]])
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[2, 3]], [[0, 1, 0]])
    assert torch.allclose(out[0], torch.tensor([1.0, -4.0, 2.0, -8.0, 1.0]))


def test_penalties_are_skipped_when_unused():
    logits = _logits(2)
    assert apply_penalties(logits, [SamplingParams()] * 2, [[1], [2]], [[3], [4]]) is logits


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    plain = _sample(logits, [SamplingParams(temperature=0.0)], outputs=[[0]])
    penalised = _sample(logits, [SamplingParams(temperature=0.0, presence_penalty=0.5)], outputs=[[0]])
    assert plain.token_ids == [0] and penalised.token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = _logits(3, seed=4)
    params = [SamplingParams(temperature=0.0, logprobs=5, presence_penalty=2.0),
              SamplingParams(temperature=0.8, logprobs=0, seed=1),
              SamplingParams(temperature=0.0)]
    result = _sample(logits, params, [None, _gen(1), None], outputs=[[int(logits[0].argmax())], [], []])
    reference = torch.log_softmax(logits, dim=-1)
    for i, token in enumerate(result.token_ids):
        assert math.isclose(result.logprobs[i], reference[i, token].item(), abs_tol=1e-5)
    top = result.top_logprobs
    assert len(top[0]) == 5 and top[1] == [] and top[2] == []
    values = [v for _, v in top[0]]
    assert values == sorted(values, reverse=True)
    expected = reference[0].topk(5)
    assert [t for t, _ in top[0]] == expected.indices.tolist()
    assert values == pytest.approx(expected.values.tolist(), abs=1e-5)
    # penalties changed the choice but not the reported logprobs
    assert result.token_ids[0] != int(logits[0].argmax())


def test_bfloat16_logits_are_accepted():
    logits = _logits(2).to(torch.bfloat16)
    result = _sample(logits, [SamplingParams(temperature=0.0), SamplingParams(seed=0)], [None, _gen(0)])
    assert result.token_ids[0] == int(logits[0].float().argmax())
    assert 0 <= result.token_ids[1] < VOCAB


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        _sample(_logits(2), [SamplingParams()])
