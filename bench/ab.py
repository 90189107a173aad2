"""Old vs new code in the same run: a child script run under two checkouts of SITS (``PYTHONPATH``),
in separate processes taking turns, the order reversed every round. Used by the ``*_ab.py`` scripts."""

import json
import os
import statistics
import subprocess
import sys


def alternate(child: str, args: list[str], old: str, new: str, rounds: int) -> dict[str, list[dict]]:
    """Per checkout ("old", "new"), each round's result: the JSON object ``child`` (``python -c``, run
    from ``/`` with ``args``) prints on its last line."""
    codes = {"old": os.path.abspath(old), "new": os.path.abspath(new)}
    runs: dict[str, list[dict]] = {c: [] for c in codes}
    for r in range(rounds):
        for c in (list(codes) if r % 2 == 0 else list(reversed(codes))):
            p = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=codes[c]), cwd="/")
            if p.returncode:
                sys.exit(f"the {c} checkout's run failed:\n{p.stderr}")
            runs[c].append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{rounds} {c}: {runs[c][-1]}", file=sys.stderr, flush=True)
    return runs


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per checkout, the median of each key the rounds share."""
    keys = [k for k in runs["old"][0] if all(k in x for xs in runs.values() for x in xs)]
    return {c: {k: statistics.median(x[k] for x in xs) for k in keys} for c, xs in runs.items()}
