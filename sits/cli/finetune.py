"""``sits finetune``: train a LoRA adapter on a dataset folder (a ``kind: finetune`` YAML, or flags),
resuming from the job folder's snapshot when there is one, then optionally hot-load it into a unit."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _spec(args: argparse.Namespace):
    import yaml

    from sits.finetune.spec import FinetuneSpec
    data: dict = {}
    if args.config:
        path = Path(args.config)
        data = yaml.safe_load(path.read_text()) or {}
        if data.pop("kind", "finetune") != "finetune":
            raise SystemExit(f"{path}: kind must be finetune")
        for key in ("model", "dataset"):           # relative to the YAML, as a unit's paths are
            if key in data and not os.path.isabs(os.path.expanduser(str(data[key]))):
                data[key] = str((path.parent / data[key]).resolve())
    flags = {"name": args.name, "model": args.model, "dataset": args.data, "rank": args.rank, "alpha": args.alpha,
             "targets": args.targets.split(",") if args.targets else None, "steps": args.steps,
             "learning_rate": args.lr, "batch_size": args.batch_size, "max_len": args.max_len, "seed": args.seed,
             "snapshot_every": args.snapshot_every, "device": args.device, "serve_into": args.serve_into}
    data |= {k: v for k, v in flags.items() if v is not None}
    try:
        return FinetuneSpec.model_validate(data)
    except Exception as e:      # noqa: BLE001 - pydantic's message names the field
        raise SystemExit(f"sits finetune: {e}") from None


def _submit(args: argparse.Namespace, spec) -> int:
    """The job to the gateway (POST /v1/finetune/jobs), its events followed until it ends."""
    import httpx

    from sits.cli.control import _gateway_url
    url = _gateway_url(args)
    key = os.environ.get("SITS_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    r = httpx.post(f"{url}/v1/finetune/jobs", json=spec.model_dump(), headers=headers, timeout=60)
    if r.status_code >= 400:
        print(f"sits finetune: {r.json().get('error', {}).get('message', r.text)}", file=sys.stderr)
        return 1
    last = {}
    with httpx.stream("GET", f"{url}/v1/finetune/jobs/{spec.name}/events", headers=headers, timeout=None) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[len("data: "):])
                print(json.dumps(last), file=sys.stderr)
    print(json.dumps(httpx.get(f"{url}/v1/finetune/jobs/{spec.name}", headers=headers, timeout=60).json()))
    return 0 if last.get("state") in ("done", "served") else 1


def cmd_finetune(args: argparse.Namespace) -> int:
    from sits.finetune.supervisor import run_supervised
    from sits.finetune.trainer import FinetuneJob
    spec = _spec(args)
    if args.submit:
        return _submit(args, spec)
    folder = Path(args.out) if args.out else Path(args.data_dir) / "finetune" / spec.name
    print(f"fine-tuning {spec.name}: {spec.steps} steps, rank {spec.rank}, job folder {folder}", file=sys.stderr)
    if hasattr(os, "fork"):      # attempts forked from a warm process: a dead one restarts from its snapshot
        if run_supervised(spec, folder, max_restarts=args.max_restarts, progress=True) != 0:
            print(f"fine-tuning {spec.name} failed; see {folder / 'events.jsonl'}", file=sys.stderr)
            return 1
    else:
        FinetuneJob(spec, folder).run(progress=True)
    done = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()][-1]
    adapter = Path(done["adapter"])
    print(json.dumps({"adapter": str(adapter), "steps": done["step"], "loss": done["loss"],
                      "loss_plot": str(folder / "loss.svg"), "events": str(folder / "events.jsonl")}))
    if spec.serve_into:
        import httpx

        from sits.cli.control import _gateway_url
        url = _gateway_url(args)
        key = os.environ.get("SITS_API_KEY")
        r = httpx.post(f"{url}/v1/units/{spec.serve_into}/adapters/{spec.name}", json={"path": str(adapter.resolve())},
                       headers={"authorization": f"Bearer {key}"} if key else {}, timeout=120)
        if r.status_code >= 400:
            print(f"the adapter is trained but {spec.serve_into} refused it: {r.text}", file=sys.stderr)
            return 1
        print(f"serving as model {spec.serve_into}:{spec.name}", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("finetune", help="train a LoRA adapter (resumes from its snapshot), optionally serve it")
    p.add_argument("--config", default=None, help="a YAML job (kind: finetune); flags override its fields")
    p.add_argument("--name", default=None, help="the job and its adapter's name")
    p.add_argument("--model", default=None, help="the base model (HF folder or .gguf)")
    p.add_argument("--data", default=None, help="a folder of *.jsonl: chats ({\"messages\": ...}) or texts")
    p.add_argument("--rank", type=int, default=None, help="the adapter's rank (default 8)")
    p.add_argument("--alpha", type=float, default=None, help="LoRA alpha: the update is scaled by alpha / rank (default 16)")
    p.add_argument("--targets", default=None, help="comma-separated, e.g. q_proj,k_proj,v_proj,o_proj")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100)")
    p.add_argument("--lr", type=float, default=None, help="learning rate")
    p.add_argument("--batch-size", type=int, default=None, help="examples per step (default 4)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per example at most")
    p.add_argument("--seed", type=int, default=None, help="the adapter's init and the data order (default 0)")
    p.add_argument("--snapshot-every", type=int, default=None, help="steps between snapshots")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto")
    p.add_argument("--out", default=None, help="the job folder (default: <data-dir>/finetune/<name>)")
    p.add_argument("--data-dir", default=os.environ.get("SITS_DATA_DIR", ".sits"),
                   help="where job folders go (default: $SITS_DATA_DIR, else .sits)")
    p.add_argument("--submit", action="store_true",
                   help="run the job on the gateway at --url (POST /v1/finetune/jobs) and follow its events")
    p.add_argument("--max-restarts", type=int, default=3, help="attempts restarted from the snapshot at most")
    p.add_argument("--serve-into", default=None, metavar="UNIT", help="hot-load the adapter into this unit when done")
    p.add_argument("--url", default=None, help="the gateway serving that unit (default: $SITS_URL or localhost:8000)")
    p.set_defaults(func=cmd_finetune)
