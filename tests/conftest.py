"""Shared fixtures: a real tiny model directory built once per session (random weights, seeded)."""

from __future__ import annotations

import os

import pytest
import torch

from sits.engine.config import EngineConfig
from sits.engine.llm_engine import LLMEngine
from sits.modelbuild.tiny import build_tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_model(path, preset="tiny", seed=0, progress=None)
    return str(path)


@pytest.fixture
def make_engine(tiny_model_dir):
    """Factory for engines on the tiny model; small KV pool and no warm-up unless asked."""

    def make(**kw) -> LLMEngine:
        kw.setdefault("device", "cpu")
        kw.setdefault("warmup", False)
        kw.setdefault("kv_cache_memory_mb", 32)
        return LLMEngine(EngineConfig(model=tiny_model_dir, **kw))

    return make


def require_cpu_kernel():
    """The C++ CPU kernels' module (``make install`` builds it; compiled here if it was not). A
    machine that cannot build it skips what needs it, unless ``SITS_REQUIRE_CPU_KERNEL=1`` (CI)."""
    from sits.engine.layers import cpu_kernels
    module = cpu_kernels.kernel()
    if module is None:
        why = f"the CPU kernels are not available: {cpu_kernels.kernel_error() or 'turned off'}"
        if os.environ.get("SITS_REQUIRE_CPU_KERNEL") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return module


def greedy_mixed(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy outputs of requests arriving one a step while others decode (steps that mix prefill
    chunks and decodes, and decode-only steps)."""
    from sits.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    seqs = []
    for p in prompts:
        seqs.append(engine.add_request(p, params))
        engine.step()
    while engine.has_unfinished:
        engine.step()
    return [list(s.output_token_ids) for s in seqs]


def dense_greedy(engine: LLMEngine, prompt_ids: list[int], n: int) -> list[int]:
    """Reference decode without any cache: re-run the whole sequence each token."""
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(engine.model.forward_dense(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


# -- HTTP servers (real uvicorn on a free port, in a background thread) --------------------------
import socket  # noqa: E402
import threading  # noqa: E402
import time as _time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import httpx  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    app: object
    server: object
    thread: threading.Thread

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def start_server(asgi_app, *, ready_path: str = "/ready", timeout: float = 120.0, server_cls=None,
                 **server_kw) -> RunningServer:
    import uvicorn
    port = free_port()
    config = uvicorn.Config(asgi_app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=5)
    server = (server_cls or uvicorn.Server)(config, **server_kw)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = _time.monotonic() + timeout
    while _time.monotonic() < deadline:
        try:
            if httpx.get(url + ready_path, timeout=2).status_code == 200:
                return RunningServer(url, asgi_app, server, thread)
        except httpx.HTTPError:
            pass
        if not thread.is_alive():
            raise RuntimeError("the server thread died during start-up")
        _time.sleep(0.05)
    server.should_exit = True
    raise RuntimeError(f"server at {url} not ready after {timeout} s")


@pytest.fixture(scope="module")
def serve_tiny(tiny_model_dir):
    """Factory: start `sits serve`'s app on the tiny model; every server started is stopped at the end."""
    from sits.api.context import ServerSettings
    from sits.api.server import DrainingServer, build_app

    started: list[RunningServer] = []

    def start(settings: ServerSettings | None = None, engine_mode: str = "process", **engine_kw) -> RunningServer:
        engine_kw.setdefault("device", "cpu")
        engine_kw.setdefault("warmup", False)
        engine_kw.setdefault("kv_cache_memory_mb", 32)
        engine_kw.setdefault("max_model_len", 256)
        settings = settings or ServerSettings(drain_grace_s=2.0, webhook_backoff_s=0.05)
        app = build_app(EngineConfig(model=tiny_model_dir, **engine_kw), settings, served_name="tiny",
                        engine_mode=engine_mode)
        srv = start_server(app, server_cls=DrainingServer, app=app, grace_s=settings.drain_grace_s)
        started.append(srv)
        return srv

    yield start
    for s in started:
        s.stop()


import shutil  # noqa: E402
import subprocess  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on loopback: the one `.ci/run` starts (SITS_TEST_REDIS_URL), else our own."""
    if os.environ.get("SITS_TEST_REDIS_URL"):
        yield os.environ["SITS_TEST_REDIS_URL"]
        return
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (`.ci/run` installs Debian's redis-server)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = _time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert _time.monotonic() < deadline, "redis-server did not start"
        _time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)
