"""Constrained decoding through the real engine: outputs obey the grammar, mixed batches work, and
jump-forward (extending forced runs in one pass) gives exactly the token-by-token greedy output."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.support.engine_harness import Harness, tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEXES = [r"\d{4}-\d{2}-\d{2}", r"(yes|no)", r"call me at \d{3}-\d{4}, thanks!"]


@pytest.fixture(scope="module")
def h():
    return Harness()


def prompt():
    return tokenizer().encode("Extract the user as JSON: Alice is 30 and an admin.")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_in_a_mixed_batch(h, temperature):
    rids = []
    for seed in range(4):
        rids.append(h.submit(prompt(), sampling={"json_schema": json.dumps(SCHEMA), "max_new_tokens": 200,
                                                 "temperature": temperature, "seed": seed}))
        rids.append(h.submit(prompt(), sampling={"max_new_tokens": 10, "temperature": 1.0, "seed": seed}))
    results = h.run(rids)
    for r in results[::2]:
        assert r["finish"]["type"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
    for r in results[1::2]:
        assert r["finish"]["type"] == "length"


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_match(h, pattern):
    for seed in range(3):
        r = h.generate(prompt(), sampling={"regex": pattern, "max_new_tokens": 60, "temperature": 1.0, "seed": seed})
        assert re.fullmatch(pattern, r["text"]), r["text"]


def test_jump_forward_extends_forced_runs_in_one_pass():
    """Forced scaffolding goes in as the tokenizer's own tokens, in fewer forward passes, and the
    output stays valid. (Token-by-token decoding lets the model pick any segmentation of a forced
    run; a random model rarely picks the canonical one, so texts may differ after the first run.)"""
    on, off = Harness(), Harness(disable_jump_forward=True)
    tk = tokenizer()
    for kind, text in [("json_schema", json.dumps(SCHEMA)), ("regex", REGEXES[2])]:
        s = {kind: text, "max_new_tokens": 200, "temperature": 0}
        a, b = on.generate(prompt(), sampling=s), off.generate(prompt(), sampling=s)
        for r in (a, b):
            if kind == "regex":
                assert re.fullmatch(text, r["text"])
            else:
                jsonschema.validate(json.loads(r["text"]), SCHEMA)
        if kind == "regex":
            # "call me at " is forced from the start: it arrives as its canonical tokens.
            forced = tk.encode("call me at ")
            assert a["ids"][1:len(forced)] == forced[1:] or a["text"].startswith("call me at ")
    assert on.engine.jump_forward_tokens > 0 and off.engine.jump_forward_tokens == 0
    assert on.engine.steps < off.engine.steps


def _extend_passes(h: Harness) -> list[int]:
    """Record, per EXTEND pass the engine launches, how many of its requests were already decoding."""
    from shared.models.forward_batch import ForwardMode

    seen, launch = [], h.engine.runner.launch

    def counted(batch):
        if batch.mode == ForwardMode.EXTEND:
            seen.append(sum(1 for r in batch.reqs if r.num_resolved > 0))
        return launch(batch)
    h.engine.runner.launch = counted
    return seen


def _lone_grammar_request_in_a_busy_batch(**cfg):
    """8 unconstrained requests decoding, then one regex request whose forced runs are a few tokens."""
    h = Harness(**cfg)
    extends = _extend_passes(h)
    busy = [h.submit(prompt(), sampling={"max_new_tokens": 48, "ignore_eos": True, "temperature": 0})
            for _ in range(8)]
    for _ in range(3):
        h.engine.step()  # admitted and decoding: the queue is empty when the grammar request starts
    rid = h.submit(prompt()[:-1], sampling={"regex": REGEXES[2], "max_new_tokens": 60, "temperature": 0})
    results = h.run(busy + [rid])
    return h, results[-1], extends


def test_a_lone_short_jump_in_a_busy_batch_is_declined():
    """--jump-forward-threshold (default 3): one request's forced run of a few tokens does not pay for the
    catch-up extend pass it would impose on 9 running requests, so it is decoded token by token (the mask
    forces each token): the same output as with jump-forward off, and no catch-up pass. With the threshold
    at 0 every forced run is jumped, as before."""
    h, r, extends = _lone_grammar_request_in_a_busy_batch()
    off, r_off, _ = _lone_grammar_request_in_a_busy_batch(disable_jump_forward=True)
    always, r_always, extends_always = _lone_grammar_request_in_a_busy_batch(jump_forward_threshold=0)
    for out in (r, r_off, r_always):
        assert re.fullmatch(REGEXES[2], out["text"]), out["text"]
    assert h.engine.jump_forward_declined > 0 and h.engine.jump_forward_tokens == 0
    assert r["ids"] == r_off["ids"]
    assert not any(extends[1:]), extends  # only admissions: no pass extended a request already decoding
    assert always.engine.jump_forward_tokens > 0 and always.engine.jump_forward_declined == 0
    assert any(extends_always[1:]), extends_always  # each jump cost a catch-up pass of the whole batch


def test_jumps_of_a_step_are_taken_together_when_they_pay():
    """Four grammar requests reaching their forced runs in the same step: "call me at " (several tokens
    each) clears the threshold per running request, so all four jump in one catch-up pass; the lone "-"
    between the digit groups (one token each) does not, and is decoded."""
    h = Harness()
    extends = _extend_passes(h)
    rids = [h.submit(prompt(), sampling={"regex": REGEXES[2], "max_new_tokens": 60, "temperature": 0})
            for _ in range(4)]
    for r in h.run(rids):
        assert re.fullmatch(REGEXES[2], r["text"]), r["text"]
    assert h.engine.jump_forward_tokens >= 4 * 5
    assert 4 in extends[1:]  # one catch-up pass carried all four


def test_bad_grammar_is_refused_and_frees_nothing(h):
    before = h.free_tokens()
    r = h.generate(prompt(), sampling={"json_schema": "{not json", "max_new_tokens": 5})
    assert r["error"] and r["finish"]["type"] == "abort"
    r = h.generate(prompt(), sampling={"regex": "(unclosed", "max_new_tokens": 5})
    assert r["error"]
    assert h.free_tokens() == before and h.engine.policy.is_idle()


def test_a_busy_compiler_refusal_says_overloaded(h):
    """The worker's busy refusal reaches the gateway marked as such (a 503 there), not as the request's fault."""
    grammars = h.engine.grammars
    grammars._abandoned.update(("regex", f"stand-in {i} for a compile still running")
                               for i in range(grammars.max_abandoned))
    try:
        rid = h.submit(prompt(), sampling={"regex": "(si|no)", "max_new_tokens": 5})
        h.run([rid])
        last = h.outputs[rid][-1]
        assert "busy" in last.error and last.overloaded and not last.refused
    finally:
        grammars._abandoned.clear()
    r = h.generate(prompt(), sampling={"regex": "(si|no)", "max_new_tokens": 5})
    assert r["error"] is None and r["text"] in ("si", "no")


@pytest.mark.parametrize("cfg", [{}, {"page_size": 4}])
def test_verified_jump_forward_equals_token_by_token(cfg):
    """Verify mode: forced runs are proposals checked in one pass against the model's own samples, so
    the output is exactly token-by-token decoding (greedy and seeded sampling), in fewer passes."""
    on = Harness(jump_forward_mode="verify", **cfg)
    off = Harness(disable_jump_forward=True, **cfg)
    cases = [("json_schema", json.dumps(SCHEMA)), ("regex", REGEXES[2]), ("regex", REGEXES[0])]
    for kind, text in cases:
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            s = {kind: text, "max_new_tokens": 200, **sampling}
            a = on.generate(prompt(), sampling=s, return_logprob=True)
            b = off.generate(prompt(), sampling=s, return_logprob=True)
            assert a["ids"] == b["ids"] and a["text"] == b["text"], (kind, sampling)
            assert [e[1] for e in a["logprobs"]] == a["ids"]
            for x, y in zip(a["logprobs"], b["logprobs"]):
                assert abs(x[0] - y[0]) < 1e-4
    assert on.engine.jump_forward_tokens > 0
    assert on.engine.steps < off.engine.steps
    # Most proposal positions took their mask from the forced text (no matcher fill).
    assert on.engine.forced_mask_rows > on.engine.jump_forward_tokens // 2
    for h in (on, off):
        assert h.engine.policy.is_idle() and h.free_tokens() == h.engine.runner.max_total_tokens


def test_verified_jump_forward_in_a_mixed_batch():
    on = Harness(jump_forward_mode="verify")
    off = Harness(disable_jump_forward=True)
    reqs = [({"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": s, "max_new_tokens": 150}) for s in range(3)]
    reqs += [{"temperature": 1.0, "seed": 9, "max_new_tokens": 20, "ignore_eos": True}]
    got = [r["ids"] for r in on.run([on.submit(prompt(), sampling=s) for s in reqs])]
    want = [r["ids"] for r in off.run([off.submit(prompt(), sampling=s) for s in reqs])]
    assert got == want


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("mode", ["retokenize", "verify"])
def test_jump_forward_under_memory_pressure_completes(mode, mixed):
    """A pool too small for every request at once: jump-forward catch-up passes must evict or retract,
    never stall; verify mode still reproduces token-by-token output exactly. With mixed chunks the
    re-admissions after retractions carry the running requests as riders."""
    small = Harness(max_total_tokens=400, jump_forward_mode=mode, init_new_token_ratio=0.0,
                    min_new_token_ratio=0.0, enable_mixed_chunk=mixed)
    sampling = [{"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": s, "max_new_tokens": 120}
                for s in range(6)]
    got = small.run([small.submit(prompt(), sampling=s) for s in sampling], max_steps=3000)
    for r in got:
        assert r["finish"]["type"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
    assert small.engine.policy.is_idle() and small.free_tokens() == 400
    if mode == "verify":
        ref = Harness(disable_jump_forward=True)
        want = ref.run([ref.submit(prompt(), sampling=s) for s in sampling])
        assert [r["ids"] for r in got] == [r["ids"] for r in want]


@pytest.mark.parametrize("cfg", [{"jump_forward_mode": "retokenize", "jump_forward_threshold": 0},
                                 {"jump_forward_mode": "verify"},
                                 {"jump_forward_threshold": 0, "page_size": 4, "max_total_tokens": 480,
                                  "init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0}])
def test_passes_write_only_new_slot_table_entries_and_rows_hold_every_slot(cfg):
    """An extend pass writes a request's slot-table row only past what earlier passes wrote (a catch-up
    pass of jump-forward: its new tokens, not the whole row again); at every launch, every row of the
    pass holds the request's slots up to the pass's end, through jumps, rejected proposals, dedup with
    the tree, retraction and re-admission (the small pool)."""
    from shared.models.forward_batch import ForwardMode

    h = Harness(**cfg)
    runner = h.engine.runner
    launch, plan = runner.launch, runner._plan
    written, catch_up_tokens, checked = [0], [0], [0]

    def counting_plan(batch):
        p = plan(batch)
        if batch.mode == ForwardMode.EXTEND and all(r.num_resolved > 0 for r in batch.reqs):
            written[0] += len(p.table_writes[0])
            catch_up_tokens[0] += sum(batch.extend_lens)
        return p

    def checking_launch(batch):
        handle = launch(batch)
        table = runner.req_pool.req_to_token
        for req, p, e in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            assert table[req.req_pool_idx, :p + e].tolist() == req.slots[:p + e], req.rid
            checked[0] += 1
        return handle
    runner._plan, runner.launch = counting_plan, checking_launch
    sampling = [{"json_schema": json.dumps(SCHEMA), "temperature": 1.0, "seed": s, "max_new_tokens": 120}
                for s in range(6)]
    got = h.run([h.submit(prompt(), sampling=s) for s in sampling], max_steps=3000)
    for r in got:
        jsonschema.validate(json.loads(r["text"]), SCHEMA)
    # A request row reused by a request with another prompt, then by one hitting the first prompt's
    # cached prefix: that prefix must be written into the row again.
    other = tokenizer().encode("Something else entirely, to be answered in a few words.")
    for ids in (other, prompt(), other):
        h.run([h.submit(ids, sampling=sampling[0])], max_steps=3000)
    assert checked[0] > 0 and catch_up_tokens[0] > 0
    if "max_total_tokens" not in cfg:  # no re-admission: catch-up passes write their new tokens only
        assert written[0] == catch_up_tokens[0], (written[0], catch_up_tokens[0])


@pytest.mark.parametrize("cfg", [{}, {"page_size": 4, "max_total_tokens": 900},
                                 {"jump_forward_mode": "verify", "max_total_tokens": 700},
                                 {"enable_overlap": False, "jump_forward_threshold": 0}])
def test_kv_entering_the_tree_while_its_pass_runs_changes_nothing(cfg, monkeypatch):
    """A pass's KV enters the tree while the device runs it (SchedulePolicy.cache_extended_apart) only where
    that leaves what the next schedule() would: requests sharing prompts, and writing the same tokens
    (greedy), jump and end under memory pressure; every pass (rows, slots) and every output is the same
    as with all of it left to schedule()."""
    from shared.engine.schedule_policy import SchedulePolicy

    runs = []
    for apart in (True, False):
        if not apart:
            monkeypatch.setattr(SchedulePolicy, "cache_extended_apart", lambda self: None)
        h = Harness(**cfg)
        h.engine.grammars.compile("json_schema", json.dumps(SCHEMA))  # no compile timing in the schedule
        h.engine.grammars.compile("regex", REGEXES[2])
        launches, launch = [], h.engine.runner.launch

        def logged(batch, launch=launch, launches=launches):
            launches.append(([r.rid.split("-")[-1] for r in batch.reqs], batch.extend_lens,
                             batch.out_cache_loc.tolist()))
            return launch(batch)
        h.engine.runner.launch = logged
        rids = []
        for i in range(12):
            grammar = {"json_schema": json.dumps(SCHEMA)} if i % 3 else {"regex": REGEXES[2]}
            sampling = {**grammar, "temperature": 0.0 if i % 2 else 1.0, "seed": i // 4, "max_new_tokens": 100}
            rids.append(h.submit(tokenizer().encode(f"Write record {i % 4}:"), rid=f"x{apart}-{i}",
                                 sampling=sampling))
        got = h.run(rids, max_steps=3000)
        runs.append((launches, [(r["ids"], r["text"], r["finish"]) for r in got], h.engine.cache.stats()))
        assert h.engine.policy.is_idle()
    assert runs[0] == runs[1]
