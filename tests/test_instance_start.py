"""An instance process that cannot load its model: a typed error for the caller, nothing left over."""

from __future__ import annotations

import asyncio
import gc
import json
import warnings

from sits.engine.config import EngineConfig
from sits.engine.errors import ModelLoadError
from sits.runtime.instance_client import InstanceBackend


def test_a_model_that_cannot_load_is_a_model_load_error_and_leaves_nothing_behind(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))

    unhandled: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
        try:
            await InstanceBackend.spawn(EngineConfig(model=str(tmp_path), device="cpu"), start_timeout_s=120)
        except ModelLoadError as e:
            err = (e.code, e.message)
        else:
            raise AssertionError("the spawn succeeded")
        await asyncio.sleep(0.2)          # the tokenizer thread ends too
        gc.collect()                      # a task whose error nobody read is reported when it is collected
        return err

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        err = asyncio.run(main())
        gc.collect()
    assert err[0] == "model_load_failed" and "failed to start" in err[1]
    assert not unhandled, unhandled
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_an_instance_on_tcp_reads_nothing_before_its_token(tiny_model_dir):
    """A zygote forks an instance listening on TCP (as on a Ray node): a peer that sends anything but
    the token is dropped unread, and the next peer with the token gets the instance's Hello."""
    import asyncio
    import socket
    from dataclasses import asdict

    from sits.engine.config import EngineConfig
    from sits.engine.messages import Hello
    from sits.runtime.wire import FrameDecoder, encode
    from sits.runtime.zygote import ZygoteClient

    async def main() -> None:
        zygote = await ZygoteClient.start()
        try:
            cfg = asdict(EngineConfig(model=tiny_model_dir, device="cpu", warmup=False, kv_cache_memory_mb=8))
            child = await zygote.fork("tcp://127.0.0.1:0", cfg, token="t" * 32)
            host, port = child.address.removeprefix("tcp://").rsplit(":", 1)

            def attempt(first: bytes) -> list:
                with socket.create_connection((host, int(port)), timeout=20) as s:
                    s.sendall(first)
                    try:
                        data = s.recv(1 << 16)
                    except ConnectionResetError:      # dropped with our bytes unread
                        return []
                    return FrameDecoder().feed(data) if data else []

            assert await asyncio.to_thread(attempt, encode(("fork", "/tmp/x", {})) + b"x" * 64) == []
            assert await asyncio.to_thread(attempt, b"u" * 32) == []
            hello = await asyncio.to_thread(attempt, b"t" * 32)
            assert isinstance(hello[0], Hello) and hello[0].pid == child.pid
            child.kill()      # (it may have exited already: its front end went away after the Hello)
            assert isinstance(await asyncio.wait_for(child.wait_async(), 30), int)
        finally:
            await zygote.shutdown()

    asyncio.run(main())
