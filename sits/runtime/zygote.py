"""The zygote: a long-lived process that has already imported torch, the model code and the
tokenizer library, and forks instance processes on request.

A cold start from a fresh interpreter spends most of its time importing (≈2 s for torch and
friends on a small CPU host); a fork of the zygote starts with all of that in memory, shared
copy-on-write, so an instance pays only for weights (memory-mapped), KV allocation and warm-up.
It also builds the models of deployed units ahead of time (``preload``): the mapped weights and the
tokenizer are then inherited by every fork, so an instance skips its weights and tokenizer phases,
and two small single-threaded forward passes pay the operators' one-time set-up for all of them.
The zygote runs torch single-threaded, so no intra-op thread pool exists when it forks (OpenMP
pools do not survive a fork); each child sets up its own. CUDA cannot cross a fork, so for a GPU
unit the zygote keeps the weights as they will serve (the device's dtype, projections merged) in
host memory, and each instance copies them to its device (``PreloadedModel.model_on``).

Standby processes: a CUDA context cannot be inherited, so a GPU instance would create its own on the
start's path. Instead the zygote keeps forked children *standing by* per device (``("standby",
device, count)``): each creates its device's context (``sits.engine.device_init``) and page-locks
the host weights it inherited, then reports ready and waits. A ``fork`` for that device (and no
extra environment) is handed to a ready one, with the instance's listening socket passed over a
socketpair, and a replacement is forked behind it once the reply is sent. Standbys are forked again
whenever the preloaded models change, so they inherit every one. A device whose standbys keep dying
before they are used gets none (its starts fork as before).

Protocol (frames of ``sits.runtime.wire`` over a Unix socket, one client): ``("preload",
engine_config_dict)`` (no reply); ``("fork", address, engine_config_dict, {"token": ...})`` →
``("forked", pid, address, {"standby": bool})`` or ``("fork_failed", message)`` (``address``: a
socket path, or ``tcp://HOST:0`` for an instance reached from another node: the port it got comes
back); ``("standby", device, count)`` (no reply; the zygote reports ``("standby_ready", pid,
device)`` and ``("standby_gone", pid)``); the zygote reaps its children and reports ``("exited", pid,
code)``. With ``SITS_DIE_WITH_PARENT`` set (a Ray node's agent sets it), the zygote and its children
die with their parent.

    python -m sits.runtime.zygote --socket PATH
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

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
    """The cached PreloadedModel for this config (built now if missing), or None (int8 for a GPU, whose
    weights are quantized on the device, or it failed)."""
    from sits.engine.config import EngineConfig, resolve_device
    from sits.engine.llm_engine import PreloadedModel
    try:
        cfg = EngineConfig(**cfg_dict)
        on_cpu = resolve_device(cfg.device).type == "cpu"
        if not on_cpu and cfg.quantization is not None:
            return None
        key = PreloadedModel.key(cfg)
        if key not in _MODELS:
            pre = PreloadedModel.load(cfg)
            if on_cpu:
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


def _as_child(fds_to_close: list[socket.socket]) -> None:
    """A forked child's set-up: the zygote's sockets closed, default signals, dies with its parent."""
    for s in fds_to_close:
        s.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if os.environ.get(DIE_WITH_PARENT):
        die_with_parent()


def _run_child(body) -> None:
    """Run ``body()`` (an exit code) and exit: a child must never return into the zygote's loop."""
    code = 1
    try:
        code = body()
    except (BrokenPipeError, ConnectionResetError):
        code = 0
    except BaseException:  # noqa: BLE001 - reported on stderr, then the child exits
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _child(sock_path: str, cfg: dict, fds_to_close: list[socket.socket], preloaded=None,
           listener: socket.socket | None = None, token: str | None = None) -> None:
    _as_child(fds_to_close)
    from sits.runtime.instance_worker import serve_instance
    _run_child(lambda: serve_instance(cfg, sock_path, preloaded, listener, token))


def _inherited(cfg_dict: dict):
    """The PreloadedModel this process inherited for ``cfg_dict``, if any (never built here)."""
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import PreloadedModel
    try:
        return _MODELS.get(PreloadedModel.key(EngineConfig(**cfg_dict)))
    except Exception:  # noqa: BLE001 - the instance reports a config that does not build
        return None


def _stand_by(device: str, assignment: socket.socket) -> int:
    """A standby's life: create the device's context, page-lock the host weights it inherited for that
    kind of device (so a start's copies to the device need no staging), say it is ready, wait for a
    start (or the zygote's end), serve it."""
    from sits.engine.config import resolve_device
    from sits.engine.device_init import init_device
    from sits.engine.host_weights import pin_in_place
    dev = resolve_device(device)
    t0 = time.perf_counter()
    init_device(dev)
    if dev.type == "cuda":
        t1 = time.perf_counter()
        pinned = pin_in_place([pre.host_region.tensor for pre in _MODELS.values() if pre.host_region is not None])
        print(f"zygote: standby {os.getpid()} for {device}: context in {(t1 - t0) * 1e3:.0f} ms; "
              f"{pinned / 2**20:.0f} MiB of host weights page-locked in {(time.perf_counter() - t1) * 1e3:.0f} ms",
              file=sys.stderr, flush=True)
    assignment.send(b"ready")
    msg, fds, _, _ = socket.recv_fds(assignment, 1 << 20, 1)
    if not msg:
        return 0                            # retired, or the zygote is gone
    requested_at = time.monotonic()
    assignment.close()
    sock_path, cfg, token = pickle.loads(msg)
    listener = socket.socket(fileno=fds[0])
    pre = _inherited(cfg)
    for key in [k for k, m in _MODELS.items() if m is not pre]:     # other units' weights: not this instance's
        del _MODELS[key]
    if dev.type == "cuda":
        from sits.engine.host_weights import unpin_all
        unpin_all(keep=[pre.host_region.tensor] if pre is not None and pre.host_region is not None else [])
    from sits.runtime.instance_worker import serve_instance
    return serve_instance(cfg, sock_path, pre, listener, token, start_requested_at=requested_at)


@dataclass(slots=True)
class _Standby:
    pid: int
    device: str
    sock: socket.socket          # the zygote's end of the pair: "ready" comes up it, a start goes down
    ready: bool = False          # its device is set up: a start handed to it skips that


STANDBY_FAILURES_MAX = 3       # standbys of a device that died unused in a row before it gets none


class _Standbys:
    """The standby processes the zygote keeps, per device. ``report(msg)`` tells the gateway which
    are ready (``("standby_ready", pid, device)``) and which are gone (``("standby_gone", pid)``)."""

    def __init__(self, keep_closed: list[socket.socket], report):
        self.keep_closed = keep_closed        # the zygote's own sockets, closed in every child
        self.report = report
        self.targets: dict[str, int] = {}
        self.live: dict[int, _Standby] = {}
        self.retired: set[int] = set()        # told to go, not reaped yet
        self.failures: dict[str, int] = {}

    def sockets(self) -> list[socket.socket]:
        return [s.sock for s in self.live.values()]

    def set_target(self, device: str, count: int) -> None:
        self.targets[device] = count
        self.failures.pop(device, None)
        self.top_up()

    def top_up(self) -> None:
        for device, want in self.targets.items():
            have = [s for s in self.live.values() if s.device == device]
            for s in have[want:]:
                self.retire(s)
            if self.failures.get(device, 0) >= STANDBY_FAILURES_MAX:
                continue
            for _ in range(want - len(have)):
                self._fork(device)

    def _fork(self, device: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError as e:
            print(f"zygote: cannot fork a standby for {device}: {e}", file=sys.stderr)
            ours.close()
            theirs.close()
            return
        if pid == 0:
            _as_child(self.keep_closed + self.sockets() + [ours])
            _run_child(lambda: _stand_by(device, theirs))
        theirs.close()
        self.live[pid] = _Standby(pid, device, ours)

    def _drop(self, s: _Standby) -> None:
        self.live.pop(s.pid, None)
        s.sock.close()
        if s.ready:
            self.report(("standby_gone", s.pid))

    def retire(self, s: _Standby) -> None:
        """End it (it serves nothing; killed rather than told, so one still setting up a device stops
        now instead of holding a context a while longer); it is reaped like any child."""
        self._drop(s)
        self.retired.add(s.pid)
        try:
            os.kill(s.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def renew(self) -> None:
        """Fork them all again (the preloaded models changed: new ones must inherit them)."""
        for s in list(self.live.values()):
            self.retire(s)
        self.top_up()

    def heard(self, sock: socket.socket) -> None:
        """A standby's socket is readable: it is ready (or gone: its exit is reaped)."""
        s = next((x for x in self.live.values() if x.sock is sock), None)
        if s is None:
            return
        try:
            said = sock.recv(16)
        except OSError:
            said = b""
        if said == b"ready" and not s.ready:
            s.ready = True
            self.report(("standby_ready", s.pid, s.device))

    def hand_over(self, device: str, sock_path: str, cfg: dict, token: str | None) -> tuple[int, str] | None:
        """Give a start to a ready standby of ``device``: ``(pid, address)``, or None (none is ready:
        the start forks; one still setting its device up might take longer than that). No replacement
        is forked here: the caller replies first, then ``top_up()``."""
        ready = [s for s in self.live.values() if s.device == device and s.ready]
        if not ready:
            return None
        try:
            listener = listen_on(sock_path)
        except OSError:
            return None                      # the fork path reports it
        address = bound_address(listener, sock_path)
        try:
            for s in ready:
                try:
                    socket.send_fds(s.sock, [pickle.dumps((address, cfg, token))], [listener.fileno()])
                except OSError:              # it died since it said ready: the next one
                    self.retire(s)
                    continue
                self._drop(s)                # an instance now
                self.failures.pop(device, None)
                return s.pid, address
        finally:
            listener.close()                 # the standby has its own copy
        _unlink_socket(sock_path)
        return None

    def pids(self) -> list[int]:
        return [*self.live, *self.retired]

    def reaped(self, pid: int) -> None:
        """A standby exited: one that had not been told to go counts against its device."""
        if pid in self.retired:
            self.retired.discard(pid)
            return
        s = self.live.get(pid)
        if s is None:
            return
        self._drop(s)
        self.failures[s.device] = self.failures.get(s.device, 0) + 1
        if self.failures[s.device] >= STANDBY_FAILURES_MAX:
            print(f"zygote: standbys for {s.device} keep exiting; its starts fork instead", file=sys.stderr)
        self.top_up()


class _Shutdown(Exception):
    """The gateway said ``shutdown``."""


def _device_key(cfg: dict) -> str:
    """The device a config's engine runs on, spelled as the gateway names standby targets."""
    from sits.runtime.device_memory import device_key
    try:
        return device_key(str(cfg.get("device", "auto")))
    except (RuntimeError, ValueError):
        return str(cfg.get("device"))


def _unlink_socket(address: str) -> None:
    """A Unix socket path left by a start that did not happen (a TCP address leaves nothing)."""
    if not address.startswith("tcp://"):
        try:
            os.unlink(address)
        except OSError:
            pass


def _serve_message(msg: tuple, conn: socket.socket, listener: socket.socket, children: set[int],
                   standbys: _Standbys, models: set) -> None:
    """One message from the gateway (see the module docstring)."""
    if msg[0] == "preload":
        _preloaded(msg[1])
    elif msg[0] == "forget":        # its unit is gone: children that use it keep their copy
        _forget(msg[1])
    elif msg[0] == "standby":
        standbys.set_target(msg[1], msg[2])
    elif msg[0] == "fork":
        _, sock_path, cfg, *opts = msg
        token = opts[0].get("token") if opts else None
        child_env = (opts[0].get("env") or {}) if opts else {}
        pre = _preloaded(cfg)
        if set(_MODELS) == models and not child_env:    # a standby has everything a fork would
            handed = standbys.hand_over(_device_key(cfg), sock_path, cfg, token)
            if handed is not None:
                children.add(handed[0])
                send_blocking(conn, ("forked", *handed, {"standby": True}))
                return
        inst_listener = None
        try:
            inst_listener = listen_on(sock_path)
            address = bound_address(inst_listener, sock_path)
            pid = os.fork()
        except OSError as e:
            if inst_listener is not None:
                inst_listener.close()
                _unlink_socket(sock_path)
            send_blocking(conn, ("fork_failed", str(e)))
            return
        if pid == 0:
            os.environ.update(child_env)
            _child(address, cfg, [conn, listener] + standbys.sockets(), pre, inst_listener, token)
        inst_listener.close()
        children.add(pid)
        send_blocking(conn, ("forked", pid, address, {"standby": False}))
    elif msg[0] == "shutdown":
        raise _Shutdown


def serve_zygote(control_path: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # a device "auto" resolved here asks NVML, not the CUDA driver: a driver initialised before a fork
    # is not usable in the child
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
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
    standbys = _Standbys([conn, listener], lambda msg: send_blocking(conn, msg))
    while True:
        readable, _, _ = select.select([conn, *standbys.sockets()], [], [], 0.2)
        for sock in readable:
            if sock is not conn:
                standbys.heard(sock)
        if conn in readable:
            data = conn.recv(1 << 16)
            if not data:
                break                       # the gateway is gone: so are we (children see their own EOF)
            for msg in decoder.feed(data):
                models = set(_MODELS)
                try:
                    _serve_message(msg, conn, listener, children, standbys, models)
                except _Shutdown:
                    return 0
                if set(_MODELS) != models:
                    standbys.renew()             # forked again, to inherit what is preloaded now
                standbys.top_up()                # replacements (after any reply: a fork takes time)
        for pid in [*children, *standbys.pids()]:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if not done:
                continue
            if pid in children:
                children.discard(pid)
                send_blocking(conn, ("exited", pid, os.waitstatus_to_exitcode(status)))
            else:
                standbys.reaped(pid)
    return 0


class ForkedProcess:
    """A zygote child, handled like ``subprocess.Popen`` (poll, wait, kill) by its non-parent;
    ``address``: where it listens (a Unix socket path, or ``tcp://HOST:PORT``)."""

    def __init__(self, pid: int, address: str | None = None):
        self.pid = pid
        self.address = address
        self.returncode: int | None = None
        self.standby = False         # handed to a standby process (its device was ready) rather than forked
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
        self.standbys: dict[int, str] = {}              # ready standby processes: pid -> device
        self._standby_changed = asyncio.Event()
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

    def standby(self, device: str, count: int) -> None:
        """Keep ``count`` processes standing by for starts on ``device`` (its context made)."""
        if self.alive:
            self._writer.write(encode(("standby", device, count)))

    def ready_standbys(self, device: str) -> int:
        return sum(1 for d in self.standbys.values() if d == device)

    async def wait_standbys(self, device: str, count: int, timeout_s: float) -> bool:
        """Until ``count`` standbys of ``device`` are ready (False: not within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.ready_standbys(device) < count:
            self._standby_changed.clear()
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive:
                return False
            try:
                await asyncio.wait_for(self._standby_changed.wait(), left)
            except TimeoutError:
                return False
        return True

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
        child.standby = bool(len(reply) > 3 and reply[3].get("standby"))
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
                elif msg[0] == "standby_ready":
                    self.standbys[msg[1]] = msg[2]
                    self._standby_changed.set()
                elif msg[0] == "standby_gone":
                    self.standbys.pop(msg[1], None)
                else:
                    self._pending.put_nowait(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.alive = False
            self.standbys.clear()                   # they die with it (their end of the pair closes)
            self._standby_changed.set()
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
