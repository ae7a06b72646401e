"""/v1/programs is bounded by the work it causes, not only by its size: prompt tokens processed over all
its generate calls, text generated, answer size, wall time, and programs running at once per API key.
Each bound ends the program with a clear 4xx naming it; the gateway stays healthy."""
from __future__ import annotations

import asyncio

from services.gateway.program_limits import ProgramBudget
from tests.support.fake_worker import gateway_stack

GEN = {"op": "gen", "name": "g", "sampling_params": {"max_new_tokens": 20}}


def _fanout(width: int, text: str) -> dict:
    branches = [[{"op": "text", "text": text}, {**GEN}] for _ in range(width)]
    return {"program": {"version": 1, "nodes": [{"op": "text", "text": "root "},
                                                {"op": "fork", "id": 0, "n": width, "branches": branches}]}}


async def _post(s, body, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = await s.client.post("/v1/programs", json=body, headers=headers)
    return r.status, await r.json()


async def test_prompt_tokens_bound():
    async with gateway_stack(program_budget=ProgramBudget(max_prompt_tokens=300)) as s:
        status, body = await _post(s, _fanout(2, "short "))
        assert status == 200, body
        status, body = await _post(s, _fanout(16, "a fairly long shared prefix for every branch " * 4))
        assert status == 400 and body["error"]["code"] == "program_limit_exceeded", body
        assert "prompt tokens" in body["error"]["message"]
        assert s.state.health.healthy


async def test_generated_text_and_answer_bounds():
    async with gateway_stack(program_budget=ProgramBudget(max_generated_chars=30)) as s:
        status, body = await _post(s, _fanout(8, "x "))
        assert status == 400 and "generated more than" in body["error"]["message"], body
    async with gateway_stack(program_budget=ProgramBudget(max_answer_bytes=400)) as s:
        status, body = await _post(s, _fanout(8, "x "))
        assert status == 400 and "answer is larger" in body["error"]["message"], body


async def test_wall_time_bound():
    async with gateway_stack(token_delay=0.05, program_budget=ProgramBudget(max_seconds=0.5)) as s:
        status, body = await _post(s, _fanout(1, "slow "))
        assert status == 400 and "longer than" in body["error"]["message"], body
        await asyncio.sleep(0.3)
        assert not s.state.dispatcher.inflight  # its generation was aborted


async def test_programs_per_key_bound():
    async with gateway_stack(api_key="ka,kb", token_delay=0.03,
                             program_budget=ProgramBudget(max_running_per_key=1)) as s:
        first = asyncio.create_task(_post(s, _fanout(1, "busy "), key="ka"))
        for _ in range(100):
            if s.state.program_slots.running:
                break
            await asyncio.sleep(0.01)
        status, body = await _post(s, _fanout(1, "again "), key="ka")
        assert status == 429 and body["error"]["code"] == "too_many_programs", body
        status, body = await _post(s, _fanout(1, "other tenant "), key="kb")
        assert status == 200, body
        assert (await first)[0] == 200
        assert not s.state.program_slots.running


async def test_doubling_a_variable_is_refused_before_it_grows():
    """`x = x + x` thirty times would be 2^30 copies of a 1,000-character value: refused once the text it
    holds passes the answer bound, before the join that would cross it."""
    nodes = [{"op": "set", "name": "x", "value": "a" * 1000}]
    nodes += [{"op": "set", "name": "x", "parts": [{"op": "var", "name": "x"}, {"op": "var", "name": "x"}]}] * 30
    async with gateway_stack() as s:
        status, body = await _post(s, {"program": {"version": 1, "nodes": nodes}})
        assert status == 400 and "answer is larger" in body["error"]["message"], body


async def test_streamed_answer_is_bounded_too():
    async with gateway_stack(program_budget=ProgramBudget(max_answer_bytes=400)) as s:
        r = await s.client.post("/v1/programs", json={**_fanout(8, "x "), "stream": True})
        raw = await r.text()
        assert r.status == 200 and "answer is larger" in raw and '"type":"result"' not in raw, raw[-500:]


async def test_answer_encoded_in_steps_is_the_same_json():
    from services.gateway.json_out import dumps
    from services.gateway.program_limits import ENCODE_STEP, ProgramMeter

    long = ('é"\\\n\u2028x' * ENCODE_STEP)[: 3 * ENCODE_STEP + 5]
    answer = {"text": long, "messages": [{"role": "user", "content": long}], "variables": {"x": [long, "y"]},
              "meta_info": {"x": None, "n": {}, "l": [], "f": [1.5, -2, [None, 3, "t"]], "k": {1: "a"}}}
    assert await ProgramMeter(ProgramBudget()).serialize(answer) == dumps(answer)
