"""``sits model``: model utilities."""

from __future__ import annotations

import argparse
import sys


def cmd_build_tiny(args: argparse.Namespace) -> int:
    from sits.modelbuild.tiny import build_tiny_model
    build_tiny_model(args.dir, preset=args.preset, seed=args.seed, train_seconds=args.train_seconds,
                     overwrite=args.overwrite, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(args.dir)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    bt = model.add_parser("build-tiny", help="write an offline Llama model directory with random weights")
    bt.add_argument("dir", help="the model directory to write")
    bt.add_argument("--preset", default="tiny", choices=["tiny", "small", "base"],
                    help="size: tiny ~5M, small ~25M, base ~110M parameters")
    bt.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    bt.add_argument("--train-seconds", type=float, default=0.0,
                    help="train briefly on offline text so output reads like text, seconds")
    bt.add_argument("--overwrite", action="store_true", help="replace a model already in the directory")
    bt.set_defaults(func=cmd_build_tiny)
