"""An instance: one engine in its own process, driven over a Unix socket (or TCP, on a Ray node).

The process is a driver of ``EngineCore``: one thread reads engine messages
(``sits.engine.messages``) from the socket, hands them to the core, steps it, and writes each step's
output back as one frame. Nothing shares its GIL, so a step never waits for an HTTP event
loop and a token never waits for a step. It listens before the model loads, so the front end can
follow the cold start (``hello`` → ``ready`` with the ColdStartReport, or ``fatal``); it exits when
told to or when the front end goes away (EOF). SIGINT is ignored: a Ctrl-C in the terminal reaches
the whole process group, and the front end must drain its streams before this process ends.

Token events leave the moment a step has them; engine stats follow in their own frame. The process
runs at a lower CPU priority than its front end (``SITS_INSTANCE_NICE``, default 10): the front
end's work is short and sits on every token's way to a client, an engine step is long, and when
both want a core (a host with fewer cores than the engine has threads) the short work goes first.
On a host with spare cores it changes nothing.

    python -m sits.runtime.instance_worker --socket PATH --config '{"model": "models/tiny", ...}'
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import time

from sits.runtime.wire import FrameDecoder, send_blocking

STATS_INTERVAL_S = 0.05    # while busy, engine stats follow the events at most this often
PENDING_POLL_S = 0.005     # while an adapter is read off the step thread, how often an idle loop looks
DEFAULT_NICE = 10


def lower_priority() -> None:
    """Step back behind the front end (see the module docstring); 0 leaves the priority as it is."""
    try:
        nice = int(os.environ.get("SITS_INSTANCE_NICE", DEFAULT_NICE))
    except ValueError:
        nice = DEFAULT_NICE
    if nice > 0:
        try:
            os.nice(nice)
        except OSError:
            pass


TOKEN_TIMEOUT_S = 10.0     # a TCP peer that has not sent the token by then is dropped
ACCEPT_TIMEOUT_S = 300.0   # on TCP: no front end with the token by then, and the instance exits


def listen_on(address: str) -> socket.socket:
    """A Unix socket at a path (private: mode 0600), or ``tcp://HOST:PORT`` (port 0: any free one;
    a peer must send the instance's token first, see ``serve_instance``)."""
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), int(port)))
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        os.chmod(address, 0o600)
    listener.listen(4)
    return listener


def bound_address(listener: socket.socket, address: str) -> str:
    """Where a peer reaches ``listener`` (a TCP port 0 resolved to the one bound)."""
    if not address.startswith("tcp://"):
        return address
    host, port = listener.getsockname()[:2]
    return f"tcp://{host}:{port}"


def _accept(listener: socket.socket, token: str | None) -> socket.socket:
    """The front end's connection: on TCP, the first peer that sends ``token`` before anything else
    (nothing it sent is unpickled before that); others are dropped."""
    import hmac
    if token is not None:
        listener.settimeout(ACCEPT_TIMEOUT_S)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            raise ConnectionResetError("no front end connected") from None
        if token is None:
            return conn
        want = token.encode()
        conn.settimeout(TOKEN_TIMEOUT_S)
        got = b""
        try:
            while len(got) < len(want):
                chunk = conn.recv(len(want) - len(got))
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass
        if hmac.compare_digest(got, want):
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
        conn.close()


def serve_instance(cfg_dict: dict, sock_path: str, preloaded=None, listener: socket.socket | None = None,
                   token: str | None = None, start_requested_at: float | None = None) -> int:
    """``preloaded``: a PreloadedModel this process inherited (a zygote fork), used when it fits;
    ``start_requested_at``: when a standby process was handed this start (its age is not the start's);
    ``listener``: the socket already bound at ``sock_path`` (a zygote binds it before forking, so the
    front end can connect the moment the fork is reported); ``token``: what a TCP peer must send first."""
    listener = listener or listen_on(sock_path)
    lower_priority()
    conn = _accept(listener, token)
    listener.close()

    from sits.engine.messages import Fatal, Hello, Ready
    send_blocking(conn, Hello(os.getpid()))
    from sits.engine.config import EngineConfig
    from sits.engine.core import EngineCore
    from sits.engine.errors import SitsError
    from sits.engine.llm_engine import LLMEngine
    try:
        engine = LLMEngine(EngineConfig(**cfg_dict), preloaded=preloaded, start_requested_at=start_requested_at)
    except SitsError as e:
        send_blocking(conn, Fatal(e.code, e.message))
        return 2
    except Exception as e:  # noqa: BLE001 - reported to the front end, then we exit
        send_blocking(conn, Fatal("model_load_failed", f"{type(e).__name__}: {e}"))
        return 2
    send_blocking(conn, Ready(pid=os.getpid(), limits=engine.limits, cold_start=engine.report.to_dict(),
                              inherited_weights=engine.inherited_weights, adapters=engine.adapter_views()))
    core = EngineCore(engine)
    try:
        return _loop(core, conn)
    finally:
        core.close()


def _loop(core, conn: socket.socket) -> int:
    from sits.engine.messages import Shutdown

    decoder = FrameDecoder()
    dirty = True
    last_stats = 0.0
    while True:
        wait = 0 if core.busy or dirty else (PENDING_POLL_S if core.pending else None)
        readable, _, _ = select.select([conn], [], [], wait)
        if readable:
            data = conn.recv(1 << 20)
            if not data:
                return 0                     # the front end is gone
            for msg in decoder.feed(data):
                if isinstance(msg, Shutdown):
                    return 0
                for out in core.handle(msg):
                    send_blocking(conn, out)
                dirty = True
        for out in core.finished_work():
            send_blocking(conn, out)
            dirty = True
        if core.has_unfinished:
            out = core.step()
            if out.events or out.errors:     # tokens first: the stats below are for dashboards
                send_blocking(conn, out)
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S or not core.has_unfinished:
                send_blocking(conn, core.stats())
                last_stats = now
            dirty = True
        elif core.idle_work():
            continue
        elif dirty:
            send_blocking(conn, core.stats())
            last_stats = time.monotonic()
            dirty = False


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--config", required=True, help="EngineConfig as JSON")
    args = ap.parse_args(argv)
    try:
        return serve_instance(json.loads(args.config), args.socket)
    except (BrokenPipeError, ConnectionResetError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
