"""``sits bench``: each benchmark module adds its own subcommand (``register_cli``)."""

from __future__ import annotations

import argparse

from sits.bench import (coldstart_bench, dtype_bench, engine_bench, fairness_bench, finetune_bench, guided_bench,
                        lora_bench, mesh_bench, prefetch_bench, ray_bench, sampler_bench, serve_bench, standby_bench,
                        step_bench, tenancy_bench, tracing_bench, wire_bench)

BENCHMARKS = (engine_bench, dtype_bench, coldstart_bench, tracing_bench, guided_bench, prefetch_bench, sampler_bench,
              serve_bench, wire_bench, fairness_bench, tenancy_bench, lora_bench, finetune_bench, mesh_bench,
              ray_bench, step_bench, standby_bench)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for module in BENCHMARKS:
        module.register_cli(bench)
