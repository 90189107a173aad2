"""Tool calls in worker processes, so a deadline always holds and the runtime never pays for a tool.

The sandbox enforces ``timeout_ms`` inside wasm code (epoch interruption), but a module blocked in a
WASI host call (``poll_oneoff``, a read on a FIFO) is not in wasm code and cannot be interrupted
there. Run in the server, such a call would hold a thread past its deadline for as long as it
blocks. Here each call runs in a warm worker process (wasmtime imported once); at the deadline the
worker is killed with whatever it was doing, the call fails with ``tool_timeout``, and a fresh
worker takes its place. A crashed worker is a ``tool_crashed`` error, never a crashed server.

Protocol: length-prefixed pickled tuples on the worker's stdin/stdout; ``("run", contract_json,
args, dirs, trace_id, python_allowed)`` -> ``("ok", result_dict)`` or ``("error", code, message)``.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import pickle
import struct
import sys
import time

from sits.tools.contract import ToolContract, ToolError
from sits.tools.sandbox import ToolResult, run_tool

_LEN = struct.Struct("!I")
KILL_SLACK_S = 0.5            # beyond a tool's timeout_ms before its worker is killed
START_TIMEOUT_S = 60.0


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls) -> "_Worker":
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "sits.tools.runner", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, start_new_session=True)
        w = cls(proc)
        try:
            ready = await asyncio.wait_for(w._read(), START_TIMEOUT_S)
            if ready != ("ready",):
                raise RuntimeError(f"tool worker said {ready!r} at start")
        except BaseException:              # failed or cancelled: no half-started worker is left behind
            w.kill()
            raise
        return w

    async def _read(self):
        head = await self.proc.stdout.readexactly(_LEN.size)
        return pickle.loads(await self.proc.stdout.readexactly(_LEN.unpack(head)[0]))

    async def call(self, msg: tuple, timeout_s: float):
        data = pickle.dumps(msg)
        self.proc.stdin.write(_LEN.pack(len(data)) + data)
        await self.proc.stdin.drain()
        return await asyncio.wait_for(self._read(), timeout_s)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, 9)      # the worker and anything it started (a Python tool)
        except ProcessLookupError:
            pass

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


class ToolRunner:
    """A small pool of tool workers: at most ``max_workers`` calls run at once (more wait their
    turn), started on first use, ``idle`` kept warm between calls."""

    def __init__(self, idle: int = 1, max_workers: int = 4):
        self.idle_target = idle
        self._slots = asyncio.Semaphore(max_workers)
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False
        self.killed = 0             # workers killed at a deadline (or found dead)

    async def _take(self) -> _Worker:
        while self._idle:
            w = self._idle.pop()
            if w.alive:
                return w
        try:
            return await _Worker.start()
        except (OSError, RuntimeError, TimeoutError, asyncio.IncompleteReadError) as e:
            raise ToolError("tool_unavailable", f"no tool worker could start: {e!r}") from None

    async def run(self, contract: ToolContract, args: dict, *, dirs: dict[str, str] | None = None,
                  trace_id: str | None = None, python_allowed: bool = False) -> ToolResult:
        async with self._slots:
            return await self._run(contract, args, dirs=dirs, trace_id=trace_id, python_allowed=python_allowed)

    async def _run(self, contract: ToolContract, args: dict, *, dirs: dict[str, str] | None,
                   trace_id: str | None, python_allowed: bool) -> ToolResult:
        if self._closed:
            raise ToolError("tool_unavailable", "the tool runner is shut down")
        w = await self._take()
        self._busy.add(w)
        keep = False
        t0 = time.monotonic()
        try:
            reply = await w.call(("run", contract.model_dump_json(), contract.source_dir, args, dirs or {}, trace_id,
                                  python_allowed), contract.timeout_ms / 1e3 + KILL_SLACK_S)
            keep = True
        except TimeoutError:
            raise ToolError("tool_timeout", f"{contract.ref} ran past its timeout of {contract.timeout_ms} ms "
                                            "(its worker was stopped)") from None
        except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError, pickle.UnpicklingError):
            raise ToolError("tool_crashed", f"{contract.ref}: its worker process died "
                                            f"after {(time.monotonic() - t0) * 1e3:.0f} ms") from None
        finally:
            self._busy.discard(w)
            if keep and not self._closed and len(self._idle) < self.idle_target:
                self._idle.append(w)
            elif keep:
                w.kill()                       # more warm workers than wanted: let this one go
            else:
                self.killed += 1
                w.kill()
                if not self._closed and len(self._idle) < self.idle_target:
                    asyncio.get_running_loop().create_task(self._replenish())
        if reply[0] == "error":
            raise ToolError(reply[1], reply[2])
        return ToolResult(**reply[1])

    async def _replenish(self) -> None:
        try:
            w = await _Worker.start()
        except (OSError, RuntimeError, TimeoutError):
            return
        if self._closed:
            w.kill()
        else:
            self._idle.append(w)

    async def close(self) -> None:
        self._closed = True
        for w in self._idle + list(self._busy):
            w.kill()
            try:
                await asyncio.wait_for(w.proc.wait(), 5)
            except TimeoutError:
                pass
        self._idle.clear()

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._idle + list(self._busy) if w.alive]


# -- the worker ------------------------------------------------------------------------------------
def _serve() -> int:
    importlib.import_module("wasmtime")     # before "ready": the first call does not pay for the import
    out, inp = sys.stdout.buffer, sys.stdin.buffer

    def send(msg: tuple) -> None:
        data = pickle.dumps(msg)
        out.write(_LEN.pack(len(data)) + data)
        out.flush()

    send(("ready",))
    while True:
        head = inp.read(_LEN.size)
        if len(head) < _LEN.size:
            return 0
        _, contract_json, source_dir, args, dirs, trace_id, python_allowed = pickle.loads(inp.read(_LEN.unpack(head)[0]))
        contract = ToolContract.model_validate_json(contract_json)
        contract.source_dir = source_dir
        try:
            r = run_tool(contract, args, dirs=dirs, trace_id=trace_id, python_allowed=python_allowed)
            send(("ok", {"ref": r.ref, "output": r.output, "elapsed_ms": r.elapsed_ms, "fuel_used": r.fuel_used}))
        except ToolError as e:
            send(("error", e.code, e.message))


if __name__ == "__main__":
    sys.exit(_serve())
