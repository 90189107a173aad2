"""``sits tenant``, ``sits key`` and ``sits usage``: clients of a running server's tenant API."""

from __future__ import annotations

import argparse
import json
import time

from sits.cli.control import _add_client_args, _control
from sits.engine.errors import SitsError


def _budget(text: str) -> dict:
    """``day:tokens=100000``, ``month:cost=5``, ``total:tokens=1000000,cost=20``."""
    period, _, rest = text.partition(":")
    out: dict = {"period": period}
    try:
        for part in filter(None, rest.split(",")):
            k, _, v = part.partition("=")
            if k not in ("tokens", "cost"):
                raise ValueError(k)
            out[k] = int(float(v)) if k == "tokens" else float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use PERIOD:tokens=N,cost=X with PERIOD day, month or total")
    if period not in ("day", "month", "total") or len(out) == 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use PERIOD:tokens=N,cost=X with PERIOD day, month or total")
    return out


def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpm", type=int, default=None, help="requests per minute")
    p.add_argument("--tpm", type=int, default=None, help="tokens (prompt + completion) per minute")
    p.add_argument("--max-concurrent", type=int, default=None, help="requests in flight at once")
    p.add_argument("--max-queued", type=int, default=None, help="requests waiting for their first token at once")
    p.add_argument("--budget", type=_budget, action="append", default=None,
                   help="PERIOD:tokens=N,cost=X (PERIOD: day, month or total; repeatable)")


def _limits(args: argparse.Namespace) -> dict | None:
    lim = {k: v for k, v in (("requests_per_min", args.rpm), ("tokens_per_min", args.tpm),
                             ("max_concurrent", args.max_concurrent), ("max_queued", args.max_queued)) if v is not None}
    return lim or None


def _show_account(v: dict, indent: str = "  ") -> None:
    if v.get("limits"):
        print(f"{indent}limits: " + ", ".join(f"{k} {n}" for k, n in v["limits"].items()))
    for b in v.get("budgets", []):
        parts = []
        if "tokens" in b:
            parts.append(f"tokens {b['tokens_spent']}/{b['tokens']} spent, {b['tokens_reserved']} reserved")
        if "cost" in b:
            parts.append(f"cost {b['cost_spent']:.6g}/{b['cost']:g} spent, {b['cost_reserved']:.6g} reserved")
        print(f"{indent}budget ({b['period']}): " + "; ".join(parts))
    print(f"{indent}in flight: {v.get('active', 0)} ({v.get('queued', 0)} waiting for a first token)")


def cmd_tenant(args: argparse.Namespace) -> int:
    c = args.tenant_command
    if c in ("create", "update"):
        body: dict = {}
        if (lim := _limits(args)) is not None:
            body["limits"] = lim
        if args.budget is not None:
            body["budgets"] = args.budget
        if args.weight is not None:
            body["weight"] = args.weight
        if c == "create":
            t = _control(args, "POST", "/v1/tenants", {"name": args.name, **body})
        else:
            if not body:
                raise SitsError("nothing to change: give limits, --budget or --weight", code="invalid_parameter")
            t = _control(args, "PATCH", f"/v1/tenants/{args.name}", body)
        print(f"{c}d tenant {t['name']}")
        _show_account(t)
    elif c == "list":
        for t in _control(args, "GET", "/v1/tenants")["data"]:
            print(f"{t['name']:<24} keys {t['keys']:<3} weight {t['weight']:g}")
            _show_account(t, "    ")
    elif c == "show":
        print(json.dumps(_control(args, "GET", f"/v1/tenants/{args.name}"), indent=2))
    elif c == "delete":
        _control(args, "DELETE", f"/v1/tenants/{args.name}")
        print(f"deleted tenant {args.name} (its keys are revoked; its usage records stay)")
    return 0


def cmd_key(args: argparse.Namespace) -> int:
    c = args.key_command
    if c == "create":
        body: dict = {"name": args.name, "role": args.role}
        if args.units:
            body["units"] = [u.strip() for u in args.units.split(",") if u.strip()]
        if (lim := _limits(args)) is not None:
            body["limits"] = lim
        if args.budget is not None:
            body["budgets"] = args.budget
        k = _control(args, "POST", f"/v1/tenants/{args.tenant}/keys", body)
        print(f"key {k['id']} for tenant {k['tenant']} ({k['role']}); it is shown this once:\n{k['key']}")
    elif c == "list":
        path = "/v1/keys" + (f"?tenant={args.tenant}" if args.tenant else "")
        for k in _control(args, "GET", path)["data"]:
            units = ",".join(k["units"]) if k["units"] is not None else "all units"
            print(f"{k['id']}  {k['tenant']:<20} {k['role']:<5} {k['name'] or '-':<16} {units:<24} {k['redacted']}")
    elif c == "rotate":
        k = _control(args, "POST", f"/v1/keys/{args.id}/rotate")
        print(f"key {k['id']} rotated; the old secret no longer works. The new key, shown this once:\n{k['key']}")
    elif c == "revoke":
        _control(args, "DELETE", f"/v1/keys/{args.id}")
        print(f"revoked key {args.id}")
    return 0


def cmd_usage(args: argparse.Namespace) -> int:
    q = {"group_by": args.group_by}
    for k, v in (("tenant", args.tenant), ("key_id", args.key), ("unit", args.unit)):
        if v:
            q[k] = v
    if args.since_h is not None:
        q["start"] = str(time.time() - args.since_h * 3600)
    path = "/v1/usage?" + "&".join(f"{k}={v}" for k, v in q.items())
    rows = _control(args, "GET", path)["data"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    groups = [g for g in args.group_by.split(",") if g]
    print("  ".join(f"{g:<16}" for g in groups) + f"{'requests':>9} {'prompt':>9} {'cached':>8} {'completion':>10} "
          f"{'PFLOP':>10} {'KV blk-s':>9} {'GB-h':>9} {'colds':>5} {'cost':>10}")
    for r in rows:
        print("  ".join(f"{str(r[g]):<16}" for g in groups) + f"{r['requests']:>9} {r['prompt_tokens']:>9} "
              f"{r['cached_tokens']:>8} {r['completion_tokens']:>10} {r['flops'] / 1e15:>10.4f} "
              f"{r['kv_block_seconds']:>9.1f} {r['gb_hours']:>9.5f} {r['cold_starts']:>5} {r['cost']:>10.4f}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    ten = sub.add_parser("tenant", help="tenants of a running server: limits and budgets").add_subparsers(
        dest="tenant_command", required=True)
    for name, text in (("create", "create a tenant"), ("update", "change a tenant's limits, budgets or weight")):
        p = ten.add_parser(name, help=text)
        p.add_argument("name", help="the tenant: lowercase letters, digits, '.', '_', '-'")
        _limit_args(p)
        p.add_argument("--weight", type=float, default=None, help="its share when tenants compete (default 1)")
    ten.add_parser("list", help="tenants, their limits and what they spent")
    for name, text in (("show", "one tenant as JSON"), ("delete", "delete a tenant and revoke its keys")):
        ten.add_parser(name, help=text).add_argument("name", help="the tenant")
    for p in ten.choices.values():
        _add_client_args(p)
        p.set_defaults(func=cmd_tenant)

    key = sub.add_parser("key", help="API keys of a running server's tenants").add_subparsers(
        dest="key_command", required=True)
    p = key.add_parser("create", help="a new key for a tenant (printed once)")
    p.add_argument("tenant", help="the tenant it belongs to")
    p.add_argument("--name", default="", help="a label for people")
    p.add_argument("--role", choices=("user", "admin"), default="user",
                   help="admin: the control API, tenants, keys and everyone's usage")
    p.add_argument("--units", default=None, help="comma-separated units/models it may call (default: all)")
    _limit_args(p)
    key.add_parser("list", help="keys (redacted)").add_argument("--tenant", default=None, help="only this tenant's")
    for name, text in (("rotate", "a new secret under the same id (the old stops working)"),
                       ("revoke", "the key stops working at once")):
        key.add_parser(name, help=text).add_argument("id", help="the key's id (sits_<id>_...)")
    for p in key.choices.values():
        _add_client_args(p)
        p.set_defaults(func=cmd_key)

    use = sub.add_parser("usage", help="tokens, FLOPs, KV block-seconds, instance GB-hours, cold starts and cost, per tenant/key/unit")
    use.add_argument("--tenant", default=None, help="only this tenant")
    use.add_argument("--key", default=None, help="only this key id")
    use.add_argument("--unit", default=None, help="only this unit")
    use.add_argument("--since-h", type=float, default=None, help="only the last this many hours")
    use.add_argument("--group-by", default="tenant,unit", help="comma-separated: tenant, key_id, unit, request_id")
    use.add_argument("--json", action="store_true", help="print the rows as JSON")
    _add_client_args(use)
    use.set_defaults(func=cmd_usage)
