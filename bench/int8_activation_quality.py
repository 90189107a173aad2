"""What 8-bit activations (``block_activations: int8``) cost in quality on a real GGUF, against the same
blocks with fp32 activations and against the weights dequantized at load (the reference).

Teacher-forced over windows of ``sits/data/corpus.txt``: every position's next-token distribution,
with each block layer taking its rows 32 at a time (``INT8_MAX_ROWS``), as a step of decodes does
(an 8-bit row is quantized on its own, so splitting the rows changes nothing but which kernel runs).
Prints each variant's
perplexity, and int8 against fp32: mean KL divergence, top-1 agreement, the largest change of a
log-probability. Then greedy generations from chat prompts through the engine, fp32 vs int8: how many
come out identical and where the others first part.

    .venv/bin/python bench/int8_activation_quality.py models/default [WINDOWS] [TOKENS]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from sits.engine.config import EngineConfig
from sits.engine.layers.block_quant import INT8_MAX_ROWS, BlockLinear
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a CPU cache is.",
           "List three prime numbers and say why they are prime.", "How do I reverse a list in Python?",
           "Give me a short recipe for pancakes.", "What causes the seasons on Earth?",
           "Translate 'good morning' into Spanish and German."]


def _engine(model: str, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device="cpu", dtype="float32", warmup=False, kv_cache_memory_mb=64,
                                  **kw))


def _rows_of_a_decode_step(module: BlockLinear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, module.in_features)
    out = torch.cat([_forward(module, rows[i:i + INT8_MAX_ROWS]) for i in range(0, rows.shape[0], INT8_MAX_ROWS)])
    return out.reshape(*x.shape[:-1], module.out_features)


_forward = BlockLinear.forward


def _logprobs(eng: LLMEngine, ids: torch.Tensor, int8: bool | None) -> torch.Tensor:
    """Log-probabilities [L, vocab]; ``int8`` None: the engine as it is (dequantized weights)."""
    if int8 is not None:
        for m in eng.model.modules():
            if isinstance(m, BlockLinear):
                m.int8_activations = int8
    with torch.inference_mode():
        return F.log_softmax(eng.model.forward_dense(ids[None])[0].float(), dim=-1)


def main(model: str, windows: int = 4, tokens: int = 256) -> None:
    blocks, dense = _engine(model), _engine(model, gguf_weights="dequantize")
    assert blocks.gguf_blocks, f"{model}: not served as blocks"
    text = (Path(__file__).resolve().parents[1] / "sits/data/corpus.txt").read_text()
    ids = blocks.tokenizer.encode(text)
    BlockLinear.forward = _rows_of_a_decode_step
    nll = {"dequantized": [], "fp32": [], "int8": []}
    kl, agree, worst = [], [], 0.0
    for w in range(windows):
        window = torch.tensor(ids[w * tokens:(w + 1) * tokens + 1])
        x, target = window[:-1], window[1:]
        got = {"dequantized": _logprobs(dense, x, None), "fp32": _logprobs(blocks, x, False),
               "int8": _logprobs(blocks, x, True)}
        for k, lp in got.items():
            nll[k].append(-lp.gather(1, target[:, None]).mean().item())
        p, q = got["fp32"], got["int8"]
        kl.append((p.exp() * (p - q)).sum(-1).mean().item())
        agree.append((p.argmax(-1) == q.argmax(-1)).float().mean().item())
        worst = max(worst, (p - q).gather(1, p.argmax(-1, keepdim=True)).abs().max().item())
        print(f"window {w}: KL {kl[-1]:.2e}, top-1 agreement {agree[-1]:.4f}", file=sys.stderr, flush=True)
    BlockLinear.forward = _forward
    print(f"Teacher-forced, {windows} windows of {tokens} tokens of sits/data/corpus.txt:\n")
    print("| weights, activations | perplexity |\n|---|---|")
    for k, v in nll.items():
        label = {"dequantized": "dequantized at load (reference)", "fp32": "blocks, fp32", "int8": "blocks, int8"}[k]
        print(f"| {label} | {torch.tensor(statistics.fmean(v)).exp().item():.3f} |")
    print(f"\nint8 vs fp32: mean KL {statistics.fmean(kl):.2e} nats, top-1 agreement {statistics.fmean(agree):.4f}, "
          f"largest change of the fp32 top token's log-probability {worst:.3f}")
    for m in blocks.model.modules():        # back to the engine's own choice: fp32 activations
        if isinstance(m, BlockLinear):
            m.int8_activations = False
    int8 = _engine(model, block_activations="int8")
    params = SamplingParams(max_tokens=48, temperature=0.0)
    chats = [blocks.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    a = [o["token_ids"] for o in blocks.generate(chats, params)]
    b = [o["token_ids"] for o in int8.generate(chats, params)]
    parted = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None) for x, y in zip(a, b)]
    same = sum(p is None and len(x) == len(y) for p, x, y in zip(parted, a, b))
    print(f"\nGreedy, {len(PROMPTS)} chat prompts x 48 tokens: {same} identical; the others first differ at token "
          f"{sorted(p for p in parted if p is not None)}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
