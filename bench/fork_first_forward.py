"""What a zygote fork's first forward pays: time and page faults of a child's first forwards.

The parent holds the preloaded model (as the zygote does: single-threaded, two small warm-up
passes) and forks; each child runs four 120-token forwards with the engine's thread count and
prints their times and minor page faults. Options: ``pool`` starts the intra-op pool first (timed
alone), ``populate`` prefaults the weights' mapping with MADV_POPULATE_READ first (timed alone),
``anon`` copies the weights into anonymous memory in the parent (fork then copies their page
table entries; a file mapping's are faulted in again by the child).

    python bench/fork_first_forward.py MODEL_DIR [pool] [populate] [anon]
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
import time

import torch

from sits.engine.config import EngineConfig
from sits.engine.llm_engine import PreloadedModel

MADV_POPULATE_READ = 22      # Linux 5.14


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(label: str, fn) -> str:
    f0, t0 = faults(), time.perf_counter()
    fn()
    return f"{label}{(time.perf_counter() - t0) * 1e3:.1f} ms/{faults() - f0} faults"


def populate(model: torch.nn.Module) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    params = list(model.parameters())
    lo = min(p.data_ptr() for p in params) & ~4095
    hi = max(p.data_ptr() + p.numel() * p.element_size() for p in params)
    if libc.madvise(lo, hi - lo, MADV_POPULATE_READ) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_READ)")


def main() -> None:
    model_dir, opts = sys.argv[1], set(sys.argv[2:])
    torch.set_num_threads(1)
    pre = PreloadedModel.load(EngineConfig(model=model_dir, device="cpu"))
    if "anon" in opts:
        with torch.no_grad():
            for p in pre.model.parameters():
                p.data = p.data.clone()
    with torch.inference_mode():
        for n in (1, 16):
            pre.model.forward_dense(torch.zeros(1, n, dtype=torch.long))
    vocab = pre.model_config.vocab_size
    for trial in range(3):
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(os.cpu_count() or 1)
            out = []
            if "populate" in opts:
                out.append(timed("populate ", lambda: populate(pre.model)) + " |")
            if "pool" in opts:
                a = torch.randn(256, 256)
                out.append(timed("pool ", lambda: (a @ a).sum()) + " |")
            with torch.inference_mode():
                ids = torch.randint(5, vocab, (1, 120))
                out += [timed("", lambda: pre.model.forward_dense(ids)) for _ in range(4)]
            print(f"fork {trial + 1}: " + "  ".join(out), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
