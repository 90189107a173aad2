"""The engine keeps its step buffers in the heap: after ``keep_step_buffers_in_heap`` a
multi-megabyte allocation no longer becomes an mmap region of its own (glibc's default would)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = r"""
import ctypes, sys
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "engine":
    from sits.engine.host_memory import keep_step_buffers_in_heap
    assert keep_step_buffers_in_heap() and keep_step_buffers_in_heap()     # idempotent
before = libc.mallinfo2().hblks
buf = libc.malloc(48 << 20)        # above glibc's largest dynamic mmap threshold (32 MiB)
print(libc.mallinfo2().hblks - before)
libc.free(buf)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
@pytest.mark.parametrize("mode, regions", [("default", 1), ("engine", 0)])
def test_step_buffers_stay_in_the_heap(mode, regions):
    libc = subprocess.run(["ldd", "--version"], capture_output=True, text=True)
    if "GLIBC" not in (libc.stdout + libc.stderr).upper():
        pytest.skip("not glibc")
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    assert int(out.stdout) == regions
