"""LoRA fine-tuning: the loss falls, a job stopped and started again continues the uninterrupted loss
curve from its snapshot, and the adapter it writes is one PEFT and SITS serve alike."""

from __future__ import annotations

import json

import pytest
import torch

from sits.engine.config import EngineConfig
from sits.engine.errors import InvalidRequestError
from sits.engine.llm_engine import LLMEngine
from sits.engine.sampling_params import SamplingParams
from sits.finetune.spec import FinetuneSpec
from sits.finetune.trainer import SNAPSHOT, FinetuneJob


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Chats that answer a colour with its fruit, and a few texts."""
    path = tmp_path_factory.mktemp("data")
    pairs = [("red", "apple"), ("yellow", "banana"), ("green", "lime"), ("orange", "orange"), ("purple", "grape")]
    with open(path / "a_chat.jsonl", "w") as f:
        for colour, fruit in pairs * 2:
            f.write(json.dumps({"messages": [{"role": "user", "content": f"colour {colour}"},
                                             {"role": "assistant", "content": f"fruit {fruit}"}]}) + "\n")
    with open(path / "b_text.jsonl", "w") as f:
        for colour, fruit in pairs:
            f.write(json.dumps({"text": f"the {colour} fruit is the {fruit}"}) + "\n")
    return path


def _spec(model: str, dataset, **kw) -> FinetuneSpec:
    return FinetuneSpec(**({"name": "fruit", "model": model, "dataset": str(dataset), "rank": 4, "alpha": 8,
                            "targets": ["q_proj", "v_proj", "down_proj"], "steps": 12, "batch_size": 4,
                            "learning_rate": 5e-3, "snapshot_every": 4, "seed": 3} | kw))


def test_a_stopped_job_resumes_its_loss_curve_exactly(tiny_model_dir, dataset, tmp_path):
    whole = FinetuneJob(_spec(tiny_model_dir, dataset), tmp_path / "whole")
    whole.run()
    assert whole.losses[-1] < whole.losses[0]                     # it learns
    states = [json.loads(l)["state"] for l in (tmp_path / "whole" / "events.jsonl").read_text().splitlines()]
    assert states == ["queued", "running", "checkpointed", "checkpointed", "checkpointed", "done"]
    assert (tmp_path / "whole" / "loss.svg").read_text().startswith("<svg")

    first = FinetuneJob(_spec(tiny_model_dir, dataset), tmp_path / "cut")
    first.run(stop_after=6)                # pre-empted after step 6: its last snapshot is step 4's
    assert first.step == 6 and (tmp_path / "cut" / SNAPSHOT).exists()
    again = FinetuneJob(_spec(tiny_model_dir, dataset), tmp_path / "cut")
    again.run()
    assert again.resumed and again.step == 12
    assert torch.allclose(torch.tensor(again.losses), torch.tensor(whole.losses), atol=1e-6)
    a = (tmp_path / "whole" / "adapter" / "adapter_model.safetensors").read_bytes()
    assert a == (tmp_path / "cut" / "adapter" / "adapter_model.safetensors").read_bytes()


def test_the_trained_adapter_is_served_as_peft_computes_it(tiny_model_dir, dataset, tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    adapter = FinetuneJob(_spec(tiny_model_dir, dataset, steps=6), tmp_path / "job").run()
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    ref_model = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, device="cpu", dtype="float32", warmup=False,
                                 kv_cache_memory_mb=16, lora_adapters=(("fruit", str(adapter)),)))
    tok = eng.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "colour red"}]))
    seq = eng.add(eng.make_request(prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                          logprobs=0), lora="fruit"))
    logprobs = []
    while eng.has_unfinished:
        logprobs += [ev.logprob for ev in eng.step()]
    tokens = list(seq.output_token_ids)
    with torch.inference_mode():
        ref = torch.log_softmax(ref_model(input_ids=torch.tensor([prompt + tokens])).logits[0].float(), -1)
    steps = ref[len(prompt) - 1:-1]
    assert tokens == steps.argmax(-1).tolist()
    want = steps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (torch.tensor(logprobs) - want).abs().max().item() <= 1e-4


def test_bad_jobs_are_refused_before_training(tiny_model_dir, dataset, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequestError, match="no \\*.jsonl"):
        FinetuneJob(_spec(tiny_model_dir, tmp_path / "empty"), tmp_path / "j1").run()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"neither": 1}\n')
    with pytest.raises(InvalidRequestError, match="x.jsonl:1"):
        FinetuneJob(_spec(tiny_model_dir, tmp_path / "bad"), tmp_path / "j2").run()
    assert json.loads((tmp_path / "j2" / "events.jsonl").read_text().splitlines()[-1])["code"] == "invalid_dataset"
    with pytest.raises(ValueError, match="targets"):
        _spec(tiny_model_dir, dataset, targets=["lm_head"])
    FinetuneJob(_spec(tiny_model_dir, dataset, steps=4), tmp_path / "j3").run()
    with pytest.raises(Exception, match="another job"):
        FinetuneJob(_spec(tiny_model_dir, dataset, rank=8), tmp_path / "j3").run()


def test_sits_finetune_trains_from_a_yaml_job_and_hot_loads_the_adapter(tiny_model_dir, dataset, tmp_path):
    """`sits finetune --config job.yaml` (kind: finetune) against a running gateway: the adapter it
    trains is served by the unit its spec names as soon as the job is done."""
    import httpx
    import yaml

    import subprocess
    import sys
    from test_gateway import start_gateway, unit
    spec = unit("chat", tiny_model_dir).model_copy(deep=True)
    spec.resources.lora = True
    srv, gw = start_gateway(tmp_path / "data", [spec])
    try:
        job = {"kind": "finetune", "name": "fruit", "model": tiny_model_dir, "dataset": str(dataset), "rank": 4,
               "alpha": 8, "steps": 4, "batch_size": 2, "learning_rate": 1e-2, "snapshot_every": 2,
               "serve_into": "chat"}
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        # its own process, as an operator runs it (it forks its attempts: not from this test's threads)
        run = subprocess.run([sys.executable, "-m", "sits.cli", "finetune", "--config", str(tmp_path / "job.yaml"),
                              "--out", str(tmp_path / "job"), "--url", srv.url], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        out = json.loads(run.stdout.strip().splitlines()[-1])
        assert out["steps"] == 4 and out["adapter"].endswith("adapter")
        r = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                       json={"model": "chat:fruit", "prompt": "colour red", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert "chat:fruit" in [m["id"] for m in httpx.get(f"{srv.url}/v1/models").json()["data"]]
    finally:
        srv.stop()


def test_a_crashed_attempt_restarts_from_its_snapshot_with_the_same_loss_curve(tiny_model_dir, dataset, tmp_path):
    """Attempts forked from a warm supervisor: the first dies after 6 steps (its last snapshot is step
    4's); the restart resumes there and the finished job's loss curve is the uninterrupted one."""
    import subprocess
    import sys
    whole = FinetuneJob(_spec(tiny_model_dir, dataset), tmp_path / "whole")
    whole.run()
    (tmp_path / "spec.json").write_text(_spec(tiny_model_dir, dataset).model_dump_json())
    run = subprocess.run([sys.executable, "-m", "sits.finetune.supervisor", str(tmp_path / "spec.json"),
                          str(tmp_path / "crashy"), "--exit-first-after", "6"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    events = [json.loads(l) for l in (tmp_path / "crashy" / "events.jsonl").read_text().splitlines()]
    assert [e["state"] for e in events if e["state"] in ("running", "stopped", "done")] == \
        ["running", "stopped", "running", "done"]
    assert [e["resumed"] for e in events if e["state"] == "running"] == [False, True]
    losses = torch.load(tmp_path / "crashy" / SNAPSHOT, weights_only=False)["losses"]
    assert torch.allclose(torch.tensor(losses), torch.tensor(whole.losses), atol=1e-6)


@pytest.mark.slow
def test_the_restart_benchmark_runs(tiny_model_dir, tmp_path):
    from sits.bench.finetune_bench import CASES, run_finetune_bench
    r = run_finetune_bench(tiny_model_dir, rounds=1, steps_before=2, docs_out=str(tmp_path / "b.md"))
    assert set(r["seconds"]) == set(CASES) and all(v > 0 for v in r["seconds"].values())
    assert r["forked_vs_cold"] < 1.0 and "sits bench finetune" in (tmp_path / "b.md").read_text()


def test_a_finetune_job_on_the_gateway_trains_reports_and_serves(tiny_model_dir, dataset, tmp_path):
    """POST /v1/finetune/jobs (a kind: finetune spec) on `sits up`'s gateway: its events stream as SSE
    until it is served, and the unit it names serves the adapter; a bad spec is a 400."""
    import httpx

    from test_gateway import start_gateway, unit
    spec = unit("chat", tiny_model_dir).model_copy(deep=True)
    spec.resources.lora = True
    srv, gw = start_gateway(tmp_path / "data", [spec])
    url = srv.url
    try:
        job = {"kind": "finetune", "name": "fruit", "model": tiny_model_dir, "dataset": str(dataset), "rank": 4,
               "alpha": 8, "steps": 4, "batch_size": 2, "learning_rate": 1e-2, "snapshot_every": 2,
               "serve_into": "chat"}
        r = httpx.post(f"{url}/v1/finetune/jobs", json=job)
        assert r.status_code == 201 and r.json()["state"] == "queued", r.text
        again = httpx.post(f"{url}/v1/finetune/jobs", json=job)
        assert again.status_code == 409 and again.json()["error"]["code"] == "job_active"
        states = []
        with httpx.stream("GET", f"{url}/v1/finetune/jobs/fruit/events", timeout=300) as s:
            for line in s.iter_lines():
                if line.startswith("event: "):
                    states.append(line[len("event: "):])
        assert states[0] == "queued" and states[-1] == "served", states
        assert "running" in states and states.count("checkpointed") == 2 and "done" in states
        view = httpx.get(f"{url}/v1/finetune/jobs/fruit").json()
        assert view["state"] == "served" and view["step"] == 4 and view["loss"] is not None
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "chat:fruit", "prompt": "colour red", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        # the same through the CLI: submitted, followed, served under a second name
        import subprocess
        import sys
        import yaml
        (tmp_path / "job.yaml").write_text(yaml.safe_dump({**job, "name": "fruit2"}))
        run = subprocess.run([sys.executable, "-m", "sits.cli", "finetune", "--config", str(tmp_path / "job.yaml"),
                              "--submit", "--url", url], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        assert json.loads(run.stdout.strip().splitlines()[-1])["state"] == "served"
        bad = httpx.post(f"{url}/v1/finetune/jobs", json={**job, "name": "x", "targets": ["lm_head"]})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_job"
        assert httpx.get(f"{url}/v1/finetune/jobs/nope").status_code == 404
    finally:
        srv.stop()


def test_a_running_finetune_job_is_cancelled(tiny_model_dir, dataset, tmp_path):
    import os

    import httpx

    from test_gateway import start_gateway, wait_for
    srv, gw = start_gateway(tmp_path / "data", [])
    url = srv.url
    try:
        job = {"name": "long", "model": tiny_model_dir, "dataset": str(dataset), "steps": 100000, "batch_size": 2,
               "snapshot_every": 1}
        assert httpx.post(f"{url}/v1/finetune/jobs", json=job).status_code == 201
        wait_for(lambda: httpx.get(f"{url}/v1/finetune/jobs/long").json()["step"] >= 1, timeout=120,
                 what="the job to train a step")
        assert httpx.delete(f"{url}/v1/finetune/jobs/long").json()["state"] == "cancelled"
        proc = gw.finetune.jobs["long"].proc
        wait_for(lambda: proc.returncode is not None, timeout=30, what="the job's process to end")
        attempt = int((tmp_path / "data" / "finetune" / "long" / "attempt.pid").read_text())

        def gone() -> bool:
            try:
                os.kill(attempt, 0)
            except ProcessLookupError:
                return True
            return open(f"/proc/{attempt}/stat").read().split()[2] == "Z"     # exited, not yet reaped
        wait_for(gone, timeout=30, what="the job's training attempt to end with it")
        listed = httpx.get(f"{url}/v1/finetune/jobs").json()["data"]
        assert [j["state"] for j in listed] == ["cancelled"]
    finally:
        srv.stop()


def test_a_chat_template_that_renders_turns_differently_still_masks_only_the_answer(tiny_model_dir):
    """Where rendering the conversation with its answer changes tokens before it, the loss starts where
    the two renderings part (not where the shorter one ends)."""
    from sits.engine.tokenizer import Tokenizer
    from sits.finetune.data import _example
    tok = Tokenizer.from_dir(tiny_model_dir)
    row = {"messages": [{"role": "user", "content": "colour red"}, {"role": "assistant", "content": "fruit apple"}]}
    ex = _example(row, tok, 512)
    context = tok.encode(tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True))
    assert ex.ids[:ex.first_target] == context and ex.first_target == len(context)
    assert tok.decode(ex.ids[ex.first_target:]).strip().startswith("fruit apple")


def test_a_job_that_cannot_succeed_is_not_restarted(tiny_model_dir, dataset, tmp_path):
    """A bad dataset (found before any attempt) and a snapshot of another spec (found by the attempt):
    each is one failed event with its code, not max_restarts tries."""
    import subprocess
    import sys
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.jsonl").write_text('{"neither": 1}\n')

    def supervise(spec, folder) -> list[dict]:
        (tmp_path / "spec.json").write_text(spec.model_dump_json())
        run = subprocess.run([sys.executable, "-m", "sits.finetune.supervisor", str(tmp_path / "spec.json"),
                              str(folder)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 2, run.stderr[-2000:]
        return [json.loads(l) for l in (folder / "events.jsonl").read_text().splitlines()]

    events = supervise(_spec(tiny_model_dir, tmp_path / "bad"), tmp_path / "j1")
    assert [e["state"] for e in events] == ["failed"] and events[0]["code"] == "invalid_dataset"
    FinetuneJob(_spec(tiny_model_dir, dataset, steps=2, snapshot_every=1), tmp_path / "j2").run()
    events = supervise(_spec(tiny_model_dir, dataset, rank=8), tmp_path / "j2")
    assert [e["state"] for e in events].count("failed") == 1
