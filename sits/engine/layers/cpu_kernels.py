"""The C++ CPU kernels (``csrc/*.cpp``), compiled once per machine into one extension module.

Each replaces torch's operators where they cost more than the arithmetic on a CPU: decode attention
that reads the paged KV cache in place (``cpu_attention``, any cache dtype; ``EngineConfig.attention``);
fp32 matmuls of a few rows that stream each weight row once across the threads (``few_rows_linear``;
``EngineConfig.linear``); and a decoder layer's small fp32 operators, RMSNorm with its residual add and
RoPE with the K/V store, one call each (``rms_norm``, ``rope_store_kv``; ``EngineConfig.elementwise``).
They are compiled with torch's C++ extension tooling (g++, ninja) for the CPU they run
on (``-march=native``) into a cache directory keyed by the sources, flags, torch's version, Python's
ABI and the CPU's flags (``SITS_KERNEL_CACHE``, default ``~/.cache/sits/kernels``). ``make install``
builds them (``python -m sits.engine.layers.cpu_kernels``, a minute or two, once). An engine set to
``auto`` uses a build it finds and never compiles one (a start must not wait for g++: it serves
through the reference paths and says how to build); ``cpp`` builds it if needed.
``SITS_CPU_KERNELS=0`` turns them off; a machine that cannot compile them keeps the reference paths
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

CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(sorted(CSRC.glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
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
    """The extension's module name: a new one for any change of a source, the flags, torch, Python or
    the CPU."""
    h = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(),
                 sysconfig.get_config_var("SOABI").encode() if sysconfig.get_config_var("SOABI") else b"",
                 _cpu_flags().encode()):
        h.update(part)
        h.update(b"\0")
    return "sits_cpu_kernels_" + h.hexdigest()[:16]


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
        log.warning("compiling the CPU kernels for this machine (once, a minute or two) into %s",
                    directory)
        module = cpp_extension.load(name=name, sources=[str(src) for src in SOURCES], extra_cflags=list(CFLAGS),
                                    extra_ldflags=list(LDFLAGS), build_directory=str(build_dir), verbose=False)
        tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")
        shutil.copyfile(build_dir / f"{name}.so", tmp)
        os.replace(tmp, so)
        return module


_BLOCK_BINDING = """
#include <torch/extension.h>
torch::Tensor block_linear(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                           c10::optional<torch::Tensor> bias);
torch::Tensor block_dequantize(torch::Tensor blocks, int64_t qtype, int64_t in_features,
                               c10::optional<torch::Tensor> out);
%s
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("block_linear", &block_linear, py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("in_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("block_dequantize", &block_dequantize, py::arg("blocks"), py::arg("qtype"), py::arg("in_features"),
        py::arg("out") = py::none(), py::call_guard<py::gil_scoped_release>());
  %s
}
"""
_INT8_DECLARATION = """
torch::Tensor block_linear_int8(torch::Tensor x, torch::Tensor blocks, int64_t qtype, int64_t in_features,
                                c10::optional<torch::Tensor> bias);"""
_INT8_BINDING = """m.def("block_linear_int8", &block_linear_int8, py::arg("x"), py::arg("blocks"), py::arg("qtype"),
        py::arg("in_features"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());"""


def build_block_kernels(name: str, src: Path, build_dir: Path, cflags: tuple[str, ...] = CFLAGS, int8: bool = True):
    """The block kernels alone (``block_linear``, ``block_dequantize``, and ``block_linear_int8`` unless
    ``int8`` is false: sources older than it lack it) built from ``src`` (a directory holding
    ``block_quant_cpu.cpp`` and its headers) with ``cflags`` into ``build_dir``, not cached: for checking
    the portable branch (flags without AVX2) or timing another revision's sources."""
    from torch.utils import cpp_extension

    binding = _BLOCK_BINDING % ((_INT8_DECLARATION, _INT8_BINDING) if int8 else ("", ""))
    (build_dir / "block_binding.cpp").write_text(binding)
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    sources = [str(build_dir / "block_binding.cpp"), str(src / "block_quant_cpu.cpp")]
    return cpp_extension.load(name=name, sources=sources, extra_cflags=[*cflags, f"-I{src}"], extra_ldflags=list(LDFLAGS),
                              build_directory=str(build_dir), verbose=False)


def kernel(build: bool = True):
    """The compiled module, or None (turned off, not built and ``build`` False, or the build failed:
    ``kernel_error()``). Loading a build is a ``dlopen``; building one takes a minute or two. A build
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
                log.info("the CPU kernels are not built for this machine; the reference paths serve "
                         "(`python -m sits.engine.layers.cpu_kernels` builds them)")
        except Exception as e:        # no compiler, no ninja, a broken build: keep the reference path
            _error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("the CPU kernels are not available (%s); the reference paths serve", _error)
        return _module


def loaded():
    """The module a ``kernel()`` call loaded (None before one did): for the paths that chose it."""
    return _module


def kernel_error() -> str | None:
    return _error


def main() -> int:
    """``python -m sits.engine.layers.cpu_kernels``: build (or find) the kernels; says which. Never
    fails the caller: a machine without a compiler serves through the reference paths."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    module = kernel(build=True)
    if module is None:
        print(f"CPU kernels: not built ({_error or 'turned off by SITS_CPU_KERNELS'}); "
              "the reference paths serve")
    else:
        print(f"CPU kernels: {module.__file__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
