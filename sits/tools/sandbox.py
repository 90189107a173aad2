"""Running one tool call, bounded by its contract.

WebAssembly (wasmtime, WASI preview 1): CPU by fuel (``quotas.fuel``) and by an epoch deadline
from ``timeout_ms`` (a timer thread bumps the engine's epoch), memory by the store's limits
(``quotas.memory_mb``), files only through the directories pre-opened for the declared side effects
(read-only unless the contract says ``write``), no sockets, no inherited environment. The module
gets its arguments as argv and, in the environment, ``SITS_TRACE_ID`` and its remaining quota
(``SITS_FUEL``, ``SITS_TIMEOUT_MS``, ``SITS_MEMORY_MB``). Stdout is the result, stderr the
explanation of a failure (exit status non-zero).

Python tools run only where a unit opts in (``python_tools: true``), in a subprocess (its own
session, killed with everything it started at the same timeout). That is not a sandbox: it runs
as the server's user and can read what that user can, the server's environment included.

Known limit: the deadline is checked in wasm code, not inside a WASI host call, so a module that
sleeps in ``poll_oneoff`` or reads a FIFO holds its thread past ``timeout_ms``; running each call
in a child process killed at the deadline is the next step before tools run on the serving path.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sits.tools.contract import ToolContract, ToolError

MAX_OUTPUT_BYTES = 1 << 20
MAX_TABLE_ELEMENTS = 10_000


@dataclass(frozen=True, slots=True)
class ToolResult:
    ref: str
    output: str
    elapsed_ms: float
    fuel_used: int | None = None

    def to_dict(self) -> dict:
        return {"tool": self.ref, "output": self.output, "elapsed_ms": round(self.elapsed_ms, 3),
                "fuel_used": self.fuel_used}


def validate_arguments(contract: ToolContract, args: dict) -> None:
    from jsonschema import Draft202012Validator
    errors = sorted(Draft202012Validator(contract.parameters).iter_errors(args), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.path) or "(arguments)"
        raise ToolError("invalid_tool_arguments", f"{contract.ref}: {where}: {e.message}")


def _argv(contract: ToolContract, args: dict) -> list[str]:
    out = [contract.id]
    for name in contract.argv:
        v = args.get(name)
        if v is None:
            continue
        out.append(v if isinstance(v, str) else json.dumps(v))
    return out


EPOCH_TICK_S = 0.01          # one engine-wide epoch tick; a call's deadline is a number of ticks
_engine_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _engine():
    """One engine for all calls (modules compile once), with one ticker thread: each store's deadline
    is its own number of ticks from now, so one call's timeout never interrupts another's."""
    import wasmtime
    with _engine_lock:
        cfg = wasmtime.Config()
        cfg.consume_fuel = True
        cfg.epoch_interruption = True
        cfg.wasm_multi_memory = False        # one linear memory, so memory_mb bounds it all
        engine = wasmtime.Engine(cfg)

        def tick():
            while True:
                time.sleep(EPOCH_TICK_S)
                engine.increment_epoch()

        threading.Thread(target=tick, name="sits-wasm-epoch", daemon=True).start()
        return engine


@functools.lru_cache(maxsize=64)
def _module(path: str, mtime: float):
    import wasmtime
    src = Path(path)
    engine = _engine()
    with _engine_lock:
        return wasmtime.Module(engine, src.read_text() if src.suffix == ".wat" else src.read_bytes())


# freed before the interpreter tears wasmtime's FFI down (else every cached object complains at exit)
atexit.register(_engine.cache_clear)
atexit.register(_module.cache_clear)


def _guest_relative(path: str, mounts: list[str]) -> str:
    """A convenience, not a defence: "/data/x" becomes "x" under the /data pre-open (WASI enforces the rest)."""
    for m in mounts:
        prefix = m.rstrip("/") + "/"
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def run_wasm(contract: ToolContract, args: dict, dirs: dict[str, str], *, trace_id: str | None = None) -> ToolResult:
    import wasmtime
    validate_arguments(contract, args)
    mounts = contract.mounts()
    for guest, _ in mounts:
        if guest not in dirs:
            raise ToolError("tool_misconfigured", f"{contract.ref} declares {guest} but the deployment maps no "
                                                  f"host directory to it (tool_dirs)")
    args = {k: (_guest_relative(v, [g for g, _ in mounts]) if isinstance(v, str) and k in contract.argv else v)
            for k, v in args.items()}
    path = contract.module_path()
    try:
        module = _module(str(path), path.stat().st_mtime)
    except (OSError, wasmtime.WasmtimeError) as e:
        raise ToolError("tool_misconfigured", f"{contract.ref}: its module cannot be loaded: "
                                              f"{str(e).splitlines()[0]}") from None
    engine = _engine()
    store = wasmtime.Store(engine)
    q = contract.quotas
    store.set_fuel(q.fuel)
    # one memory of at most memory_mb, one small table, one instance: nothing else can grow
    store.set_limits(memory_size=q.memory_mb << 20, memories=1, tables=1, table_elements=MAX_TABLE_ELEMENTS,
                     instances=1)
    with tempfile.TemporaryDirectory(prefix="sits-tool-") as tmp:
        wasi = wasmtime.WasiConfig()
        wasi.argv = _argv(contract, args)
        wasi.env = [("SITS_TRACE_ID", trace_id or ""), ("SITS_FUEL", str(q.fuel)),
                    ("SITS_TIMEOUT_MS", str(contract.timeout_ms)), ("SITS_MEMORY_MB", str(q.memory_mb))]
        for guest, writable in mounts:
            host = dirs[guest]
            if not os.path.isdir(host):
                raise ToolError("tool_misconfigured", f"{contract.ref}: {guest} maps to {host}, not a directory")
            wasi.preopen_dir(host, guest, writable)
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        wasi.stdout_file, wasi.stderr_file = out, err
        store.set_wasi(wasi)
        linker = wasmtime.Linker(engine)
        linker.define_wasi()
        t0 = time.monotonic()
        code = 0
        # the deadline covers instantiation too (a module's start function runs there)
        store.set_epoch_deadline(max(1, math.ceil(contract.timeout_ms / 1e3 / EPOCH_TICK_S)))
        try:
            instance = linker.instantiate(store, module)
            start = instance.exports(store).get("_start")
            if start is None:
                raise ToolError("tool_misconfigured", f"{contract.ref}: the module exports no _start")
            start(store)
        except wasmtime.ExitTrap as e:
            code = e.code
        except wasmtime.Trap as e:
            raise _trap_error(contract, e, store) from None
        except wasmtime.WasmtimeError as e:
            raise ToolError("tool_trap", f"{contract.ref} failed: {str(e).splitlines()[0]}") from None
        elapsed = (time.monotonic() - t0) * 1e3
        fuel_used = q.fuel - store.get_fuel()
        if os.path.getsize(out) > MAX_OUTPUT_BYTES:
            raise ToolError("tool_output_too_large", f"{contract.ref} wrote more than {MAX_OUTPUT_BYTES} bytes")
        with open(out, "rb") as f:
            stdout = f.read(MAX_OUTPUT_BYTES).decode("utf-8", "replace")
        with open(err, "rb") as f:
            stderr = f.read(4096).decode("utf-8", "replace").strip()
    if code != 0:
        raise ToolError("tool_failed", f"{contract.ref} exited with status {code}: {stderr or '(no message)'}")
    return ToolResult(contract.ref, stdout, elapsed, fuel_used)


def _trap_error(contract: ToolContract, e, store) -> ToolError:
    text = str(e)
    first = text.splitlines()[0] if text else type(e).__name__
    if "fuel" in text:
        return ToolError("tool_fuel_exhausted", f"{contract.ref} used all of its fuel ({contract.quotas.fuel})")
    if "interrupt" in text:
        return ToolError("tool_timeout", f"{contract.ref} ran past its timeout of {contract.timeout_ms} ms")
    return ToolError("tool_trap", f"{contract.ref} trapped: {first} (memory limit {contract.quotas.memory_mb} MiB)")


def run_python(contract: ToolContract, args: dict, *, trace_id: str | None = None) -> ToolResult:
    """``entry`` = 'module:function', called with the arguments as keywords in a fresh interpreter."""
    validate_arguments(contract, args)
    if not contract.entry or ":" not in contract.entry:
        raise ToolError("tool_misconfigured", f"{contract.ref}: a python tool names entry: 'module:function'")
    mod, func = contract.entry.split(":", 1)
    code = ("import importlib, json, sys\n"
            f"sys.path.insert(0, {contract.source_dir or '.'!r})\n"
            f"f = getattr(importlib.import_module({mod!r}), {func!r})\n"
            "r = f(**json.loads(sys.stdin.read()))\n"
            "sys.stdout.write(r if isinstance(r, str) else json.dumps(r))\n")
    env = {"PATH": os.environ.get("PATH", ""), "SITS_TRACE_ID": trace_id or ""}   # nothing else inherited
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # its own session: a timeout kills the tool and everything it started
        p = subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.PIPE, stdout=out, stderr=err,
                             env=env, cwd=contract.source_dir or None, start_new_session=True)
        try:
            p.communicate(json.dumps(args).encode(), timeout=contract.timeout_ms / 1e3)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise ToolError("tool_timeout", f"{contract.ref} ran past its timeout of {contract.timeout_ms} ms") from None
        out.seek(0)
        err.seek(0)
        stdout = out.read(MAX_OUTPUT_BYTES + 1)
        stderr = err.read(4096).decode("utf-8", "replace")
    if p.returncode != 0:
        raise ToolError("tool_failed", f"{contract.ref} exited with status {p.returncode}: "
                                       f"{stderr.strip().splitlines()[-1:] or ['(no message)']}")
    if len(stdout) > MAX_OUTPUT_BYTES:
        raise ToolError("tool_output_too_large", f"{contract.ref} wrote more than {MAX_OUTPUT_BYTES} bytes")
    return ToolResult(contract.ref, stdout.decode("utf-8", "replace"), (time.monotonic() - t0) * 1e3)


def run_tool(contract: ToolContract, args: dict, *, dirs: dict[str, str] | None = None, trace_id: str | None = None,
             python_allowed: bool = False) -> ToolResult:
    if contract.runtime == "python":
        if not python_allowed:
            raise ToolError("python_tools_disabled", f"{contract.ref} is a Python tool; the unit must opt in "
                                                     "with python_tools: true")
        return run_python(contract, args, trace_id=trace_id)
    return run_wasm(contract, args, dirs or {}, trace_id=trace_id)
