"""The zygote: a long-lived process that has already imported torch, the model code and the
tokenizer library, and forks instance processes on request.

A cold start from a fresh interpreter spends most of its time importing (≈2 s for torch and
friends on a small CPU host); a fork of the zygote starts with all of that in memory, shared
copy-on-write, so an instance pays only for weights (memory-mapped), KV allocation and warm-up.
It also builds the models of deployed units ahead of time (``preload``): the mapped weights and the
tokenizer are then inherited by every fork, so an instance skips its weights and tokenizer phases,
and two small single-threaded forward passes pay the operators' one-time set-up for all of them.
The zygote runs torch single-threaded, so no intra-op thread pool exists when it forks (OpenMP
pools do not survive a fork); each child sets up its own. CUDA cannot cross a fork: preloading is
for CPU engines, GPU instances load their own weights.

Protocol (frames of ``sits.runtime.wire`` over a Unix socket, one client): ``("preload",
engine_config_dict)`` (no reply); ``("fork", address, engine_config_dict, {"token": ...})`` →
``("forked", pid, address)`` or ``("fork_failed", message)`` (``address``: a socket path, or
``tcp://HOST:0`` for an instance reached from another node: the port it got comes back); the
zygote reaps its children and reports ``("exited", pid, code)``. With ``SITS_DIE_WITH_PARENT`` set
(a Ray node's agent sets it), the zygote and its children die with their parent.

    python -m sits.runtime.zygote --socket PATH
"""

from __future__ import annotations

import argparse
import asyncio
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from sits.runtime.instance_worker import bound_address, listen_on
from sits.runtime.wire import FrameDecoder, encode, read_frame, send_blocking

PRELOAD = ("torch", "safetensors", "tokenizers", "jinja2", "sits.engine.llm_engine", "sits.engine.models.llama",
           "sits.runtime.instance_worker")


def preload() -> float:
    t0 = time.perf_counter()
    import importlib
    for mod in PRELOAD:
        importlib.import_module(mod)
    return (time.perf_counter() - t0) * 1e3


_MODELS: dict[tuple, object] = {}     # PreloadedModel by (model dir, dtype, max_model_len)


def _preloaded(cfg_dict: dict):
    """The cached PreloadedModel for this config (built now if missing), or None (GPU, or it failed)."""
    from sits.engine.config import EngineConfig, resolve_device
    from sits.engine.llm_engine import PreloadedModel
    try:
        cfg = EngineConfig(**cfg_dict)
        if resolve_device(cfg.device).type != "cpu":
            return None
        key = PreloadedModel.key(cfg)
        if key not in _MODELS:
            pre = PreloadedModel.load(cfg)
            import torch
            with torch.inference_mode():   # one-time operator set-up, inherited by every fork
                for n in (1, 16):
                    pre.model.forward_dense(torch.zeros(1, n, dtype=torch.long))
            _MODELS[key] = pre
        return _MODELS[key]
    except Exception as e:  # noqa: BLE001 - the child loads (and reports the error) itself
        print(f"zygote: preloading {cfg_dict.get('model')} failed: {e}", file=sys.stderr)
        return None


DIE_WITH_PARENT = "SITS_DIE_WITH_PARENT"     # set: this zygote and its instances end when its parent does


def die_with_parent() -> None:
    """Be killed when the parent process ends (``PR_SET_PDEATHSIG``): a zygote started by a Ray
    node's agent, and its instances, go with the node."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG


def _forget(cfg_dict: dict) -> None:
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import PreloadedModel
    try:
        _MODELS.pop(PreloadedModel.key(EngineConfig(**cfg_dict)), None)
    except Exception:  # noqa: BLE001 - nothing was preloaded for a config that does not build
        pass
    import gc
    gc.collect()


def _child(sock_path: str, cfg: dict, fds_to_close: list[socket.socket], preloaded=None,
           listener: socket.socket | None = None, token: str | None = None) -> None:
    for s in fds_to_close:
        s.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if os.environ.get(DIE_WITH_PARENT):
        die_with_parent()
    code = 1
    try:
        from sits.runtime.instance_worker import serve_instance
        code = serve_instance(cfg, sock_path, preloaded, listener, token)
    except (BrokenPipeError, ConnectionResetError):
        code = 0
    except BaseException:  # noqa: BLE001 - the child must never return into the zygote's loop
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve_zygote(control_path: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.environ.get(DIE_WITH_PARENT):
        die_with_parent()
    preload_ms = preload()
    import torch
    torch.set_num_threads(1)     # never start an intra-op pool here: it would not survive the fork
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(control_path)
    os.chmod(control_path, 0o600)
    listener.listen(1)
    conn, _ = listener.accept()
    send_blocking(conn, ("hello", {"pid": os.getpid(), "preload_ms": round(preload_ms, 1)}))
    decoder = FrameDecoder()
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([conn], [], [], 0.2)
        if readable:
            data = conn.recv(1 << 16)
            if not data:
                break                       # the gateway is gone: so are we (children see their own EOF)
            for msg in decoder.feed(data):
                if msg[0] == "preload":
                    _preloaded(msg[1])
                elif msg[0] == "forget":        # its unit is gone: children that use it keep their copy
                    _forget(msg[1])
                elif msg[0] == "fork":
                    _, sock_path, cfg, *opts = msg
                    token = opts[0].get("token") if opts else None
                    child_env = (opts[0].get("env") or {}) if opts else {}
                    pre = _preloaded(cfg)
                    try:
                        inst_listener = listen_on(sock_path)
                        address = bound_address(inst_listener, sock_path)
                        pid = os.fork()
                    except OSError as e:
                        send_blocking(conn, ("fork_failed", str(e)))
                        continue
                    if pid == 0:
                        os.environ.update(child_env)
                        _child(address, cfg, [conn, listener], pre, inst_listener, token)
                    inst_listener.close()
                    children.add(pid)
                    send_blocking(conn, ("forked", pid, address))
                elif msg[0] == "shutdown":
                    return 0
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children.discard(pid)
                continue
            if done:
                children.discard(pid)
                send_blocking(conn, ("exited", pid, os.waitstatus_to_exitcode(status)))
    return 0


class ForkedProcess:
    """A zygote child, handled like ``subprocess.Popen`` (poll, wait, kill) by its non-parent;
    ``address``: where it listens (a Unix socket path, or ``tcp://HOST:PORT``)."""

    def __init__(self, pid: int, address: str | None = None):
        self.pid = pid
        self.address = address
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._lock = threading.Lock()

    def _set_exit(self, code: int) -> None:
        with self._lock:
            self.returncode = code
            self._exited.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(code))

    async def wait_async(self) -> int:
        """Its exit code, awaited on the event loop (no thread held per child)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self.returncode is not None:
                return self.returncode
            self._waiters.append((loop, fut))
        return await fut

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def send_signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass


class ZygoteClient:
    """The gateway's handle on its zygote: ``await fork(socket_path, cfg)`` is an instance launcher."""

    def __init__(self, proc: subprocess.Popen, reader, writer, info: dict, sock_dir: str):
        self.proc = proc
        self.info = info
        self._reader, self._writer = reader, writer
        self._sock_dir = sock_dir
        self._pending: asyncio.Queue = asyncio.Queue()       # fork replies, in order
        self._children: dict[int, ForkedProcess] = {}
        self._lock = asyncio.Lock()
        self.alive = True
        self._task = asyncio.get_running_loop().create_task(self._read_loop(), name="zygote-reader")

    @classmethod
    async def start(cls, timeout_s: float = 120.0, env: dict | None = None) -> "ZygoteClient":
        sock_dir = tempfile.mkdtemp(prefix="sits-zygote-")
        path = os.path.join(sock_dir, "zygote.sock")
        proc = subprocess.Popen([sys.executable, "-m", "sits.runtime.zygote", "--socket", path],
                                stdin=subprocess.DEVNULL, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the zygote exited with {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the zygote did not start")
                if os.path.exists(path):
                    try:
                        reader, writer = await asyncio.open_unix_connection(path)
                        break
                    except (ConnectionRefusedError, FileNotFoundError):
                        pass
                await asyncio.sleep(0.02)
            hello = await asyncio.wait_for(read_frame(reader), timeout_s)
        except BaseException:         # failed or cancelled (a server stopped while starting): leave nothing
            proc.kill()
            proc.wait()
            shutil.rmtree(sock_dir, ignore_errors=True)
            raise
        return cls(proc, reader, writer, hello[1], sock_dir)

    def preload(self, cfg: dict) -> None:
        """Have the zygote build this model now, so the unit's first fork inherits it."""
        if self.alive:
            self._writer.write(encode(("preload", cfg)))

    def forget(self, cfg: dict) -> None:
        """Have the zygote drop this model (its unit was undeployed)."""
        if self.alive:
            self._writer.write(encode(("forget", cfg)))

    async def fork(self, sock_path: str, cfg: dict, *, token: str | None = None,
                   env: dict[str, str] | None = None) -> ForkedProcess:
        """An instance forked to listen at ``sock_path`` (or ``tcp://HOST:0``: a port the zygote picks,
        reachable by a peer that sends ``token`` first); ``env``: set in the child before anything runs
        (e.g. ``CUDA_VISIBLE_DEVICES``, the GPUs its placement reserved)."""
        if not self.alive:
            raise RuntimeError("the zygote is gone")
        async with self._lock:           # replies come back in request order
            self._writer.write(encode(("fork", sock_path, cfg, {"token": token, "env": env or {}})))
            reply = await self._pending.get()
        if isinstance(reply, BaseException):
            raise reply
        if reply[0] != "forked":
            raise RuntimeError(f"zygote could not fork: {reply[1]}")
        child = ForkedProcess(reply[1], reply[2])
        self._children[child.pid] = child
        return child

    def child(self, pid: int) -> ForkedProcess | None:
        """A live child of this zygote, by its pid."""
        return self._children.get(pid)

    async def _read_loop(self) -> None:
        try:
            while True:
                msg = await read_frame(self._reader)
                if msg[0] == "exited":
                    child = self._children.pop(msg[1], None)
                    if child is not None:
                        child._set_exit(msg[2])
                else:
                    self._pending.put_nowait(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.alive = False
            self._pending.put_nowait(RuntimeError("the zygote is gone"))
            for child in self._children.values():   # no one reaps them now; report them as unknown
                if child.returncode is None:
                    threading.Thread(target=_reap_orphan, args=(child,), daemon=True).start()

    async def shutdown(self) -> None:
        self.alive = False
        try:
            self._writer.write(encode(("shutdown",)))
            await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 10)
        except (TimeoutError, ConnectionError, RuntimeError):
            self.proc.kill()
        self._task.cancel()
        shutil.rmtree(self._sock_dir, ignore_errors=True)


def _reap_orphan(child: ForkedProcess) -> None:
    while True:
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            child._set_exit(-1)
            return
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SITS zygote: forks pre-imported instance processes")
    ap.add_argument("--socket", required=True)
    args = ap.parse_args(argv)
    return serve_zygote(args.socket)


if __name__ == "__main__":
    sys.exit(main())
