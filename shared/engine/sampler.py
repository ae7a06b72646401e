"""Batched next-token sampler: penalties, grammar mask, greedy or temperature / top-k / top-p / min-p
sampling, and raw logprobs, for a whole batch in a few tensor ops.

Randomness is a counter-based hash of (seed, step, token id), turned into Gumbel noise, so a
request's draw depends only on its own seed and step: it is the same alone or in any batch, and on
any device up to float rounding of the logits, and needs no generator state. Sampling is then argmax(filtered_logits / T + Gumbel), which
is an exact draw from softmax(filtered_logits / T) (the "exponential race": argmax p_i / E_i).

Host work (building `SamplingBatch` from lists) happens once per step; `sample` itself never syncs
with the host, and its shapes depend only on host-side facts fixed at build time.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kernels.h2d import to_device
from shared.engine.penalties import PenaltyState
from shared.knobs import knob
from shared.sampling_params import SamplingParams

_NEG_INF = float("-inf")
# Temperatures above this sample as it does (logits / 1e30 are far under float32's resolution against the Gumbel
# noise: uniform over the allowed tokens); larger ones overflow float32 to inf, and a masked -inf / inf is NaN,
# which argmax picks: a token the mask forbids (a padded vocabulary row, a grammar's refusal).
MAX_TEMPERATURE = 1e30
logger = logging.getLogger(__name__)

# On CUDA the noise + race runs as one torch.compile'd kernel (compiled once, dynamic shapes): eager makes ~18
# passes over [B, V] int64, about 3x the whole sampled step at B=256, V=128k. False stays eager (draws are the same
# integers either way); set False here too when compiling fails.
COMPILE_ON_CUDA = knob("COMPILE_ON_CUDA")

# ---- counter-based hash in int64 torch ops ----
# Every value stays below 2^31 and every constant below 2^31, so products stay below 2^62: no int64
# overflow on any backend, and the same integers (hence the same draws) on CPU and CUDA.
_MASK31 = (1 << 31) - 1
_MUL_A = 0x27D4EB2F
_MUL_B = 0x165667B1
_GOLDEN = 0x61C88647  # odd; spreads consecutive counters before mixing


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """Bijective avalanche mix of 31-bit values (xorshift-multiply rounds, murmur-style), in place."""
    x ^= x >> 16
    x.mul_(_MUL_A).bitwise_and_(_MASK31)
    x ^= x >> 15
    x.mul_(_MUL_B).bitwise_and_(_MASK31)
    x ^= x >> 16
    return x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """[B] int64 key per (seed, step)."""
    k = _mix31(seeds.bitwise_and(_MASK31))
    k = _mix31((k + steps.bitwise_and(_MASK31) * _GOLDEN).bitwise_and_(_MASK31))
    return k


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] float32 standard Gumbel noise, a pure function of (key, token id)."""
    tok = torch.arange(vocab_size, dtype=torch.int64, device=keys.device) * _GOLDEN
    x = (keys[:, None] ^ _MASK31) + tok  # xor so that key 0 does not mix like a bare counter
    x.bitwise_and_(_MASK31)
    x = _mix31(x)  # one round suffices: 2-D chi-square of adjacent tokens / seeds / steps is clean
    # 23 bits so that (n + 0.5) is exact in float32 and u lies strictly inside (0, 1).
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(u))


# ---- per-step batch description ----
@dataclass
class SamplingBatch:
    batch_size: int
    vocab_size: int
    # Host-side facts that decide which ops run at all.
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # 0 when no sampled row uses top-k
    use_top_p: bool
    use_min_p: bool
    penalties: PenaltyState | None = None
    # The per-row tensors; None when every row is greedy (all_greedy: only an argmax runs).
    temperatures: torch.Tensor | None = None  # [B, 1] float32; 1.0 on greedy rows (never divides by ~0)
    top_ps: torch.Tensor | None = None  # [B, 1] float32; 1.0 where unused
    min_ps: torch.Tensor | None = None  # [B, 1] float32; 0.0 where unused
    top_ks: torch.Tensor | None = None  # [B, 1] int64; vocab_size where unused
    seeds: torch.Tensor | None = None  # [B] int64
    steps: torch.Tensor | None = None  # [B] int64
    greedy: torch.Tensor | None = None  # [B] bool

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: list[int], steps: list[int],
              output_ids: list[list[int]], prompt_ids: list[list[int]] | None, vocab_size: int,
              device, eos_ids: list[list[int]] | None = None,
              min_new_tokens_active: list[bool] | None = None) -> "SamplingBatch":
        """Host-side, once per step. `min_new_tokens_active` defaults to steps[i] < min_new_tokens."""
        device = torch.device(device)
        b = len(params)
        if not (len(seeds) == len(steps) == len(output_ids) == b):
            raise ValueError("params, seeds, steps and output_ids must have one entry per request")
        greedy = [p.greedy for p in params]
        temps, top_ps, min_ps, top_ks = [], [], [], []
        for p, g in zip(params, greedy):
            # Greedy rows carry neutral values so they never switch a filter on for the batch.
            temps.append(1.0 if g else min(float(p.temperature), MAX_TEMPERATURE))
            top_ps.append(1.0 if g else float(p.top_p))
            min_ps.append(0.0 if g else float(p.min_p))
            k = p.top_k
            top_ks.append(vocab_size if g or k < 0 or k >= vocab_size else int(k))
        if min_new_tokens_active is None:
            min_new_tokens_active = [s < p.min_new_tokens for p, s in zip(params, steps)]

        all_greedy = all(greedy)
        rows: dict = {}
        if not all_greedy:  # all greedy: only an argmax runs, and no per-row parameter goes to the device
            # One host->device copy per dtype.
            floats = to_device([temps, top_ps, min_ps], torch.float32, device)
            ints = to_device([[s & 0x7FFFFFFF for s in seeds], list(steps), top_ks], torch.int64, device)
            rows = dict(temperatures=floats[0, :, None], top_ps=floats[1, :, None], min_ps=floats[2, :, None],
                        seeds=ints[0], steps=ints[1], top_ks=ints[2, :, None],
                        greedy=to_device(greedy, torch.bool, device))
        sampled_k = [k for k, g in zip(top_ks, greedy) if not g and k < vocab_size]
        return cls(
            batch_size=b, vocab_size=vocab_size, **rows,
            all_greedy=all_greedy, any_greedy=any(greedy),
            max_top_k=max(sampled_k, default=0),
            use_top_p=any(tp < 1.0 for tp in top_ps), use_min_p=any(mp > 0.0 for mp in min_ps),
            penalties=PenaltyState.build(params, output_ids, prompt_ids, vocab_size, device,
                                         eos_ids, min_new_tokens_active),
        )


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32: log-softmax of the raw logits at the chosen token (None:
    #   not asked for)
    top_logprobs_ids: torch.Tensor | None  # [B, k] int64, of the raw distribution, best first
    top_logprobs: torch.Tensor | None  # [B, k] float32


# ---- the per-step path ----
def sample(logits: torch.Tensor, batch: SamplingBatch, top_logprobs_num: int = 0,
           vocab_mask: torch.Tensor | None = None, logprobs: bool = True) -> SampleOutput:
    """Choose one token per row of `logits` [B, >=V].

    `vocab_mask`: optional bool [B, V] of ALLOWED tokens (the grammar hook); applied after penalties,
    before greedy or random choice. A row with nothing allowed yields token 0.
    `logprobs`: False when no row asked for them: the log-partition (two passes over [B, V]) and the
    chosen tokens' logprobs are skipped (SampleOutput.logprobs is None; top_logprobs_num must be 0).
    """
    raw = logits[:, :batch.vocab_size]  # drop lm_head padding columns, if any
    if raw.dtype != torch.float32 and (logprobs or not batch.all_greedy or batch.penalties is not None):
        # Logprobs, penalties and the random race compute in fp32. A greedy argmax (masked or not) reads the
        # model's logits as they are: the same values, so the same token, without a widened copy.
        raw = raw.float()
    work = raw
    if batch.penalties is not None or vocab_mask is not None:
        work = raw.clone()  # raw must survive for logprobs (and may alias the caller's tensor)
        if batch.penalties is not None:
            batch.penalties.apply_(work)
        if vocab_mask is not None:
            work.masked_fill_(~vocab_mask[:, :batch.vocab_size], _NEG_INF)

    if batch.all_greedy:
        next_ids = work.argmax(dim=-1)
    else:
        next_ids = _sample_random(work, batch)
        if batch.any_greedy:
            next_ids = torch.where(batch.greedy, work.argmax(dim=-1), next_ids)

    if not logprobs:
        if top_logprobs_num > 0:
            raise ValueError("top logprobs need logprobs")
        return SampleOutput(next_ids, None, None, None)
    lse = torch.logsumexp(raw, dim=-1, keepdim=True)
    chosen = raw.gather(1, next_ids[:, None]).sub_(lse).squeeze(1)
    top_ids = top_lp = None
    if top_logprobs_num > 0:
        k = min(top_logprobs_num, batch.vocab_size)
        vals, top_ids = raw.topk(k, dim=-1, sorted=True)
        top_lp = vals - lse
    return SampleOutput(next_ids, chosen, top_ids, top_lp)


def _sample_random(work: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    scaled = work / batch.temperatures
    scaled = _filter_top_k_top_p(scaled, batch)
    if batch.use_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p); the max token survives
        # top-k/top-p, so this equals min-p on the renormalized probabilities. log(0) = -inf: no-op.
        threshold = scaled.amax(dim=-1, keepdim=True) + torch.log(batch.min_ps)
        scaled = scaled.masked_fill(scaled < threshold, _NEG_INF)
    return _race(scaled, row_keys(batch.seeds, batch.steps))


def race_eager(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax(scaled + Gumbel): one exact draw per row from softmax(scaled)."""
    return (scaled + gumbel_noise(keys, scaled.shape[-1])).argmax(dim=-1)


_race_compiled = None


def _race(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    global _race_compiled, COMPILE_ON_CUDA
    if not (COMPILE_ON_CUDA and scaled.is_cuda):
        return race_eager(scaled, keys)
    if _race_compiled is None:
        _race_compiled = torch.compile(race_eager, dynamic=True)
    try:
        return _race_compiled(scaled, keys)
    except Exception:  # a broken toolchain must not take sampling down with it
        logger.exception("torch.compile of the sampler failed; falling back to eager")
        COMPILE_ON_CUDA = False
        return race_eager(scaled, keys)


def _filter_top_k_top_p(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask to -inf every logit below the row's cut-off. Cut-offs are logit values, so ties with the
    last kept token are kept too (the choice never depends on sort order)."""
    if batch.max_top_k == 0 and not batch.use_top_p:
        return scaled
    if not batch.use_top_p:
        # top-k alone needs only the first max_top_k values, not a full sort.
        top_vals = scaled.topk(batch.max_top_k, dim=-1, sorted=True).values
        kth = top_vals.gather(1, batch.top_ks.clamp(max=batch.max_top_k) - 1)
        threshold = torch.where(batch.top_ks >= batch.vocab_size, _NEG_INF, kth)
        return scaled.masked_fill(scaled < threshold, _NEG_INF)

    sorted_logits = scaled.sort(dim=-1, descending=True).values
    if batch.max_top_k:
        # Top-k first, then top-p over the renormalized survivors (HF / vLLM order).
        rank = torch.arange(batch.vocab_size, device=scaled.device)
        sorted_logits = sorted_logits.masked_fill(rank >= batch.top_ks, _NEG_INF)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # Keep every token whose preceding mass is < top_p: those strictly under, plus the one crossing.
    keep = (cum < batch.top_ps).sum(dim=-1, keepdim=True) + 1
    keep = torch.where(batch.top_ps >= 1.0, batch.vocab_size, keep)  # rounding must not trim the tail
    keep = torch.minimum(keep.clamp(max=batch.vocab_size), batch.top_ks)
    threshold = sorted_logits.gather(1, keep - 1)
    return scaled.masked_fill(scaled < threshold, _NEG_INF)
