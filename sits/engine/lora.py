"""LoRA adapters served over one copy of the base weights, several in the same batch.

An adapter is a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``): for some of
the projections of each layer a low-rank pair A [r, in], B [out, r] whose product, scaled by
alpha / r (alpha / sqrt(r) with rsLoRA), is added to the projection's output. Every adapter read is
kept in host memory; at most ``max_loras`` of them are resident on the device at once (least recently
used goes first), and the scheduler never runs more distinct adapters in one step than that.

Within a step every token belongs to one adapter or none. Each adapted projection computes its base
output once for the whole batch; then the rows of each adapter are gathered (padded to the largest
group) and their low-rank updates computed for all adapters at once, two batched matmuls against
the resident slots' stacked matrices, and added back to those rows: S-LoRA's and Punica's batching of
different adapters against shared weights, posed as ``bmm``. In fp32 on a CPU with the C++ kernels
(``EngineConfig.linear`` cpp, what ``auto`` takes) one call per projection (``lora_add``) does it all
instead, each row reading its own adapter's matrices: torch's small matmuls, gathers and index_add
cost far more than their arithmetic at a decode step's rows. A fused projection (q|k|v, gate|up) holds
its parts' A matrices stacked and their B matrices placed in the parts' output columns, so one pair of
matmuls serves every part.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from torch import nn

from sits.engine.config import ModelConfig
from sits.engine.errors import InvalidRequestError, SitsError
from sits.engine.layers import cpu_kernels

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")

Weights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]    # (layer, module) -> (A [r, in], B·s [out, r])


class InvalidAdapterError(SitsError):
    """The folder is not a LoRA adapter this model can serve (format, targets or shapes)."""

    code = "invalid_adapter"
    http_status = 400


class AdapterNotFoundError(SitsError):
    code = "adapter_not_found"
    http_status = 404


class AdapterExistsError(SitsError):
    code = "adapter_exists"
    http_status = 409


class AdapterInUseError(SitsError):
    code = "adapter_in_use"
    http_status = 409


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int                      # the largest rank of its modules
    alpha: float
    targets: tuple[str, ...]       # the module names it adapts
    weights: Weights = field(repr=False, default_factory=dict)


def _alpha_for(module_path: str, cfg: dict) -> float:
    """PEFT's ``alpha_pattern``: a key matching the end of the module's name overrides ``lora_alpha``."""
    for key, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return float(alpha)
    return float(cfg.get("lora_alpha", 8))


def load_adapter(name: str, path: str | Path, mc: ModelConfig, dtype: torch.dtype, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA folder into host memory (the update's scale folded into B), checked against
    the base model's shapes; ``InvalidAdapterError`` says what does not fit, whatever is wrong with
    the files (a corrupt tensor file or a config of the wrong types included)."""
    try:
        return _load_adapter(name, path, mc, dtype, max_rank)
    except SitsError:
        raise
    except Exception as e:   # noqa: BLE001 - safetensors' own errors, a string where a number belongs...
        raise InvalidAdapterError(f"adapter {name!r} in {path} cannot be read: {type(e).__name__}: {e}",
                                  param="lora_path") from None


def _load_adapter(name: str, path: str | Path, mc: ModelConfig, dtype: torch.dtype, max_rank: int) -> LoraAdapter:
    folder = Path(path)
    cfg_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not cfg_path.is_file() or not weights_path.is_file():
        raise InvalidAdapterError(f"{folder} is not a PEFT adapter folder (adapter_config.json and "
                                  f"adapter_model.safetensors expected)", param="lora_path")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidAdapterError(f"{cfg_path}: {e}", param="lora_path") from None
    if not isinstance(cfg, dict):
        raise InvalidAdapterError(f"{cfg_path}: not a JSON object", param="lora_path")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InvalidAdapterError(f"adapter {name!r} is a {cfg.get('peft_type')} adapter; only LoRA is served",
                                  param="lora_path")
    for flag, why in (("use_dora", "DoRA"), ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights")):
        if cfg.get(flag):
            raise InvalidAdapterError(f"adapter {name!r} uses {why}, which is not supported", param="lora_path")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise InvalidAdapterError(f"adapter {name!r} trains biases or whole modules (bias / modules_to_save); only "
                                  f"the low-rank matrices are served", param="lora_path")
    rslora = bool(cfg.get("use_rslora"))
    q = mc.num_attention_heads * mc.head_dim
    kv = mc.num_key_value_heads * mc.head_dim
    h, inter = mc.hidden_size, mc.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    blocks: dict[tuple[int, str], str] = {}
    with safe_open(str(weights_path), "pt") as f:
        for key in f.keys():
            m = _KEY.search(key)
            if m is None:
                raise InvalidAdapterError(f"adapter {name!r}: tensor {key!r} is not a LoRA matrix of a decoder "
                                          f"layer's projection (embeddings and the LM head are not supported)",
                                          param="lora_path")
            layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if module not in shapes or layer >= mc.num_hidden_layers:
                raise InvalidAdapterError(f"adapter {name!r} adapts {module} of layer {layer}; this model has "
                                          f"{mc.num_hidden_layers} layers of {', '.join(TARGETS)}", param="lora_path")
            pairs.setdefault((layer, module), {})[ab] = f.get_tensor(key)
            blocks[(layer, module)] = block
    if not pairs:
        raise InvalidAdapterError(f"adapter {name!r} has no LoRA weights", param="lora_path")
    weights: Weights = {}
    rank = 0
    alphas = set()
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InvalidAdapterError(f"adapter {name!r}: layer {layer} {module} lacks lora_{'A' if 'A' not in ab else 'B'}",
                                      param="lora_path")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2:
            raise InvalidAdapterError(f"adapter {name!r}: layer {layer} {module}: LoRA matrices must be 2-D", param="lora_path")
        r = a.shape[0]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise InvalidAdapterError(f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)}, B "
                                      f"{tuple(b.shape)}; this model needs A [r, {n_in}], B [{n_out}, r] (an adapter "
                                      f"for another base model?)", param="lora_path")
        if r > max_rank:
            raise InvalidAdapterError(f"adapter {name!r} has rank {r}; this engine serves ranks up to {max_rank} "
                                      f"(max_lora_rank)", param="lora_path")
        alpha = _alpha_for(f"model.layers.{layer}.{blocks[(layer, module)]}.{module}", cfg)
        alphas.add(alpha)
        scale = alpha / (math.sqrt(r) if rslora else r)
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous())
        rank = max(rank, r)
    targets = tuple(t for t in TARGETS if any(m == t for _, m in weights))
    return LoraAdapter(name, str(folder), rank, max(alphas), targets, weights)


class LoraBatch:
    """How the step now running maps its flat rows to adapter slots, shared by every ``LoraLinear``.

    ``one``: every row runs the adapter in slot ``slot``. ``gathered``: the rows of ``G`` adapters,
    padded to ``n`` each (``gather``: [G*n] flat rows, the padding pointing at an extra zero row), run
    as two batched matmuls against those slots' stacks and added back (``valid`` of the padded
    results to ``rows``); the stacks are read in place when the groups are the slots ``span`` in
    order (a slot between the step's ones gets a group of padding), else gathered (``slots``).
    ``groups``: per slot its rows, when padding would waste too much. ``rows`` (fp32 on a CPU with the
    kernels): ``row_slots`` names each flat row's slot (-1: none), and one C++ call per projection
    adds every row's update, whatever the mix.
    """

    __slots__ = ("mode", "slot", "slots", "span", "gather", "valid", "rows", "shape", "groups", "row_slots")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.mode: str | None = None
        self.slot = 0
        self.slots = self.gather = self.valid = self.rows = None
        self.span = (0, 0)
        self.shape = (0, 0)
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.row_slots: torch.Tensor | None = None     # set: every mode runs as one C++ call (fp32 CPU)


class LoraLinear(nn.Module):
    """A projection (or a fused group of them) plus the low-rank updates of the step's adapters.

    Per resident adapter slot it holds its parts' A matrices stacked (``A``: [slots, R, in]) and their
    B matrices block-placed in the output columns (``B``: [slots, out, R]), so that one pair of
    matmuls gives every part's update, whichever parts an adapter targets (the rest are zeros)."""

    def __init__(self, base: nn.Module, layer: int, parts: list[tuple[str, int, int]], batch: LoraBatch):
        super().__init__()
        self.base = base
        self.layer = layer
        self.parts = parts              # (module name, first output column, columns)
        self.batch = batch
        self.out_features = sum(width for _, _, width in parts)
        self.A: torch.Tensor | None = None
        self.B: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        b = self.batch
        if b.mode is None or self.A is None:
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if b.row_slots is not None:
            if x.dtype == torch.float32 and not torch.is_grad_enabled():
                cpu_kernels.loaded().lora_add(x2.contiguous(), out2, self.A, self.B, b.row_slots)
            else:                       # (a forward the kernel does not take: each slot's rows in turn)
                for slot in b.row_slots.unique().tolist():
                    if slot >= 0:
                        rows = (b.row_slots == slot).nonzero().squeeze(1)
                        out2.index_add_(0, rows, (x2.index_select(0, rows) @ self.A[slot].t()) @ self.B[slot].t())
            return out
        if b.mode == "one":
            out2 += (x2 @ self.A[b.slot].t()) @ self.B[b.slot].t()
        elif b.mode == "gathered":
            g, n = b.shape
            xp = torch.cat([x2, x2.new_zeros(1, x2.shape[1])]).index_select(0, b.gather).view(g, n, -1)
            if b.slots is None:         # the stacks in place: a gather would copy them every projection
                A, B = self.A[b.span[0]:b.span[1]], self.B[b.span[0]:b.span[1]]
            else:
                A, B = self.A.index_select(0, b.slots), self.B.index_select(0, b.slots)
            u = torch.bmm(xp, A.transpose(1, 2))
            d = torch.bmm(u, B.transpose(1, 2)).view(g * n, -1)
            out2.index_add_(0, b.rows, d.index_select(0, b.valid))
        else:
            for slot, rows in b.groups:
                out2.index_add_(0, rows, (x2.index_select(0, rows) @ self.A[slot].t()) @ self.B[slot].t())
        return out

    def rank_for(self, adapter: "LoraAdapter") -> int:
        """The stack rank ``adapter`` takes in this module (its parts' ranks side by side)."""
        return sum(adapter.weights[(self.layer, name)][0].shape[0] for name, _, _ in self.parts
                   if (self.layer, name) in adapter.weights)

    def shrink_to(self, rank: int) -> None:
        """Drop the stacks' columns past ``rank`` (no resident adapter uses them): every later step
        then multiplies by the largest rank still served, not the largest ever loaded. A slot's
        adapter fills its columns from 0, so the adapters kept lose nothing."""
        if self.A is None or rank >= self.A.shape[1]:
            return
        if rank == 0:
            self.A = self.B = None
            return
        self.A = self.A[:, :rank].contiguous()
        self.B = self.B[:, :, :rank].contiguous()

    def fill(self, slot: int, adapter: "LoraAdapter", slots: int, device: torch.device, dtype: torch.dtype) -> None:
        """Put ``adapter``'s matrices for these parts into ``slot`` (growing the stacks' rank if needed)."""
        pieces = [(first, width, adapter.weights[(self.layer, name)]) for name, first, width in self.parts
                  if (self.layer, name) in adapter.weights]
        rank = sum(a.shape[0] for _, _, (a, _) in pieces)
        have = 0 if self.A is None else self.A.shape[1]
        if rank > have:
            in_features = pieces[0][2][0].shape[1]
            A = torch.zeros(slots, rank, in_features, device=device, dtype=dtype)
            B = torch.zeros(slots, self.out_features, rank, device=device, dtype=dtype)
            if self.A is not None:
                A[:, :have], B[:, :, :have] = self.A, self.B
            self.A, self.B = A, B
        if self.A is None:
            return
        self.A[slot].zero_()
        self.B[slot].zero_()
        r0 = 0
        for first, width, (a, b) in pieces:
            r = a.shape[0]
            self.A[slot, r0:r0 + r] = a.to(device)
            self.B[slot, first:first + width, r0:r0 + r] = b.to(device)
            r0 += r


def install_lora(model: nn.Module) -> tuple[LoraBatch, list[LoraLinear]]:
    """Wrap every adaptable projection of ``model`` (fused or not); returns the batch they read and the
    wrappers (the same again for a model wrapped already)."""
    if isinstance(getattr(model, "lora_batch", None), LoraBatch):
        return model.lora_batch, [m for m in model.modules() if isinstance(m, LoraLinear)]
    batch = model.lora_batch = LoraBatch()
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if attn.qkv_proj is not None:
            qs, ks, vs = attn.qkv_sizes
            attn.qkv_proj = LoraLinear(attn.qkv_proj, i, [("q_proj", 0, qs), ("k_proj", qs, ks),
                                                          ("v_proj", qs + ks, vs)], batch)
        else:
            for name, width in zip(("q_proj", "k_proj", "v_proj"), attn.qkv_sizes):
                setattr(attn, name, LoraLinear(getattr(attn, name), i, [(name, 0, width)], batch))
        attn.o_proj = LoraLinear(attn.o_proj, i, [("o_proj", 0, model.config.hidden_size)], batch)
        inter = model.config.intermediate_size
        if mlp.gate_up_proj is not None:
            mlp.gate_up_proj = LoraLinear(mlp.gate_up_proj, i, [("gate_proj", 0, inter), ("up_proj", inter, inter)],
                                          batch)
        else:
            mlp.gate_proj = LoraLinear(mlp.gate_proj, i, [("gate_proj", 0, inter)], batch)
            mlp.up_proj = LoraLinear(mlp.up_proj, i, [("up_proj", 0, inter)], batch)
        mlp.down_proj = LoraLinear(mlp.down_proj, i, [("down_proj", 0, model.config.hidden_size)], batch)
    return batch, [m for m in model.modules() if isinstance(m, LoraLinear)]


class AdapterManager:
    """The adapters an engine serves: all in host memory, up to ``max_loras`` resident on the device
    in numbered slots (least recently used evicted first)."""

    GATHER_WASTE = 4.0         # padded rows / real rows above which a step's adapters run one by one
    SPAN_WASTE = 2.0           # slots read in place / slots used, above which the used ones are gathered
    cpu_kernel = False         # fp32 on a CPU: each projection's updates in one C++ call (``lora_add``)

    def __init__(self, model: nn.Module, mc: ModelConfig, device: torch.device, dtype: torch.dtype,
                 max_loras: int, max_rank: int):
        self.mc, self.device, self.dtype = mc, device, dtype
        self.max_loras, self.max_rank = max_loras, max_rank
        self.batch, self.modules = install_lora(model)
        self.host: dict[str, LoraAdapter] = {}
        self.roots: dict[str, int] = {}          # each load's own prefix-cache chain (a reload is another)
        self._serial = itertools.count(1)
        self.resident: OrderedDict[str, int] = OrderedDict()      # name -> slot, least recently used first

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and serve an adapter now (``read`` then ``add``)."""
        return self.add(name, self.read(name, path))

    def read(self, name: str, path: str | Path) -> LoraAdapter:
        """An adapter's folder into host memory, checked against this engine; serves nothing yet (no
        engine state is touched, so it may run beside the engine's steps)."""
        self.check_new(name)
        return load_adapter(name, path, self.mc, self.dtype, self.max_rank)

    def check_new(self, name: str) -> None:
        if not name or ":" in name or "/" in name:
            raise InvalidRequestError(f"adapter name {name!r}: use letters, digits, '-', '_' or '.'",
                                      param="lora_name", code="invalid_adapter_name")
        if name in self.host:
            raise AdapterExistsError(f"adapter {name!r} is loaded already; unload it first", param="lora_name")

    def add(self, name: str, adapter: LoraAdapter) -> LoraAdapter:
        """Serve an adapter ``read`` returned (between steps)."""
        self.check_new(name)
        self.host[name] = adapter
        self.roots[name] = xxhash.xxh64_intdigest(f"lora:{name}:{next(self._serial)}".encode()) & 0x7FFF_FFFF_FFFF_FFFF
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.host:
            raise AdapterNotFoundError(f"no adapter {name!r} is loaded", param="lora_name")
        del self.host[name]
        del self.roots[name]
        self.resident.pop(name, None)            # its slot is overwritten by the next adapter that needs one
        for module in self.modules:             # and the stacks keep only the rank the others need
            module.shrink_to(max((module.rank_for(self.host[n]) for n in self.resident), default=0))

    def has(self, name: str) -> bool:
        return name in self.host

    def _slot(self, name: str, keep: set[str]) -> int:
        slot = self.resident.get(name)
        if slot is not None:
            self.resident.move_to_end(name)
            return slot
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((n for n in self.resident if n not in keep), None)
            if victim is None:      # the scheduler keeps a step's adapters within max_loras
                raise RuntimeError(f"more than max_loras={self.max_loras} adapters in one step")
            slot = self.resident.pop(victim)
        adapter = self.host[name]
        for module in self.modules:
            module.fill(slot, adapter, self.max_loras, self.device, self.dtype)
        self.resident[name] = slot
        return slot

    def bind(self, rows_of: dict[str, list[int]], num_rows: int) -> None:
        """The step's adapters and their flat rows (what ``LoraLinear`` reads during the forward)."""
        b = self.batch
        b.clear()
        if not rows_of:
            return
        keep = set(rows_of)
        slots = {name: self._slot(name, keep) for name in rows_of}
        to = self.device
        if self.cpu_kernel:        # one call per projection, whatever the mix: each row names its slot
            row_slots = torch.full((num_rows,), -1, dtype=torch.long)
            for name, rows in rows_of.items():
                row_slots[rows] = slots[name]
            b.mode, b.row_slots = "rows", row_slots
            return
        if len(rows_of) == 1 and len(next(iter(rows_of.values()))) == num_rows:
            b.mode, b.slot = "one", slots[next(iter(rows_of))]
            return
        n = max(len(r) for r in rows_of.values())
        real = sum(len(r) for r in rows_of.values())
        if len(rows_of) * n > self.GATHER_WASTE * real:
            b.mode = "groups"
            b.groups = [(slots[name], torch.tensor(rows, dtype=torch.long).to(to)) for name, rows in rows_of.items()]
            return
        by_slot = {slots[name]: rows for name, rows in rows_of.items()}
        lo, hi = min(by_slot), max(by_slot) + 1
        # in place: the stacks between the step's slots read too (a group of padding each), if few
        in_place = hi - lo <= self.SPAN_WASTE * len(by_slot) and (hi - lo) * n <= self.GATHER_WASTE * real
        order = list(range(lo, hi)) if in_place else sorted(by_slot)
        gather, valid, flat = [], [], []
        for g, slot in enumerate(order):
            rows = by_slot.get(slot, [])
            gather += rows + [num_rows] * (n - len(rows))       # row num_rows: the zero row appended
            valid += range(g * n, g * n + len(rows))
            flat += rows
        b.mode, b.shape = "gathered", (len(order), n)
        b.span = (lo, hi)
        b.slots = None if in_place else torch.tensor(order, dtype=torch.long).to(to)
        b.gather = torch.tensor(gather, dtype=torch.long).to(to)
        b.valid = torch.tensor(valid, dtype=torch.long).to(to)
        b.rows = torch.tensor(flat, dtype=torch.long).to(to)

    def unbind(self) -> None:
        self.batch.clear()

    def view(self) -> list[dict]:
        return [{"name": a.name, "path": a.path, "rank": a.rank, "alpha": a.alpha, "targets": list(a.targets),
                 "resident": a.name in self.resident} for a in self.host.values()]


__all__ = ["AdapterManager", "LoraAdapter", "LoraLinear", "load_adapter", "install_lora", "InvalidAdapterError",
           "AdapterNotFoundError", "AdapterExistsError", "AdapterInUseError", "TARGETS"]
