"""Tests of the batched sampler: each sampling option, penalties, determinism and the distribution."""
from __future__ import annotations

import math

import pytest
import torch

from shared.engine.penalties import PenaltyState
from shared.engine.sampler import SamplingBatch, gumbel_noise, row_keys, sample
from shared.sampling_params import SamplingParams as SP

V = 32


def build(params, *, seeds=None, steps=None, output_ids=None, prompt_ids=None, vocab=V, device="cpu",
          eos_ids=None, active=None):
    b = len(params)
    return SamplingBatch.build(
        params, seeds if seeds is not None else list(range(b)), steps if steps is not None else [0] * b,
        output_ids if output_ids is not None else [[] for _ in range(b)], prompt_ids, vocab, device,
        eos_ids=eos_ids, min_new_tokens_active=active)


def draw(logits, params, **kw):
    """Sample with the given per-row params; `logits` [V] is broadcast to every row."""
    vocab_mask = kw.pop("vocab_mask", None)
    if logits.dim() == 1:
        logits = logits.expand(len(params), -1).contiguous()
    return sample(logits, build(params, vocab=logits.shape[1], **kw), vocab_mask=vocab_mask).next_token_ids


def many_seeds(logits, p, n=2000, **kw):
    return draw(logits, [p] * n, seeds=list(range(n)), **kw)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    ok = expected >= 5
    assert counts[~ok].sum() <= 0.002 * counts.sum(), "mass where the target has almost none"
    stat = ((counts[ok] - expected[ok]) ** 2 / expected[ok]).sum().item()
    return stat, int(ok.sum()) - 1


def assert_matches(tokens: torch.Tensor, probs: torch.Tensor):
    stat, dof = chi_square(torch.bincount(tokens, minlength=probs.numel()).double(), probs.double())
    # Draws are a fixed function of the seeds, so this is deterministic; the bound is p ~ 1e-4.
    assert stat < dof + 5.5 * math.sqrt(2 * dof), (stat, dof)


@pytest.fixture
def logits():
    return torch.randn(V, generator=torch.Generator().manual_seed(0)) * 2


# ---- greedy ----
def test_greedy_is_argmax_whatever_the_seed():
    x = torch.randn(16, V, generator=torch.Generator().manual_seed(1))
    for seed in range(3):
        out = draw(x, [SP(temperature=0.0)] * 16, seeds=[seed] * 16)
        assert torch.equal(out, x.argmax(-1))


def test_an_all_greedy_batch_sends_no_row_parameters_to_the_device():
    """Only an argmax runs for it: no per-row tensors are built (each would be a host-to-device copy per
    decode step); one sampled row brings them all back, for every row."""
    greedy = build([SP(temperature=0.0)] * 3)
    assert greedy.all_greedy and greedy.temperatures is None and greedy.seeds is None and greedy.greedy is None
    mixed = build([SP(temperature=0.0), SP(temperature=0.7, top_p=0.9), SP(temperature=0.0)])
    assert not mixed.all_greedy and mixed.temperatures.shape == (3, 1) and mixed.greedy.tolist() == [True, False, True]


def test_top_k_one_equals_greedy():
    x = torch.randn(16, V, generator=torch.Generator().manual_seed(2))
    out = draw(x, [SP(temperature=1.5, top_k=1)] * 16, seeds=list(range(100, 116)))
    assert torch.equal(out, x.argmax(-1))


def test_mixed_greedy_and_sampled_rows():
    x = torch.zeros(4, V)
    x[:, 7] = 1.0  # flat enough that sampled rows rarely pick 7
    params = [SP(temperature=0.0), SP(temperature=1.0), SP(top_k=1), SP(temperature=1.0)]
    outs = torch.stack([draw(x, params, seeds=[s] * 4) for s in range(50)])
    assert (outs[:, 0] == 7).all() and (outs[:, 2] == 7).all()
    assert (outs[:, 1] != 7).sum() > 25 and (outs[:, 3] != 7).sum() > 25


# ---- filters ----
def test_top_k_restricts_support(logits):
    out = many_seeds(logits, SP(temperature=1.0, top_k=5))
    top5 = set(logits.topk(5).indices.tolist())
    assert set(out.tolist()) == top5  # inside the top 5, and all of them reachable
    assert_matches(out, torch.softmax(logits.masked_fill(~torch.isin(torch.arange(V), torch.tensor(list(top5))),
                                                         float("-inf")), -1))


def test_top_p_keeps_the_nucleus_and_renormalizes():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    x = probs.log()
    out = many_seeds(x, SP(top_p=0.75))
    assert set(out.tolist()) == {0, 1}  # 0.5 < 0.75, so the crossing token 1 is kept; 2.. are not
    assert_matches(out, torch.tensor([0.5, 0.3, 0, 0, 0]) / 0.8)
    assert set(many_seeds(x, SP(top_p=0.81)).tolist()) == {0, 1, 2}


def test_top_p_keeps_at_least_one_token():
    x = torch.tensor([0.6, 0.4]).log()
    assert set(many_seeds(x, SP(top_p=0.01), n=300).tolist()) == {0}


def test_top_k_then_top_p_uses_renormalized_top_k_mass():
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])
    # After top_k=2 the survivors are {0: 2/3, 1: 1/3}; top_p=0.6 keeps only token 0 (2/3 >= 0.6).
    # Without renormalization 0.4 < 0.6 would keep token 1 as well.
    out = many_seeds(probs.log(), SP(top_k=2, top_p=0.6), n=500)
    assert set(out.tolist()) == {0}


def test_min_p_relative_to_max_prob():
    probs = torch.tensor([0.4, 0.25, 0.19, 0.16])
    out = many_seeds(probs.log(), SP(min_p=0.5))  # keep p >= 0.2
    assert set(out.tolist()) == {0, 1}
    assert_matches(out, torch.tensor([0.4, 0.25, 0, 0]) / 0.65)


def test_low_temperature_concentrates(logits):
    top = logits.argmax().item()
    hot = (many_seeds(logits, SP(temperature=2.0)) == top).float().mean()
    base = (many_seeds(logits, SP(temperature=1.0)) == top).float().mean()
    cold = (many_seeds(logits, SP(temperature=0.1)) == top).float().mean()
    assert hot < base < cold and cold > 0.95


def test_a_huge_temperature_samples_uniformly_among_allowed_tokens():
    """1e300 overflows float32 to inf and a masked -inf / inf is NaN, which argmax took: a forbidden token (an id past
    the tokenizer's vocabulary, seen through the gateway). It samples as the largest finite temperature does."""
    x = torch.randn(V, generator=torch.Generator().manual_seed(3)) * 4
    x[V - 4:] = float("-inf")  # padded rows, as the model runner masks them
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[:8] = True  # and a grammar allowing 8 tokens
    for t in (1e300, float(torch.finfo(torch.float32).max) * 10, 1e30):
        out = many_seeds(x, SP(temperature=t), vocab_mask=allowed.expand(2000, -1))
        assert out.max().item() < 8, t
        assert_matches(out, allowed.double() / 8)


def test_distribution_matches_softmax_over_seeds():
    x = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    t = 0.7
    out = many_seeds(x, SP(temperature=t), n=20000)
    assert_matches(out, torch.softmax(x / t, -1))
    # The same draws would not pass for the wrong temperature.
    with pytest.raises(AssertionError):
        assert_matches(out, torch.softmax(x, -1))


def test_distribution_matches_softmax_over_steps_of_one_seed():
    x = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    n = 20000
    out = draw(x, [SP()] * n, seeds=[1234] * n, steps=list(range(n)))
    assert_matches(out, torch.softmax(x, -1))


def test_distribution_with_all_filters_on_a_larger_vocab():
    x = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 1.5
    t, k, p = 0.8, 12, 0.85
    out = many_seeds(x, SP(temperature=t, top_k=k, top_p=p), n=20000)
    z = x / t
    kept = z.topk(k).values
    pk = torch.softmax(kept, -1)
    n_keep = int((pk.cumsum(-1) < p).sum()) + 1
    target = torch.full_like(z, float("-inf"))
    idx = z.topk(n_keep).indices
    target[idx] = z[idx]
    assert_matches(out, torch.softmax(target, -1))


def test_gumbel_noise_is_standard_gumbel_and_uniform_over_tokens():
    g = gumbel_noise(row_keys(torch.arange(8), torch.zeros(8, dtype=torch.int64)), 50000)
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.std().item() - math.pi / math.sqrt(6)) < 0.01
    # argmax of pure noise: every token equally likely.
    n = 20000
    out = draw(torch.zeros(10), [SP()] * n, seeds=list(range(n)))
    assert_matches(out, torch.full((10,), 0.1))


# ---- penalties ----
def apply_penalties(x, params, output_ids, prompt_ids=None, **kw):
    st = PenaltyState.build(params, output_ids, prompt_ids, x.shape[1], torch.device("cpu"),
                            kw.get("eos_ids"), kw.get("active", [False] * len(params)))
    return st.apply_(x.clone()) if st is not None else x.clone()


def test_no_penalties_means_no_penalty_state():
    b = build([SP(), SP(temperature=0.0, top_p=0.5)], output_ids=[[1, 2], [3]], prompt_ids=[[4], [5]])
    assert b.penalties is None


def test_frequency_penalty_scales_with_count():
    x = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    hist = [[0, 0, 0, 2]]
    got = apply_penalties(x, [SP(frequency_penalty=0.2)], hist)
    assert torch.allclose(got, torch.tensor([[1.4, 1.5, -0.2, 0.0]]))
    assert draw(x, [SP(temperature=0.0)], output_ids=hist).item() == 0
    assert draw(x, [SP(temperature=0.0, frequency_penalty=0.2)], output_ids=hist).item() == 1


def test_presence_penalty_is_flat():
    x = torch.tensor([[2.0, 1.5, 0.0, 0.0]])
    hist = [[0, 0, 0, 2]]
    got = apply_penalties(x, [SP(presence_penalty=0.2)], hist)
    assert torch.allclose(got, torch.tensor([[1.8, 1.5, -0.2, 0.0]]))
    assert draw(x, [SP(temperature=0.0, presence_penalty=0.2)], output_ids=hist).item() == 0
    assert draw(x, [SP(temperature=0.0, presence_penalty=0.6)], output_ids=hist).item() == 1


def test_repetition_penalty_hf_semantics_over_prompt_and_output():
    x = torch.tensor([[3.0, 2.0, -1.0, -0.5, 1.0]])
    got = apply_penalties(x, [SP(repetition_penalty=2.0)], output_ids=[[0, 0]], prompt_ids=[[2]])
    assert torch.allclose(got, torch.tensor([[1.5, 2.0, -2.0, -0.5, 1.0]]))
    assert draw(x, [SP(temperature=0.0, repetition_penalty=2.0)], output_ids=[[0]], prompt_ids=[[4]]).item() == 1
    # Rows without the penalty are untouched even when another row uses it.
    got = apply_penalties(x.repeat(2, 1), [SP(repetition_penalty=2.0), SP()], [[0], [0]], [[2], [2]])
    assert torch.equal(got[1], x[0])


def test_logit_bias_is_added_and_out_of_range_ids_ignored():
    x = torch.zeros(1, 6)
    x[0, 1] = 1.0
    got = apply_penalties(x, [SP(logit_bias={3: 5.0, 99: 1.0, 0: -2.0})], [[]])
    assert torch.allclose(got, torch.tensor([[-2.0, 1.0, 0.0, 5.0, 0.0, 0.0]]))
    assert draw(x, [SP(temperature=0.0, logit_bias={3: 5.0})]).item() == 3
    out = many_seeds(x[0], SP(logit_bias={4: 100.0}), n=200)
    assert (out == 4).all()


def test_min_new_tokens_blocks_eos_and_stop_ids():
    x = torch.zeros(1, 8)
    x[0, 7], x[0, 5], x[0, 2] = 10.0, 9.0, 1.0  # 7 = eos, 5 = a stop token id
    p = SP(temperature=0.0, min_new_tokens=3, stop_token_ids=[5])
    assert draw(x, [p], eos_ids=[[7]], active=[True]).item() == 2
    assert draw(x, [p], eos_ids=[[7]], active=[False]).item() == 7
    # Default activity: generated so far < min_new_tokens.
    assert draw(x, [p], eos_ids=[[7]], steps=[2]).item() == 2
    assert draw(x, [p], eos_ids=[[7]], steps=[3]).item() == 7
    # The ban beats a logit bias, and holds for sampled rows too.
    ps = SP(min_new_tokens=1, logit_bias={7: 50.0})
    assert (many_seeds(x[0], ps, n=300, eos_ids=[[7]] * 300) != 7).all()


def test_penalties_do_not_touch_raw_logits_or_logprobs():
    x = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    before = x.clone()
    b = build([SP(repetition_penalty=1.5, frequency_penalty=1.0, logit_bias={0: 3.0}), SP(temperature=0.3)],
              output_ids=[[1, 2, 2], []], prompt_ids=[[3], []])
    out = sample(x, b)
    assert torch.equal(x, before)
    lp = torch.log_softmax(x, -1).gather(1, out.next_token_ids[:, None]).squeeze(1)
    assert torch.allclose(out.logprobs, lp, atol=1e-5)


# ---- determinism ----
def test_same_seed_same_tokens_different_seeds_differ():
    x = torch.zeros(1000)
    a = many_seeds(x, SP(), n=200)
    b = many_seeds(x, SP(), n=200)
    assert torch.equal(a, b)
    # 200 uniform draws over 1000 tokens: ~181 distinct expected; a broken seed would give ~1.
    assert len(set(a.tolist())) > 160
    steps = draw(x, [SP()] * 200, seeds=[7] * 200, steps=list(range(200)))
    assert len(set(steps.tolist())) > 160
    # Seeds are taken modulo 2^31 like SamplingParams.validate does.
    assert torch.equal(draw(x, [SP()], seeds=[5 + (1 << 31)]), draw(x, [SP()], seeds=[5]))


def test_draw_is_independent_of_batch_composition():
    gen = torch.Generator().manual_seed(4)
    target = torch.randn(V, generator=gen)
    probe = SP(temperature=0.9, top_p=0.95)
    others = [SP(temperature=0.0), SP(top_k=3, repetition_penalty=1.3), SP(min_p=0.1, logit_bias={2: 4.0}),
              SP(temperature=1.7, frequency_penalty=0.5, presence_penalty=0.5, min_new_tokens=4)]
    for seed in range(40):
        alone = draw(target, [probe], seeds=[seed], steps=[seed % 5]).item()
        x = torch.randn(len(others) + 1, V, generator=gen)
        x[2] = target
        params = others[:2] + [probe] + others[2:]
        seeds = [seed + 1, seed * 3, seed, 99, seed + 2]
        mask = torch.ones(len(params), V, dtype=torch.bool)
        mask[0, :10] = False
        mixed = draw(x, params, seeds=seeds, steps=[0, 1, seed % 5, 3, 4],
                     output_ids=[[1, 2], [3], [], [4, 4], [5]], prompt_ids=[[1], [2], [3], [4], [5]],
                     eos_ids=[[0]] * 5, vocab_mask=mask)
        assert mixed[2].item() == alone


# ---- logprobs ----
def test_logprobs_are_raw_log_softmax_at_the_chosen_token():
    x = torch.randn(6, V, generator=torch.Generator().manual_seed(6)) * 3
    params = [SP(temperature=0.0), SP(temperature=0.5), SP(top_k=3), SP(top_p=0.5), SP(min_p=0.2),
              SP(temperature=0.0, repetition_penalty=3.0)]
    out = sample(x, build(params, output_ids=[[0]] * 6, prompt_ids=[[1]] * 6))
    ref = torch.log_softmax(x, -1).gather(1, out.next_token_ids[:, None]).squeeze(1)
    assert out.logprobs.dtype == torch.float32 and out.next_token_ids.dtype == torch.int64
    assert torch.allclose(out.logprobs, ref, atol=1e-5)
    assert out.top_logprobs is None and out.top_logprobs_ids is None


def test_logprobs_skipped_when_no_row_asks():
    """Without logprobs the same tokens come out (seeded draws included) and nothing else is computed."""
    x = torch.randn(4, V, generator=torch.Generator().manual_seed(9)) * 2
    params = [SP(temperature=0.0), SP(temperature=0.7), SP(top_k=5), SP(temperature=0.0, repetition_penalty=2.0)]
    kw = dict(seeds=[1, 2, 3, 4], steps=[0, 1, 2, 3], output_ids=[[0], [1], [2], [3]], prompt_ids=[[1]] * 4)
    full = sample(x, build(params, **kw))
    bare = sample(x, build(params, **kw), logprobs=False)
    assert torch.equal(full.next_token_ids, bare.next_token_ids)
    assert bare.logprobs is None and bare.top_logprobs is None and bare.top_logprobs_ids is None
    with pytest.raises(ValueError):
        sample(x, build(params, **kw), top_logprobs_num=2, logprobs=False)


def test_top_logprobs_sorted_and_correct():
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(7))
    out = sample(x, build([SP(temperature=0.0), SP(), SP(repetition_penalty=5.0)], output_ids=[[0], [0], [0]]),
                 top_logprobs_num=5)
    ref_vals, ref_ids = torch.log_softmax(x, -1).topk(5, -1)
    assert out.top_logprobs_ids.shape == (3, 5) and out.top_logprobs_ids.dtype == torch.int64
    assert torch.equal(out.top_logprobs_ids, ref_ids)
    assert torch.allclose(out.top_logprobs, ref_vals, atol=1e-5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()


def test_bf16_logits_and_padded_vocab():
    x = torch.randn(4, V + 8, generator=torch.Generator().manual_seed(8))
    x[:, V:] = 100.0  # lm_head padding beyond the real vocab must never win
    out = sample(x.bfloat16(), build([SP(temperature=0.0), SP(), SP(top_k=4), SP(top_p=0.9)]), top_logprobs_num=2)
    assert (out.next_token_ids < V).all() and (out.top_logprobs_ids < V).all()
    assert out.logprobs.dtype == torch.float32


def test_model_dtype_logits_sample_as_their_fp32_widening(monkeypatch):
    """The CUDA-graph runner hands the sampler its lm_head's bf16 logits, not a widened fp32 copy: every
    path (greedy with ties and padding, masked greedy, penalties, random, logprobs) gives what the fp32
    widening of the same logits gives, and a plain greedy argmax reads the bf16 tensor without widening it."""
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(6, V + 8, generator=g) * 3).bfloat16()
    x[:, V:] = 100.0  # lm_head padding
    x[0, 5] = x[0, 17] = x[0, :V].max() + 1  # an exact tie: the first index wins in both
    x[1, :V] = 0.5  # all equal
    mask = torch.rand(6, V, generator=g) < 0.5
    mask[:, 3] = True
    cases = [
        ([SP(temperature=0.0)] * 6, None, False),
        ([SP(temperature=0.0)] * 6, mask, False),
        ([SP(temperature=0.0)] * 6, None, True),
        ([SP(temperature=0.0, frequency_penalty=1.0)] * 6, mask, False),
        ([SP(temperature=0.9), SP(temperature=0.0), SP(top_k=3), SP(top_p=0.8), SP(min_p=0.1), SP()], mask, True),
    ]
    kw = dict(seeds=list(range(6)), steps=[3] * 6, output_ids=[[1, 2, 2]] * 6)
    for params, m, lp in cases:
        a = sample(x, build(params, **kw), vocab_mask=m, logprobs=lp, top_logprobs_num=2 if lp else 0)
        b = sample(x.float(), build(params, **kw), vocab_mask=m, logprobs=lp, top_logprobs_num=2 if lp else 0)
        assert torch.equal(a.next_token_ids, b.next_token_ids), params
        if lp:
            assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.top_logprobs_ids, b.top_logprobs_ids)
    assert sample(x, build([SP(temperature=0.0)] * 6), logprobs=False).next_token_ids[0] == 5
    # The plain greedy path never widens.
    widened = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.dtype) or real_float(t))
    sample(x, build([SP(temperature=0.0)] * 6), logprobs=False)
    sample(x, build([SP(temperature=0.0)] * 6), vocab_mask=mask, logprobs=False)
    assert widened == []
    sample(x, build([SP(temperature=0.0)] * 6), logprobs=True)
    assert widened == [torch.bfloat16]


# ---- grammar hook ----
def test_vocab_mask_respected_for_greedy_and_random():
    x = torch.randn(V, generator=torch.Generator().manual_seed(9))
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[3, 11, 20]] = True
    allowed[x.argmax()] = False
    n = 600
    mask = allowed.expand(n, -1)
    greedy = draw(x, [SP(temperature=0.0)] * n, vocab_mask=mask)
    assert (greedy == x.masked_fill(~allowed, float("-inf")).argmax()).all()
    rand = draw(x, [SP(temperature=1.5)] * n, seeds=list(range(n)), vocab_mask=mask)
    assert set(rand.tolist()) <= {3, 11, 20} and len(set(rand.tolist())) >= 2


# ---- devices ----
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_matches_cpu(compiled, monkeypatch):
    import shared.engine.sampler as sampler_mod
    monkeypatch.setattr(sampler_mod, "COMPILE_ON_CUDA", compiled)
    x = torch.randn(256, 1000, generator=torch.Generator().manual_seed(10))
    params = [SP(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.1)] * 128 + [SP()] * 128
    kw = dict(seeds=list(range(256)), output_ids=[[1, 2, 3]] * 256, prompt_ids=[[4]] * 256, vocab=1000)
    cpu = sample(x, build(params, **kw), top_logprobs_num=3)
    gpu = sample(x.cuda(), build(params, device="cuda", **kw), top_logprobs_num=3)
    assert (cpu.next_token_ids == gpu.next_token_ids.cpu()).float().mean() > 0.99
    assert torch.allclose(cpu.logprobs, gpu.logprobs.cpu(), atol=1e-4)
    assert sampler_mod.COMPILE_ON_CUDA == compiled  # the compiled path really ran
