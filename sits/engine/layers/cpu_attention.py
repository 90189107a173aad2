"""Decode attention that reads the paged KV cache in place on a CPU: a small C++ kernel, built once
per machine.

The reference path (``models/llama.py``) gathers every decoding sequence's blocks into a padded copy
for each layer of each step and runs SDPA over that copy: on a CPU the copy and the second read of it
cost more than the attention itself. ``csrc/paged_decode_cpu.cpp`` walks each sequence's block table
and reads every cached K/V row once, where it lies: one task per sequence (the row of all KV heads
read whole), or per (sequence, KV head) when there are fewer sequences than threads; fp32 scores
and softmax whatever the cache's dtype.

It is compiled with torch's C++ extension tooling (g++, ninja) for the CPU it runs on
(``-march=native``) into a cache directory keyed by the source, torch's version, Python's and the
CPU's flags (``SITS_KERNEL_CACHE``, default ``~/.cache/sits/kernels``). ``make install`` builds it
(``python -m sits.engine.layers.cpu_attention``, about a minute, once). An engine with ``attention:
auto`` uses a build it finds and never compiles one (a start must not wait for g++: it serves through
the reference path and says how to build); ``attention: cpp`` builds it if needed.
``SITS_CPU_KERNELS=0`` turns it off; a machine that cannot compile it keeps the reference path
(``kernel_error()`` says why).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_cpu.cpp"
# compile only (so the library does not set flush-to-zero for the process). -ffast-math whole: it is
# what makes glibc declare its vector exp, which the softmax needs to vectorize
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_module = None
_error: str | None = None
_hinted = False
_build_failed = False     # a failed build is not retried in this process


def enabled() -> bool:
    return os.environ.get("SITS_CPU_KERNELS", "1") not in ("0", "false", "no", "off")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def build_name() -> str:
    """The extension's module name: a new one for any change of source, flags, torch, Python or CPU."""
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
                 sysconfig.get_config_var("SOABI").encode() if sysconfig.get_config_var("SOABI") else b"",
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return "sits_paged_decode_" + h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("SITS_KERNEL_CACHE") or Path.home() / ".cache" / "sits" / "kernels")


def _import(name: str, path: Path):
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _compile(name: str, directory: Path, so: Path):
    """Build under a lock on the directory (one builder per machine; the others wait, then load its
    result), in ``build/``, then publish the library at ``so`` by an atomic rename: a process that
    finds ``so`` finds it whole."""
    from torch.utils import cpp_extension

    build_dir = directory / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if so.exists():
            return _import(name, so)
        # torch's own lock file, left behind by a build that was killed, would make its build wait forever
        (build_dir / "lock").unlink(missing_ok=True)
        # ninja from this environment (the ``ninja`` package) when the shell's PATH lacks it
        bin_dir = os.path.dirname(sys.executable)
        if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        log.warning("compiling the CPU decode-attention kernel for this machine (once, about a minute) into %s",
                    directory)
        module = cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
                                    extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False)
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        shutil.copyfile(build_dir / f"{name}.so", tmp)
        os.replace(tmp, so)
        return module


def kernel(build: bool = True):
    """The compiled module, or None (turned off, not built and ``build`` False, or the build failed:
    ``kernel_error()``). Loading a build is a ``dlopen``; building one takes about a minute. A build
    that does not load is rebuilt when ``build`` is True."""
    global _module, _error, _hinted, _build_failed
    if not enabled():
        return None
    if _module is not None:
        return _module
    with _lock:
        if _module is not None or (_build_failed and build):
            return _module
        name = build_name()
        directory = cache_dir() / name
        so = directory / f"{name}.so"
        try:
            if so.exists():
                try:
                    _module = _import(name, so)
                except Exception:
                    if not build:
                        raise
                    so.unlink(missing_ok=True)         # a broken library: built again below
            if _module is None and build:
                _build_failed = True                   # until it returns
                _module = _compile(name, directory, so)
                _build_failed = False
            elif _module is None and not _hinted:
                _hinted = True
                log.info("the CPU decode-attention kernel is not built for this machine; decodes gather their "
                         "blocks (`python -m sits.engine.layers.cpu_attention` builds it)")
        except Exception as e:        # no compiler, no ninja, a broken build: keep the reference path
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("the CPU decode-attention kernel is not available (%s); decodes gather their blocks",
                        _error)
        return _module


def kernel_error() -> str | None:
    return _error


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """q: [B, H, D] one query per sequence; kv_cache: [2, num_blocks, block_size, H_kv, D];
    block_tables: [B, W] int64; context_lens: [B] int64 (the new token included) -> [B, H, D]."""
    return _module.paged_decode_attention(q, kv_cache, block_tables, context_lens, scale, window or 0)


def main() -> int:
    """``python -m sits.engine.layers.cpu_attention``: build (or find) the kernel; says which. Never
    fails the caller: a machine without a compiler serves through the reference path."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    module = kernel(build=True)
    if module is None:
        print(f"CPU decode-attention kernel: not built ({_error or 'turned off by SITS_CPU_KERNELS'}); "
              "the reference attention serves")
    else:
        print(f"CPU decode-attention kernel: {module.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
