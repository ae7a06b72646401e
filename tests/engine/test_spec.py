"""Speculative decoding (shared/engine/spec/): greedy and seeded output equal to decoding without it, the
verification rule's distribution, KV accounting back to baseline, flags refused at start."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from shared.engine.config import EngineConfig
from shared.engine.sampler import SamplingBatch, sample
from shared.engine.spec import SpecConfigError, spec_config_error
from shared.engine.spec.ngram import NgramIndex
from shared.models.tiny_random import tiny_random_config, tiny_random_state_dict
from shared.sampling_params import SamplingParams
from shared.tokenizer import save_tiny_tokenizer
from tests.support.engine_harness import Harness, tokenizer

PROMPTS = [[5, 6, 7, 8, 9, 10, 11] * 5, [20, 21, 22, 23] * 8 + [20, 21], list(range(30, 70)) + list(range(30, 38))]
GREEDY = {"temperature": 0, "max_new_tokens": 12}


def run_all(h: Harness, prompts, sampling, **kw):
    rids = [h.submit(p, sampling=dict(sampling), **kw) for p in prompts]
    return h.run(rids)


@pytest.fixture(scope="module")
def plain():
    return Harness()


@pytest.fixture(scope="module")
def ngram():
    # Pages of 4: a rejected draft's slot in a kept page stays the request's, the rest go back.
    return Harness(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5, page_size=4)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A draft of the tiny tokenizer whose weights differ from the target's: its drafts are often rejected."""
    path = str(tmp_path_factory.mktemp("draft"))
    cfg = tiny_random_config()
    gen = torch.Generator().manual_seed(7)
    sd = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) for k, v in tiny_random_state_dict(cfg).items()}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f)
    save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(path)
    return path


def test_ngram_index_proposes_what_followed_the_longest_match():
    idx = NgramIndex(1, 3)
    idx.sync([1, 2, 3, 4, 9, 2, 3], [], 0)
    assert idx.propose(3) == [4, 9, 2]  # "2 3" was followed by 4 9 2
    idx.sync([1, 2, 3, 4, 9, 2, 3], [4, 7], 1)  # only the confirmed output token is taken
    assert idx.tokens[-1] == 4 and idx.propose(2) == [9, 2]
    idx = NgramIndex(2, 2)
    idx.sync([1, 2, 3], [], 0)
    assert idx.propose(4) == []  # no earlier "2 3"


def check_spec_equals_plain(plain, spec, sampling, prompts=PROMPTS, **kw):
    base = plain.free_tokens()
    want = run_all(plain, prompts, sampling, **kw)
    stats0 = dict(spec.engine.spec.stats.__dict__)
    free0 = spec.free_tokens()
    cache, P = spec.engine.cache, spec.engine.config.page_size
    # What the tree will hold of each sequence: its confirmed tokens with KV (all but the last), page-aligned.
    seqs = [p + w["ids"][:-1] for p, w in zip(prompts, want)]
    before = [cache.match_prefix(x, record=False).length for x in seqs]
    tree0 = cache.evictable_size()
    got = run_all(spec, prompts, sampling, **kw)
    for w, g in zip(want, got):
        assert g["ids"] == w["ids"] and g["text"] == w["text"] and g["finish"] == w["finish"]
        assert g["error"] is None
    # The tree holds those sequences and nothing else: no rejected draft ever entered it.
    after = [cache.match_prefix(x, record=False).length for x in seqs]
    assert after == [len(x) // P * P for x in seqs]
    assert cache.evictable_size() - tree0 == sum(a - b for a, b in zip(after, before))
    # Nothing leaked: the pool and request rows are back (the tree holds the finished requests, evictable).
    assert spec.free_tokens() == free0 and plain.free_tokens() == base
    assert spec.engine.runner.req_pool.available() == spec.engine.config.max_running_requests
    stats = spec.engine.spec.stats
    return want, got, stats.proposed - stats0["proposed"], stats.accepted - stats0["accepted"]


def test_ngram_greedy_equals_plain_with_rejections(plain, ngram):
    _, _, proposed, accepted = check_spec_equals_plain(plain, ngram, GREEDY)
    assert 0 < accepted < proposed  # both acceptance and rejection ran
    info = ngram.engine.info()["speculative"]
    assert info["algorithm"] == "NGRAM" and info["mean_accept_length"] > 1.0


def test_ngram_seeded_sampling_stops_and_logprobs_equal_plain(plain, ngram):
    # Sampling: the same seed gives the same tokens with drafts (the rule is exact, not just in law); with
    # logprobs and top logprobs from the target's verification pass, and a stop token inside an accepted run.
    sampling = {"temperature": 0.9, "seed": 11, "max_new_tokens": 12, "top_k": 20}
    want, got, _, _ = check_spec_equals_plain(plain, ngram, sampling, return_logprob=True, top_logprobs_num=2)
    for w, g in zip(want, got):
        assert [t for _, t in g["logprobs"]] == g["ids"]
        for (a, _), (b, _) in zip(w["logprobs"], g["logprobs"]):
            assert math.isclose(a, b, abs_tol=1e-4)
        assert [[t for _, t in row] for row in g["top"]] == [[t for _, t in row] for row in w["top"]]
    stop_tok = want[0]["ids"][5]
    check_spec_equals_plain(plain, ngram, {**GREEDY, "stop_token_ids": [stop_tok], "repetition_penalty": 1.3,
                                           "min_new_tokens": 3}, prompts=PROMPTS[:1])
    # A stop string inside an accepted run (the worker's detokenizer takes the accepted tokens one by one).
    text = run_all(plain, PROMPTS[:1], GREEDY)[0]["text"]
    for trim in (False, True):
        want, _, _, accepted = check_spec_equals_plain(
            plain, ngram, {**GREEDY, "stop": [text[len(text) // 2:len(text) // 2 + 3]], "no_stop_trim": trim},
            prompts=PROMPTS[:1], stream=True)
        assert want[0]["finish"]["type"] == "stop" and accepted > 0


def test_ngram_with_grammar_equals_plain(plain, ngram):
    # Drafts the regex allows are verified under the masks replayed over them; the rest are cut.
    prompt = tokenizer().encode("abab abab abab abab abab abab abab")
    _, _, proposed, accepted = check_spec_equals_plain(
        plain, ngram, {"temperature": 0, "max_new_tokens": 16, "regex": "(ab|ba| )+"}, prompts=[prompt])
    assert accepted > 0


def test_standalone_same_model_accepts_every_draft(plain):
    # With pages of 4 (rejected drafts' slots in a kept page stay the request's), chunked prompts and mixed
    # chunks (drafting starts once a prompt is done).
    spec = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny-random",
                   speculative_num_steps=3, page_size=4, chunked_prefill_size=16, max_prefill_tokens=32,
                   enable_mixed_chunk=True)
    _, _, proposed, accepted = check_spec_equals_plain(plain, spec, GREEDY, prompts=PROMPTS[:2])
    assert proposed > 0 and accepted == proposed
    draft = spec.engine.spec
    assert draft.allocator.available_size() == draft.allocator.total_size()  # draft KV all given back
    assert draft.runner.req_pool.available() == spec.engine.config.max_running_requests


def test_standalone_other_draft_rejects_and_still_equals_plain(plain, other_draft):
    spec = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path=other_draft,
                   speculative_num_steps=3)
    _, _, proposed, accepted = check_spec_equals_plain(plain, spec, GREEDY, prompts=PROMPTS[:2])
    assert accepted < proposed
    draft = spec.engine.spec
    assert draft.allocator.available_size() == draft.allocator.total_size()


def test_draft_of_a_shorter_context_stops_drafting_at_its_end(plain, other_draft, tmp_path):
    """A draft model whose context is shorter than the target's drafts while a request fits it and not past it
    (the request decodes on plainly): its request table was indexed past its width before."""
    import shutil

    path = str(tmp_path / "draft64")
    shutil.copytree(other_draft, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "max_position_embeddings": 64}, f)
    spec = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path=path, speculative_num_steps=3)
    assert spec.engine.spec.runner.max_context_len == 64 < spec.engine.runner.max_context_len
    prompts = [PROMPTS[0] + PROMPTS[0][:21], PROMPTS[2] * 2]  # 56 tokens: reaches its end; 96: past it
    _, _, proposed, _ = check_spec_equals_plain(plain, spec, {**GREEDY, "ignore_eos": True}, prompts=prompts)
    assert proposed > 0
    draft = spec.engine.spec
    assert draft.allocator.available_size() == draft.allocator.total_size()
    assert draft.runner.req_pool.available() == spec.engine.config.max_running_requests


def test_draft_pool_too_small_for_every_prompt_still_drafts_for_some(plain):
    """The draft's pool (as many tokens as the target's) shares no prefixes: eight requests of one long prompt
    fit the target's pool, not the draft's. The requests whose KV fits draft; before, a round that could not
    hold every request's tokens drafted for none (one verification in the whole run)."""
    spec = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny-random",
                   speculative_num_steps=3, max_total_tokens=600)
    prompts = [list(range(100, 160)) + [5 + i, 6, 7, 8] * 3 for i in range(8)]  # 8 x 72 tokens, 60 shared
    sampling = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True}
    want = run_all(plain, prompts, sampling)
    assert [g["ids"] for g in run_all(spec, prompts, sampling)] == [w["ids"] for w in want]
    stats, draft = spec.engine.spec.stats, spec.engine.spec
    assert stats.verifications >= 16 and stats.accepted == stats.proposed
    assert draft.allocator.available_size() == draft.allocator.total_size()
    assert spec.engine.policy.is_idle() and spec.free_tokens() == spec.engine.runner.max_total_tokens


def test_switch_from_overlapped_steps_to_drafting_equals_plain(plain):
    """Above --speculative-disable-batch-size steps overlap (step N + 1 is launched before N is processed).
    An abort brings the batch under it while a pass is in flight: the requests that draft now leave that
    pass (their rows dropped, their KV forgotten) and verify from the right place: spec off's tokens."""
    prompts = [[(7 * i + j) % 200 + 5 for j in range(12)] * 2 for i in range(5)]
    sampling = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    want = run_all(plain, prompts[1:], sampling)
    h = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny-random",
                speculative_disable_batch_size=4)
    e, dropped = h.engine, []
    process = e._process

    def counting(batch, out, gone=frozenset()):
        dropped.append(len(gone))
        return process(batch, out, gone)
    e._process = counting
    rids = [h.submit(p, sampling=dict(sampling)) for p in prompts]
    for _ in range(6):
        e.step()
    assert e.spec.stats.proposed == 0  # five running: no drafts, overlapped steps
    e.abort(rids[0])
    got = h.run(rids[1:])
    assert [g["ids"] for g in got] == [w["ids"] for w in want]
    assert sum(dropped) > 0 and e.spec.stats.accepted > 0
    assert e.policy.is_idle() and h.free_tokens() == e.runner.max_total_tokens
    assert e.spec.allocator.available_size() == e.spec.allocator.total_size()


def test_acceptance_rule_keeps_the_target_distribution():
    """The verification rule on a 6-token vocabulary: a one-hot draft x is kept when the target's seeded
    sample equals it (probability p(x)); otherwise the sample stands, a draw from p without x renormalized.
    Over many seeds the emitted token follows p (chi-square), and the acceptance rate is p(x)."""
    V, n, x = 6, 6000, 2
    logits = torch.tensor([1.0, 0.2, 0.7, -0.5, 0.0, 1.3])
    p = torch.softmax(logits, 0)
    sb = SamplingBatch.build([SamplingParams(temperature=1.0)] * n, list(range(n)), [3] * n, [[]] * n, None, V, "cpu")
    drawn = sample(logits.expand(n, V).contiguous(), sb).next_token_ids
    accepted = drawn == x
    assert abs(accepted.double().mean().item() - p[x].item()) < 4 * math.sqrt(p[x] * (1 - p[x]) / n)
    emitted = torch.where(accepted, torch.full_like(drawn, x), drawn)
    counts = torch.bincount(emitted, minlength=V).double()
    stat = ((counts - p * n) ** 2 / (p * n)).sum().item()
    assert stat < (V - 1) + 5.5 * math.sqrt(2 * (V - 1))
    rejected = torch.bincount(drawn[~accepted], minlength=V).double()
    q = p.clone()
    q[x] = 0
    q /= q.sum()
    assert rejected[x] == 0 and (rejected / rejected.sum() - q).abs().sum() / 2 < 0.03  # total variation


@pytest.mark.parametrize("flags, message", [
    ({"speculative_algorithm": "EAGLE"}, "not implemented"),
    ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "x"}, "uses no draft model"),
    ({"speculative_draft_model_path": "x"}, "needs --speculative-algorithm"),
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "x", "speculative_num_steps": 3,
      "speculative_num_draft_tokens": 6}, "num-steps + 1"),
])
def test_bad_flags_are_refused(flags, message):
    assert message in spec_config_error(EngineConfig(**flags))


def test_draft_with_another_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer as HF, models, pre_tokenizers

    path = str(tmp_path)
    save_tiny_tokenizer(path)
    hf = HF(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(os.path.join(path, "tokenizer.json"))
    with pytest.raises(SpecConfigError, match="different tokenizer"):
        Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path=path)


def tiny_model_dir(path: str, vocab_size: int, seed: int) -> str:
    """The tiny tokenizer with a model of `vocab_size` embedding rows (more than its ids: padding, as real
    checkpoints have)."""
    import dataclasses

    cfg = dataclasses.replace(tiny_random_config(), vocab_size=vocab_size)
    torch.manual_seed(seed)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf(), f)
    save_file(tiny_random_state_dict(cfg), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    save_tiny_tokenizer(path)
    return path


def test_draft_padded_unlike_the_target_speculates(tmp_path):
    """Same tokenizer, another lm_head padding (Qwen2.5's 0.5B and 7B): accepted, both ways. Drafts are
    sampled within the tokenizer's ids; a prompt holding an id past the draft's rows (the target's padding)
    decodes without drafts. A draft that does not cover the tokenizer is refused."""
    small, big = tiny_model_dir(str(tmp_path / "v512"), 512, 1), tiny_model_dir(str(tmp_path / "v640"), 640, 2)
    prompts = [PROMPTS[0], PROMPTS[1][:-1] + [600]]
    sampling = {**GREEDY, "ignore_eos": True}
    for target, draft, jobs in ((small, big, prompts[:1]), (big, small, prompts)):
        want = run_all(Harness(model_path=target), jobs, sampling)
        spec = Harness(model_path=target, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft)
        got = run_all(spec, jobs, sampling)
        assert [(g["ids"], g["error"]) for g in got] == [(w["ids"], None) for w in want]
        assert spec.engine.spec.stats.proposed > 0
        d = spec.engine.spec
        assert d.allocator.available_size() == d.allocator.total_size()
        assert d.runner.req_pool.available() == spec.engine.config.max_running_requests
    with pytest.raises(SpecConfigError, match="does not cover"):
        Harness(model_path=big, speculative_algorithm="STANDALONE",
                speculative_draft_model_path=tiny_model_dir(str(tmp_path / "v256"), 256, 3))


def test_worker_cli_refuses_bad_flags(capsys):
    from services.worker.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--speculative-algorithm", "EAGLE"])
    assert "not implemented" in capsys.readouterr().err


def test_launcher_refuses_bad_flags(capsys):
    from services.launch import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--speculative-algorithm", "STANDALONE"])
    assert "needs --speculative-draft-model-path" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [{"speculative_algorithm": "NGRAM"},
                                   {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "tiny-random"}])
def test_spec_on_gpu_with_cuda_graphs_equals_plain(flags):
    """On CUDA: verification passes replay the extend graphs, the draft's decode steps its own graphs."""
    plain = Harness(device="cuda")
    spec = Harness(device="cuda", **flags)
    _, _, proposed, accepted = check_spec_equals_plain(plain, spec, {"temperature": 0, "max_new_tokens": 24})
    assert proposed > 0 and accepted > 0


def test_ngram_under_tensor_parallelism_equals_plain(plain):
    """TP=2 (gloo on the CPU): rank 0 drafts and verifies; the ranks replay its catch-up passes and take
    its corrections of the next input (a rejected draft)."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("TP=2 on the GPU needs 2 GPUs")
    want = run_all(plain, PROMPTS[:1], GREEDY)
    h = Harness(tp_size=2, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    try:
        got = run_all(h, PROMPTS[:1], GREEDY)
        stats = h.engine.spec.stats
    finally:
        h.engine.stop()
    assert got[0]["ids"] == want[0]["ids"] and 0 < stats.accepted < stats.proposed


def test_standalone_under_tensor_parallelism_equals_plain(plain, other_draft):
    """TP=2 (gloo on the CPU): the draft is rank 0's alone (a single-rank runner, no ranks of its own); its
    drafts reach the follower as the verification pass's proposals, a rejection's next input by set_token.
    The tokens of spec off, and the very drafts and acceptances of STANDALONE at TP=1."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("TP=2 on the GPU needs 2 GPUs")
    from shared.models import parallel

    flags = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": other_draft,
             "speculative_num_steps": 3}
    assert spec_config_error(EngineConfig(tp_size=2, **flags)) is None  # refused before this worked
    prompts = PROMPTS[:2]
    want = run_all(plain, prompts, GREEDY)
    results = []
    for tp in (1, 2):
        h = Harness(tp_size=tp, **flags)
        try:
            if tp == 2:
                assert len(h.engine.runner.tp.procs) == 1 and h.engine.spec.runner.tp is None
            got = run_all(h, prompts, GREEDY, return_logprob=True)
            assert parallel.tp_size() == tp  # the draft's single-rank passes left the rank state as it was
            stats = h.engine.spec.stats
            results.append(([g["ids"] for g in got], stats.proposed, stats.accepted,
                            [g["logprobs"] for g in got]))
            draft = h.engine.spec
            assert draft.allocator.available_size() == draft.allocator.total_size()
        finally:
            h.engine.stop()
    (ids1, proposed1, accepted1, lps1), (ids2, proposed2, accepted2, lps2) = results
    assert ids2 == ids1 == [w["ids"] for w in want]
    assert (proposed2, accepted2) == (proposed1, accepted1) and 0 < accepted2 < proposed2
    for a, b in zip(lps1, lps2):
        assert [t for _, t in a] == [t for _, t in b]
        assert all(math.isclose(x, y, abs_tol=1e-4) for (x, _), (y, _) in zip(a, b))


@pytest.mark.parametrize("flags", [
    {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5},
    {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "tiny-random"}])
def test_pd_decode_side_drafts_and_equals_plain(plain, flags):
    """PD's decode side (its stages driven here without the transfer glue, as tests/pd/test_stages.py does):
    the prompt's pages come from the plain engine's tree, the first token from its output, and the decode
    worker speculates on the rest (STANDALONE's draft computes the prompt itself: its pages are the target's)."""
    from shared.protocol import KvDone, Transfer
    from tests.pd.test_stages import decode_harness

    prompt = PROMPTS[0]
    sampling = {**GREEDY, "ignore_eos": True}
    want = run_all(plain, [prompt], sampling)[0]
    match = plain.engine.cache.match_prefix(prompt)
    assert match.length == len(prompt)
    pages = plain.engine.runner.gather_kv(match.slots)
    h, _ = decode_harness(**flags)
    e = h.engine
    rid = h.submit(prompt, transfer=Transfer(role="decode", id="s1"), sampling=dict(sampling))
    e.step()
    e.kv_offered("s1")
    e._drain_inbox(block=False)
    e.policy.schedule()
    e.decode_side.announce()
    e.kv_arrived("s1", KvDone(transfer_id="s1", first_token=want["ids"][0]), pages)
    got = h.run([rid])[0]
    assert got["ids"] == want["ids"] and e.spec.stats.verifications > 0
    assert e.policy.is_idle() and h.free_tokens() == e.runner.max_total_tokens


def count_verify_fills(engine) -> list[tuple[int, int]]:
    """(drafts kept, grammar mask fills) of each `_grammar_drafts` call from now on: the draft model hands the
    masks it sampled its drafts under, so verification fills one, after the last (none if the grammar ended);
    the masks it sets are checked against the matcher's own fills."""
    from shared.constrained import GrammarState

    rounds, grammar_drafts, fill = [], engine._grammar_drafts, GrammarState.fill_bitmask
    fills = [0]

    def counting_fill(self, bitmask, row):
        fills[0] += 1
        return fill(self, bitmask, row)

    def counted(req, drafts):
        fills[0] = 0
        GrammarState.fill_bitmask = counting_fill
        try:
            kept = grammar_drafts(req, drafts)
        finally:
            GrammarState.fill_bitmask = fill
        rounds.append((len(kept), fills[0]))
        if kept:  # the masks verification samples under: bit for bit those the matcher fills itself
            g = req.grammar
            g.rollback(len(kept))
            want = torch.full_like(req.proposal_masks, -1)
            for m, t in enumerate(kept):
                fill(g, want, m)
                assert g.try_accept(t)
            if not g.is_terminated():
                fill(g, want, len(kept))
            assert torch.equal(want, req.proposal_masks)
        return kept

    engine._grammar_drafts = counted
    return rounds


def test_standalone_with_grammar_drafts_only_what_it_allows(plain):
    """The draft model's argmax is taken over the tokens the grammar allows at each draft step (its matcher
    advanced over the drafts, rolled back after): a draft equal to the target proposes exactly the target's
    constrained tokens, so nothing is cut before verification and every draft is accepted. JSON schema and
    regex; the engine's jump-forward on (forced runs), as by default."""
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                         "required": ["a", "b"]})
    regex = r"(ab|ba| )+x[0-9]{2}"
    spec = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path="tiny-random",
                   speculative_num_steps=3)
    stats = spec.engine.spec.stats
    prompt = tokenizer().encode("abab abab abab")
    draft = spec.engine.spec
    propose, rounds = draft.propose, []

    def grammar_states(reqs):
        def allowed(g):
            mask = torch.full((1, g.mask_words), -1, dtype=torch.int32)
            g.fill_bitmask(mask, 0)
            return mask.tolist()
        return [(r.grammar.num_accepted, r.grammar.is_terminated() or allowed(r.grammar)) for r in reqs]

    def checked_propose(reqs, budgets):  # each request's matcher exactly as it was after a round
        before = grammar_states(reqs)
        drafts = propose(reqs, budgets)
        assert grammar_states(reqs) == before
        rounds.append(len(reqs))
        return drafts

    draft.propose = checked_propose
    fills = count_verify_fills(spec.engine)
    for key, value, check in (("json_schema", schema, lambda t: set(json.loads(t)) == {"a", "b"}),
                              ("regex", regex, lambda t: re.fullmatch(regex, t) is not None)):
        cut0, proposed, accepted = stats.grammar_cut, stats.proposed, stats.accepted
        # Compared directly, not by check_spec_equals_plain: a request the grammar ends (its stop token) leaves
        # one token more in the radix tree than that check expects, with speculation off as well.
        sampling = {"temperature": 0, "max_new_tokens": 24, key: value}
        want = run_all(plain, [prompt, PROMPTS[1]], sampling)
        got = run_all(spec, [prompt, PROMPTS[1]], sampling)
        assert [(g["ids"], g["text"], g["finish"], g["error"]) for g in got] == \
            [(w["ids"], w["text"], w["finish"], None) for w in want]
        proposed, accepted = stats.proposed - proposed, stats.accepted - accepted
        grammars = spec.engine.grammars
        for g in got:  # every output is in the grammar: a prefix of a match, a full one where the grammar ended it
            assert grammars.new_state(grammars.compile(key, value)).accept_tokens(g["ids"])
            if g["finish"]["type"] == "stop":
                assert check(g["text"]), g["text"]
        assert proposed > 0 and accepted == proposed
        assert stats.grammar_cut == cut0  # no draft the grammar refuses was proposed
    assert want[0]["finish"]["type"] == "stop"  # a draft run may end at the grammar's stop token
    assert spec.engine.info()["speculative"]["grammar_cut"] == 0 and rounds
    # No mask filled twice: the drafts' masks come from the draft runner, verification fills the one after.
    assert fills and all(kept > 0 and n <= 1 for kept, n in fills) and any(n == 1 for _, n in fills)
    assert draft.allocator.available_size() == draft.allocator.total_size()
    assert spec.engine.runner.req_pool.available() == spec.engine.config.max_running_requests


def test_standalone_other_draft_mixed_grammar_batch_equals_plain(plain, other_draft):
    # Constrained and unconstrained requests draft in the same passes (the unconstrained rows unmasked), with a
    # draft that is often wrong: rejections, but no draft the grammar refuses.
    spec = Harness(speculative_algorithm="STANDALONE", speculative_draft_model_path=other_draft,
                   speculative_num_steps=3)
    jobs = [(tokenizer().encode("abab abab abab"), {"temperature": 0, "max_new_tokens": 16, "regex": "(ab|ba| )+"}),
            (PROMPTS[0], GREEDY)]

    def outputs(h):
        return h.run([h.submit(p, sampling=dict(s)) for p, s in jobs])

    fills = count_verify_fills(spec.engine)
    assert [g["ids"] for g in outputs(spec)] == [w["ids"] for w in outputs(plain)]
    assert fills and all(n <= 1 for _, n in fills)
    stats = spec.engine.spec.stats
    assert 0 < stats.accepted < stats.proposed and stats.grammar_cut == 0
