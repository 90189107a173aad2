"""``sits tool``: tool contracts and the WASM sandbox, without a gateway."""

from __future__ import annotations

import argparse
import json
import sys


def cmd_tool_list(args: argparse.Namespace) -> int:
    from sits.tools import ToolRegistry
    for c in ToolRegistry(args.tools_dir or []).all():
        print(f"{c.ref:<24} {c.runtime:<6} {c.timeout_ms:>6} ms  {', '.join(c.side_effects):<32} {c.description}")
    return 0


def cmd_tool_run(args: argparse.Namespace) -> int:
    """Run one tool call in the sandbox, as a unit would (e.g. to try a new contract)."""
    from sits.tools import ToolError, ToolRegistry, run_tool
    try:
        call_args = json.loads(args.arguments)
    except json.JSONDecodeError as e:
        print(f"arguments are not JSON: {e}", file=sys.stderr)
        return 2
    dirs = dict(d.split("=", 1) for d in args.dir or [])
    try:
        contract = ToolRegistry(args.tools_dir or []).resolve(args.ref)
        r = run_tool(contract, call_args, dirs=dirs, python_allowed=args.allow_python)
    except ToolError as e:
        print(f"{e.code}: {e.message}", file=sys.stderr)
        return 1
    sys.stdout.write(r.output)
    print(f"[{r.ref}: {r.elapsed_ms:.1f} ms, fuel {r.fuel_used}]", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    tool = sub.add_parser("tool", help="tool contracts and the WASM sandbox").add_subparsers(dest="tool_cmd",
                                                                                          required=True)
    tl = tool.add_parser("list", help="the known contracts (built-ins and --tools-dir)")
    tl.add_argument("--tools-dir", action="append", help="a directory of *.yaml contracts (repeatable)")
    tl.set_defaults(func=cmd_tool_list)
    tr = tool.add_parser("run", help="run one call: sits tool run 'math.eval@^1' '{\"expression\": \"6*7\"}'")
    tr.add_argument("ref", help="id@constraint, e.g. file.read@^1.2")
    tr.add_argument("arguments", help="the call's arguments as JSON")
    tr.add_argument("--dir", action="append", help="GUEST=HOST: the host directory behind a declared one")
    tr.add_argument("--tools-dir", action="append", help="a directory of *.yaml contracts (repeatable)")
    tr.add_argument("--allow-python", action="store_true", help="allow runtime: python tools")
    tr.set_defaults(func=cmd_tool_run)
