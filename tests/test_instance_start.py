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
