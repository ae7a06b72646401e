"""Pure-torch versions of every kernel: the CPU path and the oracle the Triton kernels are tested against.

Each function computes in fp32 and returns the dtype its kernel returns; in-place kernels have
out-of-place references so tests can compare.
"""
from __future__ import annotations

import struct

import torch


def paged_attention_ref(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor,
                        prefix_len: int, scaling: float, k_scale: float = 1.0, v_scale: float = 1.0,
                        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q: [n, Hq, D] new tokens at positions prefix_len..prefix_len+n-1; slots: [prefix_len + n] pool
    slots of the whole context. Causal. Returns [n, Hq, D] in q's dtype (computed in fp32).
    k_scale, v_scale: an FP8 pool's (from_pool_ref). new_kv: the new tokens' own k, v [n, Hkv, D] as computed,
    read in place of their pool rows (what extend attention does: an FP8 pool's rounding then only touches the
    cached prefix)."""
    n, hq, d = q.shape
    k = from_pool_ref(k_buf[slots], k_scale)  # [L, Hkv, D]
    v = from_pool_ref(v_buf[slots], v_scale)
    if new_kv is not None and n:
        k[-n:], v[-n:] = new_kv[0].float(), new_kv[1].float()
    group = hq // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scaling
    L = k.shape[0]
    qpos = torch.arange(prefix_len, prefix_len + n, device=q.device).unsqueeze(1)
    kpos = torch.arange(L, device=q.device).unsqueeze(0)
    scores = scores.masked_fill((kpos > qpos).unsqueeze(0), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, v).to(q.dtype)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """y = x / rms(x) * weight. With residual: r = x + residual (rounded to x's dtype), y = norm(r);
    returns (y, r)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        new_residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    y = y.to(x.dtype)
    return (y, new_residual) if residual is not None else y


def residual_norm_produce_ref(h: torch.Tensor, norm) -> torch.Tensor:
    """The producer side of a split residual RMSNorm (kernels/residual_norm.py): h [R, H] (the producer
    GEMV's output, in the activation dtype; R = 1 or 2 rows) added into norm.residual in place, each row's sum of
    squares added to its partials in norm.sumsq; returns g = gamma * residual."""
    r = (h.float() + norm.residual.float()).to(norm.residual.dtype)
    norm.residual.copy_(r)
    rf = r.float()
    norm.sumsq.view(r.shape[0], -1)[:, 0] += rf.pow(2).sum(dim=-1).double()
    return (rf * norm.weight.float()).to(h.dtype)


def residual_norm_scale_ref(norm) -> torch.Tensor:
    """The consumer side: rsqrt(mean(residual^2) + eps) from the producer's partial sums, a row's each (fp32
    [R, 1])."""
    return torch.rsqrt((norm.sumsq.view(norm.residual.shape[0], -1).sum(dim=-1, keepdim=True) / norm.size).float()
                       + norm.eps)


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim] fp32 table: cos in the first half of each row, sin in the second.
    inv_freq [rotary_dim / 2] already carries any rope scaling (Llama 3.1 etc.)."""
    t = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (HF Llama rotate_half) rotary embedding on the first rotary_dim dims of each head.
    q: [T, Hq*D] or [T, Hq, D]; k likewise. Returns new tensors of the same shapes."""
    rot = cos_sin_cache.shape[1]
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2:]

    def apply(x):
        shape = x.shape
        x = x.reshape(x.shape[0], -1, head_dim)
        xf = x.float()
        x1, x2, rest = xf[..., : rot // 2], xf[..., rot // 2: rot], xf[..., rot:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
        return out.to(x.dtype).reshape(shape)

    return apply(q), apply(k)


def rope_store_ref(y: torch.Tensor, rope) -> torch.Tensor:
    """The qkv GEMV's rope epilogue (kernels/rope_store.py) after the fact: y [M, q + 2 kv] (the GEMV's output,
    in the activation dtype) with q and k rotated at rope.positions, k and v written to slots rope.loc of the
    pool. Returns a new tensor."""
    qs, kvs, d = rope.q_size, rope.kv_size, rope.head_dim
    q, k = rope_ref(y[:, :qs], y[:, qs:qs + kvs], rope.positions, rope.cos_sin_cache, d)
    v = y[:, qs + kvs:]
    store_kv_ref(rope.k_buf, rope.v_buf, rope.loc, k.view(y.shape[0], -1, d), v.reshape(y.shape[0], -1, d))
    return torch.cat([q, k, v], dim=-1)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(x[:, :I]) * x[:, I:]."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def inverse_scale(scale: float) -> float:
    """What an FP8 pool's writers multiply by: 1 / scale rounded to fp32 (the store kernels and to_pool_ref)."""
    return 1.0 if scale == 1.0 else struct.unpack("f", struct.pack("f", 1.0 / scale))[0]


def to_pool_ref(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV pool of `dtype` stores it (kernels.kv_store.to_pool): a cast, or for FP8 x / scale (times the
    fp32 inverse) saturated to the format's finite range and rounded to nearest even."""
    if dtype.itemsize != 1:
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return (x.to(torch.float32) * inverse_scale(scale)).clamp(-fmax, fmax).to(dtype)


def from_pool_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Pool values [..] as fp32: an FP8 pool's times its scale."""
    return x.float() * scale if x.dtype.itemsize == 1 else x.float()


def store_kv_ref(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    k_buf[loc.long()] = to_pool_ref(k, k_scale, k_buf.dtype)
    v_buf[loc.long()] = to_pool_ref(v, v_scale, v_buf.dtype)


def decode_inputs_ref(staged: torch.Tensor, token_buf: torch.Tensor, req_to_token: torch.Tensor):
    """kernels.decode_inputs.unpack_decode_inputs out of place: (input_ids, positions, req_pool_indices,
    out_cache_loc, seq_lens, prefix_lens, the new req_to_token)."""
    rows, seq, loc, table = staged.unbind(1)
    table_out = req_to_token.clone()
    table_out[rows, seq - 1] = table.to(torch.int32)
    return (token_buf[rows], seq - 1, rows.clone(), loc.clone(), seq.to(torch.int32), (seq - 1).to(torch.int32),
            table_out)


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w^T with fp32 accumulation, in x's dtype."""
    return (x.float() @ w.float().t()).to(x.dtype)


def decode_attention_ref(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         seq_lens: torch.Tensor, scaling: float, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> torch.Tensor:
    """q: [B, Hq, D], one token per request at the last position of its context."""
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        n = int(seq_lens[i])
        slots = req_to_token[req_pool_indices[i], :n].long()
        out[i:i + 1] = paged_attention_ref(q[i:i + 1], k_buf, v_buf, slots, n - 1, scaling, k_scale, v_scale)
    return out


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, k_scale: float = 1.0,
                     v_scale: float = 1.0):
    """q [n, Hq, D] against pool rows k/v [L, Hkv, D] (no mask): normalised output [n, Hq, D] and natural-log
    log-sum-exp [n, Hq], in fp32."""
    group = q.shape[1] // k.shape[1]
    k = from_pool_ref(k, k_scale).repeat_interleave(group, dim=1)
    v = from_pool_ref(v, v_scale).repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->nhl", q.float(), k) * scaling
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("nhl,lhd->nhd", torch.exp(s - lse[..., None]), v), lse


def cascade_decode_attention_ref(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                                 req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                 seq_lens: torch.Tensor, groups: list[tuple[int, list[int]]],
                                 scaling: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention computed the cascade way: each group's shared prefix (prefix_len, member batch
    indices; the members' first prefix_len slots are the same) attended once for all its members' query
    rows, each request's suffix on its own, the two merged through the log-sum-exp. Equals
    decode_attention_ref."""
    B = q.shape[0]
    rows = req_pool_indices.tolist()
    start = [0] * B
    o_pre = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse_pre = torch.full(q.shape[:2], float("-inf"), device=q.device)
    for plen, members in groups:
        slots = req_to_token[rows[members[0]], :plen].long()
        o, lse = _attend_with_lse(q[members], k_buf[slots], v_buf[slots], scaling, k_scale, v_scale)
        o_pre[members], lse_pre[members] = o, lse
        for b in members:
            start[b] = plen
    out = torch.empty_like(q)
    for b in range(B):
        slots = req_to_token[rows[b], start[b]:int(seq_lens[b])].long()
        o_suf, lse_suf = _attend_with_lse(q[b:b + 1], k_buf[slots], v_buf[slots], scaling, k_scale, v_scale)
        m = torch.maximum(lse_pre[b], lse_suf[0])
        w_pre, w_suf = torch.exp(lse_pre[b] - m), torch.exp(lse_suf[0] - m)
        merged = (w_pre[:, None] * o_pre[b] + w_suf[:, None] * o_suf[0]) / (w_pre + w_suf)[:, None]
        out[b] = merged.to(q.dtype)
    return out


def extend_attention_ref(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                         prefix_lens: list[int], extend_lens: list[int], scaling: float, k_scale: float = 1.0,
                         v_scale: float = 1.0, k: torch.Tensor | None = None,
                         v: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] packed new tokens; each request's new K/V must already be in the pool. k, v [T, Hkv, D]:
    the new tokens' own, read in place of their pool rows (paged_attention_ref's new_kv)."""
    out = torch.empty_like(q)
    start = 0
    for i, (p, n) in enumerate(zip(prefix_lens, extend_lens)):
        slots = req_to_token[req_pool_indices[i], :p + n].long()
        new_kv = (k[start:start + n], v[start:start + n]) if k is not None else None
        out[start:start + n] = paged_attention_ref(q[start:start + n], k_buf, v_buf, slots, p, scaling, k_scale,
                                                   v_scale, new_kv)
        start += n
    return out


FP8_DTYPE = torch.float8_e4m3fn  # e4m3 with no infinities, what FP8 checkpoints hold
FP8_MAX = 448.0  # its largest finite value


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 e4m3 [M, K], float32 scale [M, 1]) with each row's max mapped to the FP8 range."""
    scale = x.abs().amax(dim=-1, keepdim=True).to(torch.float32).clamp(min=1e-12) / FP8_MAX
    q = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_group_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of group) -> (fp8 e4m3 [M, K], float32 scale [M, K / group]): each row's
    groups of `group` consecutive values quantized like quantize_fp8_per_token's rows (the activations of a
    block-scaled FP8 GEMM)."""
    M, K = x.shape
    q, scale = quantize_fp8_per_token(x.reshape(M * (K // group), group))
    return q.reshape(M, K), scale.reshape(M, K // group)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ dequantized(weight)^T in x's dtype, the weight dequantized first (weight-only FP8): one scale per
    row (float32 [N]) or per block (float32 [N / bn, K / bk]; dequantize_fp8_ref)."""
    return torch.nn.functional.linear(x, dequantize_fp8_ref(weight, weight_scale, x.dtype), bias)


def scale_block(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int] | None:
    """The (bn, bk) block of a block-scaled FP8 weight [N, K] whose scale is [N / bn, K / bk] (the blocks
    tile the weight exactly: the engine keeps block scales only then); None for one scale per row."""
    if weight_scale.dim() == 1:
        return None
    (n, k), (sn, sk) = weight.shape, weight_scale.shape
    assert n % sn == 0 and k % sk == 0, f"block scales {tuple(weight_scale.shape)} do not tile a weight {n}x{k}"
    return n // sn, k // sk


def dequantize_fp8_ref(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weight [N, K] with one scale per row ([N]) or per [bn, bk] block ([N / bn, K / bk]) -> the weight
    in `dtype`."""
    block = scale_block(weight, weight_scale)
    if block is None:
        return (weight.to(torch.float32) * weight_scale.to(torch.float32)[:, None]).to(dtype)
    return dequantize_blocks_ref(weight, weight_scale, block, dtype)


def dequantize_blocks_ref(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype) -> torch.Tensor:
    """FP8 weight [N, K] with one scale per [bn, bk] block ([ceil(N / bn), ceil(K / bk)]: the last blocks may be
    partial) -> the weight in `dtype`."""
    (n, k), (bn, bk) = weight.shape, block
    full = scale.to(torch.float32).repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (weight.to(torch.float32) * full).to(dtype)


def block_fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What the block-scaled FP8 GEMM computes: x quantized per token and group of bk inputs, each group's
    products summed in fp32 and scaled by the activation's and the weight block's scales, the sum rounded to
    out_dtype (x's by default)."""
    bn, bk = scale_block(weight, weight_scale)
    xq, xs = quantize_fp8_per_group_ref(x, bk)
    xd = xq.to(torch.float32) * xs.repeat_interleave(bk, 1)
    y = xd @ dequantize_fp8_ref(weight, weight_scale, torch.float32).t()
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(out_dtype or x.dtype)
