"""The gateway's edges, in process over fake workers: any string is accepted or refused with a 400 (lone
UTF-16 surrogates included), request ids are per tenant, which routes stay open under --api-key, and the
published OpenAPI document covers every route."""
from __future__ import annotations

import asyncio

from tests.support.fake_worker import gateway_stack

LONE = "\\ud800"  # as it appears in the JSON text: half a surrogate pair

SURROGATE_BODIES = [
    ("/generate", '{"text": "hi %s"}'),
    ("/generate", '{"text": ["ok", "bad %s"]}'),
    ("/generate", '{"text": "hi", "rid": "r%s"}'),
    ("/generate", '{"text": "hi", "sampling_params": {"stop": ["%s"]}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"regex": "a%s"}}'),
    ("/generate", '{"text": "hi", "sampling_params": {"x%s": 1}}'),
    ("/v1/completions", '{"prompt": "hi %s", "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": "hi", "stop": "%s", "max_tokens": 1}'),
    ("/v1/completions", '{"prompt": "hi", "model": "m%s", "max_tokens": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi %s"}], "max_tokens": 1}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "us%ser", "content": "hi"}]}'),
    ("/v1/programs", '{"program": {"version": 1, "nodes": [{"type": "text", "text": "%s"}]}}'),
]


async def test_lone_surrogates_are_refused_with_400():
    async with gateway_stack() as s:
        headers = {"Content-Type": "application/json"}
        for path, template in SURROGATE_BODIES:
            r = await s.client.post(path, data=(template % LONE).encode(), headers=headers)
            body = await r.json()
            assert r.status == 400, (path, template, body)
            assert body["error"]["code"] == "invalid_unicode", body
        # A proper pair is just a character.
        r = await s.client.post("/generate", data=b'{"text": "hi \\ud83d\\ude00", "sampling_params": {"max_new_tokens": 2}}',
                                headers=headers)
        assert r.status == 200, await r.text()


async def test_request_ids_are_per_tenant():
    async with gateway_stack(api_key="key-a,key-b", token_delay=0.05) as s:
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        body = {"text": "hi", "rid": "shared-id", "sampling_params": {"max_new_tokens": 30}}
        first = asyncio.create_task(s.client.post("/generate", json=body, headers=a))
        for _ in range(100):
            if s.state.dispatcher.inflight:
                break
            await asyncio.sleep(0.01)
        # Another tenant's equal id is none of its business: it runs (and says nothing about A's).
        r = await s.client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 2}}, headers=b)
        assert r.status == 200, await r.text()
        assert (await r.json())["meta_info"]["id"] == "shared-id"
        # The same tenant reusing its own running id is told so.
        r = await s.client.post("/generate", json=body, headers=a)
        assert r.status == 400 and "already running" in (await r.json())["error"]["message"]
        r = await first
        assert r.status == 200 and (await r.json())["meta_info"]["id"] == "shared-id"


async def test_routes_that_need_a_key():
    async with gateway_stack(api_key="sekret") as s:
        ok = {"Authorization": "Bearer sekret"}
        for path in ("/health", "/metrics", "/openapi.json"):
            assert (await s.client.get(path)).status == 200, path
        for path in ("/server_info", "/get_server_info", "/get_model_info", "/model_info", "/health_generate",
                     "/v1/models"):
            r = await s.client.get(path)
            assert r.status == 401, path
            assert (await r.json())["error"]["type"] == "authentication_error"
            assert (await s.client.get(path, headers=ok)).status == 200, path


async def test_openapi_document_covers_every_route():
    async with gateway_stack() as s:
        r = await s.client.get("/openapi.json")
        spec = await r.json()
        assert spec["openapi"].startswith("3.")
        routes = {(res.method.lower(), res.resource.canonical) for res in s.server.app.router.routes()
                  if res.method != "HEAD"}
        documented = {(m, p) for p, item in spec["paths"].items() for m in item}
        assert routes and routes <= documented, routes - documented
        for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/v1/detokenize",
                     "/v1/programs"):
            assert spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"], path
        for ref in spec["components"]["schemas"]:
            assert spec["components"]["schemas"][ref], ref
        assert spec["paths"]["/health"]["get"]["security"] == []
        assert spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]


async def test_an_escaped_backslash_before_u_d800_is_plain_text():
    from services.gateway.http.body import _SURROGATE_ESCAPE

    assert _SURROGATE_ESCAPE.search(b'{"text": "\\u00e9 \\\\ud800 is text"}') is not None  # walked, then accepted
    async with gateway_stack() as s:
        r = await s.client.post("/generate", data=b'{"text": "a \\\\ud800 b", "sampling_params": {"max_new_tokens": 1}}',
                                headers={"Content-Type": "application/json"})
        assert r.status == 200, await r.text()


async def test_a_rid_with_control_characters_is_refused():
    """A rid reaches the workers' log lines: a newline in it would forge lines there."""
    async with gateway_stack() as s:
        one = {"max_new_tokens": 1}
        for rid in ("a\nINFO forged", "a\rb", "a\x00b", "a\x1bb", "a\x85b", ["ok", "a\nb"]):
            text = ["x", "y"] if isinstance(rid, list) else "x"
            r = await s.client.post("/generate", json={"text": text, "rid": rid, "sampling_params": one})
            body = await r.json()
            assert r.status == 400 and body["error"]["param"] == "rid", (rid, body)
        r = await s.client.post("/generate", json={"text": "x", "rid": "r-1 é:ok", "sampling_params": one})
        assert r.status == 200, await r.text()


async def test_health_names_workers_only_to_a_key_holder():
    """/health answers without a key (load balancers carry none), so under --api-key it says that workers
    are not up but not their internal addresses; a key holder (or a keyless server) gets the names."""
    async with gateway_stack(num_workers=2, api_key="sekret") as s:
        address = s.state.router.workers[1].address
        s.state.health.supervisor_says(address, "restarting")
        r = await s.client.get("/health")
        text = await r.text()
        assert r.status == 200 and "degraded" in text and address not in text, text
        text = await (await s.client.get("/health", headers={"Authorization": "Bearer sekret"})).text()
        assert f"worker {address}: restarting" in text, text
    async with gateway_stack(num_workers=2) as s:
        address = s.state.router.workers[1].address
        s.state.health.supervisor_says(address, "down")
        assert f"worker {address}: down" in await (await s.client.get("/health")).text()


async def test_a_503_does_not_name_worker_addresses(caplog):
    """The fleet's layout is internal: a request no worker can serve gets a 503 that says so, while the
    address and the socket error go to the gateway's log for the operator."""
    async with gateway_stack(api_key="sekret") as s:
        address = s.state.router.workers[0].address
        await s.workers[0].drop_connections()
        await s.workers[0].stop()
        r = await s.client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}},
                                headers={"Authorization": "Bearer sekret"})
        body = await r.json()
        assert r.status == 503 and body["error"]["code"] == "worker_unavailable", body
        assert address not in body["error"]["message"] and address.split(":")[1] not in body["error"]["message"]
        assert any(address in rec.getMessage() for rec in caplog.records), [r.getMessage() for r in caplog.records]
