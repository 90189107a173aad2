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

A GPU unit's host copy is built by a forked *loader* process (``_Loaders``), not in the zygote's
loop, which keeps forking other units' instances meanwhile: the loader sends the shared region's
descriptor and the model pickled around it, and the zygote maps the same pages. A start of a unit
whose copy is still being built does not wait for it: its instance reads the checkpoint itself.

Protocol (frames of ``sits.runtime.wire`` over a Unix socket, one client): ``("preload",
engine_config_dict)`` → ``("preloaded", weights_key, ok, ms)`` when built (or not; a config that
does not build gets no reply);
``("fork", address, engine_config_dict, {"token": ..., "env": ..., "id": n})`` → ``("forked", pid,
address, {"standby": bool, "id": n})`` or ``("fork_failed", message, {"id": n})``, replies matched by
``id``, not order (``address``: a socket path, or ``tcp://HOST:0`` for an instance reached from
another node: the port it got comes back); ``("standby", device, count)`` (no reply; the zygote
reports ``("standby_ready", pid, device)`` and ``("standby_gone", pid)``); ``("forget",
engine_config_dict)``; the zygote reaps its children and reports ``("exited", pid, code)``. With
``SITS_DIE_WITH_PARENT`` set (a Ray node's agent sets it), the zygote and its children die with
their parent.

    python -m sits.runtime.zygote --socket PATH
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import itertools
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field

from sits.runtime.instance_worker import bound_address, listen_on
from sits.runtime.wire import FrameDecoder, encode, read_frame, send_blocking

PRELOAD = ("torch", "safetensors", "tokenizers", "jinja2", "sits.engine.llm_engine", "sits.engine.models.llama",
           "sits.runtime.instance_worker")


def preload() -> float:
    t0 = time.perf_counter()
    import importlib
    for mod in PRELOAD:
        importlib.import_module(mod)
    from sits.engine.layers import cpu_kernels
    cpu_kernels.kernel(build=False)     # built kernels loaded once here, inherited by every fork
    return (time.perf_counter() - t0) * 1e3


_MODELS: dict[tuple, object] = {}     # PreloadedModel by PreloadedModel.key
_BUILT: dict[tuple, int] = {}         # per key, which build of it _MODELS holds (a rebuild is a change)
_BUILDS = itertools.count(1)


def _keep(key: tuple, pre) -> None:
    _MODELS[key] = pre
    _BUILT[key] = next(_BUILDS)


def _key(cfg_dict: dict) -> tuple | None:
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import PreloadedModel
    try:
        return PreloadedModel.key(EngineConfig(**cfg_dict))
    except Exception:  # noqa: BLE001 - a config that does not build: its instance reports why
        return None


def weights_key(cfg_dict: dict) -> str | None:
    """The preloaded model a config's instances share, as a string (configs that differ only in what
    does not change the weights share one): how the zygote reports a preload and the gateway
    groups units' weights."""
    key = _key(cfg_dict)
    return None if key is None else _key_text(key)


def _key_text(key: tuple) -> str:
    return "|".join(map(str, key))


def _models_now() -> dict:
    """What is preloaded, by key and build: a model built again under the same key is a change."""
    return {k: _BUILT.get(k) for k in _MODELS}


def _loads_apart(cfg_dict: dict) -> bool:
    """A GPU unit's host copy is built by a loader process (``_Loaders``); a CPU unit's here."""
    from sits.engine.config import resolve_device
    try:
        return resolve_device(cfg_dict.get("device", "auto")).type != "cpu" and cfg_dict.get("quantization") is None
    except (RuntimeError, ValueError):
        return False


def _preloaded(cfg_dict: dict):
    """The cached PreloadedModel for this CPU config (built now if missing), or None (a GPU config:
    ``_Loaders`` builds those; or it failed). Built here rather than apart because a CPU model is more
    than its weights (linears packed for oneDNN) and its operators' one-time set-up is inherited too."""
    from sits.engine.config import EngineConfig, resolve_device
    from sits.engine.llm_engine import PreloadedModel
    try:
        cfg = EngineConfig(**cfg_dict)
        if resolve_device(cfg.device).type != "cpu":
            return None
        key = PreloadedModel.key(cfg)
        if key not in _MODELS:
            t0 = time.perf_counter()
            pre = PreloadedModel.load(cfg)
            import torch
            with torch.inference_mode():   # one-time operator set-up, inherited by every fork
                for n in (1, 16):
                    pre.model.forward_dense(torch.zeros(1, n, dtype=torch.long))
            _keep(key, pre)
            print(f"zygote: preloaded {cfg.model} for cpu in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
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
    gone = _MODELS.get(_key(cfg_dict))
    if gone is not None:
        _drop_models(lambda m: m is gone, collect=True)


def _as_child(fds_to_close: list) -> None:
    """A forked child's set-up: the zygote's sockets (and descriptors) closed, default signals, dies
    with its parent."""
    for s in fds_to_close:
        if isinstance(s, int):
            os.close(s)
        else:
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


def _fork_with_pair(kind: int, keep_closed: list[socket.socket], body, what: str) -> tuple[int, socket.socket] | None:
    """Fork a child that runs ``body(its end of a new socketpair of `kind`)`` and exits: ``(pid, our
    end)``, or None (the fork failed: said on stderr)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, kind)
    try:
        pid = os.fork()
    except OSError as e:
        print(f"zygote: cannot fork {what}: {e}", file=sys.stderr)
        ours.close()
        theirs.close()
        return None
    if pid == 0:
        _as_child(keep_closed + [ours])
        _run_child(lambda: body(theirs))
    theirs.close()
    return pid, ours


def _child(sock_path: str, cfg: dict, fds_to_close: list[socket.socket], preloaded=None,
           listener: socket.socket | None = None, token: str | None = None) -> None:
    _as_child(fds_to_close)

    def serve() -> int:
        # other GPU units' host copies: unmapped here, so an undeployed unit's shared pages go with the
        # zygote's copy (a CPU model's pages are the zygote's copy-on-write: dropping them frees nothing)
        _drop_models(lambda m: m is not preloaded and m.host_region is not None)
        from sits.runtime.instance_worker import serve_instance
        return serve_instance(cfg, sock_path, preloaded, listener, token)
    _run_child(serve)


def _drop_models(which, collect: bool = False) -> None:
    """Forget the preloaded models ``which(model)`` picks (their tensors go with the last reference;
    ``collect``: also what only a reference cycle keeps, a full collection a start should not pay)."""
    gone = [k for k, m in _MODELS.items() if which(m)]
    for key in gone:
        del _MODELS[key]
    if gone and collect:
        import gc
        gc.collect()


def _inherited(cfg_dict: dict):
    """The PreloadedModel this process inherited for ``cfg_dict``, if any (never built here)."""
    return _MODELS.get(_key(cfg_dict))


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
    if dev.type == "cuda":                  # unpinned before their memory can be unmapped
        from sits.engine.host_weights import unpin_all
        unpin_all(keep=[pre.host_region.tensor] if pre is not None and pre.host_region is not None else [])
    _drop_models(lambda m: m is not pre)            # other units' weights: not this instance's
    from sits.runtime.instance_worker import serve_instance
    return serve_instance(cfg, sock_path, pre, listener, token, start_requested_at=requested_at)


@dataclass(slots=True)
class _Standby:
    pid: int
    device: str
    sock: socket.socket          # the zygote's end of the pair: "ready" comes up it, a start goes down
    models: frozenset            # the preloaded models it inherited: (key, build) pairs
    ready: bool = False          # its device is set up: a start handed to it skips that


STANDBY_FAILURES_MAX = 3       # standbys of a device that died unused in a row before it gets none


class _Standbys:
    """The standby processes the zygote keeps, per device. ``report(msg)`` tells the gateway which
    are ready (``("standby_ready", pid, device)``) and which are gone (``("standby_gone", pid)``)."""

    def __init__(self, keep_closed, report):
        self.keep_closed = keep_closed        # () -> the zygote's own sockets, closed in every child
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
        forked = _fork_with_pair(socket.SOCK_SEQPACKET, self.keep_closed(), lambda pair: _stand_by(device, pair),
                                 f"a standby for {device}")
        if forked is not None:
            self.live[forked[0]] = _Standby(forked[0], device, forked[1], frozenset(_models_now().items()))

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
        _kill(s.pid)

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

    def hand_over(self, device: str, sock_path: str, cfg: dict, token: str | None,
                  needs: tuple | None) -> tuple[int, str] | None:
        """Give a start to a ready standby of ``device`` that inherited ``needs`` (the preloaded model's
        ``(key, build)``, if any): ``(pid, address)``, or None (none is ready: the start forks; one still
        setting its device up might take longer than that). No replacement is forked here: the caller
        replies first, then ``top_up()``."""
        ready = [s for s in self.live.values() if s.device == device and s.ready and (needs is None or needs in s.models)]
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


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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


_LOADED_HEADER = struct.Struct("<QQ")      # the region's size, the pickled rest's size (the fd rides with it)
LOADER_GATE = "SITS_LOADER_GATE"           # a test seam: a file whose lock a loader takes before it reads
LOADER_NICE = 15                           # nicer than instances (instance_worker.DEFAULT_NICE)
LOADER_DEADLINE_S = 1800.0                 # a loader still at work after this is killed (its starts load their own)


def _load_apart(cfg_dict: dict, sock: socket.socket) -> int:
    """A loader's life: build a GPU unit's host copy (``PreloadedModel.load``: read, convert, merge,
    copy into a shared region), send it to the zygote and exit."""
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import PreloadedModel
    die_with_parent()                       # a zygote gone (killed while it loads) needs no copy
    os.nice(LOADER_NICE)                    # cores serving requests come first
    _drop_models(lambda m: True)            # other units' copies: not held open while this one loads
    if os.environ.get(LOADER_GATE):         # a test holds the load open while it checks the zygote serves
        with open(os.environ[LOADER_GATE]) as gate:
            fcntl.flock(gate, fcntl.LOCK_SH)
    import torch
    torch.set_num_threads(len(os.sched_getaffinity(0)))     # it forks nothing: its conversions may use every core
    try:
        pre = PreloadedModel.load(EngineConfig(**cfg_dict))
    except Exception as e:  # noqa: BLE001 - an instance that starts without it loads (and reports) itself
        print(f"zygote: preloading {cfg_dict.get('model')} failed: {e}", file=sys.stderr)
        return 1
    fd, nbytes, data = pre.export()
    socket.send_fds(sock, [_LOADED_HEADER.pack(nbytes, len(data))], [fd])
    sock.sendall(data)
    return 0


@dataclass(slots=True)
class _Loading:
    """A GPU unit's host copy being built by a loader process."""
    pid: int
    sock: socket.socket            # the zygote's end: the result comes up it (EOF alone: it failed)
    cfg: dict
    started: float = field(default_factory=time.perf_counter)
    received: bytearray = field(default_factory=bytearray)     # what it sent so far
    fds: list[int] = field(default_factory=list)


class _Loaders:
    """GPU units' host copies, each built by a forked loader process, so the zygote keeps forking other
    units' instances (and handing starts to standbys) meanwhile: building one reads and converts the
    whole checkpoint, seconds to minutes for a large model. The loader sends the shared region's
    descriptor and the model pickled around it; the zygote maps the same pages, so nothing is copied."""

    def __init__(self, keep_closed):
        self.keep_closed = keep_closed        # () -> the zygote's sockets, closed in every child
        self.loading: dict[tuple, _Loading] = {}
        self.unreaped: set[int] = set()

    def sockets(self) -> list[socket.socket]:
        return [x.sock for x in self.loading.values()]

    def pending_fds(self) -> list[int]:
        """Region descriptors received from loaders whose rest has not come yet."""
        return [fd for x in self.loading.values() for fd in x.fds]

    def start(self, key: tuple, cfg: dict) -> bool:
        """A loader forked for ``key`` (False: it could not be)."""
        forked = _fork_with_pair(socket.SOCK_STREAM, self.keep_closed(), lambda pair: _load_apart(cfg, pair),
                                 f"a loader for {cfg.get('model')}")
        if forked is None:
            return False
        forked[1].setblocking(False)          # read as it comes, never waited on
        self.loading[key] = _Loading(forked[0], forked[1], cfg)
        self.unreaped.add(forked[0])
        return True

    def heard(self, sock: socket.socket):
        """A loader's socket is readable: what it sent is taken in (never waiting for more); once all of
        it is in, or the loader is gone, ``(key, its _Loading, the PreloadedModel or None)``."""
        key, job = next(((k, x) for k, x in self.loading.items() if x.sock is sock), (None, None))
        if job is None:
            return None
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
        except BlockingIOError:
            return None
        except OSError:
            data, fds = b"", []
        job.fds += fds
        job.received += data
        head = _LOADED_HEADER.size
        if data and (len(job.received) < head or len(job.received) < head + _LOADED_HEADER.unpack_from(job.received)[1]):
            return None
        return self._finish(key, job)

    def overdue(self) -> list:
        """Loaders past ``LOADER_DEADLINE_S``, killed: their results (no model) as ``heard`` gives them."""
        now = time.perf_counter()
        out = []
        for key, job in list(self.loading.items()):
            if now - job.started > LOADER_DEADLINE_S:
                print(f"zygote: the loader of {job.cfg.get('model')} took over {LOADER_DEADLINE_S:.0f} s; killed",
                      file=sys.stderr)
                _kill(job.pid)
                out.append(self._finish(key, job))
        return out

    def _finish(self, key: tuple, job: _Loading):
        del self.loading[key]
        job.sock.close()
        pre, head = None, _LOADED_HEADER.size
        try:
            if job.fds and len(job.received) >= head:
                nbytes, size = _LOADED_HEADER.unpack_from(job.received)
                if len(job.received) == head + size:
                    from sits.engine.llm_engine import PreloadedModel
                    pre = PreloadedModel.attach(job.fds.pop(0), nbytes, bytes(job.received[head:]))
        except Exception as e:  # noqa: BLE001 - a broken hand-over is a failed preload, never a dead zygote
            print(f"zygote: receiving {job.cfg.get('model')} from its loader failed: {e}", file=sys.stderr)
            pre = None
        finally:
            for fd in job.fds:          # any not taken by a region
                os.close(fd)
            job.fds.clear()
        return key, job, pre

    def cancel(self, key: tuple) -> None:
        """Stop building ``key`` (its unit was undeployed)."""
        job = self.loading.pop(key, None)
        if job is not None:
            job.sock.close()
            for fd in job.fds:
                os.close(fd)
            _kill(job.pid)

    def stop(self) -> None:
        for key in list(self.loading):
            self.cancel(key)


class _Zygote:
    """The zygote's loop state: its connection to the gateway, its children, standbys and loaders."""

    def __init__(self, conn: socket.socket, listener: socket.socket):
        self.conn, self.listener = conn, listener
        self.children: set[int] = set()
        self.standbys = _Standbys(self.own_sockets, self.report)
        self.loaders = _Loaders(self.own_sockets)

    def own_sockets(self) -> list[socket.socket]:
        """Every socket (and received descriptor) of the zygote's, closed in each child it forks."""
        return [self.conn, self.listener, *self.standbys.sockets(), *self.loaders.sockets(),
                *self.loaders.pending_fds()]

    def report(self, msg: tuple) -> None:
        send_blocking(self.conn, msg)

    def serve(self, msg: tuple) -> None:
        """One message from the gateway (see the module docstring)."""
        if msg[0] == "preload":
            self.preload(msg[1])
        elif msg[0] == "forget":        # its unit is gone: children that use it keep their copy
            key = _key(msg[1])
            if key is not None:
                self.loaders.cancel(key)
            _forget(msg[1])
        elif msg[0] == "standby":
            self.standbys.set_target(msg[1], msg[2])
        elif msg[0] == "fork":
            # a GPU unit's start takes its host copy if it is in; one still being built is not waited
            # for: the instance reads the checkpoint itself (straight to its device through pinned
            # buffers, faster than the copy's read, merge and copy into shared memory), the copy serves
            # the starts after it (only a preload starts a loader)
            cfg = msg[2]
            self.fork(msg, _MODELS.get(_key(cfg)) if _loads_apart(cfg) else _preloaded(cfg))
        elif msg[0] == "shutdown":
            raise _Shutdown

    def preload(self, cfg: dict) -> None:
        """Build a unit's model ahead of its starts: a CPU unit's here, a GPU unit's by a loader.
        Reported as ``("preloaded", weights_key, ok, ms)`` once built (a loader's: when it is in)."""
        key = _key(cfg)
        if key is None:
            return                      # a config that does not build: its instances report why

        def done(ok: bool, ms: float) -> None:
            self.report(("preloaded", _key_text(key), ok, round(ms, 1)))

        if not _loads_apart(cfg):
            t0 = time.perf_counter()
            done(_preloaded(cfg) is not None, (time.perf_counter() - t0) * 1e3)
        elif key in _MODELS:
            done(True, 0.0)
        elif key not in self.loaders.loading and not self.loaders.start(key, cfg):
            done(False, 0.0)

    def loaded(self, done) -> None:
        """A loader is done (or gone): its model kept for the starts to come."""
        key, job, pre = done
        seconds = time.perf_counter() - job.started
        if pre is not None:
            _keep(key, pre)
            print(f"zygote: preloaded {job.cfg.get('model')} for {key[-1]} in {seconds:.1f} s "
                  f"({pre.host_region.nbytes / 2**20:.0f} MiB)", file=sys.stderr)
        else:
            print(f"zygote: no host copy of {job.cfg.get('model')}: its instances load their own", file=sys.stderr)
        self.report(("preloaded", _key_text(key), pre is not None, round(seconds * 1e3, 1)))

    def fork(self, msg: tuple, pre) -> None:
        """Start an instance: handed to a ready standby of its device that holds what a fork would
        inherit, else forked now. The reply carries the request's ``id``."""
        _, sock_path, cfg, *opts = msg
        opts = opts[0] if opts else {}
        token, child_env, rid = opts.get("token"), opts.get("env") or {}, opts.get("id")
        if not child_env:
            key = _key(cfg) if pre is not None else None
            needs = (key, _BUILT.get(key)) if key is not None else None
            handed = self.standbys.hand_over(_device_key(cfg), sock_path, cfg, token, needs)
            if handed is not None:
                self.children.add(handed[0])
                self.report(("forked", *handed, {"standby": True, "id": rid}))
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
            self.report(("fork_failed", str(e), {"id": rid}))
            return
        if pid == 0:
            os.environ.update(child_env)
            _child(address, cfg, self.own_sockets(), pre, inst_listener, token)
        inst_listener.close()
        self.children.add(pid)
        self.report(("forked", pid, address, {"standby": False, "id": rid}))

    def reap(self) -> None:
        for pid in [*self.children, *self.standbys.pids(), *self.loaders.unreaped]:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if not done:
                continue
            if pid in self.children:
                self.children.discard(pid)
                self.report(("exited", pid, os.waitstatus_to_exitcode(status)))
            elif pid in self.loaders.unreaped:
                self.loaders.unreaped.discard(pid)
            else:
                self.standbys.reaped(pid)

    def run(self) -> int:
        decoder = FrameDecoder()
        while True:
            readable, _, _ = select.select([self.conn, *self.standbys.sockets(), *self.loaders.sockets()], [], [], 0.2)
            models = _models_now()
            for sock in readable:
                if sock in self.loaders.sockets():
                    if (done := self.loaders.heard(sock)) is not None:
                        self.loaded(done)
                elif sock is not self.conn:
                    self.standbys.heard(sock)
            for done in self.loaders.overdue():
                self.loaded(done)
            if self.conn in readable:
                data = self.conn.recv(1 << 16)
                if not data:
                    break                   # the gateway is gone: so are we (children see their own EOF)
                for msg in decoder.feed(data):
                    try:
                        self.serve(msg)
                    except _Shutdown:
                        return 0
            if _models_now() != models:
                self.standbys.renew()       # forked again, to inherit what is preloaded now
            if readable:
                self.standbys.top_up()      # replacements (after any reply: a fork takes time)
            self.reap()
        return 0

    def close(self) -> None:
        self.loaders.stop()


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
    zygote = _Zygote(conn, listener)
    try:
        return zygote.run()
    finally:
        zygote.close()


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
        self._replies: dict[int, asyncio.Future] = {}       # fork requests awaiting their reply, by id
        self._ids = itertools.count()
        self._children: dict[int, ForkedProcess] = {}
        self.standbys: dict[int, str] = {}              # ready standby processes: pid -> device
        self._standby_changed = asyncio.Event()
        # preloaded models, by weights_key: {"ok": bool, "ms": float} once built (or not)
        self.preloads: dict[str, dict] = {}
        self._preloads_changed = asyncio.Event()
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
        """Have the zygote build this model now, so the unit's first fork inherits it (``preloads``
        says when it is done)."""
        self.preloads.pop(weights_key(cfg), None)
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
        return await self._until(lambda: self.ready_standbys(device) >= count, self._standby_changed, timeout_s)

    async def _until(self, ready, changed: asyncio.Event, timeout_s: float) -> bool:
        """Until ``ready()``, checked again whenever ``changed`` is set (False: not within ``timeout_s``,
        or the zygote is gone)."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            changed.clear()
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive:
                return False
            try:
                await asyncio.wait_for(changed.wait(), left)
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
        rid = next(self._ids)
        reply_to = self._replies[rid] = asyncio.get_running_loop().create_future()
        self._writer.write(encode(("fork", sock_path, cfg, {"token": token, "env": env or {}, "id": rid})))
        try:
            reply = await reply_to
        except asyncio.CancelledError:      # cancelled after its reply came: that instance is no one's
            if reply_to.done() and not reply_to.cancelled() and reply_to.result()[0] == "forked":
                _kill(reply_to.result()[1])
            raise
        finally:
            self._replies.pop(rid, None)
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
                elif msg[0] == "preloaded":
                    self.preloads[msg[1]] = {"ok": msg[2], "ms": msg[3]}
                    self._preloads_changed.set()
                elif msg[0] in ("forked", "fork_failed"):
                    self._replied(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self.alive = False
            self.standbys.clear()                   # they die with it (their end of the pair closes)
            self._standby_changed.set()
            self._preloads_changed.set()
            for reply_to in self._replies.values():
                if not reply_to.done():
                    reply_to.set_exception(RuntimeError("the zygote is gone"))
            for child in self._children.values():   # no one reaps them now; report them as unknown
                if child.returncode is None:
                    threading.Thread(target=_reap_orphan, args=(child,), daemon=True).start()

    def _replied(self, msg: tuple) -> None:
        reply_to = self._replies.pop(msg[-1].get("id"), None)
        if reply_to is not None and not reply_to.done():
            reply_to.set_result(msg)
        elif msg[0] == "forked":        # its caller gave up (cancelled): the instance is no one's
            _kill(msg[1])

    def preload_state(self, cfg: dict) -> dict | None:
        """What the zygote said of ``cfg``'s preloaded model (``{"ok", "ms"}``), or None (not yet)."""
        return self.preloads.get(weights_key(cfg))

    async def wait_preloaded(self, cfg: dict, timeout_s: float) -> dict | None:
        """Until the zygote reports ``cfg``'s preloaded model built or failed: ``{"ok", "ms"}``, or None
        (not within ``timeout_s``)."""
        if await self._until(lambda: self.preload_state(cfg) is not None, self._preloads_changed, timeout_s):
            return self.preload_state(cfg)
        return None

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
