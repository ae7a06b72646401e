"""Helpers the kernel checks share."""
from __future__ import annotations

import torch


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _head_dims(device):
    return (16, 32, 24) if device.type == "cpu" else (64, 128, 16)


def _rand(*shape, dtype, device):
    return torch.randn(*shape, dtype=torch.float32, device=device).to(dtype)


class _Launches:
    """Stands in for a Triton kernel (kernel[grid](...)): each launch's grid appended to `launched`, then launched."""

    def __init__(self, kernel, launched: list):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(grid)
        return self.kernel[grid]


def _qkv_heads(device):
    """A qkv projection's heads for the rope epilogue checks (Llama-8B's on CUDA, a small set on the CPU):
    (q heads, kv heads, head dim, K, q size, kv size, N, the rotary cos/sin cache)."""
    from kernels.reference import rope_cos_sin_cache
    hq, hkv, d, K = (4, 2, 16, 96) if device.type == "cpu" else (32, 8, 128, 4096)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    return hq, hkv, d, K, hq * d, hkv * d, (hq + 2 * hkv) * d, rope_cos_sin_cache(inv_freq, 4096)


def _block_fp8(N, K, block, gen, device):
    """A random FP8 weight [N, K] with float32 scales [N / bn, K / bk] spread over two decades."""
    from kernels.reference import FP8_DTYPE
    bn, bk = block
    q = (torch.randn(N, K, generator=gen) * 60).clamp(-448, 448).to(FP8_DTYPE)
    s = torch.rand(N // bn, K // bk, generator=gen) * 1e-3 + 1e-5
    return q.to(device), s.to(device)


def _paged_setup(device, dtype, hkv, d, prefix_lens, extend_lens, num_slots=600):
    """A pool with shuffled slots and a req_to_token table for requests in rows 1..B (row 0 = padding)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_buf = _rand(num_slots, hkv, d, dtype=dtype, device=device)
    v_buf = _rand(num_slots, hkv, d, dtype=dtype, device=device)
    perm = torch.randperm(num_slots - 1, device=device) + 1
    r2t = torch.zeros(len(seq_lens) + 2, max(seq_lens) + 3, dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(seq_lens):
        r2t[i + 1, :n] = perm[used:used + n].to(torch.int32)
        used += n
    req_idx = torch.arange(1, len(seq_lens) + 1, device=device)
    return k_buf, v_buf, r2t, req_idx, seq_lens


def _decode_case(device, dtype, lens, hq, hkv, d):
    """One decode batch over a shuffled pool (a zero length: a padding request): (k_buf, v_buf, req_to_token,
    req_idx, seq_lens, the live rows, q, the reference output of the live rows)."""
    from kernels.reference import decode_attention_ref
    k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, dtype, hkv, d, [max(0, n - 1) for n in lens],
                                                 [min(1, n) for n in lens])
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    live = [i for i, n in enumerate(lens) if n]
    q = _rand(len(lens), hq, d, dtype=dtype, device=device)
    ref = decode_attention_ref(q[live], k_buf, v_buf, r2t, req_idx[live], seq_lens[live], d ** -0.5)
    return k_buf, v_buf, r2t, req_idx, seq_lens, live, q, ref


def _extend_case(device, dtype, hq, hkv, d, prefix, ext):
    """An extend pass over _paged_setup's pool: the pool, table, rows, q, the new tokens' k and v (in the pool, as the
    backend guarantees, and passed packed), the requests' start offsets, and the reference's output."""
    from kernels.reference import extend_attention_ref
    k_buf, v_buf, r2t, req_idx, _ = _paged_setup(device, dtype, hkv, d, prefix, ext)
    q = _rand(sum(ext), hq, d, dtype=dtype, device=device)
    slots = torch.cat([r2t[i + 1, p:p + e] for i, (p, e) in enumerate(zip(prefix, ext))]).long()
    starts = torch.tensor([sum(ext[:i]) for i in range(len(ext))], dtype=torch.int32, device=device)
    ref = extend_attention_ref(q, k_buf, v_buf, r2t, req_idx, prefix, ext, d ** -0.5)
    return k_buf, v_buf, r2t, req_idx, q, k_buf[slots], v_buf[slots], starts, ref


def write_rows(r2t, rows, prefix, ext, locs, device) -> None:
    """Each row's new slots into the request-to-token table after its prefix (locs: all rows' slots, in order)."""
    off = 0
    for row, p, e in zip(rows, prefix, ext):
        r2t.write(row, p, locs[off:off + e].to(device))
        off += e
