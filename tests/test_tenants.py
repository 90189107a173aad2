"""Tenants end to end over HTTP: keys (hashed, shown once, rotated, revoked), scopes, the control
API closed to user keys, limits and budgets as typed 429s, usage per request and in /v1/usage."""

from __future__ import annotations

import asyncio
import csv
import json
import io
import random
import time

import httpx
import openai
import pytest

from sits.api.context import ServerSettings
from test_gateway import wait_for


@pytest.fixture(scope="module")
def server(serve_tiny, tmp_path_factory):
    return serve_tiny(ServerSettings(drain_grace_s=0.5, data_dir=str(tmp_path_factory.mktemp("tenants"))),
                      engine_mode="thread")


_ADMIN_KEYS: dict[str, str] = {}


def _admin(url: str) -> str:
    """The first admin key of a server: created while it has no keys (the bootstrap), then required."""
    if url not in _ADMIN_KEYS:
        r = httpx.post(f"{url}/v1/tenants", json={"name": "ops"})
        assert r.status_code == 201, r.text
        r = httpx.post(f"{url}/v1/tenants/ops/keys", json={"name": "root", "role": "admin"})
        assert r.status_code == 201, r.text
        _ADMIN_KEYS[url] = r.json()["key"]
    return _ADMIN_KEYS[url]


def _h(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def _tenant(url: str, name: str, **spec) -> str:
    """A tenant with one user key; returns the key."""
    admin = _h(_admin(url))
    r = httpx.post(f"{url}/v1/tenants", json={"name": name, **spec}, headers=admin)
    assert r.status_code == 201, r.text
    key_spec = spec.pop("key", {}) if "key" in spec else {}
    r = httpx.post(f"{url}/v1/tenants/{name}/keys", json=key_spec, headers=admin)
    assert r.status_code == 201, r.text
    return r.json()["key"]


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, f"{r.status_code}: {r.text[:400]}"
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


def _complete(url: str, key: str, max_tokens: int = 4, prompt: str = "hello there") -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=_h(key), timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_keys_are_required_once_one_exists_and_stored_hashed(server, tmp_path_factory):
    url = server.url
    admin = _admin(url)
    _error(httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}), 401,
           "invalid_api_key")
    _error(_complete(url, admin[:-2] + "xx"), 401, "invalid_api_key")
    assert _complete(url, admin).status_code == 200
    # the key is shown once: listings carry a redacted form, and the database only its hash
    keys = httpx.get(f"{url}/v1/keys", headers=_h(admin)).json()["data"]
    assert all("key" not in k and k["redacted"].startswith("sits_") for k in keys)
    ctx = server.app.state.sits
    db = open(ctx.tenancy.store.path, "rb").read()
    assert admin.split("_", 2)[2].encode() not in db


def test_rotate_and_revoke_take_effect_at_once(server):
    url = server.url
    admin = _h(_admin(url))
    key = _tenant(url, "rotating")
    kid = key.split("_")[1]
    assert _complete(url, key).status_code == 200
    new = httpx.post(f"{url}/v1/keys/{kid}/rotate", headers=admin).json()["key"]
    assert new != key and new.split("_")[1] == kid
    _error(_complete(url, key), 401, "invalid_api_key")
    assert _complete(url, new).status_code == 200
    assert httpx.delete(f"{url}/v1/keys/{kid}", headers=admin).json()["revoked_at"] is not None
    _error(_complete(url, new), 401, "invalid_api_key")
    _error(httpx.post(f"{url}/v1/keys/{kid}/rotate", headers=admin), 404, "key_not_found")


def test_user_keys_cannot_use_the_admin_apis(server):
    url = server.url
    key = _tenant(url, "plain")
    for method, path, body in (("POST", "/v1/tenants", {"name": "evil"}), ("GET", "/v1/tenants", None),
                               ("GET", "/v1/keys", None), ("POST", "/v1/tenants/plain/keys", {"role": "admin"}),
                               ("GET", "/v1/status", None), ("GET", "/v1/units", None)):
        r = httpx.request(method, f"{url}{path}", json=body, headers=_h(key))
        assert r.status_code in (403, 404), (path, r.status_code, r.text)     # /v1/units: no gateway here
        if r.status_code == 403:
            assert r.json()["error"]["code"] == "admin_required"
    _error(httpx.post(f"{url}/v1/tenants", json={"name": "x", "oops": 1}, headers=_h(_admin(url))), 400,
           "invalid_parameter")
    _error(httpx.post(f"{url}/v1/tenants", json={"name": "plain"}, headers=_h(_admin(url))), 409, "tenant_exists")


def test_a_key_scoped_to_units_sees_and_calls_only_those(server):
    url = server.url
    admin = _h(_admin(url))
    httpx.post(f"{url}/v1/tenants", json={"name": "scoped"}, headers=admin)
    key = httpx.post(f"{url}/v1/tenants/scoped/keys", json={"units": ["other"]}, headers=admin).json()["key"]
    _error(_complete(url, key), 403, "model_not_allowed")
    assert httpx.get(f"{url}/v1/models", headers=_h(key)).json()["data"] == []
    _error(httpx.get(f"{url}/v1/models/tiny", headers=_h(key)), 404, "model_not_found")


def test_requests_per_minute_and_tokens_per_minute(server):
    url = server.url
    key = _tenant(url, "rpm", limits={"requests_per_min": 2})
    r = _complete(url, key)
    assert r.status_code == 200
    assert r.headers["x-ratelimit-limit-requests"] == "2" and r.headers["x-ratelimit-remaining-requests"] == "1"
    assert _complete(url, key).status_code == 200
    err = _complete(url, key)
    _error(err, 429, "rate_limit_exceeded")
    assert int(err.headers["retry-after"]) >= 1 and err.headers["x-ratelimit-remaining-requests"] == "0"
    key = _tenant(url, "tpm", limits={"tokens_per_min": 40})
    _error(_complete(url, key, max_tokens=100), 429, "rate_limit_exceeded")     # can never fit: no retry-after
    ok = _complete(url, key, max_tokens=8)
    assert ok.status_code == 200
    reserved = ok.json()["usage"]["prompt_tokens"] + 8          # prompt + max_tokens, taken at admission
    assert 40 - reserved <= int(ok.headers["x-ratelimit-remaining-tokens"]) <= 40 - reserved + 1
    _error(_complete(url, key, max_tokens=30), 429, "rate_limit_exceeded")      # fits the limit, not what is left


def test_usage_extension_and_usage_endpoint(server):
    url = server.url
    key = _tenant(url, "metered")
    r = _complete(url, key, max_tokens=5).json()
    ext = r["usage"]["sits"]
    assert ext["flops"] > 0 and ext["kv_block_seconds"] >= 0 and ext["cost"] == 0
    resp = httpx.post(f"{url}/v1/responses", headers=_h(key), timeout=60,
                      json={"model": "tiny", "input": "hi", "max_output_tokens": 3}).json()
    assert resp["usage"]["sits"]["flops"] > 0
    req = httpx.post(f"{url}/v1/requests", headers=_h(key), json={"prompt": "hi", "constraints": {"max_tokens": 2}})
    assert _finished(url, req.json()["id"], key)["usage"]["sits"]["flops"] > 0
    mine = httpx.get(f"{url}/v1/usage", headers=_h(key)).json()["data"]
    assert [row["tenant"] for row in mine] == ["metered"]
    assert mine[0]["requests"] == 3 and mine[0]["completion_tokens"] >= r["usage"]["completion_tokens"]
    # a user key cannot read another tenant's usage, even by asking for it
    assert httpx.get(f"{url}/v1/usage?tenant=ops", headers=_h(key)).json()["data"][0]["tenant"] == "metered"
    rows = list(csv.DictReader(io.StringIO(httpx.get(f"{url}/v1/usage?format=csv&group_by=tenant",
                                                     headers=_h(_admin(url))).text)))
    assert {"ops", "metered"} <= {row["tenant"] for row in rows}


def test_a_budget_is_never_overspent_under_concurrency_and_disconnects(server):
    """Many concurrent requests with random lengths, some streams dropped: the settled spend stays
    within the budget and every reservation is released."""
    url = server.url
    budget = 300
    key = _tenant(url, "racer", budgets=[{"period": "day", "tokens": budget}])
    spent = _race([url], key, budget, "racer", _admin(url))
    err = _error(_complete(url, key, max_tokens=min(budget - spent + 1, 240)), 429, "budget_exceeded")
    assert "day budget" in err["message"]


def _race(urls: list[str], key: str, budget: int, tenant: str, admin: str, n: int = 40, before: int = 0) -> int:
    """``n`` concurrent requests of random lengths spread over ``urls``, a third of them streams the
    client may drop (``before``: requests the tenant made earlier): returns the settled spend, checked against the budget, the usage rows and the
    tenant's view (nothing left reserved or in flight) on every server."""
    rng = random.Random(7)

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        m = rng.randint(1, 24)
        try:
            if i % 3 == 0:
                stream = await client.completions.create(model="tiny", prompt="count " * rng.randint(1, 8),
                                                         max_tokens=m, temperature=0, stream=True)
                async for _ in stream:
                    if rng.random() < 0.5:
                        await stream.close()     # a client that goes away mid-stream
                        return "dropped"
                return "ok"
            await client.completions.create(model="tiny", prompt="word " * rng.randint(1, 8), max_tokens=m,
                                            temperature=0)
            return "ok"
        except openai.RateLimitError as e:
            assert e.code == "budget_exceeded", e
            return "429"

    async def run() -> list[str]:
        clients = [openai.AsyncOpenAI(base_url=f"{u}/v1", api_key=key, max_retries=0, timeout=60) for u in urls]
        try:
            return await asyncio.gather(*(one(clients[i % len(clients)], i) for i in range(n)))
        finally:
            for c in clients:
                await c.close()

    outcomes = asyncio.run(run())
    assert "429" in outcomes and "ok" in outcomes
    # every reservation released (streams the client dropped included) once the servers have seen them end
    for url in urls:
        view = wait_for(lambda: (v := httpx.get(f"{url}/v1/tenants/{tenant}", headers=_h(admin)).json())["active"] == 0
                        and v["queued"] == 0 and v["budgets"][0]["tokens_reserved"] == 0 and v, timeout=30,
                        what="every reservation to be settled")
        spent = view["budgets"][0]["tokens_spent"]
        assert spent <= budget and view["budgets"][0]["tokens_remaining"] == budget - spent
    rows = wait_for(lambda: (r := httpx.get(f"{urls[0]}/v1/usage", params={"tenant": tenant, "group_by": "tenant"},
                                            headers=_h(admin)).json()["data"]) and r[0]["total_tokens"] == spent and r,
                    timeout=30, what="the usage rows of every request")
    assert rows[0]["requests"] == before + sum(o != "429" for o in outcomes)
    return spent


def _finished(url: str, rid: str, key: str) -> dict:
    deadline = time.monotonic() + 60
    while True:
        v = httpx.get(f"{url}/v1/requests/{rid}", headers=_h(key), timeout=10).json()
        if v.get("state") in ("RESOLVED", "REJECTED"):
            return v
        assert time.monotonic() < deadline, v
        time.sleep(0.05)


def test_isolation_matrix_every_route_that_takes_an_id(server):
    """Tenant A's requests, responses, sessions and memory sets, addressed by id with tenant B's key,
    are not found (404), and B's listings do not show them; A reads each of them."""
    url = server.url
    a, b = _tenant(url, "alpha"), _tenant(url, "beta")
    # A's objects
    req = httpx.post(f"{url}/v1/requests", headers=_h(a), json={"prompt": "hi", "constraints": {"max_tokens": 2}})
    assert req.status_code == 202, req.text
    rid = req.json()["id"]
    assert _finished(url, rid, a)["state"] == "RESOLVED"
    resp = httpx.post(f"{url}/v1/responses", headers=_h(a), timeout=60,
                      json={"model": "tiny", "input": "hi", "max_output_tokens": 2}).json()["id"]
    chat = httpx.post(f"{url}/v1/chat/completions", headers={**_h(a), "x-session-id": "shared-name"}, timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200
    mem = httpx.post(f"{url}/v1/memory/notes", headers=_h(a), json={"texts": ["the vault code is 1234"]})
    assert mem.status_code == 201
    mid = mem.json()["ids"][0]
    assert httpx.post(f"{url}/v1/memory/notes/snapshots", headers=_h(a), json={"name": "s1"}).status_code == 201
    rag = httpx.post(f"{url}/v1/requests", headers=_h(a), json={"prompt": "code?", "memory_ref": "notes",
                                                                "constraints": {"max_tokens": 2}}).json()["id"]
    assert _finished(url, rag, a)["state"] == "RESOLVED"

    reads = [("GET", f"/v1/requests/{rid}", "request_not_found"), ("GET", f"/v1/requests/{rid}/events", "request_not_found"),
             ("DELETE", f"/v1/requests/{rid}", "request_not_found"),
             ("GET", f"/v1/responses/{resp}", "response_not_found"), ("DELETE", f"/v1/responses/{resp}", "response_not_found"),
             ("GET", "/v1/sessions/shared-name", "session_not_found"),
             ("DELETE", "/v1/sessions/shared-name", "session_not_found"),
             ("GET", f"/v1/memory/{mid}/chain", "memory_not_found"), ("GET", f"/v1/memory/{rag}/chain", "memory_not_found"),
             ("POST", "/v1/memory/notes/snapshots/s1/restore", "snapshot_not_found")]
    for method, path, code in reads:
        r = httpx.request(method, f"{url}{path}", headers=_h(b), timeout=10)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert r.json()["error"]["code"] == code, (path, r.json())
    # listings and searches by name see B's own (empty) namespace
    assert httpx.get(f"{url}/v1/memory", headers=_h(b)).json()["data"] == []
    assert httpx.get(f"{url}/v1/memory/notes/memories", headers=_h(b)).json()["data"] == []
    assert httpx.get(f"{url}/v1/memory/notes/search", params={"q": "vault"}, headers=_h(b)).json()["data"] == []
    assert httpx.get(f"{url}/v1/memory/notes/snapshots", headers=_h(b)).json()["data"] == []
    r = httpx.post(f"{url}/v1/responses", headers=_h(b), timeout=30,
                   json={"model": "tiny", "input": "hi", "previous_response_id": resp, "max_output_tokens": 2})
    assert r.status_code == 404 or r.json()["error"]["code"].endswith("not_found"), r.text
    r = httpx.post(f"{url}/v1/requests", headers=_h(b), json={"prompt": "code?", "memory_ref": "notes",
                                                              "constraints": {"max_tokens": 2}}).json()["id"]
    assert _finished(url, r, b)["error"]["code"] == "memory_not_found"
    # the same session id under B is B's own new session
    r = httpx.post(f"{url}/v1/chat/completions", headers={**_h(b), "x-session-id": "shared-name"}, timeout=60,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "other"}], "max_tokens": 2})
    assert r.status_code == 200
    sb = httpx.get(f"{url}/v1/sessions/shared-name", headers=_h(b)).json()
    assert sb["id"] == "shared-name" and sb["messages"][0]["content"] == "other" and sb["turns"] == 1
    # and A still reads all of its own
    for path in (f"/v1/requests/{rid}", f"/v1/responses/{resp}", "/v1/sessions/shared-name", f"/v1/memory/{mid}/chain",
                 f"/v1/memory/{rag}/chain"):
        assert httpx.get(f"{url}{path}", headers=_h(a), timeout=10).status_code == 200, path
    assert httpx.get(f"{url}/v1/sessions/shared-name", headers=_h(a)).json()["messages"][0]["content"] == "hi"
    assert [s["set"] for s in httpx.get(f"{url}/v1/memory", headers=_h(a)).json()["data"]] == ["notes"]
    chain = httpx.get(f"{url}/v1/memory/{mid}/chain", headers=_h(a)).json()
    assert chain["set"] == "notes" and [x["response"] for x in chain["retrieved_by"]] == [rag]


def test_flops_and_kv_block_seconds_match_a_hand_calculation(server, tiny_model_dir):
    """usage.sits.flops of a request on the tiny model, against the model's shape worked by hand:
    every computed position costs 2 x the layers' matmul parameters plus attention over its keys,
    and every position that yields a token the LM head."""
    cfg = json.loads(open(f"{tiny_model_dir}/config.json").read())
    h, inter, L, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", h // heads)
    vocab = cfg["vocab_size"]
    key = _tenant(server.url, "handcalc")
    prompt = list(range(10, 30))                      # 20 tokens, a token-id prompt: no template, no BOS
    r = httpx.post(f"{server.url}/v1/completions", headers=_h(key), timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    usage = r.json()["usage"]
    p, c, cached = usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert (p, c) == (20, 7)
    layer_params = L * (h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h + 3 * h * inter)
    flops = 0
    for pos in range(cached, p + c - 1):              # the last generated token is never fed back
        flops += 2 * layer_params + 4 * L * heads * hd * (pos + 1)
    flops += 2 * h * vocab * c                        # the prompt's last position and each decode step
    assert usage["sits"]["flops"] == flops
    row = asyncio.run(server.app.state.sits.tenancy.store.usage(tenant="handcalc"))[0]
    assert row.flops == flops and row.prompt_tokens == 20 and row.completion_tokens == 7


def test_kv_block_seconds_and_prices():
    from sits.tenancy.cost import kv_block_seconds
    from sits.tenancy.spec import PricingSpec
    # 40 prompt tokens in blocks of 16: 3 blocks for 0.5 s of prefill, then growing to ceil(60/16)=4 over 2 s
    assert kv_block_seconds(40, 20, 16, 10.0, 10.5, 12.5) == pytest.approx(3 * 0.5 + (3 + 4) / 2 * 2.0)
    assert kv_block_seconds(40, 0, 16, None, None, None) == 0.0
    price = PricingSpec(input_per_mtok=1.0, cached_input_per_mtok=0.25, output_per_mtok=4.0, per_pflop=2.0)
    assert price.cost(1000, 400, 500, flops=1e15) == pytest.approx((600 * 1 + 400 * 0.25 + 500 * 4) / 1e6 + 2.0)
    assert PricingSpec(input_per_mtok=1.0).cost(1000, 400, 0) == pytest.approx(1000 / 1e6)


def test_an_async_request_over_budget_is_429_before_its_202(server):
    url = server.url
    key = _tenant(url, "asyncbudget", budgets=[{"period": "total", "tokens": 50}])
    r = httpx.post(f"{url}/v1/requests", headers=_h(key), json={"prompt": "hi", "constraints": {"max_tokens": 60}})
    _error(r, 429, "budget_exceeded")
    r = httpx.post(f"{url}/v1/requests", headers=_h(key), json={"prompt": "hi", "constraints": {"max_tokens": 4}})
    assert r.status_code == 202
    assert _finished(url, r.json()["id"], key)["state"] == "RESOLVED"
    # a tenant's remember needs a set of its own
    _error(httpx.post(f"{url}/v1/requests", headers=_h(key), json={"prompt": "hi", "remember": True}), 400,
           "memory_ref_required")


def test_tenant_metrics_and_the_cli(server, capsys):
    from sits.cli import main
    url = server.url
    admin = _admin(url)
    key = _tenant(url, "clitenant", budgets=[{"period": "day", "tokens": 10_000}])
    assert _complete(url, key).status_code == 200
    text = httpx.get(f"{url}/metrics").text
    assert 'sits:tenant_requests_total{outcome="finished",tenant="clitenant",unit="tiny"} 1.0' in text
    assert 'sits:tenant_budget_remaining{measure="tokens",period="day",tenant="clitenant"}' in text
    assert 'sits:tenant_flops_total{tenant="clitenant",unit="tiny"}' in text
    base = ["--url", url, "--api-key", admin]
    assert main(["tenant", "create", "fromcli", "--rpm", "5", "--budget", "month:tokens=1000,cost=2.5", *base]) == 0
    out = capsys.readouterr().out
    assert "created tenant fromcli" in out and "budget (month): tokens 0/1000" in out
    assert main(["key", "create", "fromcli", "--units", "tiny", "--name", "ci", *base]) == 0
    new_key = capsys.readouterr().out.strip().splitlines()[-1]
    assert new_key.startswith("sits_") and _complete(url, new_key).status_code == 200
    assert main(["key", "list", "--tenant", "fromcli", *base]) == 0
    listed = capsys.readouterr().out
    assert "tiny" in listed and new_key not in listed and new_key[-4:] in listed
    assert main(["usage", "--tenant", "fromcli", *base]) == 0
    assert "fromcli" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["tenant", "create", "x", "--budget", "week:tokens=5", *base])
    assert "PERIOD day, month or total" in capsys.readouterr().err
    assert main(["tenant", "create", "fromcli", *base]) == 2          # exists: one line, typed
    assert "[tenant_exists]" in capsys.readouterr().err


def test_embeddings_count_against_a_tenants_limits_and_usage(server):
    url = server.url
    key = _tenant(url, "embedder", limits={"tokens_per_min": 30})
    r = httpx.post(f"{url}/v1/embeddings", headers=_h(key), json={"model": "tiny", "input": [list(range(5, 25))]})
    assert r.status_code == 200, r.text
    assert int(r.headers["x-ratelimit-remaining-tokens"]) <= 11
    _error(httpx.post(f"{url}/v1/embeddings", headers=_h(key), json={"model": "tiny", "input": [list(range(5, 25))]}),
           429, "rate_limit_exceeded")
    rows = asyncio.run(server.app.state.sits.tenancy.store.usage(tenant="embedder"))
    assert [(r.prompt_tokens, r.completion_tokens, r.outcome) for r in rows] == [(20, 0, "finished")]
    assert rows[0].flops > 0


def test_an_update_keeps_spend_and_reservations_of_each_budget():
    from sits.tenancy.accounts import Account
    from sits.tenancy.spec import BudgetSpec, LimitsSpec
    budgets = [BudgetSpec(period="day", tokens=100), BudgetSpec(period="day", cost=1.0)]
    acct = Account.new("tenant", "t", LimitsSpec(), budgets, now=1000.0)
    acct.reserve(10, 0.5)
    acct.settle(10, 0.5, 4, 0.2, started=False)
    acct.reserve(30, 0.1)
    acct.configure(LimitsSpec(), [BudgetSpec(period="day", tokens=200), BudgetSpec(period="day", cost=2.0)], 1001.0,
                   lambda b, since: (0, 0.0))
    tok, cost = acct.budgets
    assert (tok.spec.tokens, tok.settled_tokens, tok.reserved_tokens) == (200, 4, 30)
    assert (cost.spec.cost, cost.settled_cost, cost.reserved_cost) == (2.0, pytest.approx(0.2), pytest.approx(0.1))
    assert acct.refusal(166, 0.0, 1001.0) is None and acct.refusal(167, 0.0, 1001.0).code == "budget_exceeded"


def test_max_queued_bounds_a_tenants_unfinished_async_requests(server):
    url = server.url
    key = _tenant(url, "queuer", limits={"max_queued": 2})
    body = {"prompt": "hi", "constraints": {"max_tokens": 200}}
    ids, refused = [], []
    for _ in range(6):
        r = httpx.post(f"{url}/v1/requests", headers=_h(key), json=body)
        (ids if r.status_code == 202 else refused).append(r)
    assert len(ids) >= 2 and refused, [r.status_code for r in refused]
    for r in refused:
        _error(r, 429, "queue_limit_exceeded")
        assert r.headers["retry-after"] == "1"
    for r in ids:
        httpx.delete(f"{url}/v1/requests/{r.json()['id']}", headers=_h(key))
        assert _finished(url, r.json()["id"], key)["state"] in ("RESOLVED", "REJECTED")
    assert httpx.post(f"{url}/v1/requests", headers=_h(key), json=body).status_code == 202


# -- several gateways sharing their tenants through one Redis ------------------------------------------
@pytest.fixture(scope="module")
def shared_pair(serve_tiny, redis_url, tmp_path_factory):
    """Two servers, each with its own data directory, whose tenants live in one real Redis."""
    import redis
    url = redis_url.rsplit("/", 1)[0] + "/6"          # a database of its own: the sessions' tests use 0
    redis.Redis.from_url(url).flushdb()
    return [serve_tiny(ServerSettings(drain_grace_s=0.5, data_dir=str(tmp_path_factory.mktemp(f"gw{i}")),
                                      tenant_store=url), engine_mode="thread") for i in range(2)], url


def test_gateways_sharing_redis_share_keys_and_revocation(shared_pair):
    (a, b), _ = shared_pair
    admin = _admin(a.url)
    _ADMIN_KEYS[b.url] = admin
    # B hears of A's change (pub/sub): the admin key made on A opens B's admin API, and B needs a key now
    wait_for(lambda: httpx.get(f"{b.url}/v1/tenants", headers=_h(admin)).status_code == 200, timeout=30,
             what="B to hear of the key created on A")
    _error(httpx.post(f"{b.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}), 401,
           "invalid_api_key")
    key = _tenant(b.url, "roamer", limits={"requests_per_min": 100})
    wait_for(lambda: _complete(a.url, key).status_code == 200, timeout=30, what="A to accept the key made on B")
    r = _complete(b.url, key)
    assert r.status_code == 200 and int(r.headers["x-ratelimit-remaining-requests"]) <= 98   # one bucket for both
    kid = key.split("_")[1]
    assert httpx.delete(f"{a.url}/v1/keys/{kid}", headers=_h(admin)).status_code == 200
    # refused on B at once: its admission is checked against the shared set of live keys
    _error(_complete(b.url, key), 401, "invalid_api_key")
    rows = httpx.get(f"{a.url}/v1/usage", params={"tenant": "roamer", "group_by": "tenant"}, headers=_h(admin))
    assert rows.json()["data"][0]["requests"] == 2      # the rows of both servers, read from either


def test_a_budget_shared_by_two_gateways_is_never_overspent(shared_pair):
    (a, b), _ = shared_pair
    admin = _admin(a.url)
    _ADMIN_KEYS.setdefault(b.url, admin)
    budget = 300
    key = _tenant(a.url, "duo", budgets=[{"period": "day", "tokens": budget}])
    wait_for(lambda: _complete(b.url, key, max_tokens=1).status_code == 200, timeout=30, what="B to know the key")
    spent = _race([a.url, b.url], key, budget, "duo", admin, n=48, before=1)     # the probe counts too
    _error(_complete(b.url, key, max_tokens=min(budget - spent + 1, 240)), 429, "budget_exceeded")


def test_a_dead_gateways_reservations_are_released(shared_pair):
    from redis.asyncio import Redis

    from sits.tenancy.redis_ledger import RedisLedger
    from sits.tenancy.spec import LimitsSpec
    (a, b), url = shared_pair
    admin = _admin(a.url)
    key = _tenant(a.url, "solo", limits={"max_concurrent": 1})
    wait_for(lambda: _complete(b.url, key).status_code == 200, timeout=30, what="B to know the key")
    kid = key.split("_")[1]
    prefix = "sits:{tenancy}:"

    async def die_holding_a_request() -> None:
        client = Redis.from_url(url, decode_responses=True)
        doomed = RedisLedger(client, prefix)              # a third gateway, admitting one request...
        await doomed.start()
        doomed.configure(("key", kid), LimitsSpec(), [])
        doomed.configure(("tenant", "solo"), LimitsSpec(max_concurrent=1), [])
        await doomed.admit([("key", kid), ("tenant", "solo")], 10, 0.0)
        for task in doomed._maintainers:                  # ...then dies: its heartbeat stops
            task.cancel()
        await client.delete(f"{prefix}gw:{doomed.gateway_id}")
        await client.aclose()

    asyncio.run(die_holding_a_request())
    _error(_complete(a.url, key), 429, "concurrency_limit_exceeded")

    async def reap() -> int:
        client = Redis.from_url(url, decode_responses=True)
        try:
            return await RedisLedger(client, prefix).reap()
        finally:
            await client.aclose()

    assert asyncio.run(reap()) == 1                       # what any gateway's upkeep does every few seconds
    assert _complete(b.url, key).status_code == 200
    assert httpx.get(f"{a.url}/v1/tenants/solo", headers=_h(admin)).json()["active"] == 0


def test_an_unreachable_shared_store_refuses_with_a_typed_503():
    from redis.asyncio import Redis

    from sits.tenancy.redis_ledger import RedisLedger, TenancyUnavailableError
    from sits.tenancy.spec import LimitsSpec

    async def admit() -> None:
        client = Redis.from_url("redis://127.0.0.1:1/0", decode_responses=True, socket_connect_timeout=1)
        ledger = RedisLedger(client, "sits:{tenancy}:")
        ledger.configure(("tenant", "t"), LimitsSpec(), [])
        try:
            await ledger.admit([("key", "k"), ("tenant", "t")], 10, 0.0)
        finally:
            await client.aclose()

    with pytest.raises(TenancyUnavailableError) as info:
        asyncio.run(admit())
    assert info.value.http_status == 503 and info.value.code == "tenancy_unavailable"


def test_tenancy_bench_runs_against_a_real_redis(redis_url, tmp_path):
    from sits.bench.tenancy_bench import run_tenancy_bench
    url = redis_url.rsplit("/", 1)[0] + "/7"
    r = run_tenancy_bench(rounds=1, n=50, url=url, docs_out=str(tmp_path / "b.md"))
    assert set(r["admissions_per_s"]) == {"local", "redis", "redis, 2 gateways"}
    assert all(v > 0 for v in r["admissions_per_s"].values()) and r["latency"]["redis"]["p50_us"] > 0
    assert "sits bench tenancy" in (tmp_path / "b.md").read_text() and (tmp_path / "img" / "tenancy_bench.png").exists()


def test_the_shared_ledger_never_leaks_or_forgets_a_reservation(redis_url):
    """Three ways a reservation could outlive its request, or a request its reservation, in Redis:
    an admission whose answer never came back (cancelled; its release may even arrive first), a
    gateway whose heartbeat lapsed while its request ran (reaped, then settled: the spend still
    counts), and a gateway that shuts down with reservations open."""
    from redis.asyncio import Redis

    from sits.tenancy.ledger import Reservation
    from sits.tenancy.redis_ledger import RedisLedger, TenancyUnavailableError
    from sits.tenancy.redis_store import connect
    from sits.tenancy.spec import BudgetSpec, LimitsSpec
    url = redis_url.rsplit("/", 1)[0] + "/8"
    prefix = "sits:{tenancy}:"
    refs = [("key", "k1"), ("tenant", "t1")]

    async def ledger() -> RedisLedger:
        led = RedisLedger(connect(url), prefix)
        led.configure(("key", "k1"), LimitsSpec(), [])
        led.configure(("tenant", "t1"), LimitsSpec(max_concurrent=4), [BudgetSpec(period="total", tokens=1000)])
        await led.start()
        return led

    async def budget(led) -> dict:
        return (await led.view(("tenant", "t1")))

    async def main() -> None:
        admin = Redis.from_url(url, decode_responses=True)
        await admin.flushdb()
        await admin.hset(f"{prefix}tenants", "t1", "{}")
        await admin.sadd(f"{prefix}live_keys", "k1")
        a, b = await ledger(), await ledger()
        # 1. the release overtakes the admission it releases: the admission is refused, nothing is held
        req, _ = a._request(refs, 100, 0.0, dry=False)
        a._release(req["rid"], [])
        await a.drain()
        with pytest.raises(TenancyUnavailableError):
            await a._run_admit_request(req, a._request(refs, 100, 0.0, dry=False)[1], 100, 0.0)
        v = await budget(a)
        assert v["active"] == 0 and v["budgets"][0]["tokens_reserved"] == 0
        # ...and admissions cancelled at every point of their way: what one got back its caller settles
        # (as a generation does); what was cancelled is released once the script has run, or refused
        for ticks in range(12):
            task = asyncio.ensure_future(a.admit(refs, 100, 0.0))
            for _ in range(ticks):
                await asyncio.sleep(0)
            task.cancel()
            [got] = await asyncio.gather(task, return_exceptions=True)
            if isinstance(got, Reservation):
                a.settle(got, 0, 0.0)
        await a.drain()
        v = await budget(a)
        assert v["active"] == 0 and v["budgets"][0]["tokens_reserved"] == 0
        # 2. reaped while its request ran (the heartbeat lapsed), settled afterwards: the spend counts
        res = await a.admit(refs, 100, 0.0)
        await admin.delete(f"{prefix}gw:{a.gateway_id}")
        assert await b.reap() == 1
        a.settle(res, 60, 0.0)
        await a.drain()
        v = await budget(b)
        assert v["active"] == 0 and v["budgets"][0]["tokens_spent"] == 60 and v["budgets"][0]["tokens_reserved"] == 0
        # 3. shut down with a reservation open: released, not orphaned
        await b.admit(refs, 100, 0.0)
        await b.aclose()
        v = await budget(a)
        assert v["active"] == 0 and v["budgets"][0]["tokens_reserved"] == 0
        await a.aclose()
        for led in (a, b):
            await led.redis.aclose(close_connection_pool=True)
        await admin.aclose()

    asyncio.run(main())
