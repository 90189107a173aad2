"""Weights from ``*.safetensors``: memory-mapped and zero-copy on CPU, staged through two reused pinned
buffers on GPU (``StagedUpload``).

The safetensors format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte offsets) and one flat byte buffer. Parsing it ourselves lets every tensor be a view into one
private mmap of the file: nothing is read until a page is touched, and on CPU weights kept in their
stored dtype are never copied (the kernel's page cache *is* the model).
"""

from __future__ import annotations

import copy

import json
import mmap
import struct
from pathlib import Path

import torch
from torch import nn

from sits.engine.config import ModelConfig
from sits.engine.errors import ModelLoadError
from sits.engine.gguf_model import open_gguf
from sits.engine.host_weights import is_pinned_in_place
from sits.engine.layers.block_quant import BlockEmbedding, BlockLinear, BlockWeight
from sits.engine.models.llama import LlamaForCausalLM

_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
              "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsFile:
    """One safetensors file mapped into memory; ``tensors()`` yields zero-copy views."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ModelLoadError(f"{path}: not a safetensors file (too short)")
            # ACCESS_COPY: private copy-on-write mapping, so views are writable and the file never is.
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (header_len,) = struct.unpack("<Q", self._mm[:8])
        if header_len > size - 8:
            raise ModelLoadError(f"{path}: corrupt safetensors header")
        try:
            self.header = json.loads(self._mm[8:8 + header_len])
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: corrupt safetensors header: {e.msg}") from None
        self.header.pop("__metadata__", None)
        self._data_start = 8 + header_len

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, info in self.header.items():
            dtype = _ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ModelLoadError(f"{self.path}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            numel = 1
            for d in info["shape"]:
                numel *= d
            if numel == 0:
                out[name] = torch.empty(info["shape"], dtype=dtype)
                continue
            t = torch.frombuffer(self._mm, dtype=dtype, count=numel, offset=self._data_start + begin)
            if t.numel() * t.element_size() != end - begin:
                raise ModelLoadError(f"{self.path}: tensor {name} size does not match its offsets")
            out[name] = t.view(info["shape"])
        return out


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files that make up the checkpoint: those its ``model.safetensors.index.json``
    names, else ``model.safetensors``, else every ``*.safetensors`` but a ``consolidated*`` one (Mistral
    repositories keep their native-format copy of the same weights beside the HF shards)."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        files = [root / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are not there: {', '.join(missing[:5])}", param="model")
        return files
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    return sorted(f for f in root.glob("*.safetensors") if not f.name.startswith("consolidated"))


def load_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    files = weight_files(model_dir)
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found (PyTorch .bin is not supported)",
                             param="model")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(SafetensorsFile(f).tensors())
    return state


class StagedUpload:
    """Host tensors to a device through two reused pinned staging buffers, a chunk at a time: while
    the device copies one chunk out of a buffer, the host fills the other (reading the mapped file,
    converting the dtype on the way). ``Tensor.pin_memory()`` per tensor would page-lock a fresh
    buffer the size of each weight, the whole checkpoint over; here ``2 × chunk_bytes`` are locked
    once. Without CUDA the buffers are plain memory and the same chunked copy runs synchronously."""

    def __init__(self, device: torch.device, chunk_bytes: int = 64 << 20):
        """``chunk_bytes``: each buffer's size (a checkpoint whose largest weight is smaller needs no more)."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.chunk_bytes = chunk_bytes
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.done: list[torch.cuda.Event | None] = [None, None]    # the device's last copy out of each buffer
        self.turn = 0
        self.bytes = 0
        self.direct_bytes = 0          # of which read straight from page-locked host memory (no staging)

    def upload(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``t`` as ``dtype`` on the device (the copy may still be in flight: ``finish()`` waits)."""
        if self.cuda:
            with torch.cuda.device(self.device):      # the events must be on the copies' stream
                return self._upload(t, dtype)
        return self._upload(t, dtype)

    def _upload(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=dtype, device=self.device)
        if self.cuda and t.dtype == dtype and t.is_contiguous() and is_pinned_in_place(t):
            out.copy_(t, non_blocking=True)           # page-locked already: the device reads it by DMA
            self.direct_bytes += out.numel() * out.element_size()
            self.bytes += out.numel() * out.element_size()
            return out
        src, dst = t.reshape(-1), out.view(-1)
        step = max(1, self.chunk_bytes // out.element_size())
        for start in range(0, src.numel(), step):
            n = min(step, src.numel() - start)
            buf, event = self.buffers[self.turn], self.done[self.turn]
            if event is not None:
                event.synchronize()           # the device has read this buffer's previous chunk
            staged = buf[:n * out.element_size()].view(dtype)
            staged.copy_(src[start:start + n])
            dst[start:start + n].copy_(staged, non_blocking=self.cuda)
            if self.cuda:
                self.done[self.turn] = torch.cuda.Event()
                self.done[self.turn].record()
            self.turn ^= 1
        self.bytes += out.numel() * out.element_size()
        return out

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


_MERGED_PROJECTIONS = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "gate", "up"))


def load_model(model_dir: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
               max_positions: int, gguf_blocks: bool = False) -> LlamaForCausalLM:
    """Build the module (uninitialised parameters: untouched pages, no random init) and assign the
    mapped weights to it. Not on the meta device: its dispatch imports torch's compiler (seconds).
    ``gguf_blocks``: a GGUF's block-quantized weights (``BLOCK_TYPES``) stay blocks (``layers.block_quant``; fp32 CPU
    only), their modules swapped for ``BlockLinear``/``BlockEmbedding``."""
    model = LlamaForCausalLM(cfg, max_positions=max_positions)
    gguf = open_gguf(model_dir)
    if gguf_blocks and (gguf is None or device.type != "cpu" or dtype != torch.float32):
        raise ValueError("GGUF blocks serve fp32 on a CPU, from a GGUF file")
    state = gguf.state_dict(dtype, keep_blocks=gguf_blocks) if gguf is not None else load_state_dict(model_dir)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        raise ModelLoadError(f"{model_dir}: lm_head.weight missing and tie_word_embeddings is false")
    expected = {k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = expected - set(state), set(state) - expected
    unexpected = {k for k in unexpected if "rotary_emb" not in k}
    if missing or unexpected:
        raise ModelLoadError(f"{model_dir}: weights do not match {cfg.architecture}: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    blocks = {name: state.pop(name) for name in list(state) if isinstance(state[name], BlockWeight)}
    swapped = _swap_block_modules(model, blocks, state, cfg.tie_word_embeddings)
    expected -= swapped
    upload = None
    converted: set[str] = set()   # names whose tensors are now this process's memory, not the file's
    if device.type != "cpu":      # buffers no larger than the largest weight needs
        largest = max((t.numel() for t in state.values()), default=1) * torch.empty((), dtype=dtype).element_size()
        upload = StagedUpload(device, chunk_bytes=min(64 << 20, max(largest, 16)))
    for name, t in state.items():
        want = dtype if t.is_floating_point() else t.dtype
        if upload is not None:
            t = upload.upload(t, want)
        elif t.dtype != want:
            t = t.to(want)
            converted.add(name)
        state[name] = t
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" not in swapped:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    if upload is not None:
        upload.finish()
    # whether the projections merged for serving are copies already (merging them then costs no memory;
    # a GGUF's are, or are blocks, whose merge copies a fifth of the dequantized size)
    model.weights_copied = gguf is not None or upload is not None or all(
        name in converted for name in expected if name.endswith(_MERGED_PROJECTIONS))
    return model.eval()


def _swap_block_modules(model: LlamaForCausalLM, blocks: dict[str, BlockWeight], state: dict[str, torch.Tensor],
                        tied: bool) -> set[str]:
    """Put a ``BlockLinear`` (``BlockEmbedding`` for the token embedding, and a ``BlockLinear`` over the
    same blocks for a tied LM head) where each of ``blocks`` goes, its bias (Qwen2's q/k/v) taken out
    of ``state``; returns the names of the weights and biases they took."""
    taken = set(blocks)
    for name, weight in blocks.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if path == "model.embed_tokens":
            parent.embed_tokens = BlockEmbedding(weight)
            if tied:
                model.lm_head = BlockLinear(weight)
            continue
        dense = getattr(parent, attr)
        if (dense.out_features, dense.in_features) != (weight.out_features, weight.in_features):
            raise ModelLoadError(f"{name}: the file's blocks hold [{weight.out_features}, {weight.in_features}], "
                                 f"the model expects [{dense.out_features}, {dense.in_features}]")
        bias = state.pop(f"{path}.bias", None)
        if bias is not None:
            taken.add(f"{path}.bias")
        setattr(parent, attr, BlockLinear(weight, bias))
    return taken


def upload_module(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """A copy of a host-resident model on ``device``: its parameters as ``dtype``, its buffers in their
    own dtype (the rotary tables stay fp32), sent through ``StagedUpload``. ``model`` is left as it
    is (its module objects are cloned, not its tensors); shared tensors (tied embeddings) are copied
    once and stay shared."""
    tensors = {id(t): t for m in model.modules() for t in (*m._parameters.values(), *m._buffers.values())
               if t is not None}
    largest = max((t.numel() * max(t.element_size(), dtype.itemsize) for t in tensors.values()), default=16)
    upload = StagedUpload(device, chunk_bytes=min(64 << 20, max(largest, 16)))
    clone = copy.deepcopy(model, memo=dict(tensors))        # new modules around the same tensors
    moved: dict[int, torch.Tensor] = {}
    for m in clone.modules():
        for slots, as_param in ((m._parameters, True), (m._buffers, False)):
            for name, t in list(slots.items()):
                if t is None:
                    continue
                if id(t) not in moved:
                    want = dtype if as_param and t.is_floating_point() else t.dtype
                    data = upload.upload(t.detach(), want)
                    moved[id(t)] = nn.Parameter(data, requires_grad=False) if as_param else data
                slots[name] = moved[id(t)]
    upload.finish()
    return clone


def count_parameters(model: nn.Module) -> int:
    packed = (getattr(m, "packed", None) for m in model.modules())     # oneDNN-laid-out linears
    blocks = {m.blocks.data_ptr(): m.blocks.shape[0] * m.in_features for m in model.modules()
              if isinstance(m, (BlockLinear, BlockEmbedding))}         # GGUF blocks (a tied head's once)
    return (sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in packed if p is not None)
            + sum(blocks.values()))
