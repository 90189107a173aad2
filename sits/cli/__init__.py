"""The ``sits`` command: one module per command group, each adding its subcommands with ``register``.

Group modules import nothing heavy at the top (torch, uvicorn, fastapi, transformers load inside the
command that needs them), so ``sits --help`` and the control commands start fast.
"""

from __future__ import annotations

import argparse
import sys

from sits.cli import bench, control, finetune, model, serve, tenants, tools
from sits.cli.control import DEFAULT_URL, _gateway_url  # noqa: F401  (tests read them here)
from sits.engine.errors import SitsError

_GROUPS = (model, serve, control, tenants, tools, finetune, bench)


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.default is None
                or action.default is False or action.default == [] or action.default == argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """The ``sits`` parser; its subcommand parsers are of this class too, so all share the formatter."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kw)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """``argv``: the command line it will parse; the benchmarks' parsers are built only for ``sits bench``
    (always when ``argv`` is None)."""
    parser = _Parser(prog="sits", description="SITS: a serverless runtime for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in _GROUPS:
        if group is bench:
            group.register(sub, full=argv is None or argv[:1] == ["bench"])
        else:
            group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except SitsError as e:
        print(f"sits: error [{e.code}]: {e.message}", file=sys.stderr)
        return 2
    except FileExistsError as e:          # build-tiny: the message says to pass --overwrite
        print(f"sits: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.filename is None:            # not a file the user named: a bug, keep its traceback
            raise
        print(f"sits: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
