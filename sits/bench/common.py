"""What every benchmark shares: its command-line arguments, progress lines, percentiles, and its
section of docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

DOC_HEADER = "# Benchmarks\n\nEvery figure is a ratio against a baseline measured in the same run.\n\n"


def add_bench_command(subparsers: argparse._SubParsersAction, name: str, help: str, run, *, model: bool = True,
                      threads: str | None = None, repeats: str | None = None,
                      repeats_default: int | None = None) -> argparse.ArgumentParser:
    """``sits bench NAME``, run by ``run(args)``, with the arguments benchmarks share: ``--model``
    (unless it brings its own), ``--threads`` (``threads``: whose threads), ``--repeats`` (``repeats``:
    what one repeat is), ``--json`` and ``--write-docs``. Returns the parser for its own arguments."""
    p = subparsers.add_parser(name, help=help)
    if model:
        p.add_argument("--model", required=True, help="local Hugging Face model directory")
    if threads:
        p.add_argument("--threads", type=int, default=None, help=f"{threads} (default: all cores)")
    if repeats:
        p.add_argument("--repeats", type=int, default=repeats_default, help=repeats)
    p.add_argument("--json", default=None, help="write the results as JSON to this file")
    p.add_argument("--write-docs", default=None, metavar="FILE[#TAG]",
                   help="put the results section in this markdown file (replacing its previous one; with "
                        "#TAG, the previous one of that tag, so runs on several models stay side by side)")
    p.set_defaults(func=run)
    return p


def print_summary(name: str, run) -> int:
    """A benchmark's command: ``run()``'s result summary printed as JSON (exit 0), or the ValueError
    it refused with as one line (exit 2)."""
    try:
        result = run()
    except ValueError as e:
        print(f"sits bench {name}: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result["summary"], indent=2))
    return 0


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


def bench_command(name: str) -> str:
    """The command line that produced this run, as docs/benchmarks.md records it."""
    if sys.argv[1:3] == ["bench", name]:
        return f"sits bench {name} " + " ".join(sys.argv[3:])
    return f"sits bench {name}"


def write_json(path: str | Path | None, obj) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2))


def publish(result: dict, name: str, markdown, begin: str, end: str, json_out: str | None,
            docs_out: str | None, plot=None) -> dict:
    """A finished benchmark's result to its JSON file and its docs section (``markdown(result,
    command)``, or with ``plot(result, path)``: ``markdown(result, command, the plot's relative
    path)``, the plot in ``img/<name>_bench.png`` beside the docs), where asked; returns the result."""
    write_json(json_out, result)
    if docs_out:
        docs_path, _, tag = docs_out.partition("#")     # FILE#TAG: a section of its own per tag
        tagged = (begin, end) if not tag else tuple(m.replace(":", f" [{tag}]:", 1) for m in (begin, end))
        docs = Path(docs_path)
        args = [result, bench_command(name)]
        if plot is not None:
            path = docs.parent / "img" / (f"{name}_{tag}_bench.png" if tag else f"{name}_bench.png")
            plot(result, path)
            args.append(os.path.relpath(path, docs.parent))
        section = markdown(*args)
        if tag:      # the section's markers and its title name its tag
            section = section.replace(begin, tagged[0]).replace(end, tagged[1]).replace("\n## ", f"\n## [{tag}] ", 1)
        write_docs(docs, section, *tagged)
    return result


def write_docs(path: Path, section: str, begin: str, end: str) -> None:
    """Replace this benchmark's section (between its markers) or append it; other sections stay."""
    text = path.read_text() if path.exists() else DOC_HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll ``pred`` (HTTP errors count as "not yet") until it returns something truthy."""
    import httpx    # not at the top: `sits --help` imports every benchmark module
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")


def start_sits(args: list[str], timeout_s: float = 300.0, code_dir: str | None = None) -> tuple[subprocess.Popen, str]:
    """Run ``sits ARGS --port P`` in a child process (never sharing the benchmark's GIL); wait for /ready.
    ``code_dir``: run the ``sits`` package found there (another checkout: old vs new code in one run)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sits.cli", *args, "--port", str(port), "--log-level", "warning"]
    env = None
    if code_dir is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(code_dir),
                                                                          os.environ.get("PYTHONPATH")]))}
    log(f"starting: {' '.join(cmd)}" + (f" (code from {code_dir})" if code_dir else ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        import httpx
        if proc.poll() is not None:
            raise RuntimeError(f"sits {args[0]} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        return httpx.get(url + "/ready", timeout=2).status_code == 200

    try:
        wait_until(ready, timeout_s, f"sits {args[0]} at {url}", 0.2)
    except BaseException:
        proc.kill()
        raise
    threading.Thread(target=proc.stderr.read, daemon=True).start()   # a full pipe must never block it
    return proc, url


def stop_sits(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def revision(checkout: str) -> str:
    """The checkout's commit, for labels (its path if it is not a git work tree)."""
    try:
        return subprocess.run(["git", "-C", checkout, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return checkout


def grouped_bars(path: Path, groups: list[str], series: dict[str, list[float]], *, ylabel: str, title: str,
                 log_scale: bool = False) -> None:
    """A bar chart with one group of bars per entry of ``groups``, one bar per series in each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, (label, values) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(groups))], values, width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(groups))], groups, fontsize=8)
    if log_scale:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
