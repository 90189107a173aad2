"""GPU memory, read without a CUDA context: the gateway budgets each GPU for the instances it
starts there, and must not hold a context itself (hundreds of MiB of the device, and a process that
forks must not have initialised CUDA).

NVML (the driver's ``libnvidia-ml.so.1``, loaded with ctypes: no Python package needed) reports each
device's total and free memory. Indices follow ``CUDA_VISIBLE_DEVICES`` when it lists device
numbers, as CUDA numbers them; a list of UUIDs or MIG instances is not mapped (no budget then).
"""

from __future__ import annotations

import ctypes
import os

MIB = 2**20
CUDA_CONTEXT_BYTES = 512 * MIB      # what a process's CUDA context and its libraries' handles take on the device (estimate)


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def visible_indices(visible: str | None, count: int) -> list[int] | None:
    """The physical devices CUDA numbers 0, 1, … under ``CUDA_VISIBLE_DEVICES=visible``; None when
    they cannot be told from it (UUIDs, MIG)."""
    if visible is None:
        return list(range(count))
    out: list[int] = []
    for item in visible.split(","):
        item = item.strip()
        if not item:
            break
        if not item.isdigit():
            return None
        if int(item) >= count:
            break                       # CUDA stops at the first invalid entry
        out.append(int(item))
    return out


def gpu_memory() -> dict[str, tuple[int, int]]:
    """``{"cuda:N": (free_bytes, total_bytes)}`` for the GPUs this process would see; ``{}`` without
    NVML (no NVIDIA driver) or when it fails."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return {}
    if nvml.nvmlInit_v2() != 0:
        return {}
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return {}
        indices = visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), count.value)
        out: dict[str, tuple[int, int]] = {}
        for n, index in enumerate(indices or []):
            handle, mem = ctypes.c_void_p(), _NvmlMemory()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
                continue
            out[f"cuda:{n}"] = (int(mem.free), int(mem.total))
        return out
    finally:
        nvml.nvmlShutdown()


def device_key(device: str) -> str:
    """The device a unit's ``device`` names, one spelling per device (``auto`` resolved; ``cuda`` and
    ``cuda:0`` are one GPU): the key of its ledger and of its standby processes."""
    from sits.engine.config import resolve_device
    name = str(resolve_device(device))
    return "cuda:0" if name == "cuda" else name
