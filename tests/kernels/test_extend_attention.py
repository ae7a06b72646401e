"""Extend (prefill) attention over a paged prefix (kernels/attention/triton_extend.py), TMA included."""
from __future__ import annotations

import torch

from tests.kernels._helpers import _tol, _head_dims, _extend_case
from tests.kernels._runner import kernel_tests


def check_extend_attention(device, dtype):
    from kernels.attention.triton_extend import extend_attention, extend_pack
    # A request with no new tokens is a captured graph's padding row: it must write nothing.
    cases = [([0, 5, 33, 0], [7, 1, 30, 70]), ([130], [33]), ([40, 0, 9], [17, 0, 5])]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    for d in _head_dims(device)[:2]:
        for hq, hkv in [(4, 4), (4, 2), (8, 2), (12, 2), (8, 1)]:  # groups 1, 2, 4, 6 (packs 2), 8
            for prefix, ext in cases:
                k_buf, v_buf, r2t, req_idx, q, k, v, starts, ref = _extend_case(device, dtype, hq, hkv, d, prefix, ext)
                # pack: query heads per program (None: the kernel's choice); a grid bound above the
                # longest request (as a captured graph has) changes nothing.
                full = extend_pack(hq, hkv)
                assert (hq // hkv) % full == 0 and full & (full - 1) == 0
                for pack, bound in [(None, max(ext)), (1, max(ext)), (full, max(ext) + 40), (max(1, full // 2), max(ext))]:
                    out = extend_attention(q, k, v, k_buf, v_buf, r2t, req_idx, i32(prefix), i32(ext), starts,
                                           bound, d ** -0.5, pack=pack)
                    torch.testing.assert_close(out, ref, **_tol(dtype),
                                               msg=lambda m: f"d={d} hq={hq} hkv={hkv} {prefix} {ext} pack={pack}: {m}")


def check_extend_attention_tma(device, dtype):
    """The new tokens' k and v read by TMA: the pointer loads' output (bit for bit interpreted; on a GPU
    within the dtype's tolerance), and the reference's. Requests side by side, so a tile read past one request's end
    holds the next one's rows, which the mask must hide."""
    from kernels.attention.triton_extend import extend_attention, tma_applies
    d = 64
    blk = 32 if device.type == "cpu" else 64  # the tile's key block here
    cases = [([0, 0], [3 * blk + 5, 2 * blk - 3]), ([17, 0, 40], [blk + 1, 2 * blk + 9, 7])]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    for hq, hkv in [(8, 2), (4, 4)]:
        for prefix, ext in cases:
            k_buf, v_buf, r2t, req_idx, q, k, v, starts, ref = _extend_case(device, dtype, hq, hkv, d, prefix, ext)
            interpreted = device.type == "cpu"
            assert tma_applies(k, v, d) == (interpreted or torch.cuda.get_device_capability(device)[0] >= 9)
            base = extend_attention(q, k, v, k_buf, v_buf, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext),
                                    d ** -0.5, tma=False)
            out = extend_attention(q, k, v, k_buf, v_buf, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext),
                                   d ** -0.5, tma=True)
            msg = f"hq={hq} hkv={hkv} {prefix} {ext}"
            if interpreted:
                assert torch.equal(out, base), msg
            else:
                torch.testing.assert_close(out, base, **_tol(dtype), msg=lambda m: f"{msg}: {m}")
            torch.testing.assert_close(out, ref, **_tol(dtype), msg=lambda m: f"{msg}: {m}")
            # An FP8 pool under the prefix (the new tokens' k and v stay in q's dtype): the same output either way.
            kb8, vb8 = k_buf.to(torch.float8_e4m3fn), v_buf.to(torch.float8_e4m3fn)
            outs = [extend_attention(q, k, v, kb8, vb8, r2t, req_idx, i32(prefix), i32(ext), starts, max(ext), d ** -0.5,
                                     k_scale=0.5, v_scale=2.0, tma=t) for t in (False, True)]
            if interpreted:
                assert torch.equal(*outs), f"FP8 pool: {msg}"
            else:
                torch.testing.assert_close(*outs, **_tol(dtype), msg=lambda m: f"FP8 pool: {msg}: {m}")


def test_extend_reads_new_tokens_by_tma_from_256_tokens_a_request(monkeypatch):
    """The prefill kernel takes the new tokens' k and v by TMA in passes whose longest request adds at least
    TMA_MIN_TOKENS, where tma_applies (docs/kernels.md); shorter passes (the short-extend graphs, jump-forward's
    catch-up) and layouts TMA cannot read keep the pointer loads; tma= overrides."""
    import kernels.attention.triton_extend as te

    launches = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw.get("TMA", False))

    monkeypatch.setattr(te, "_extend_kernel", Launch())
    monkeypatch.setattr(te, "_kv_descriptor", lambda t, block_n: ("desc", block_n))
    hq, hkv, d = 8, 2, 64

    def run(max_len, tma=None, kv=None):
        T = max_len
        q = torch.zeros(T, hq, d)
        k = v = kv if kv is not None else torch.zeros(T, hkv, d)
        one = torch.ones(1, dtype=torch.int32)
        te.extend_attention(q, k, v, torch.zeros(4, hkv, d), torch.zeros(4, hkv, d), torch.zeros(2, 4, dtype=torch.int32),
                            one, one * 0, one * T, one * 0, max_len, 0.125, tma=tma)
        return launches.pop()

    monkeypatch.setattr(te, "tma_applies", lambda k, v, block_d: True)
    assert te.TMA_MIN_TOKENS == 256
    assert [run(n) for n in (64, 255, 256, 4096)] == [False, False, True, True]
    assert run(64, tma=True) and not run(4096, tma=False)
    monkeypatch.setattr(te, "tma_applies", lambda k, v, block_d: False)
    assert not run(4096) and not run(4096, tma=True)
    # What TMA can read: heads side by side at a power-of-two head size, 16-byte rows; not a CPU tensor outside
    # the interpreter.
    monkeypatch.undo()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kv = torch.zeros(16, hkv, d, dtype=torch.bfloat16)
    assert te.tma_applies(kv, kv, d)
    assert not te.tma_applies(kv, kv, 128)  # a block wider than the head
    assert not te.tma_applies(kv.transpose(0, 1).contiguous().transpose(0, 1), kv, d)  # heads not side by side
    padded = torch.zeros(16, hkv * d + 4, dtype=torch.bfloat16)[:, :hkv * d].unflatten(1, (hkv, d))
    assert te.tma_applies(kv, kv, d) and not te.tma_applies(padded, kv, d)  # token rows 8 bytes off 16
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not te.tma_applies(kv, kv, d)


test_interpreted_cpu, test_cuda_bf16 = kernel_tests(globals())
