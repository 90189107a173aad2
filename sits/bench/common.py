"""What every benchmark shares: progress lines, percentiles, and its section of docs/benchmarks.md."""

from __future__ import annotations

import sys
import time
from pathlib import Path

DOC_HEADER = "# Benchmarks\n\nEvery figure is a ratio against a baseline measured in the same run.\n\n"


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1]); NaN for no data."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def write_docs(path: Path, section: str, begin: str, end: str) -> None:
    """Replace this benchmark's section (between its markers) or append it; other sections stay."""
    text = path.read_text() if path.exists() else DOC_HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
