"""Keep a CPU engine's per-step tensors in the heap instead of fresh ``mmap`` regions.

A CPU step allocates and frees buffers of megabytes (logits, probabilities, their cumulative
sum). glibc hands allocations above its mmap threshold to ``mmap`` and returns them with
``munmap``; its threshold adapts upward, but heap trimming can undo that, so a step may fault
every page of its buffers in again, which costs more than the arithmetic on them. Fixing both
thresholds keeps those buffers in the heap and reused from step to step (the same remedy as
vLLM's advice to run its CPU backend under tcmalloc). Process-wide, so it is set once, and only
under glibc; elsewhere it is a no-op.

The same thresholds keep the free holes a one-time rewrite of the weights leaves (merged
projections: the parts are freed after the merged copy is made) in the process; ``release_free_heap``
hands those pages back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

# Allocations below this stay in the heap; the KV cache and weights are larger and keep mmap.
MMAP_THRESHOLD_BYTES = 256 << 20
# Free memory at the top of the heap kept before it is given back to the OS.
TRIM_THRESHOLD_BYTES = 512 << 20

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied: bool | None = None


def _glibc() -> ctypes.CDLL | None:
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        try:
            return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        except OSError:
            return None
    return None


def release_free_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``); True if any were."""
    libc = _glibc()
    try:
        return bool(libc is not None and libc.malloc_trim(0))
    except AttributeError:
        return False


def keep_step_buffers_in_heap() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; True when they are in force."""
    global _applied
    if _applied is None:
        _applied = False
        libc = _glibc()
        if libc is not None:
            try:
                _applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
            except AttributeError:
                _applied = False
    return _applied
