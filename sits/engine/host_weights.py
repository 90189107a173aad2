"""A GPU model's weights kept in host memory between its engines' starts, ready to be copied.

The weights live in one region: an anonymous *shared* mapping (``memfd_create``, ``MAP_SHARED``)
holding every parameter and buffer. A fork shares those pages rather than copying them on write,
and a process that page-locks the region (``cudaHostRegister``, so the device reads it by DMA
with no staging) pins the very pages its parent holds. Were the weights in private memory, Linux
would give the pinning process its own copy of each page first (a long-term pin of a page shared
copy-on-write unshares it), so every standby process would hold the model again.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle

import torch
from torch import nn

ALIGN = 256                               # bytes: each tensor's offset in the region
HOST_REGISTER_READ_ONLY = 0x08            # cudaHostRegisterReadOnly: the device only reads it
_PINNED: list[tuple[int, int]] = []       # host ranges this process page-locked in place (start, end)


class SharedHostRegion:
    """``nbytes`` of anonymous shared memory, as one uint8 tensor (kept alive with its mapping).
    ``fd``: map a region another process made (sent here over a Unix socket) instead of a new one.
    The region keeps its descriptor open (``fd``), so it can be sent on."""

    def __init__(self, nbytes: int, name: str = "sits-weights", *, fd: int | None = None):
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, max(nbytes, 1))
            except OSError:
                os.close(fd)
                raise
        else:
            os.set_inheritable(fd, False)     # as a region made here (a descriptor received has no CLOEXEC)
        self.fd = fd
        self.mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:        # 2 MiB pages where the kernel gives them to shared memory: fewer faults when a fork reads it
            self.mapping.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):
            pass
        self.tensor = torch.frombuffer(self.mapping, dtype=torch.uint8)[:nbytes]
        self.nbytes = nbytes

    def __del__(self):
        try:
            os.close(self.fd)
        except (AttributeError, OSError):
            pass

    def contains(self, t: torch.Tensor) -> bool:
        start = self.tensor.data_ptr()
        return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= start + self.nbytes


def move_to_shared_region(model: nn.Module) -> SharedHostRegion:
    """Every parameter and buffer of ``model`` copied into one new shared region, and the module
    re-pointed at the copies (tensors shared between modules, as tied embeddings, stay shared)."""
    tensors: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                tensors.setdefault(id(t), t)
    offsets, total = {}, 0
    for key, t in tensors.items():
        offsets[key] = total
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    region = SharedHostRegion(total)
    moved: dict[int, torch.Tensor] = {}
    for key, t in tensors.items():
        n = t.numel() * t.element_size()
        view = region.tensor[offsets[key]:offsets[key] + n].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        moved[key] = nn.Parameter(view, requires_grad=False) if isinstance(t, nn.Parameter) else view
    for m in model.modules():
        for slots in (m._parameters, m._buffers):
            for name, t in list(slots.items()):
                if t is not None:
                    slots[name] = moved[id(t)]
    return region


class _RegionPickler(pickle.Pickler):
    """Pickles an object graph with every tensor on ``region``'s storage written as its place there
    (storage offset, dtype, shape, stride), never its bytes."""

    def __init__(self, file, region: SharedHostRegion):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.base = region.tensor.untyped_storage().data_ptr()

    def persistent_id(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.untyped_storage().data_ptr() == self.base:
            return ("region", obj.storage_offset(), str(obj.dtype).removeprefix("torch."), tuple(obj.shape),
                    obj.stride(), isinstance(obj, nn.Parameter))
        if isinstance(obj, (torch.UntypedStorage, torch.TypedStorage)) and obj.data_ptr() == self.base:
            raise pickle.PicklingError("the region's storage itself would be pickled whole")
        return None


class _RegionUnpickler(pickle.Unpickler):
    def __init__(self, file, region: SharedHostRegion):
        super().__init__(file)
        self.storage = region.tensor.untyped_storage()
        self.seen: dict[tuple, torch.Tensor] = {}      # one object per tensor: tied weights stay tied

    def persistent_load(self, pid):
        if pid not in self.seen:
            _, offset, dtype_name, shape, stride, is_param = pid
            t = torch.empty(0, dtype=getattr(torch, dtype_name)).set_(self.storage, offset, shape, stride)
            self.seen[pid] = nn.Parameter(t, requires_grad=False) if is_param else t
        return self.seen[pid]


def dumps_in_region(obj, region: SharedHostRegion) -> bytes:
    """``obj`` pickled with its tensors in ``region`` as references, not bytes: another process that
    maps the same region (``SharedHostRegion(nbytes, fd=...)``) rebuilds it around the same pages."""
    buf = io.BytesIO()
    _RegionPickler(buf, region).dump(obj)
    return buf.getvalue()


def loads_in_region(data: bytes, region: SharedHostRegion):
    return _RegionUnpickler(io.BytesIO(data), region).load()


def pin_in_place(tensors) -> int:
    """Page-lock host tensors where they are (``cudaHostRegister``, read-only), so copies to the
    device read them by DMA with no staging: a shared region's pages stay the ones every process
    maps (see the module docstring). Needs this process's CUDA context; a range the driver refuses
    stays unpinned (its copies are staged). Returns the bytes pinned."""
    cudart = torch.cuda.cudart()
    done, refused = 0, False
    for t in tensors:
        storage = t.untyped_storage()
        start, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or any(a < start + n and start < b for a, b in _PINNED):
            continue
        # read-only where the device supports it; else plain (a shared region's pages are not copied either way)
        for flags in (HOST_REGISTER_READ_ONLY, 0):
            if int(cudart.cudaHostRegister(start, n, flags)) == 0:
                _PINNED.append((start, start + n))
                done += n
                break
            refused = True
    if refused:
        _clear_cuda_error()
    return done


def _clear_cuda_error() -> None:
    """A refused ``cudaHostRegister`` stays CUDA's last error, which torch raises at its next kernel
    launch; one launch here takes it (and its error) instead."""
    try:
        torch.empty(1, device=torch.device("cuda", torch.cuda.current_device())).fill_(0)
    except RuntimeError:
        pass


def unpin_all(keep=()) -> None:
    """Undo ``pin_in_place`` (before the memory is freed, or its range could be taken for pinned),
    except for the storages of the tensors in ``keep``."""
    cudart = torch.cuda.cudart()
    kept = {t.untyped_storage().data_ptr() for t in keep}
    for start, end in list(_PINNED):
        if start not in kept:
            cudart.cudaHostUnregister(start)
            _PINNED.remove((start, end))


def is_pinned_in_place(t: torch.Tensor) -> bool:
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    return any(a <= start and end <= b for a, b in _PINNED)
