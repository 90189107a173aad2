"""``sits iu`` and ``sits status``: clients of a running gateway's control API."""

from __future__ import annotations

import argparse
import json
import os

from sits.engine.errors import SitsError

DEFAULT_URL = "http://127.0.0.1:8000"


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help=f"the SITS gateway (default: $SITS_URL, else {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="Bearer key (default: $SITS_API_KEY, else none)")
    p.add_argument("--timeout", type=float, default=600.0, help="how long to wait for the gateway's answer, seconds")


def _gateway_url(args: argparse.Namespace) -> str:
    """--url, else $SITS_URL as it is when the command runs, else the default."""
    return args.url or os.environ.get("SITS_URL") or DEFAULT_URL


def _control(args: argparse.Namespace, method: str, path: str, body=None):
    import httpx
    url = _gateway_url(args)
    key = args.api_key or os.environ.get("SITS_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.request(method, url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise SitsError(f"cannot reach the SITS gateway at {url} (set --url or SITS_URL): {e}",
                        code="gateway_unreachable") from None
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        err = data.get("error") or {}
        raise SitsError(err.get("message") or f"HTTP {r.status_code}", code=err.get("code") or "http_error")
    return data


def _instances_summary(u: dict) -> str:
    if u.get("kind") in ("remote", "mesh"):
        return f"{u['kind']}, {u['inflight']} in flight"
    counts: dict[str, int] = {}
    for i in u["instances"]:
        counts[i["state"]] = counts.get(i["state"], 0) + 1
    return ", ".join(f"{n} {st}" for st, n in counts.items()) or "0"


def cmd_iu(args: argparse.Namespace) -> int:
    if args.iu_command == "deploy":
        from sits.runtime.unit_spec import load_unit_file   # imports torch (via the engine config)
        spec = load_unit_file(args.file)
        u = _control(args, "POST", "/v1/units", spec.model_dump())
        print(f"deployed {u['name']} ({u['model']}); instances: {_instances_summary(u)}, desired {u['desired']}")
    elif args.iu_command == "list":
        for u in _control(args, "GET", "/v1/units")["data"]:
            sc = u["spec"]["scale"]
            print(f"{u['name']:<20} instances {_instances_summary(u):<20} desired {u['desired']} "
                  f"(min {sc['min_instances']}, max {sc['max_instances']})  model {u['model']}"
                  + (f" at {u['backend']['openai']}" if u.get("kind") == "remote" else ""))
    elif args.iu_command == "export":
        return _export(args)
    elif args.iu_command == "delete":
        _control(args, "DELETE", f"/v1/units/{args.name}")
        print(f"deleted {args.name}")
    elif args.iu_command == "scale":
        u = _control(args, "POST", f"/v1/units/{args.name}/scale", {"instances": args.instances})
        print(f"{u['name']}: desired {u['desired']}; instances: {_instances_summary(u)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    """A unit (from its YAML file, or the gateway's deployed spec) as a Knative / KServe resource."""
    import yaml

    from sits.runtime.k8s_export import ExportOptions, export_unit
    from sits.runtime.unit_spec import UnitSpec, load_unit_file
    if (args.file is None) == (args.name is None):
        raise SystemExit("sits iu export: name a deployed unit or give --file (one of them)")
    spec = load_unit_file(args.file) if args.file else \
        UnitSpec.model_validate(_control(args, "GET", f"/v1/units/{args.name}")["spec"])
    out = export_unit(spec, args.format, ExportOptions(
        image=args.image, namespace=args.namespace, model_path=args.model_path, pvc=args.pvc,
        storage_uri=args.storage_uri, concurrency_target=args.concurrency_target))
    text = "".join(f"# note: {n}\n" for n in out.notes)
    text += yaml.safe_dump(out.manifest, sort_keys=False)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {args.output} ({out.manifest['kind']} {spec.name})")
    else:
        print(text, end="")
    return 0


def _fmt(v, spec: str = ".0f", unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def cmd_status(args: argparse.Namespace) -> int:
    st = _control(args, "GET", "/v1/status")
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(f"{'unit':<16} {'desired':>7}  {'instances':<22} {'waiting':>7} {'ttft p95':>9} {'itl p95':>8} "
          f"{'rps':>6} {'health':>6}  cold start  last decision")
    for u in st["units"]:
        m, d = u["metrics"], u["last_decision"] or {}
        cold = u["cold_start"].get("total_ms")
        print(f"{u['name']:<16} {u['desired']:>7}  {_instances_summary(u):<22} {u['waiting']:>7} "
              f"{_fmt(m['ttft_p95_ms'], '.0f', 'ms'):>9} {_fmt(m['itl_p95_ms'], '.0f', 'ms'):>8} {m['rps']:>6.2f} "
              f"{_fmt(u['slo_health'], '.2f'):>6}  {_fmt(cold, '.0f', ' ms'):>10}  {d.get('reason', '-')}")
        phases = u["cold_start"].get("phases_ms") or {}
        if phases:
            print("    last cold start: " + ", ".join(f"{k} {v:.0f}ms" for k, v in phases.items()))
        by_node: dict[str, dict[str, int]] = {}
        for i in u["instances"]:
            if i.get("node"):
                states = by_node.setdefault(i["node"], {})
                states[i["state"]] = states.get(i["state"], 0) + 1
        for node, states in sorted(by_node.items()):
            print(f"    node {node}: " + ", ".join(f"{n} {st}" for st, n in states.items()))
        quotas = {i["cpu_quota"]["mechanism"] + (f" {i['cpu_quota']['cpus']:g} cpu" if i["cpu_quota"]["cpus"] else "")
                  for i in u["instances"] if i.get("cpu_quota")}
        if quotas:
            print("    cpu quota: " + ", ".join(sorted(quotas)))
        if (h := u.get("host_copy")) and h["state"] != "ready":     # worth a line while it is not there yet
            print(f"    weights preloaded by the zygote: {h['state']}"
                  + (" (its instances load their own)" if h["state"] == "failed" else ""))
        if u.get("device_memory_mb") is not None:
            print(f"    device memory: {u['device_memory_mb']:.0f} MiB held by its instances")
        if (f := u.get("start_failure")):
            print(f"    FAILING TO START ({f['failures_in_a_row']} in a row, next try in {f['retry_in_s']:.1f}s): "
                  f"{f['error']}")
    if st.get("nodes"):
        print()
        print("Ray nodes: " + ", ".join(f"{n['node_id']} ({n['ip']})" for n in st["nodes"]))
    if st.get("memory"):
        m = st["memory"]
        print()
        print(f"memory: {m['reserved_mb']:.0f} of {m['capacity_mb']:.0f} MiB held by instances ("
              + (", ".join(f"{u} {mb:.0f}" for u, mb in m["by_unit_mb"].items()) or "none") + ")")
    for device, sb in (st.get("standby") or {}).items():
        print(f"standby processes for {device}: {sb['ready']} of {sb['target']} ready")
    for device, m in (st.get("device_memory") or {}).items():
        print(f"{device} memory: {m['reserved_mb']:.0f} of {m['capacity_mb']:.0f} MiB reserved ("
              + (", ".join(f"{u} {mb:.0f}" for u, mb in m["by_unit_mb"].items()) or "none") + ")")
    print()
    print(f"{'SLA':<16} {'ttft slo':>9} {'target':>7} {'attained':>9} {'in window':>9}  {'breaker':<9} {'trips':>5} "
          f"{'shed':>5}  fallback")
    for u in st["units"]:
        s = u.get("sla") or {}
        if not s:
            continue
        print(f"{u['name']:<16} {_fmt(s['ttft_slo_ms'], '.0f', 'ms'):>9} {s['success_rate_target']:>7.2f} "
              f"{_fmt(s['attainment'], '.2f'):>9} {s['requests_in_window']:>9}  {s['state']:<9} {s['trips']:>5} "
              f"{s['rejected']:>5}  {s.get('fallback') or '-'}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    iu = sub.add_parser("iu", help="manage the units of a running gateway").add_subparsers(dest="iu_command",
                                                                                         required=True)
    dep = iu.add_parser("deploy", help="deploy (or replace) a unit from its YAML file")
    dep.add_argument("--file", required=True, help="the unit's YAML file")
    iu.add_parser("list", help="deployed units and their instances")
    de = iu.add_parser("delete", help="delete a unit (its instances drain and stop)")
    de.add_argument("name", help="the unit")
    scl = iu.add_parser("scale", help="set a unit's instance count now (the autoscaler carries on from there)")
    scl.add_argument("name", help="the unit")
    scl.add_argument("instances", type=int, help="instances wanted now")
    exp = iu.add_parser("export", help="write a unit as a Knative Service or KServe InferenceService running "
                                       "`sits serve` (scale-to-zero from its scale block, resources from its resources)")
    exp.add_argument("name", nargs="?", help="a deployed unit (read from the gateway)")
    exp.add_argument("--file", help="the unit's YAML file instead of a deployed unit")
    exp.add_argument("--format", choices=["knative", "kserve"], required=True,
                     help="knative: a Knative Service; kserve: a KServe InferenceService (serverless mode)")
    exp.add_argument("--image", default="sits:latest", help="a container image with SITS installed (default: %(default)s)")
    exp.add_argument("--namespace", default=None, help="the resource's namespace (default: none, kubectl's current)")
    exp.add_argument("--model-path", default=None,
                     help="the model inside the container (default: /models/<folder name>, /mnt/models with --storage-uri)")
    exp.add_argument("--pvc", default=None, help="a PersistentVolumeClaim holding the models, mounted at /models")
    exp.add_argument("--storage-uri", default=None, help="kserve: the model's URI for KServe's storage initializer")
    exp.add_argument("--concurrency-target", type=int, default=8,
                     help="in-flight requests per replica before Knative adds one (default: %(default)s)")
    exp.add_argument("-o", "--output", default=None, help="write here instead of stdout")
    for p in iu.choices.values():
        _add_client_args(p)
        p.set_defaults(func=cmd_iu)
    stp = sub.add_parser("status", help="units, instances, SLO health, cold starts and scaling decisions")
    stp.add_argument("--json", action="store_true", help="print the gateway's /v1/status JSON instead of tables")
    _add_client_args(stp)
    stp.set_defaults(func=cmd_status)
