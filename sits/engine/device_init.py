"""What the first use of a device creates, created ahead of need.

On a GPU a process's first CUDA call creates the context (hundreds of milliseconds), and its first
matmul creates cuBLAS's handle and workspace. An instance start pays both unless the process made
them before the start was asked for: a standby process (``sits.runtime.zygote``) runs this while
it waits for a unit, and an engine runs it as its ``cuda_init`` phase (free when already done).
"""

from __future__ import annotations

import torch


def init_device(device: torch.device) -> None:
    """The device's context, made current (Triton launches on the current device), with the
    caching allocator's first segment and cuBLAS's handle. Nothing on a CPU."""
    if device.type != "cuda":
        return
    # set_device needs an index: plain "cuda" is the current device (0 in a fresh process)
    torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    a = torch.ones(16, 16, device=device, dtype=torch.float16)
    (a @ a).sum().item()          # waits: the context and cuBLAS's handle exist when this returns
