"""Build a small Hugging Face–format Llama model directory offline.

Tests, benchmarks and demos need a real model directory (``config.json``, ``model.safetensors``,
``tokenizer.json``) but these machines cannot reach a model hub. This module makes one from what
ships with Python: a byte-level BPE tokenizer trained on the stdlib's English documentation
(``pydoc_data.topics`` plus ``sits/data/corpus.txt``, stdlib docstrings extracted round-robin across
modules, capped below 200 KB), and a ``LlamaForCausalLM`` with seeded random weights, optionally
trained for a few wall-clock seconds so its output is less than pure noise.

The directory loads in both SITS and ``transformers``; weights are saved through the native model
so the tensor names are exactly the ones SITS' loader reads. With ``train_seconds=0`` a build is
byte-for-byte reproducible for one seed on one Python version (``pydoc_data`` changes between
Python releases); training stops on wall time, so trained weights are not.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from sits.engine.config import ModelConfig
from sits.engine.models.llama import LlamaForCausalLM

# Sizes: tiny (~5M) builds and trains in seconds on a laptop CPU, for tests; small (~28M) and base
# (~113M) give benchmarks real compute per token, with the shapes (GQA, tied embeddings) of small
# chat models. Vocabularies stay under the ~14k tokens the offline corpus yields before BPE runs out
# of pairs to merge (every word already one token); a larger request comes out smaller, and
# config.json follows the tokenizer.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6,
             "num_attention_heads": 8, "num_key_value_heads": 4},
    "small": {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4},
    "base": {"vocab_size": 12288, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 12, "num_key_value_heads": 4},
}

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
MAX_POSITIONS = 2048
# ChatML, plus tools in the Hermes format (as Qwen2.5's template does): the tool list joins the
# system turn, an assistant's calls are <tool_call> blocks, a tool's result is a user turn.
TOOLS_PREAMBLE = ("# Tools\\n\\nYou may call one or more of these functions to answer. Their signatures, one per "
                  "line:\\n<tools>")
TOOLS_POSTAMBLE = ("\\n</tools>\\n\\nTo call one, write its name and arguments as JSON between tags:\\n"
                   "<tool_call>\\n{\\\"name\\\": <function name>, \\\"arguments\\\": <arguments object>}\\n</tool_call>")
CHAT_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '" + TOOLS_POSTAMBLE + "' + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% if not loop.first or message['content'] %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training defaults: a peak LR this high suits a few minutes of training from scratch on a model
# this small; the short warm-up keeps the first Adam steps from blowing up the random init.
PEAK_LR = 3e-3
WARMUP_STEPS = 10
WARMUP_FRACTION = 0.1  # of the time budget: caps the warm-up when steps are slow or the budget short
REPORT_EVERY_S = 2.0


def build_tiny_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0, train_seconds: float = 0.0,
                     progress: Callable[[str], None] | None = print, overwrite: bool = False, *,
                     batch_size: int = 16, seq_len: int = 128, threads: int | None = None) -> Path:
    """Write a complete Llama model directory to ``out_dir`` and return its path.

    ``train_seconds > 0`` trains with AdamW on ``batch_size`` windows of ``seq_len`` tokens for that
    long, on ``threads`` CPU threads (default: every core; fewer on a shared box, where torch's
    spinning intra-op threads slow down many times over when other processes hold the cores).
    The loss curve goes to ``progress`` and to ``build_info.json`` (with the preset, seed, parameter
    count and training settings), so a benchmark can say which model it ran. ``config.json`` is
    written last: a directory holding one is complete, and is only replaced with ``overwrite=True``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if batch_size < 1 or not 1 <= seq_len <= MAX_POSITIONS:
        raise ValueError(f"need batch_size >= 1 and 1 <= seq_len <= {MAX_POSITIONS}, "
                         f"got {batch_size} and {seq_len}")
    out = Path(out_dir)
    if (out / "config.json").exists() and not overwrite:
        raise FileExistsError(f"{out} already holds a model (config.json); pass overwrite=True to replace it")
    say = progress or (lambda _msg: None)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    docs = _corpus()
    t0 = time.perf_counter()
    wanted = PRESETS[preset]["vocab_size"]
    tokenizer = _train_tokenizer(docs, wanted)
    vocab_size = tokenizer.get_vocab_size()
    short = "" if vocab_size == wanted else f" (the corpus is too small for {wanted})"
    say(f"tokenizer: {vocab_size} tokens{short} trained on {sum(map(len, docs)) / 1e3:.0f} KB "
        f"in {time.perf_counter() - t0:.2f}s")

    config = _hf_config(preset, vocab_size)
    t0 = time.perf_counter()
    model = _init_model(config, seed)
    num_params = sum(p.numel() for p in model.parameters())
    say(f"weights: {preset} preset, {num_params:,} parameters, initialised in {time.perf_counter() - t0:.2f}s")

    loss_curve: list[dict[str, float]] = []
    if train_seconds > 0:
        ids = _tokenize_corpus(tokenizer, docs)
        threads = threads or os.cpu_count() or 1
        loss_curve = _train(model, ids, train_seconds, seed, batch_size, seq_len, threads, say)

    t0 = time.perf_counter()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        del state["lm_head.weight"]  # the same tensor as embed_tokens; safetensors refuses shared storage
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config())
    _write_json(out / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": config["eos_token_id"], "pad_token_id": PAD_ID})
    _write_json(out / "build_info.json", {
        "preset": preset, "seed": seed, "num_parameters": num_params, "train_seconds": train_seconds,
        "batch_size": batch_size, "seq_len": seq_len, "loss_curve": loss_curve,
    })
    _write_json(out / "config.json", config)
    say(f"saved {out} in {time.perf_counter() - t0:.2f}s "
        f"(build {time.perf_counter() - t_start:.2f}s)")
    return out


def _corpus() -> list[str]:
    """The training documents, in a fixed order so the tokenizer and batches are reproducible."""
    from pydoc_data.topics import topics

    shipped = resources.files("sits").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [topics[k] for k in sorted(topics)] + [d for d in shipped.split("\n\n") if d.strip()]


def _train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: the 256-byte initial alphabet means any UTF-8 text encodes and round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets include the spaces
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(docs, trainer=trainer)
    return tokenizer


def _hf_config(preset: str, vocab_size: int) -> dict[str, Any]:
    """A ``config.json`` for LlamaForCausalLM, with the fields transformers writes.

    ``vocab_size`` is the trained tokenizer's, so every id the model can emit decodes. Both the
    pre-5 ``rope_theta`` and the transformers 5 ``rope_parameters`` are written, so every version
    reads the same RoPE. Stopping on ``<|im_end|>`` as well as ``<|eos|>`` ends chat turns.
    """
    p = PRESETS[preset]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["hidden_size"] // p["num_attention_heads"],
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": [EOS_ID, IM_END_ID],
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _init_model(config: dict[str, Any], seed: int) -> LlamaForCausalLM:
    """The native model with GPT-style init (normal std 0.02, unit norms) from a private generator.

    The generator, not torch's global RNG, makes the weights depend on ``seed`` alone;
    ``fork_rng`` keeps the default init that ``nn.Linear`` runs first from moving the caller's RNG.
    """
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(ModelConfig.from_dict(config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model


def _tokenize_corpus(tokenizer: Tokenizer, docs: list[str]) -> torch.Tensor:
    """All documents as one token stream, each ended by ``<|eos|>`` so the model learns to stop."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def _train(model: LlamaForCausalLM, ids: torch.Tensor, seconds: float, seed: int, batch_size: int,
           seq_len: int, threads: int, say: Callable[[str], None]) -> list[dict[str, float]]:
    """Next-token training on random corpus windows until ``seconds`` of wall time have passed.

    LR: linear warm-up, done after ``WARMUP_STEPS`` steps or ``WARMUP_FRACTION`` of the budget,
    whichever comes first; then cosine over the time budget down to a tenth of the peak (the step
    count is unknown in advance, elapsed time is not). Returns the loss curve,
    one point per report: the first step's loss, then the mean since the previous report.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.1)
    offsets = torch.arange(seq_len + 1)
    callers_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    curve: list[dict[str, float]] = []
    pending: list[float] = []
    step = 0
    start = last_report = time.perf_counter()
    try:
        while (elapsed := time.perf_counter() - start) < seconds:
            decay = 0.5 * (1.0 + math.cos(math.pi * elapsed / seconds))
            warmup = min(1.0, max((step + 1) / WARMUP_STEPS, elapsed / (WARMUP_FRACTION * seconds)))
            lr = PEAK_LR * warmup * (0.1 + 0.9 * decay)
            for group in opt.param_groups:
                group["lr"] = lr
            starts = torch.randint(0, ids.numel() - seq_len - 1, (batch_size,), generator=gen)
            window = ids[starts[:, None] + offsets]
            logits = model.forward_dense(window[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            pending.append(loss.item())
            now = time.perf_counter()
            if step == 1 or now - last_report >= REPORT_EVERY_S or now - start >= seconds:
                curve.append({"step": step, "elapsed_s": round(now - start, 3),
                              "loss": sum(pending) / len(pending)})
                say(f"train: step {step} loss {curve[-1]['loss']:.4f} lr {lr:.2e} ({now - start:.1f}s)")
                pending.clear()
                last_report = now
    finally:
        torch.set_num_threads(callers_threads)
    tokens = step * batch_size * seq_len
    say(f"train: {step} steps, {tokens:,} tokens in {time.perf_counter() - start:.1f}s")
    return curve


def _tokenizer_config() -> dict[str, Any]:
    """What ``AutoTokenizer`` needs to wrap ``tokenizer.json``, plus the ChatML chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
