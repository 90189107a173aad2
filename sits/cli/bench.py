"""``sits bench``: each benchmark module adds its own subcommand (``register_cli``)."""

from __future__ import annotations

import argparse

_MODULES = ("engine_bench", "dtype_bench", "coldstart_bench", "tracing_bench", "guided_bench", "prefetch_bench",
            "sampler_bench", "serve_bench", "wire_bench", "fairness_bench", "tenancy_bench", "lora_bench",
            "finetune_bench", "mesh_bench", "ray_bench", "step_bench", "standby_bench", "peer_bench")


def register(sub: argparse._SubParsersAction, full: bool = True) -> None:
    """``full``: every benchmark's subcommand (their modules import torch); else ``bench`` alone, for a
    command line that runs none, so ``sits status`` and the other control commands start fast."""
    parser = sub.add_parser("bench", help="benchmarks (sits bench -h lists them)")
    if not full:
        parser.add_argument("args", nargs=argparse.REMAINDER)
        return
    import importlib
    bench = parser.add_subparsers(dest="bench_command", required=True)
    for name in _MODULES:
        importlib.import_module(f"sits.bench.{name}").register_cli(bench)
