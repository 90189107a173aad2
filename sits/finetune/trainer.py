"""A LoRA fine-tuning job: trains an adapter on the frozen base model's dense path (fp32), and
snapshots everything a continuation needs (the adapter, AdamW's moments and step, the data position,
the RNG, the loss curve) every ``snapshot_every`` steps. A job started again with the same spec and
job folder resumes from its snapshot and continues the loss curve it would have had uninterrupted
(the data order is a function of the seed and the epoch, so the position is two numbers).

The job's life is a stream of events in ``events.jsonl`` (queued → running → checkpointed … → done |
failed), its adapter a PEFT folder (``adapter/``) the serving side loads, its loss curve ``loss.svg``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import nn

from sits.engine.config import ModelConfig
from sits.engine.errors import SitsError
from sits.engine.loader import load_model
from sits.engine.tokenizer import Tokenizer
from sits.finetune.data import Example, load_examples
from sits.finetune.spec import FinetuneSpec

SNAPSHOT = "snapshot.pt"


def job_device(spec: FinetuneSpec) -> torch.device:
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec.device)


class TrainableLora(nn.Module):
    """A frozen projection plus a trainable low-rank update, initialised as PEFT does (A Kaiming-
    uniform, B zeros: the model starts out unchanged)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base = base
        out_features, in_features = base.weight.shape
        self.A = nn.Parameter(torch.empty(rank, in_features))
        bound = 1.0 / math.sqrt(in_features)         # kaiming_uniform_(a=sqrt(5)) on [rank, in]
        with torch.no_grad():
            self.A.uniform_(-bound, bound, generator=generator)
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t()) @ self.B.t() * self.scale


def _attach(model: nn.Module, spec: FinetuneSpec) -> dict[str, TrainableLora]:
    g = torch.Generator().manual_seed(spec.seed)
    out = {}
    for i, layer in enumerate(model.model.layers):
        for target in spec.targets:
            block = layer.self_attn if target in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp
            lora = TrainableLora(getattr(block, target), spec.rank, spec.alpha, g)
            setattr(block, target, lora)
            out[f"base_model.model.model.layers.{i}.{'self_attn' if block is layer.self_attn else 'mlp'}.{target}"] = lora
    return out


@dataclass
class Prepared:
    """What every attempt of a job needs before its first step, built once: the base model (frozen,
    weights mapped), its tokenizer and the tokenized dataset. A supervisor holds it and forks attempts."""

    model_config: ModelConfig
    model: nn.Module
    tokenizer: Tokenizer
    examples: list[Example]
    device: torch.device

    @classmethod
    def load(cls, spec: FinetuneSpec, device: torch.device | None = None) -> "Prepared":
        device = device or job_device(spec)
        mc = ModelConfig.from_dir(spec.model)
        tokenizer = Tokenizer.from_dir(spec.model)
        examples = load_examples(spec.dataset, tokenizer, spec.max_len)
        model = load_model(spec.model, mc, device, torch.float32, max(spec.max_len, 16))
        model.requires_grad_(False)
        return cls(mc, model, tokenizer, examples, device)


class FinetuneJob:
    def __init__(self, spec: FinetuneSpec, folder: str | Path, on_event: Callable[[dict], None] | None = None,
                 prepared: Prepared | None = None):
        """``prepared``: the model and data already loaded (this process's own copy: the adapter is
        attached to that model)."""
        self.spec = spec
        self.prepared = prepared
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.on_event = on_event
        self.step = 0
        self.epoch, self.offset = 0, 0
        self.losses: list[float] = []
        self.first_step_ms: float | None = None
        self.first_step_done_at: float | None = None       # wall clock, for restart measurements
        self.resumed = False

    # -- events -----------------------------------------------------------------------------------
    def _event(self, state: str, **data) -> None:
        ev = {"state": state, "at": time.time(), "job": self.spec.name, "step": self.step, **data}
        with open(self.folder / "events.jsonl", "a") as f:
            f.write(json.dumps(ev) + "\n")
        if self.on_event is not None:
            self.on_event(ev)

    # -- the job ----------------------------------------------------------------------------------
    def run(self, stop_after: int | None = None, progress: bool = False) -> Path:
        """Train to ``spec.steps`` (or ``stop_after`` steps in this run: a pre-emption, in tests and
        benchmarks); returns the adapter folder. Raises the typed error of a bad spec or dataset."""
        self._event("queued")
        try:
            return self._run(stop_after, progress)
        except BaseException as e:
            self.record_failure(e)
            raise

    def record_failure(self, e: BaseException) -> None:
        """A ``failed`` event for ``e`` (also for what went wrong before an attempt could start)."""
        self._event("failed", error=e.message if isinstance(e, SitsError) else f"{type(e).__name__}: {e}",
                    code=e.code if isinstance(e, SitsError) else "internal_error")

    def _run(self, stop_after: int | None, progress: bool) -> Path:
        spec = self.spec
        torch.manual_seed(spec.seed)
        t_load = time.perf_counter()
        prepared = self.prepared or Prepared.load(spec)
        model, tokenizer, examples, device = prepared.model, prepared.tokenizer, prepared.examples, job_device(spec)
        loras = _attach(model, spec)
        model.to(device)        # the new adapter; and the base too where a supervisor prepared it on the CPU
        params = [p for lora in loras.values() for p in (lora.A, lora.B)]
        opt = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=spec.weight_decay)
        self._restore(loras, opt)
        load_ms = (time.perf_counter() - t_load) * 1e3
        self._event("running", examples=len(examples), resumed=self.resumed, load_ms=round(load_ms, 1))
        pad = tokenizer.pad_token_id or 0
        ran = 0
        while self.step < spec.steps and (stop_after is None or ran < stop_after):
            t0 = time.perf_counter()
            batch = self._next_batch(examples)
            for group in opt.param_groups:
                group["lr"] = spec.learning_rate * min(1.0, (self.step + 1) / spec.warmup_steps) \
                    if spec.warmup_steps else spec.learning_rate
            loss = _loss(model, batch, pad, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            self.step += 1
            ran += 1
            self.losses.append(float(loss.detach()))
            if self.first_step_ms is None:
                self.first_step_ms = (time.perf_counter() - t0) * 1e3
                self.first_step_done_at = time.time()
            if progress:
                _progress(self.step, spec.steps, self.losses[-1])
            if self.step % spec.snapshot_every == 0 or self.step == spec.steps:
                self._snapshot(loras, opt)
                self._event("checkpointed", loss=self.losses[-1])
        if progress:
            print(file=sys.stderr)
        adapter = self._save_adapter(loras)
        _loss_svg(self.losses, self.folder / "loss.svg", spec.name)
        if self.step >= spec.steps:
            self._event("done", loss=self.losses[-1] if self.losses else None, adapter=str(adapter),
                        first_step_ms=self.first_step_ms, first_step_done_at=self.first_step_done_at)
        else:
            self._event("stopped", loss=self.losses[-1] if self.losses else None, first_step_ms=self.first_step_ms,
                        first_step_done_at=self.first_step_done_at)
        return adapter

    def _next_batch(self, examples: list[Example]) -> list[Example]:
        """The next ``batch_size`` examples of a per-epoch permutation fixed by the seed."""
        out = []
        while len(out) < self.spec.batch_size:
            order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(self.spec.seed * 1000003
                                                                                         + self.epoch)).tolist()
            take = order[self.offset:self.offset + self.spec.batch_size - len(out)]
            out += [examples[i] for i in take]
            self.offset += len(take)
            if self.offset >= len(examples):
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    # -- snapshots ----------------------------------------------------------------------------------
    def _snapshot(self, loras: dict[str, TrainableLora], opt: torch.optim.Optimizer) -> None:
        state = {"spec": self.spec.model_dump(), "step": self.step, "epoch": self.epoch, "offset": self.offset,
                 "losses": self.losses, "lora": {k: (v.A.detach().cpu(), v.B.detach().cpu()) for k, v in loras.items()},
                 "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state()}
        tmp = self.folder / (SNAPSHOT + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.folder / SNAPSHOT)       # a crash mid-write leaves the previous one

    def _restore(self, loras: dict[str, TrainableLora], opt: torch.optim.Optimizer) -> None:
        path = self.folder / SNAPSHOT
        if not path.exists():
            return
        state = torch.load(path, weights_only=False)
        mine = self.spec.model_dump()
        same = {k: v for k, v in mine.items() if k not in ("steps", "snapshot_every", "serve_into")}
        if {k: state["spec"].get(k) for k in same} != same:
            raise SitsError(f"the snapshot in {self.folder} is of another job (a different spec); use another "
                            "folder or delete it")
        with torch.no_grad():
            for k, (a, b) in state["lora"].items():
                loras[k].A.copy_(a)
                loras[k].B.copy_(b)
        opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.epoch, self.offset, self.losses = state["step"], state["epoch"], state["offset"], state["losses"]
        self.resumed = True

    def _save_adapter(self, loras: dict[str, TrainableLora]) -> Path:
        out = self.folder / "adapter"
        out.mkdir(exist_ok=True)
        tensors = {}
        for key, lora in loras.items():
            tensors[f"{key}.lora_A.weight"] = lora.A.detach().cpu().contiguous()
            tensors[f"{key}.lora_B.weight"] = lora.B.detach().cpu().contiguous()
        save_file(tensors, str(out / "adapter_model.safetensors"))
        spec = self.spec
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": spec.targets,
            "lora_dropout": 0.0, "bias": "none", "use_rslora": False, "use_dora": False, "task_type": "CAUSAL_LM",
            "base_model_name_or_path": str(spec.model)}, indent=2))
        return out


def _loss(model, batch: list[Example], pad: int, device: torch.device) -> torch.Tensor:
    """Mean cross-entropy of each example's target tokens (right-padded; causal, so padding after an
    example changes nothing before it)."""
    width = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for r, e in enumerate(batch):
        ids[r, :len(e.ids)] = torch.tensor(e.ids)
        labels[r, e.first_target - 1:len(e.ids) - 1] = torch.tensor(e.ids[e.first_target:])
    logits = model.forward_dense(ids.to(device))
    return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.to(device).view(-1), ignore_index=-100)


def _progress(step: int, total: int, loss: float) -> None:
    width = 30
    done = int(width * step / total)
    print(f"\r[{'#' * done}{'.' * (width - done)}] step {step}/{total} loss {loss:.4f}", end="", file=sys.stderr,
          flush=True)


def _loss_svg(losses: list[float], path: Path, title: str) -> None:
    """The loss curve as a small SVG (no plotting library needed where a job runs)."""
    if not losses:
        return
    w, h, m = 480, 240, 30
    lo, hi = min(losses), max(losses)
    span = (hi - lo) or 1.0
    n = max(len(losses) - 1, 1)
    pts = " ".join(f"{m + (w - 2 * m) * i / n:.1f},{h - m - (h - 2 * m) * (v - lo) / span:.1f}"
                   for i, v in enumerate(losses))
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">'
        f'<text x="{m}" y="16">{title}: training loss, {len(losses)} steps</text>'
        f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="#888"/>'
        f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="#888"/>'
        f'<text x="2" y="{m + 4}">{hi:.3g}</text><text x="2" y="{h - m}">{lo:.3g}</text>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/></svg>')


__all__ = ["FinetuneJob", "Prepared", "TrainableLora", "SNAPSHOT"]
