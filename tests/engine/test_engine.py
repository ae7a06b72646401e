"""The real engine on the tiny random model: sampling options end to end, cache reuse, and that the
scheduling machinery (chunking, retraction, cache on/off) never changes what greedy decoding produces."""
from __future__ import annotations

import random
import types

import pytest
import torch

from tests.support.engine_harness import Harness, tokenizer

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def h():
    return Harness()


def prompts(n, seed=0, lo=5, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_greedy_is_deterministic_and_batch_independent(h):
    ps = prompts(6, seed=1)
    alone = [h.generate(p, sampling=GREEDY)["ids"] for p in ps]
    rids = [h.submit(p, sampling=GREEDY) for p in ps]
    batched = [r["ids"] for r in h.run(rids)]
    assert alone == batched
    assert all(len(x) == 24 for x in alone)


def test_info_counts_passes_by_mode(h):
    """info()["passes"]: one extend pass for prompts submitted together, then a decode pass per further
    token (the serving benchmark compares these between the server and the offline engine)."""
    ps = prompts(3, seed=11)
    before = h.engine.info()["passes"]
    h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 5}) for p in ps])
    after = h.engine.info()["passes"]
    # Four decode passes make the other four tokens (with overlap the fifth token is still in flight when
    # the next pass is scheduled, but it is the last max_new_tokens allows: no pass is launched for nothing).
    assert after["extend"] - before["extend"] == 1 and after["decode"] - before["decode"] == 4
    assert after["extend_tokens"] - before["extend_tokens"] == sum(len(p) for p in ps)
    # Each pass's time runs to the next launch; the last before the engine ran out of work is not timed.
    passes = after["extend"] + after["decode"] - before["extend"] - before["decode"]
    assert after["busy_timed"] - before["busy_timed"] == passes - 1
    # Decode steps are timed from the third decode launch in a row on: E D D D D -> launch 4 (the 5th pass).
    assert after["decode_timed"] - before["decode_timed"] == passes - 3
    assert after["busy_s"] - before["busy_s"] > after["decode_s"] - before["decode_s"] > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_no_decode_row_for_a_request_whose_last_token_is_in_flight(overlap):
    """A request's budget is known on the host: once the pass in flight makes its last allowed token
    (max_new_tokens, or the context's end), no further decode row is computed for it. Overlap scheduling
    used to launch one more pass for such requests (a decode after every prefill of max_new_tokens=1
    requests, and one wasted row per request at its end). Outputs are unchanged."""
    h = Harness(enable_overlap=overlap, max_context_len=64)
    launched = []
    launch = h.engine.runner.launch

    def record(batch):
        launched.append((batch.mode.name, sorted(r.rid for r in batch.reqs)))
        return launch(batch)
    h.engine.runner.launch = record
    free_before = h.free_tokens()
    ps = prompts(4, seed=21, lo=10, hi=20)
    # max_new_tokens 1 (the prefill's token only), 0 (no token), 3 and 6; one prompt ends at the context.
    budgets = [1, 0, 3, 6]
    rids = [h.submit(p, sampling={**GREEDY, "max_new_tokens": n}) for p, n in zip(ps, budgets)]
    long_prompt = prompts(1, seed=22, lo=60, hi=61)[0]
    rids.append(h.submit(long_prompt, sampling={**GREEDY, "max_new_tokens": 20}))
    res = h.run(rids)
    assert [len(r["ids"]) for r in res] == [1, 0, 3, 6, 64 - 60]
    decode_rows = {}
    for mode, batch in launched:
        if mode == "DECODE":
            for rid in batch:
                decode_rows[rid] = decode_rows.get(rid, 0) + 1
    # Every decode row makes a token the request returns: its tokens after the prefill's one.
    assert decode_rows == {rids[2]: 2, rids[3]: 5, rids[4]: 3}
    # Same tokens as each request alone without overlap.
    solo = Harness(enable_overlap=False, max_context_len=64)
    for p, n, r in zip(ps + [long_prompt], budgets + [20], res):
        assert solo.generate(p, sampling={**GREEDY, "max_new_tokens": n})["ids"] == r["ids"]
    assert h.free_tokens() == free_before  # no slot of a skipped row leaked


@pytest.mark.parametrize("overlap", [True, False])
def test_mixed_chunks_change_no_token(overlap):
    """--enable-mixed-chunk through the real engine: requests arriving while others decode, prompts chunked
    over several passes, seeded sampling and a stop: the same tokens as without mixing, fewer decode passes,
    and every slot back."""
    ps = prompts(8, seed=31, lo=20, hi=70)
    sampling = [{**GREEDY, "max_new_tokens": 12}, {"temperature": 0.8, "seed": 5, "max_new_tokens": 9, "ignore_eos": True}]
    results, passes = {}, {}
    for mixed in (False, True):
        h = Harness(enable_overlap=overlap, enable_mixed_chunk=mixed, max_prefill_tokens=64, chunked_prefill_size=48)
        free = h.free_tokens()
        rids = [h.submit(p, sampling=sampling[i % 2]) for i, p in enumerate(ps[:3])]
        for _ in range(3):
            h.engine.step()
        rids += [h.submit(p, sampling=sampling[i % 2]) for i, p in enumerate(ps[3:])]
        results[mixed] = [r["ids"] for r in h.run(rids)]
        passes[mixed] = h.engine.info()["passes"]
        assert h.free_tokens() == free
    assert results[True] == results[False]
    assert passes[True]["decode"] < passes[False]["decode"]


def test_mixed_chunk_warmup_runs_the_passes_mixed_chunks_form():
    """With --enable-mixed-chunk the warm-up runs a prefill pass with a full batch of riders behind a chunk-sized
    prompt, and a small one (their kernels compile there, not in the first live mixed pass); without the flag it
    runs none. The warm-up leaves nothing behind: the tokens afterwards are those of an engine that never ran it,
    and every slot is free."""
    ps = prompts(3, seed=36, lo=20, hi=60)
    runs = {}
    for mixed in (False, True):
        h = Harness(enable_mixed_chunk=mixed, max_prefill_tokens=64, chunked_prefill_size=48, max_running_requests=8)
        runner = h.engine.runner
        seen = []
        forward = runner.model.forward

        def spy(fb, *a, **kw):
            if fb.mode.name == "EXTEND":
                seen.append((list(fb.extend_prefix_lens_cpu), list(fb.extend_seq_lens_cpu)))
            return forward(fb, *a, **kw)
        runner.model.forward = spy
        free = h.free_tokens()
        runner.warmup()
        runner.model.forward = forward
        riders = [lens for prefix, lens in seen if len(lens) > 1 and set(lens[1:]) == {1} and prefix[1] > 0]
        if mixed:
            # 8 riders (max_running_requests) reserved from 64 tokens, then a prompt of one chunk (48); then 2 behind 48.
            assert riders == [[48] + [1] * 8, [48, 1, 1]], seen
        else:
            assert riders == [], seen
        assert h.free_tokens() == free
        runs[mixed] = [r["ids"] for r in h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 8}) for p in ps])]
    assert runs[True] == runs[False]


def test_mixed_chunk_warmup_covers_every_decode_tail_plan(monkeypatch):
    """On the H200 (132 SMs) the decode tail's split plan, which picks the compiled kernel variant, takes six values
    over 1..256 riders: the warm-up runs one mixed pass at the largest rider count of each (the first live mixed
    run compiled two variants the single large pass had not, 2026-12-05), each with the longest prompt it leaves
    room for, then the small pass."""
    import shared.models.attention.triton_backend as tb
    from shared.engine.config import EngineConfig
    from shared.engine.model_runner import mixed_warmup_passes
    import kernels.attention.triton_decode as td
    monkeypatch.setattr(td, "num_sms", lambda: 132)
    be = tb.TritonAttentionBackend(32, 8, 128)
    counts = be.rider_counts(256)
    assert counts == [256, 65, 32, 16, 8, 4], counts
    assert {tb.plan_max_kv_splits(r, 8) for r in counts} == {tb.plan_max_kv_splits(r, 8) for r in range(1, 257)}
    from shared.engine.sizing import CPU_SIZES, Sizes, fill
    cfg = fill(EngineConfig(model_path="tiny-random", enable_mixed_chunk=True), Sizes(*CPU_SIZES))  # 256 running
    passes = mixed_warmup_passes(cfg, 8192, be.rider_counts)
    assert passes == [(4096, r, 32) for r in counts] + [(64, 2, 32)], passes


def test_mixed_chunk_warmup_passes_are_passes_the_scheduler_forms():
    """The warm-up's largest mixed pass has as many riders as PrefillAdder reserves for at most (one more and it
    reserves none) and the prompt chunk the rest of the budget leaves: the two share prefill_adder's rules."""
    from shared.engine.config import EngineConfig
    from shared.engine.model_runner import mixed_warmup_passes
    from shared.engine.prefill_adder import PrefillAdder
    for budget, chunk in [(64, 48), (65, 16), (8192, 4096)]:
        cfg = EngineConfig(model_path="tiny-random", enable_mixed_chunk=True, max_prefill_tokens=budget,
                           chunked_prefill_size=chunk, max_running_requests=4096)
        prompt, riders, _ = mixed_warmup_passes(cfg, 8192)[0]
        stub = types.SimpleNamespace(config=cfg, _reserved_tokens=lambda: 0)
        adder = PrefillAdder(stub)
        assert len(adder.reserve_riders([object()] * riders)) == riders
        assert prompt == min(chunk, adder.budget), (budget, chunk, prompt, adder.budget)
        assert PrefillAdder(stub).reserve_riders([object()] * (riders + 1)) == []


def test_mixed_chunk_warmup_reaches_the_triton_decode_tail():
    """At the engine's defaults on an H100 (sizes derived for an 8B Llama's pool there) and Llama-8B's heads, the
    warm-up's large mixed pass is one where the Triton backend runs the riders with its decode kernel (the tail), so
    that variant is compiled before serving too."""
    from shared.engine.config import EngineConfig
    from shared.models.forward_batch import ForwardBatch, ForwardMode
    from shared.engine.model_runner import mixed_warmup_passes
    from shared.models.attention.triton_backend import TritonAttentionBackend
    from shared.engine.sizing import GIB, ModelShape, derive_sizes, fill
    sizes = derive_sizes(424_000, 80 * GIB, ModelShape(8192, 128256, 4096, 14336))
    cfg = fill(EngineConfig(model_path="tiny-random", enable_mixed_chunk=True), sizes)
    passes = mixed_warmup_passes(cfg, 8192)  # the largest pass, then the small one
    be = TritonAttentionBackend(32, 8, 128)  # the plan is host arithmetic: no kernel runs here
    pool = types.SimpleNamespace(dtype=torch.bfloat16)  # what the plan reads of the KV pool
    tails = []
    for prompt, riders, ctx in passes:
        lens = [prompt] + [1] * riders
        pool_rows = torch.zeros(1, 8192, dtype=torch.int32)
        fb = ForwardBatch.build(ForwardMode.EXTEND, [0] * sum(lens), [0] * len(lens), [0] + [ctx] * riders, lens,
                                torch.zeros(sum(lens), dtype=torch.int64), pool_rows, pool, be, torch.device("cpu"))
        be.init_forward_metadata(fb)
        tails.append(be._meta.tail is not None)
    assert tails == [True, False], (passes, tails)


def test_seed_reproducible_and_distinct(h):
    p = prompts(1, seed=2)[0]
    s = {"temperature": 1.0, "max_new_tokens": 20, "ignore_eos": True}
    a = h.generate(p, sampling={**s, "seed": 7})["ids"]
    b = h.generate(p, sampling={**s, "seed": 7})["ids"]
    c = h.generate(p, sampling={**s, "seed": 8})["ids"]
    assert a == b and a != c


def test_second_identical_request_reports_cached_prefix(h):
    p = prompts(1, seed=3, lo=40, hi=41)[0]
    first = h.generate(p, sampling=GREEDY)
    second = h.generate(p, sampling=GREEDY)
    assert first["cached"] == 0
    assert second["cached"] == len(p) - 1  # all but the token that must be recomputed for logits
    assert first["ids"] == second["ids"]


def test_max_new_tokens_zero_is_a_cache_hint(h):
    shared = prompts(1, seed=4, lo=50, hi=51)[0]
    hint = h.generate(shared, sampling={"max_new_tokens": 0})
    assert hint["ids"] == [] and hint["finish"] == {"type": "length", "length": 0}
    child = h.generate(shared + [17, 18, 19], sampling=GREEDY)
    assert child["cached"] == len(shared)


def test_stop_token_ids_and_stop_strings(h):
    p = prompts(1, seed=5)[0]
    ref = h.generate(p, sampling=GREEDY)
    stop_id = ref["ids"][5]
    first = ref["ids"].index(stop_id)
    r = h.generate(p, sampling={**GREEDY, "stop_token_ids": [stop_id]})
    assert r["ids"] == ref["ids"][:first + 1]
    assert r["finish"] == {"type": "stop", "matched": stop_id}
    # A stop string made of text spanning two tokens must be found and trimmed.
    text = ref["text"]
    tk = tokenizer()
    pieces = [tk.decode([t]) for t in ref["ids"]]
    k = next(i for i in range(3, 20) if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[k][-1:] + pieces[k + 1][:1]
    cut = text.find(stop)
    r = h.generate(p, sampling={**GREEDY, "stop": [stop]})
    assert r["finish"] == {"type": "stop", "matched": stop}
    assert r["text"] == text[:cut]
    r = h.generate(p, sampling={**GREEDY, "stop": [stop], "no_stop_trim": True})
    assert r["text"] == text[:cut + len(stop)]


def test_streamed_text_never_shows_a_stop_string(h):
    p = prompts(1, seed=5)[0]
    ref = h.generate(p, sampling=GREEDY)
    stop = ref["text"][10:13]
    rid = h.submit(p, sampling={**GREEDY, "stop": [stop]}, stream=True)
    h.run([rid])
    streamed = ""
    for o in h.outputs[rid]:
        streamed += o.text
        assert stop not in streamed
    assert streamed == ref["text"][:ref["text"].find(stop)]


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_batches_increments_and_loses_nothing(h, interval):
    """--stream-interval N: the first token at once, then increments of N tokens, the rest with the
    finish; the concatenation is the whole greedy output, ids and text alike."""
    p = prompts(1, seed=9)[0]
    ref = h.generate(p, sampling=GREEDY)
    h.engine.config.stream_interval = interval
    try:
        rid = h.submit(p, sampling=GREEDY, stream=True)
        h.run([rid])
    finally:
        h.engine.config.stream_interval = 1
    outs = [o for o in h.outputs[rid] if o.token_ids or o.finished]
    assert [t for o in outs for t in o.token_ids] == ref["ids"]
    assert "".join(o.text for o in h.outputs[rid]) == ref["text"]
    sizes = [len(o.token_ids) for o in outs]
    assert sizes[0] == 1
    if interval == 1:
        assert set(sizes[:-1]) == {1}
    else:
        assert all(n >= interval for n in sizes[1:-1]), sizes
        assert len(outs) <= 2 + GREEDY["max_new_tokens"] // interval, sizes


def test_min_new_tokens_blocks_eos(h):
    p = prompts(1, seed=6)[0]
    eos = tokenizer().eos_token_ids[0]
    r = h.generate(p, sampling={"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 12,
                                "stop_token_ids": [eos], "logit_bias": {str(eos): 100.0}})
    assert len(r["ids"]) == 12 and eos not in r["ids"][:-1]
    r = h.generate(p, sampling={"temperature": 0, "max_new_tokens": 12, "logit_bias": {str(eos): 100.0}})
    assert r["ids"] == [eos] and r["finish"]["type"] == "stop"


def test_output_and_input_logprobs(h):
    p = prompts(1, seed=7, lo=20, hi=21)[0]
    r = h.generate(p, sampling={**GREEDY, "max_new_tokens": 5}, return_logprob=True, logprob_start_len=0,
                   top_logprobs_num=3)
    assert len(r["logprobs"]) == 5
    for (lp, tid), top, out_id in zip(r["logprobs"], r["top"], r["ids"]):
        assert tid == out_id and lp <= 0
        assert len(top) == 3 and top[0][1] == tid  # greedy: the chosen token is the top-1
        assert abs(top[0][0] - lp) < 1e-5
    assert len(r["input_logprobs"]) == len(p)
    assert r["input_logprobs"][0][0] is None and [e[1] for e in r["input_logprobs"]] == p
    # Input logprobs from a later start, with the prefix cached, give the same numbers.
    r2 = h.generate(p, sampling={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=10)
    assert [e[1] for e in r2["input_logprobs"]] == p[10:]
    for a, b in zip(r2["input_logprobs"], r["input_logprobs"][10:]):
        assert abs(a[0] - b[0]) < 1e-4


def test_logprobs_computed_only_for_batches_that_ask(h, monkeypatch):
    """A batch where nobody asked for logprobs skips them (sample(..., logprobs=False)); one request that
    asks, batched with one that does not, gets the numbers it gets alone."""
    from shared.engine import model_runner

    asked = []
    real = model_runner.sample

    def spy(*a, **kw):
        asked.append(kw.get("logprobs", True))
        return real(*a, **kw)

    monkeypatch.setattr(model_runner, "sample", spy)
    p, q = prompts(2, seed=9, lo=12, hi=13)
    h.generate(p, sampling={**GREEDY, "max_new_tokens": 3})
    assert asked and not any(asked)
    alone = h.generate(q, sampling={**GREEDY, "max_new_tokens": 4}, return_logprob=True)
    asked.clear()
    rids = [h.submit(p, sampling={**GREEDY, "max_new_tokens": 4}),
            h.submit(q, sampling={**GREEDY, "max_new_tokens": 4}, return_logprob=True)]
    h.run(rids)
    assert any(asked)
    got = h.result(rids[1])
    assert [t for _, t in got["logprobs"]] == alone["ids"] == got["ids"]
    for (a, _), (b, _) in zip(got["logprobs"], alone["logprobs"]):
        assert abs(a - b) < 1e-4


def test_abort_frees_everything(h):
    before = h.free_tokens()
    p = prompts(1, seed=8)[0]
    rid = h.submit(p, sampling={"max_new_tokens": 500, "ignore_eos": True})
    for _ in range(5):
        h.engine.step()
    h.engine.abort(rid)
    h.engine.step()
    assert h.done(rid)
    assert h.outputs[rid][-1].finish_reason.TYPE == "abort"
    assert h.engine.policy.is_idle()
    assert h.free_tokens() == before


def test_bad_requests_are_refused_not_crashed(h):
    r = h.generate([], sampling=GREEDY)
    assert r["error"] and "empty" in r["error"]
    r = h.generate([1, 2, 10_000], sampling=GREEDY)
    assert r["error"] and "input_ids" in r["error"]
    r = h.generate([1, 2], sampling={"max_new_tokens": -3})
    assert r["error"] and "max_new_tokens" in r["error"]
    r = h.generate([5] * 5000, sampling=GREEDY)
    assert r["error"] and "context" in r["error"]


@pytest.mark.parametrize("cfg", [
    {"disable_radix_cache": True},
    {"chunked_prefill_size": 7, "max_prefill_tokens": 16},
    {"max_total_tokens": 160, "init_new_token_ratio": 0.0, "min_new_token_ratio": 0.0},  # forces retraction
    {"page_size": 4},
    {"schedule_policy": "fcfs"},
])
def test_scheduling_machinery_does_not_change_greedy_output(h, cfg):
    # Scheduling-policy logic is device-independent; the torch backend keeps the arithmetic identical across
    # chunkings (Triton-vs-torch agreement is tested in tests/kernels/).
    if torch.cuda.is_available():
        h = Harness(attention_backend="torch")
        cfg = {**cfg, "attention_backend": "torch"}
    ps = prompts(5, seed=9, lo=10, hi=40)
    ref = [h.generate(p, sampling=GREEDY)["ids"] for p in ps]
    other = Harness(**cfg)
    rids = [other.submit(p, sampling=GREEDY) for p in ps]
    got = [r["ids"] for r in other.run(rids)]
    assert got == ref
    if "max_total_tokens" in cfg:
        assert other.engine.policy.stats.retractions > 0
    assert other.engine.policy.is_idle()
    assert other.free_tokens() == other.engine.runner.max_total_tokens



def _stress(overlap: bool, seed: int, **cfg):
    """Requests arriving at random steps with mixed options, some aborted mid-way."""
    h = Harness(enable_overlap=overlap, max_total_tokens=2048, **cfg)
    rng = random.Random(seed)
    plan = []
    for k in range(24):
        p = [rng.randrange(3, 400) for _ in range(rng.randrange(3, 50))]
        s = {"max_new_tokens": rng.randrange(1, 40), "temperature": rng.choice([0, 0.7, 1.0]),
             "seed": rng.randrange(1000), "ignore_eos": rng.random() < 0.5}
        if rng.random() < 0.3:
            s["stop_token_ids"] = [rng.randrange(3, 400)]
        if rng.random() < 0.2:
            s["frequency_penalty"] = 0.5  # host-dependent: turns overlap off while it runs
        plan.append((rng.randrange(0, 60), f"s{k}", p, s, rng.random() < 0.15))
    rids, aborted = [], set()
    for t in range(400):
        for at, rid, p, s, abort in plan:
            if at == t:
                h.submit(p, rid=rid, sampling=s)
                rids.append(rid)
            if abort and at + 5 == t:
                h.engine.abort(rid)
                aborted.add(rid)
        if not (h.engine.policy.is_idle() and h.engine.inbox.empty() and h.engine._pending is None):
            h.engine.step()  # an idle engine blocks waiting for work
    h.run(rids)
    assert h.engine.policy.is_idle() and h.free_tokens() == 2048
    return {r: h.result(r) for r in rids}, aborted


@pytest.mark.parametrize("seed", [0, 1])
def test_overlap_scheduling_changes_nothing(seed):
    """Overlap (launch step N+1 before step N's tokens are on the host) gives the same tokens as
    strictly sequential steps, with aborts, stops and host-dependent requests mixed in."""
    on, aborted = _stress(True, seed)
    off, _ = _stress(False, seed)
    for rid in on:
        if rid in aborted:
            assert on[rid]["finish"]["type"] in ("abort", "length", "stop")
            continue
        assert on[rid]["ids"] == off[rid]["ids"], rid
        assert on[rid]["finish"] == off[rid]["finish"]


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_chunks_under_the_stress_change_nothing(seed):
    """Mixed chunks with overlap, small prefill passes (prompts chunked, riders competing for the budget),
    arrivals, aborts, stops and penalties: the tokens of plain sequential steps, and every slot back."""
    small = {"max_prefill_tokens": 48, "chunked_prefill_size": 32}
    mixed, aborted = _stress(True, seed, enable_mixed_chunk=True, **small)
    plain, _ = _stress(False, seed, **small)
    for rid in mixed:
        if rid in aborted:
            continue
        assert mixed[rid]["ids"] == plain[rid]["ids"], rid
        assert mixed[rid]["finish"] == plain[rid]["finish"]


def test_siblings_arriving_while_the_first_decodes_hit_its_prefix():
    """The first request's prompt enters the tree when its prefill ends: siblings submitted while it
    decodes get the prefix from the cache (hit counters), and greedy outputs are those of no cache."""
    rng = random.Random(21)
    system = [rng.randrange(3, 400) for _ in range(48)]
    qs = [[100 + k] + [rng.randrange(3, 400) for _ in range(6)] for k in range(4)]
    cfg = {"attention_backend": "torch"} if torch.cuda.is_available() else {}
    h = Harness(max_total_tokens=4096, **cfg)  # overlap on: the first token is still pending at insert
    first = h.submit(system + qs[0], sampling=GREEDY)
    while len([t for o in h.outputs.get(first, []) for t in o.token_ids]) < 3:
        h.engine.step()
    assert h.engine.cache.protected_size() >= len(system)  # in the tree, locked by the running request
    rids = [h.submit(system + q, sampling=GREEDY) for q in qs[1:]]
    hits_before = h.engine.cache.stats()["hit_tokens"]
    for _ in range(3):
        h.engine.step()
    assert h.engine.policy.stats.cached_tokens == 3 * len(system) and not h.done(first)
    res = h.run([first] + rids)
    assert [r["cached"] for r in res] == [0] + [len(system)] * 3
    assert h.engine.cache.stats()["hit_tokens"] - hits_before >= 3 * len(system)
    assert h.engine.policy.stats.cached_tokens == 3 * len(system)
    ref = Harness(disable_radix_cache=True, max_total_tokens=4096, **cfg)
    want = [ref.generate(system + q, sampling=GREEDY)["ids"] for q in qs]
    assert [r["ids"] for r in res] == want
    assert h.engine.policy.is_idle() and h.free_tokens() == h.engine.runner.max_total_tokens


def test_select_prefix_groups_puts_each_request_in_the_group_that_saves_most():
    """Nested groups from the tree: a deeper group takes its members only when the reads it saves them
    exceed its own prefix read; groups left below the minimum size, or too little saved, are dropped."""
    from shared.models.attention import create_attention_backend
    be = create_attention_backend("torch", 4, 2, 16, device="cpu")
    be.cascade_min_group, be.cascade_min_prefix, be.cascade_min_saved_tokens = 4, 256, 0
    sys16 = (2048, list(range(16)))
    # Two questions sharing one more token than the system prompt: not worth a group of their own.
    assert be.select_prefix_groups([sys16, (2049, [3, 7])]) == [sys16]
    be.cascade_min_group = 2
    assert be.select_prefix_groups([sys16, (2049, [3, 7])]) == [sys16]
    # A prefix inserted chunk by chunk is a chain of nodes: the whole group goes to the deepest.
    assert be.select_prefix_groups([(1936, list(range(16))), sys16, (2049, [3, 7])]) == [sys16]
    # Eight requests sharing 4,000 tokens under a 2,000-token prompt of sixteen: two groups.
    assert be.select_prefix_groups([(2000, list(range(16))), (4000, list(range(8)))]) == \
        [(2000, list(range(8, 16))), (4000, list(range(8)))]
    be.cascade_min_group = 4
    # Moving six of eight leaves two: the shallow group is dropped, its two requests read alone.
    assert be.select_prefix_groups([(2000, list(range(8))), (4000, list(range(6)))]) == [(4000, list(range(6)))]
    assert be.select_prefix_groups([(100, list(range(8)))]) is None  # below min_prefix
    be.cascade_min_saved_tokens = 10 ** 6
    assert be.select_prefix_groups([sys16]) is None


def test_shared_prefix_attention_groups_from_the_tree_keep_greedy_output():
    """Decode batches of requests sharing a cached prefix go through shared-prefix attention (groups
    found from the tree's shared locked node); greedy output is that of plain attention."""
    rng = random.Random(23)
    systems = [[rng.randrange(3, 400) for _ in range(40)] for _ in range(2)]
    ps = [systems[k % 2] + [200 + k] + [rng.randrange(3, 400) for _ in range(5)] for k in range(6)]
    cfg = {"attention_backend": "torch", "max_total_tokens": 4096}
    h = Harness(**cfg)
    be = h.engine.runner.attn_backend
    be.cascade_min_group, be.cascade_min_prefix, be.cascade_min_saved_tokens = 2, 16, 0
    seen = []
    select = be.select_prefix_groups
    be.select_prefix_groups = lambda g: seen.append(select(g)) or seen[-1]
    warm = [h.submit(s + [1], sampling={"max_new_tokens": 0}) for s in systems]
    h.run(warm)
    got = [r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in ps])]
    used = [g for g in seen if g]
    assert used and any(sorted(len(m) for _, m in g) == [3, 3] for g in used)
    assert all(p >= 40 for g in used for p, _ in g)
    ref = Harness(disable_shared_prefix_attention=True, **cfg)
    assert ref.engine.runner.attn_backend.cascade_enabled is False
    want = [r["ids"] for r in ref.run([ref.submit(p, sampling=GREEDY) for p in ps])]
    assert got == want
    # The runner's warm-up of the path (CUDA only) runs, and a failure there turns it off cleanly.
    runner = h.engine.runner
    runner._warmup_shared_prefix()
    assert be.cascade_enabled
    forward = runner.model.forward
    runner.model.forward = lambda fb: (_ for _ in ()).throw(RuntimeError("no kernel"))
    try:
        runner._warmup_shared_prefix()
    finally:
        runner.model.forward = forward
    assert not be.cascade_enabled and be.select_prefix_groups([(64, [0, 1, 2, 3])]) is None


@pytest.mark.gpu
def test_shared_prefix_attention_in_cuda_graphs_keeps_greedy_output():
    """On the GPU, decode batches with prefix groups replay the batch size's shared-prefix graph (groups
    staged into the backend's static plan), and groups that do not fit its capacities run eagerly; greedy
    output is that of plain attention either way."""
    rng = random.Random(29)
    systems = [[rng.randrange(3, 400) for _ in range(64)] for _ in range(12)]
    ps = [systems[k % 4] + [rng.randrange(3, 400) for _ in range(6)] for k in range(24)]  # 4 groups of 6
    pairs = [systems[4 + k // 2] + [rng.randrange(3, 400) for _ in range(6)] for k in range(16)]  # 8 of 2
    h = Harness(max_running_requests=32)
    runner = h.engine.runner
    be, gr = runner.attn_backend, runner.graph_runner
    assert gr is not None and be.graph_cascade()
    be.cascade_min_prefix, be.cascade_min_saved_tokens = 16, 0
    replays, chosen = [], []
    run, select = gr.run, be.select_prefix_groups
    gr.run = lambda *a, **kw: replays.append(kw.get("cascade", False)) or run(*a, **kw)
    be.select_prefix_groups = lambda g: chosen.append(select(g)) or chosen[-1]
    h.run([h.submit(s + [1], sampling={"max_new_tokens": 0}) for s in systems])
    got = [r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in ps])]
    assert any(replays), "no shared-prefix graph replayed"
    # Groups of two (allowed now, below the size the graphs were captured for): more entries than a
    # graph holds, so those steps run eagerly.
    be.cascade_min_group = 2
    n_replays, n_chosen = len(replays), len(chosen)
    got_pairs = [r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in pairs])]
    assert any(chosen[n_chosen:]) and not any(replays[n_replays:])
    ref = Harness(max_running_requests=32, disable_shared_prefix_attention=True)
    assert [r["ids"] for r in ref.run([ref.submit(p, sampling=GREEDY) for p in ps])] == got
    assert [r["ids"] for r in ref.run([ref.submit(p, sampling=GREEDY) for p in pairs])] == got_pairs


@pytest.mark.gpu
def test_cuda_graphs_write_one_logits_buffer_and_each_replay_gets_its_own_rows():
    """Every captured decode graph writes its logits into the runner's one buffer (per-graph outputs
    held ~18 GB at sizes to 1,024): replays of other sizes in between leave a replay's answer exactly
    what it was, and a row's logits are its own input's whatever the batch around it."""
    h = Harness(max_running_requests=16, cuda_graph_max_bs=16)
    runner = h.engine.runner
    gr = runner.graph_runner
    assert gr is not None and gr.logits.shape == (16, runner.model.config.vocab_size)
    dev = runner.device
    ids = torch.randint(3, 400, (16,), generator=torch.Generator().manual_seed(5)).to(dev)
    # Input j decodes at position 0 in request row j + 1, whose one slot is j + 1: rows of their own (all
    # writing one slot would make each row read whichever row wrote last).
    # The graph gathers each row's input from the runner's last samples and writes the slot table itself.
    own = list(range(1, 17))
    runner.token_buf[torch.tensor(own, device=dev)] = ids

    def replay(first, bs):
        rows = own[first:first + bs]
        got, dev_rows = gr.run(rows, [1] * bs, torch.tensor(rows, dtype=torch.int64), rows)
        assert got.data_ptr() == gr.logits.data_ptr() and got.shape[0] == bs
        assert dev_rows.tolist() == rows
        assert runner.req_pool.req_to_token[dev_rows, 0].tolist() == rows
        return got.clone()

    seen = {}
    for first, bs in [(0, 16), (4, 3), (0, 8), (0, 16), (7, 1), (4, 3), (0, 8)]:
        got = replay(first, bs)
        if (first, bs) in seen:
            assert torch.equal(got, seen[first, bs])
        seen[first, bs] = got
    full = seen[0, 16]
    for (first, bs), got in seen.items():
        torch.testing.assert_close(got, full[first:first + bs], rtol=1e-3, atol=1e-3)
    assert not torch.allclose(full[0], full[1])


@pytest.mark.gpu
def test_decode_in_cuda_graphs_gives_the_tokens_of_eager_decode():
    """Graph replays (padded to their bucket, logits in the shared buffer) decode what eager passes
    decode: fp32, batches shrinking as requests of different lengths finish."""
    ps = prompts(12, seed=41)
    lens = [4 + 3 * k for k in range(12)]
    graphs, eager = Harness(max_running_requests=16), Harness(max_running_requests=16, cuda_graph=False)
    assert graphs.engine.runner.graph_runner is not None and eager.engine.runner.graph_runner is None
    got = [graphs.submit(p, sampling={**GREEDY, "max_new_tokens": n}) for p, n in zip(ps, lens)]
    ref = [eager.submit(p, sampling={**GREEDY, "max_new_tokens": n}) for p, n in zip(ps, lens)]
    assert [r["ids"] for r in graphs.run(got)] == [r["ids"] for r in eager.run(ref)]


@pytest.mark.gpu
def test_bf16_rows_on_the_gemv_decode_what_cublas_decodes(monkeypatch):
    """bf16 batches of 2-16 rows (here decode steps of 8 in graphs) take the GEMV's tensor-core tile up to
    kernels.ops.GEMV_MAX_M rows, their logits too: each step's top logprob equals cuBLAS's (GEMV_MAX_M = 1) to bf16's
    rounding, and so does the greedy token wherever cuBLAS's top two are not a near tie. With the several-row fusions
    (rope and the KV store in qkv_proj's epilogue, two rows on the one-row kernel with both epilogues and the split
    norms there, two rows gated there)."""
    import kernels.gemv as kg
    import kernels.ops as ops
    real, rows = kg.gemv, []
    monkeypatch.setattr(kg, "gemv", lambda x, w, *a, **kw: rows.append(x.shape[0]) or real(x, w, *a, **kw))
    ps = prompts(8, seed=46, lo=6, hi=14)
    lens = [3 if i < 6 else 6 for i in range(8)]  # six requests finish early: the last steps decode two rows
    out = {}
    for max_m in (16, 1):
        monkeypatch.setattr(ops, "GEMV_MAX_M", max_m)
        h = Harness(dtype="bfloat16", max_running_requests=8)
        out[max_m] = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": n}, return_logprob=True,
                                     top_logprobs_num=2) for p, n in zip(ps, lens)])
        if max_m == 16:
            assert 2 in rows and 8 in rows, rows  # the several-row GEMV ran, at 8 rows and at 2
    for got, ref in zip(out[16], out[1]):
        for t, (top_g, top_r) in enumerate(zip(got["top"], ref["top"])):
            assert abs(top_g[0][0] - top_r[0][0]) < 0.05, (t, top_g, top_r)
            if top_r[0][0] - top_r[1][0] > 0.05:
                assert top_g[0][1] == top_r[0][1], (t, top_g, top_r)
            else:
                break  # a near tie may pick either token; the sequences part from here


@pytest.mark.gpu
def test_fp8_rows_gated_in_gate_up_decode_what_the_unfused_rows_decode(monkeypatch):
    """FP8 weights (quantized at load, per row) at decode batches of 2-16 in graphs gate the MLP in gate_up_proj's
    epilogue on the GEMV (batch 2 on the one-row kernel with its epilogues and split norms, more on the tensor-core
    tile): each step's top logprob equals the unfused rows' (silu_and_mul in down_proj's load; the model told the GEMV
    does not take its rows) to bf16's rounding, and so does the greedy token wherever their top two are not a near
    tie."""
    import kernels.gemv as kg
    import kernels.ops as ops
    real, gated = kg.gemv, []
    monkeypatch.setattr(kg, "gemv", lambda x, w, *a, **kw: (kw.get("gated_out") and gated.append(x.shape[0]))
                        or real(x, w, *a, **kw))
    ps = prompts(8, seed=47, lo=6, hi=14)
    lens = [3 if i < 6 else 6 for i in range(8)]  # the last steps decode two rows
    out = {}
    for on in (True, False):
        if not on:  # the model's question alone: ops still runs its linears on the GEMV
            monkeypatch.setattr(ops, "gemv_applies", lambda x, w, s=None: False)
        gated.clear()
        h = Harness(dtype="bfloat16", quantization="fp8", max_running_requests=8)
        out[on] = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": n}, return_logprob=True,
                                  top_logprobs_num=2) for p, n in zip(ps, lens)])
        assert (2 in gated and 8 in gated) if on else not [m for m in gated if m > 1], gated
    for got, ref in zip(out[True], out[False]):
        for t, (top_g, top_r) in enumerate(zip(got["top"], ref["top"])):
            assert abs(top_g[0][0] - top_r[0][0]) < 0.05, (t, top_g, top_r)
            if top_r[0][0] - top_r[1][0] > 0.05:
                assert top_g[0][1] == top_r[0][1], (t, top_g, top_r)
            else:
                break


@pytest.mark.gpu
def test_bf16_graph_logits_sample_as_their_fp32_widening(monkeypatch):
    """In bf16 the graphs' logits buffer is bf16, written by the lm_head's GEMM itself, and a greedy batch's
    argmax reads it unwidened. Every sampling call of a bf16 run with graphs (greedy, seeded, logprobs in the
    same batches) gives what it gives on the fp32 widening of the same logits."""
    import shared.engine.model_runner as mr
    real, calls = mr.sample, []

    def checked(logits, sb, **kw):
        got = real(logits, sb, **kw)
        ref = real(logits.float(), sb, **kw)
        calls.append(logits.dtype)
        assert torch.equal(got.next_token_ids, ref.next_token_ids)
        assert (got.logprobs is None) == (ref.logprobs is None)
        if got.logprobs is not None:
            assert torch.equal(got.logprobs, ref.logprobs)
        return got
    monkeypatch.setattr(mr, "sample", checked)
    h = Harness(dtype="bfloat16", max_running_requests=8)
    assert h.engine.runner.graph_runner.logits.dtype == torch.bfloat16
    sampling = [{**GREEDY, "max_new_tokens": 10}, {"temperature": 0.7, "seed": 3, "max_new_tokens": 10, "ignore_eos": True}]
    greedy = h.run([h.submit(p, sampling=sampling[0]) for p in prompts(4, seed=43)])
    mixed = h.run([h.submit(p, sampling=sampling[i % 2], return_logprob=i % 3 == 0)
                   for i, p in enumerate(prompts(8, seed=44))])
    assert all(len(r["ids"]) == 10 for r in greedy + mixed)
    assert torch.bfloat16 in calls


@pytest.mark.gpu
@pytest.mark.parametrize("decode_tail", [False, True])
def test_mixed_chunks_on_cuda_change_no_token(decode_tail, monkeypatch):
    """--enable-mixed-chunk on the GPU (Triton backend, graphs for the decode passes, fp32): the tokens of
    runs without it; with decode_tail the riders always go through the decode kernel."""
    import shared.models.attention.triton_backend as tb
    monkeypatch.setattr(tb, "DECODE_TAIL_MIN_EMPTY_PROGRAMS", 0 if decode_tail else 1 << 30)
    ps = prompts(12, seed=45, lo=40, hi=120)
    out = {}
    for mixed in (False, True):
        h = Harness(enable_mixed_chunk=mixed, max_prefill_tokens=128, chunked_prefill_size=96, max_running_requests=16)
        rids = [h.submit(p, sampling={**GREEDY, "max_new_tokens": 14}) for p in ps[:4]]
        for _ in range(4):
            h.engine.step()
        rids += [h.submit(p, sampling={**GREEDY, "max_new_tokens": 14}) for p in ps[4:]]
        out[mixed] = [r["ids"] for r in h.run(rids)]
    assert out[True] == out[False]


@pytest.mark.gpu
def test_a_neutralized_bare_replay_leaves_the_kv_pool_and_slot_table_as_they_are():
    """Benchmarks time bare replays of the last step's graph. The graph gathers its inputs from the last
    samples and writes the slot table and the new token's K/V itself, so a bare replay would overwrite a
    cached token's K/V with the next token's; after neutralize() it writes only the padding slot."""
    h = Harness(max_running_requests=8)
    runner = h.engine.runner
    gr = runner.graph_runner
    h.run([h.submit(prompts(1, seed=47)[0], sampling={**GREEDY, "max_new_tokens": 12})])
    table = runner.req_pool.req_to_token.clone()
    k_before = [k.clone() for k in runner.kv_pool.k_buffers]
    v_before = [v.clone() for v in runner.kv_pool.v_buffers]
    gr.neutralize(1)
    for _ in range(3):
        gr.graphs[1, False].replay()
    torch.cuda.synchronize()
    assert torch.equal(runner.req_pool.req_to_token, table)
    for before, after in zip(k_before + v_before, list(runner.kv_pool.k_buffers) + list(runner.kv_pool.v_buffers)):
        assert torch.equal(after[1:], before[1:]), "a bare replay wrote a real slot"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability >= 9")
def test_pdl_launches_decode_the_tokens_of_plain_launches():
    """bf16 (the batch-1 GEMV path), CUDA graphs: the engine with programmatic dependent launch decodes
    what it decodes without, one request alone and several together. The setting is process-wide, so
    the two engines run one after the other."""
    from kernels._utils import set_pdl
    ps = prompts(5, seed=43)
    results = {}
    try:
        for pdl in (False, True, "early"):  # early: each kernel lets the next launch before it waits
            h = Harness(dtype="bfloat16", max_running_requests=8, enable_pdl=bool(pdl),
                        pdl_early_trigger=pdl == "early")
            alone = h.run([h.submit(ps[0], sampling={**GREEDY, "max_new_tokens": 24})])
            together = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 16}) for p in ps])
            results[pdl] = [r["ids"] for r in alone + together]
            h.engine.stop()
    finally:
        set_pdl(False)
    assert results[True] == results[False] == results["early"]


@pytest.mark.gpu
def test_one_launch_decode_attention_decodes_the_tokens_of_two_launches():
    """Split decode attention merged in its own launch (the last program per request and KV head) decodes
    what the two-launch merge decodes: CUDA graphs replayed step after step (the counters must be clean
    at every replay), one request alone and several of different lengths together, contexts of up to
    ~1k tokens (up to 16 chunks each), and eager steps."""
    rng = random.Random(53)
    ps = [[rng.randrange(3, 400) for _ in range(n)] for n in (900, 250, 40, 600, 3)]
    results = {}
    for one in (False, True):
        for graphs in (True, False):
            h = Harness(max_running_requests=8, one_launch_decode_attention=one, cuda_graph=graphs)
            be = h.engine.runner.attn_backend
            assert be.one_launch_decode is one
            alone = h.run([h.submit(ps[0], sampling={**GREEDY, "max_new_tokens": 20})])
            together = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 16}) for p in ps])
            results[one, graphs] = [r["ids"] for r in alone + together]
            assert be._tickets is None or not be._tickets.any()
            assert one == (be._tickets is not None)
            h.engine.stop()
    assert results[True, True] == results[False, True] == results[True, False] == results[False, False]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_norm_fusion_decodes_the_tokens_of_whole_norms(dtype):
    """Batch-1 passes with the residual norms split between the GEMVs around them (bf16: the Triton
    GEMVs' epilogues; fp32: the torch path) decode what whole norms decode, in CUDA graphs and eagerly:
    one request alone (every step one token), then several together (the unsplit path)."""
    ps = prompts(4, seed=59)
    results = {}
    for fused in (False, True):
        for graphs in (True, False):
            h = Harness(dtype=dtype, max_running_requests=8, decode_norm_fusion=fused, cuda_graph=graphs)
            sums = h.engine.runner.model.model.row_norm_sums
            assert h.engine.runner.decode_norm_fusion is fused and (sums is not None) is fused
            alone = h.run([h.submit(ps[0], sampling={**GREEDY, "max_new_tokens": 24})])
            if fused:
                # The layers' norms; the last row is the final norm's, used only where the fold runs (bf16 GEMVs).
                assert bool((sums[:-1].sum(1) > 0).all()), "the split norms did not run"
            together = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 12}) for p in ps])
            results[fused, graphs] = [r["ids"] for r in alone + together]
            h.engine.stop()
    assert results[True, True] == results[False, True] == results[True, False] == results[False, False]


@pytest.mark.gpu
def test_decode_l2_prefetch_decodes_the_tokens_without_it():
    """bf16, CUDA graphs and eager steps, split and whole norms: asking o_proj's weights into L2 changes no
    token (a hint only; on GPUs before Hopper it launches nothing)."""
    ps = prompts(3, seed=61)
    results = {}
    for prefetch in (False, True):
        for fused in (True, False):
            for graphs in (True, False):
                h = Harness(dtype="bfloat16", max_running_requests=8, decode_l2_prefetch=prefetch,
                            decode_norm_fusion=fused, cuda_graph=graphs)
                assert (h.engine.runner.model.model.row_prefetcher is not None) is prefetch
                alone = h.run([h.submit(ps[0], sampling={**GREEDY, "max_new_tokens": 16})])
                together = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 8}) for p in ps])
                results[prefetch, fused, graphs] = [r["ids"] for r in alone + together]
                h.engine.stop()
    for fused in (True, False):
        for graphs in (True, False):
            assert results[True, fused, graphs] == results[False, fused, graphs], (fused, graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_rope_fusion_decodes_the_tokens_of_the_rope_kernel(dtype):
    """Batch-1 decode with rope and the KV store in the qkv GEMV's epilogue (bf16: the Triton epilogue; fp32:
    the torch path) decodes what the rope + KV-store kernel does, in CUDA graphs and eagerly, with split and
    whole norms: one request alone (every step one token), then several together (the unfused path)."""
    ps = prompts(4, seed=67)
    results = {}
    for fused in (False, True):
        for norms in (True, False):
            for graphs in (True, False):
                h = Harness(dtype=dtype, max_running_requests=8, decode_rope_fusion=fused, decode_norm_fusion=norms,
                            cuda_graph=graphs)
                assert h.engine.runner.decode_rope_fusion is fused
                alone = h.run([h.submit(ps[0], sampling={**GREEDY, "max_new_tokens": 24})])
                together = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 12}) for p in ps])
                results[fused, norms, graphs] = [r["ids"] for r in alone + together]
                h.engine.stop()
    for norms in (True, False):
        for graphs in (True, False):
            assert results[True, norms, graphs] == results[False, norms, graphs], (norms, graphs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_final_norm_in_the_lm_head_decodes_the_tokens_of_the_norm_kernel(dtype, monkeypatch):
    """Batch-1 graphs with the final norm split into the last down_proj and the lm_head GEMV (with the split norms,
    --decode-norm-fusion; bf16: the Triton GEMV writing the rounded logits in fp32, fp32: the torch path) decode what
    the final norm kernel and cuBLAS's lm_head do (without the split norms), alone and with others."""
    ps = prompts(3, seed=71)
    results = {}
    for fold in (False, True):
        h = Harness(dtype=dtype, max_running_requests=8, decode_norm_fusion=fold)
        sums = h.engine.runner.model.model.row_norm_sums
        alone = h.run([h.submit(ps[0], sampling={**GREEDY, "max_new_tokens": 24})])
        assert (sums is not None and bool(sums[-1].sum() > 0)) == fold, \
            "the final norm's split did not run" if fold else "it ran unasked"
        together = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 12}) for p in ps])
        results[fold] = [r["ids"] for r in alone + together]
        h.engine.stop()
    assert results[True] == results[False]


@pytest.mark.gpu
def test_short_extends_in_cuda_graphs_give_the_results_of_eager_extends(monkeypatch):
    """Extend passes of a few tokens per request over cached prefixes (a second turn, jump-forward's
    catch-ups) replay a captured graph padded to their token bucket; tokens and input logprobs are those
    of eager passes, and passes beyond the graphs' bounds (a request with > 64 new tokens) run eagerly."""
    from shared.engine import extend_graph
    from shared.engine.extend_graph import MAX_EXTEND_LEN

    monkeypatch.setattr(extend_graph, "LONG_MAX_TOKENS", 0)  # the short family alone (the long one: the next test)
    graphs = Harness(max_running_requests=16, cuda_graph_max_extend_tokens=512)
    eager = Harness(max_running_requests=16, cuda_graph_max_extend_tokens=0)
    eg = graphs.engine.runner.extend_graphs
    assert eg is not None and eager.engine.runner.extend_graphs is None and eg.sizes[-1] == 512
    replays, run = [], eg.run
    eg.run = lambda fb, graph: replays.append(fb.extend_seq_lens_cpu) or run(fb, graph)
    rng = random.Random(43)
    first = prompts(10, seed=43, lo=5, hi=120)  # some beyond MAX_EXTEND_LEN: eager
    results = []
    for h in (graphs, eager):
        got = [r["ids"] for r in h.run([h.submit(p, sampling=GREEDY) for p in first])]
        # Second turns: each conversation so far plus 1-40 new tokens, cached but for those.
        rng = random.Random(44)
        turns = [p + out + [rng.randrange(3, 400) for _ in range(rng.randrange(1, 41))] for p, out in zip(first, got)]
        second = h.run([h.submit(t, sampling=GREEDY, return_logprob=True, logprob_start_len=len(t) - 3) for t in turns])
        results.append((got, [(r["ids"], r["cached"]) for r in second], [r["input_logprobs"] for r in second]))
    assert results[0][:2] == results[1][:2]
    for a, b in zip(results[0][2], results[1][2]):
        assert [t for _, t in a] == [t for _, t in b]
        torch.testing.assert_close([lp for lp, _ in a], [lp for lp, _ in b], rtol=1e-4, atol=1e-4)
    assert all(c > 0 for _, c in results[0][1])  # the second turns did extend cached prefixes
    assert replays and all(max(lens) <= MAX_EXTEND_LEN for lens in replays)
    assert any(len(lens) > 1 for lens in replays)  # several requests in one captured pass


@pytest.mark.gpu
def test_long_extends_in_cuda_graphs_give_the_results_of_eager_extends(monkeypatch):
    """With the long-extend graphs (shared.engine.extend_graph.LONG_MAX_TOKENS) prompts of 65 to 500 new tokens,
    alone and a few at a time, and second turns beyond 64 new tokens over cached prefixes replay graphs padded to
    their bucket: the tokens and input logprobs of eager passes."""
    from shared.engine import extend_graph

    monkeypatch.setattr(extend_graph, "LONG_MAX_TOKENS", 512)
    graphs = Harness(max_running_requests=16, cuda_graph_max_extend_tokens=512)
    monkeypatch.setattr(extend_graph, "LONG_MAX_TOKENS", 0)
    eager = Harness(max_running_requests=16, cuda_graph_max_extend_tokens=0)
    eg = graphs.engine.runner.extend_graphs
    assert sorted(eg.long_graphs) == [s for s in eg.sizes if s > extend_graph.MAX_EXTEND_LEN]
    replays, run = [], eg.run
    eg.run = lambda fb, graph: replays.append(graph) or run(fb, graph)
    first = prompts(6, seed=47, lo=65, hi=500)
    results = []
    for h in (graphs, eager):
        alone = [h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 6}, return_logprob=True,
                                 logprob_start_len=len(p) - 4)])[0] for p in first[:3]]
        together = h.run([h.submit(p, sampling={**GREEDY, "max_new_tokens": 6}) for p in first[3:]])
        rng = random.Random(48)
        turns = [p + r["ids"] + [rng.randrange(3, 400) for _ in range(rng.randrange(65, 200))]
                 for p, r in zip(first[:3], alone)]
        second = [h.run([h.submit(t, sampling={**GREEDY, "max_new_tokens": 4})])[0] for t in turns]
        results.append(([r["ids"] for r in alone + together + second], [r["cached"] for r in second],
                        [r["input_logprobs"] for r in alone]))
    assert results[0][:2] == results[1][:2]
    assert all(c > 0 for c in results[0][1])  # the second turns extended cached prefixes
    for a, b in zip(results[0][2], results[1][2]):
        assert [t for _, t in a] == [t for _, t in b]
        torch.testing.assert_close([lp for lp, _ in a], [lp for lp, _ in b], rtol=1e-4, atol=1e-4)
    longs = [p for p in replays if p is not None and p[1]]
    assert len(longs) >= 6  # three prompts alone, their second turns; the three together in one or more passes


def test_long_extend_graphs_are_captured_with_their_own_rows_and_attention_bound(monkeypatch):
    """LONG_MAX_TOKENS: after the short family, one long-extend graph a bucket above MAX_EXTEND_LEN up to it, each
    traced with long_reqs request rows and the attention grid bounded by the whole bucket (checked without a GPU:
    capture_graph stubbed to run the pass once); off (0), none; clear() drops both families."""
    from types import SimpleNamespace

    from shared.engine import cuda_graph, extend_graph

    class _Graph:
        def pool(self):
            return None
    monkeypatch.setattr(cuda_graph, "capture_graph", lambda forward, stream, pool: forward() or _Graph())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    traced = []
    backend = SimpleNamespace(init_forward_metadata=lambda fb: traced.append((fb.num_tokens, fb.batch_size,
                                                                               fb.max_extend_len)))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=8),
                            forward=lambda fb: torch.zeros(fb.num_tokens, 8))
    for long_max, expect in ((256, [96, 128, 160, 192, 256]), (0, [])):
        monkeypatch.setattr(extend_graph, "LONG_MAX_TOKENS", long_max)
        traced.clear()
        r = extend_graph.ExtendGraphRunner(model, None, None, backend, max_tokens=512, max_reqs=16,
                                           dtype=torch.float32, device=torch.device("cpu"), progress=False)
        assert sorted(r.graphs) == r.sizes and sorted(r.long_graphs) == expect
        assert traced[:len(r.sizes)] == [(t, min(t, 16), min(t, extend_graph.MAX_EXTEND_LEN)) for t in reversed(r.sizes)]
        assert traced[len(r.sizes):] == [(t, 4, t) for t in reversed(expect)]
        r.clear()
        assert not r.graphs and not r.long_graphs


def test_extend_graph_eligibility_bounds_tokens_requests_and_new_tokens_per_request():
    """Which extend passes a captured graph takes (the padded bucket must hold every token, every request
    row and each request's new tokens); checked without capturing (no GPU needed)."""
    from shared.engine.extend_graph import MAX_EXTEND_LEN, ExtendGraphRunner, capture_sizes

    assert capture_sizes(15) == [] and capture_sizes(512)[-1] == 512 and capture_sizes(2048)[-1] == 2048
    r = object.__new__(ExtendGraphRunner)
    r.sizes, r.req_cap, r.long_reqs = capture_sizes(512), 16, 4
    r.graphs, r.long_graphs = dict.fromkeys(r.sizes), {}
    assert r.bucket(1) == 16 and r.bucket(17) == 32 and r.bucket(512) == 512 and r.bucket(513) is None
    assert r.max_reqs(16) == 16 and r.max_reqs(512) == 16
    assert r.pick([17] * 10) is not None and r.pick([MAX_EXTEND_LEN] * 8) is not None and r.pick([1] * 16) is not None
    assert r.pick([MAX_EXTEND_LEN + 1]) is None  # one request too long for the attention grid's bound
    assert r.pick([1] * 17) is None  # more request rows than the bucket has
    assert r.pick([64] * 9) is None  # 576 tokens: beyond the largest bucket
    assert r.pick([]) is None
    # The long-extend family (LONG_MAX_TOKENS): up to long_reqs requests of any length within its buckets.
    r.long_graphs = dict.fromkeys(s for s in r.sizes if MAX_EXTEND_LEN < s <= 384)
    assert r.pick([MAX_EXTEND_LEN + 1]) == (96, True) and r.pick([300]) == (320, True)
    assert r.pick([100, 100, 100, 60]) == (384, True)  # four requests, one bucket of 384
    assert r.pick([17] * 10) == (192, False)  # short passes keep the short family
    assert r.pick([65, 1, 1, 1, 1]) is None  # five request rows: more than long_reqs
    assert r.pick([385]) is None and r.pick([200, 200]) is None  # 385 and 400 tokens: beyond the long buckets
    r.graphs = {}
    assert r.pick([5]) is None  # nothing captured
