"""Device dispatch for the model code: Triton kernels on CUDA, the torch references elsewhere.

In-place contracts hold on both paths (apply_rope writes q and k; store_kv writes the buffers;
apply_rope_and_store_kv does both).
rms_norm with a residual returns (y, new_residual): use the returned residual, since only the Triton
path also updates its argument in place.
A residual RMSNorm split around two GEMVs (kernels/residual_norm.py) updates its residual in place on both
paths: linear/silu_mul_linear with `add_norm` produce it, with `norm_in` consume it.
linear with `rope` (one row, a qkv projection; kernels/rope_store.py) returns q and k rotated and writes k, v
to the token's pool slot, on both paths.
"""
from __future__ import annotations

import torch

from kernels import reference as ref
from kernels.residual_norm import ResidualNorm
from kernels.rope_store import RopeStore
from shared.knobs import knob

# Rows up to which a linear takes the GEMV (bf16 weights: one row on its row kernel, several on its tensor-core tile)
# rather than cuBLAS, and FP8 weights with per-row scales the weight-only GEMV rather than quantize +
# torch._scaled_mm (W8A8). Read when a linear is called (a CUDA graph keeps what it captured).
GEMV_MAX_M = knob("GEMV_MAX_M")
GEMV_MAX_M_FP8 = knob("GEMV_MAX_M_FP8")


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             zero: torch.Tensor | None = None):
    """zero: a tensor also filled with zeros (the split norms' partial sums of the pass this norm starts)."""
    if _on_gpu(x):
        from kernels.norm import rms_norm as k
        return k(x, weight, eps, residual, zero)
    if zero is not None:
        zero.zero_()
    return ref.rms_norm_ref(x, weight, eps, residual)


def embed_rms_norm(ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float,
                   zero: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(table[ids]), table[ids]): the embedding lookup and the first norm of a pass (one launch on
    CUDA); zero: as rms_norm's."""
    if _on_gpu(table):
        from kernels.norm import embed_rms_norm as k
        return k(ids, table, weight, eps, zero)
    if zero is not None:
        zero.zero_()
    e = torch.nn.functional.embedding(ids, table)
    return ref.rms_norm_ref(e, weight, eps), e


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_gpu(q):
        from kernels.rope import apply_rope as kern
        return kern(q, k, positions, cos_sin_cache, head_dim)
    q_new, k_new = ref.rope_ref(q, k, positions, cos_sin_cache, head_dim)
    q.copy_(q_new)
    k.copy_(k_new)
    return q, k


def l2_prefetch(t: torch.Tensor, pdl: bool | None = None) -> None:
    """A hint that t will be read soon: on Hopper GPUs its bytes are brought into L2 (kernels/prefetch.py);
    a no-op elsewhere."""
    if _on_gpu(t):
        from kernels.prefetch import l2_prefetch as kern
        kern(t, pdl)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _on_gpu(x):
        from kernels.activation import silu_and_mul as kern
        return kern(x)
    return ref.silu_and_mul_ref(x)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k_scale, v_scale: an FP8 pool's (kernels/kv_store.py)."""
    if _on_gpu(k):
        from kernels.kv_store import store_kv as kern
        kern(k_buf, v_buf, loc, k, v, k_scale, v_scale)
    else:
        ref.store_kv_ref(k_buf, v_buf, loc, k, v, k_scale, v_scale)


def apply_rope_and_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos_sin_cache: torch.Tensor, head_dim: int, k_buf: torch.Tensor, v_buf: torch.Tensor,
                            loc: torch.Tensor, out: bool = False, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """apply_rope then store_kv; one kernel on CUDA (k, v: [T, Hkv, D]). Returns (q, k, v): rotated in
    place, or with `out` new contiguous [T, H, D] tensors (kernels.rope.apply_rope_and_store_kv)."""
    if _on_gpu(q):
        from kernels.rope import apply_rope_and_store_kv as kern
        return kern(q, k, v, positions, cos_sin_cache, head_dim, k_buf, v_buf, loc, out=out, k_scale=k_scale,
                    v_scale=v_scale)
    if out:
        q, k, v = (x.reshape(x.shape[0], -1, head_dim).clone(memory_format=torch.contiguous_format) for x in (q, k, v))
    q, k = apply_rope(q, k, positions, cos_sin_cache, head_dim)
    store_kv(k_buf, v_buf, loc, k, v, k_scale, v_scale)
    return q, k, v


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None, norm_in: ResidualNorm | None = None,
           add_norm: ResidualNorm | None = None, rope: RopeStore | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias). With `weight_scale` the weight is FP8 e4m3 and each row (float32
    [N]) or [bn, bk] block (float32 [N / bn, K / bk]) dequantizes by its scale. norm_in / add_norm: one row, a split residual RMSNorm's consumer
    (x is gamma * residual; the output is scaled by the norm) or producer (returns gamma * residual).
    rope: one row of a qkv projection without bias; q and k come out rotated, k and v also go to the pool.
    out (with norm_in): the output buffer, of any float dtype (the GEMV writes its sums rounded to x's dtype)."""
    if norm_in is not None or add_norm is not None or rope is not None:
        return _split_norm_linear(x, weight, bias, weight_scale, norm_in, add_norm, gated=False, rope=rope, out=out)
    assert out is None, "linear writes into `out` only as a split norm's consumer"
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias)
    if _gemv_applies(x, weight, None):
        from kernels.gemv import gemv
        y = gemv(x, weight)
        return y + bias if bias is not None else y
    return torch.nn.functional.linear(x, weight, bias)


def _gemv_applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """The decode-time GEMV takes this matmul: CUDA, contiguous rows, and bf16 weights at most GEMV_MAX_M rows or
    FP8 ones with their scales at one row, or at most GEMV_MAX_M_FP8 rows where the scales are per row."""
    if not (_on_gpu(x) and x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1):
        return False
    if weight_scale is None:
        return x.shape[0] <= GEMV_MAX_M and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
    return x.shape[0] <= (GEMV_MAX_M_FP8 if weight_scale.dim() == 1 else 1)  # block scales: one row


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> bool:
    """Whether linear(x, weight, ..., weight_scale) runs on the decode GEMV (and gated_linear's epilogue with it): the
    models' question. ops itself asks _gemv_applies, so that a test can pretend a GPU to a model (patching this one)
    while ops still computes on the CPU."""
    return _gemv_applies(x, weight, weight_scale)


def two_row_norms_apply(x: torch.Tensor, weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> bool:
    """Whether a two-row pass may split its residual norms into the GEMVs around them, as one row does: x [2, K] on the
    GEMV, and each (weight, scale) of a layer's linears on its one-row kernel (each row its own partial sums). The
    models' question, like gemv_applies."""
    import kernels.gemv as kg
    return x.shape[0] == 2 and all(_gemv_applies(x, w, s) and not kg.on_tensor_cores(2, w, s) for w, s in weights)


def two_row_gating_applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> bool:
    """Whether a two-row pass's gate_up projection runs on the GEMV's one-row kernel with the gating epilogue, as one
    row does, rather than on its tensor-core tile. The models' question."""
    import kernels.gemv as kg
    return (x.shape[0] == 2 and _gemv_applies(x, weight, weight_scale)
            and not kg.on_tensor_cores(2, weight, weight_scale))


def gemv_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """x @ weight^T (unquantized) written into out ([M, N] of x's dtype or wider) by the GEMV, where the GEMV takes
    this matmul (CUDA, bf16, at most GEMV_MAX_M rows); None where it does not."""
    if not _gemv_applies(x, weight, None):
        return None
    from kernels.gemv import gemv
    return gemv(x, weight, out=out)


def _split_norm_linear(x, weight, bias, weight_scale, norm_in: ResidualNorm | None, add_norm: ResidualNorm | None,
                       gated: bool, rope: RopeStore | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMV's epilogues (split norms: one row; rope + KV store: the rows the GEMV takes) or their torch
    equivalents."""
    assert all(n is None or n.rows == x.shape[0] for n in (norm_in, add_norm)) and (add_norm is None or bias is None), \
        "split norms: the rows of x (one, or two on the GEMV's two-row kernel), a producer without bias"
    assert rope is None or bias is None, "rope in the epilogue: a qkv projection without bias"
    assert out is None or (norm_in is not None and bias is None and rope is None)
    if _gemv_applies(x, weight, weight_scale):
        from kernels.gemv import gemv
        y = gemv(x, weight, out=out, scale=weight_scale, silu_mul=gated, norm_in=norm_in, add_norm=add_norm, rope=rope)
        return y + bias if bias is not None else y
    if gated:
        x = silu_and_mul(x)
    if weight_scale is not None:
        weight = ref.dequantize_fp8_ref(weight, weight_scale, x.dtype)
    y = x.float() @ weight.float().t()
    if norm_in is not None:
        y = y * ref.residual_norm_scale_ref(norm_in)
    y = y.to(x.dtype)
    if add_norm is not None:
        return ref.residual_norm_produce_ref(y, add_norm)
    if rope is not None:
        return ref.rope_store_ref(y, rope)
    if out is not None:
        return out.copy_(y)
    return y + bias if bias is not None else y


def gated_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, norm_in: ResidualNorm | None = None) -> torch.Tensor:
    """silu_and_mul(linear(x, ...)) for a gated MLP's gate | up projection (weight [2I, K]): [M, I]. Rows the GEMV
    takes (_gemv_applies), without bias or block scales, go through it with the gating in its epilogue (the bits of
    the two steps, no [M, 2I] output written and read back); anything else runs the two. norm_in: as linear's
    (one row)."""
    if (x.dim() == 2 and bias is None and _gemv_applies(x, weight, weight_scale)
            and (weight_scale is None or ref.scale_block(weight, weight_scale) is None)):
        from kernels.gemv import gemv
        return gemv(x, weight, scale=weight_scale, norm_in=norm_in, gated_out=True)
    return silu_and_mul(linear(x, weight, bias, weight_scale, norm_in=norm_in))


def silu_mul_linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    weight_scale: torch.Tensor | None = None, add_norm: ResidualNorm | None = None) -> torch.Tensor:
    """linear(silu_and_mul(h), ...) for h [M, 2K] (gate | up). Where the GEMV takes one row the activation is
    computed in its input load (no silu_and_mul launch); the result is the same bits.
    add_norm: as linear's."""
    if add_norm is not None:
        return _split_norm_linear(h, weight, bias, weight_scale, None, add_norm, gated=True)
    if _gemv_applies(h, weight, weight_scale):
        import kernels.gemv as kg
        if not kg.on_tensor_cores(h.shape[0], weight, weight_scale):
            y = kg.gemv(h, weight, scale=weight_scale, silu_mul=True)  # one row, or two on the one-row kernel
        else:  # several rows (the 16-row tensor-core tile): the activation in the load would be computed for all 16
            # padded rows by every program along N (docs/kernels.md)
            y = kg.gemv(silu_and_mul(h), weight, scale=weight_scale)
        return y + bias if bias is not None else y
    if weight_scale is not None and _fp8_gemm_applies(h, weight, h.shape[-1] // 2):
        return _fp8_gemm(h, weight, weight_scale, bias, silu_mul=True)  # the activation straight into the FP8 input
    return linear(silu_and_mul(h), weight, bias, weight_scale)


def _fp8_gemm_applies(x: torch.Tensor, weight: torch.Tensor, k: int) -> bool:
    """torch._scaled_mm takes x (k inputs per row) against FP8 weight [N, k]: CUDA, 16-aligned sizes, a
    half-precision activation with contiguous rows."""
    return (_on_gpu(x) and x.dim() == 2 and x.stride(1) == 1 and k % 16 == 0 and weight.shape[0] % 16 == 0
            and x.dtype in (torch.bfloat16, torch.float16))


def _fp8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
              silu_mul: bool = False) -> torch.Tensor:
    """x (silu_mul: gate | up) quantized in one launch and multiplied by FP8 weights in x's dtype: per token
    through torch._scaled_mm for per-row scales, per token and group of bk inputs through the block GEMM
    (kernels/fp8_block_gemm.py) for block scales."""
    block = ref.scale_block(weight, weight_scale)
    if block is not None:
        from kernels.fp8_block_gemm import block_fp8_gemm
        from kernels.quant import quantize_per_group
        return block_fp8_gemm(*quantize_per_group(x, block[1], silu_mul=silu_mul), weight, weight_scale, bias,
                              x.dtype)
    from kernels.quant import quantize_per_token  # one launch: rows' max, scale, convert
    xq, x_scale = quantize_per_token(x, silu_mul=silu_mul)
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, weight.shape[0]),
                            out_dtype=x.dtype, bias=bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 weights [N, K] with per-row scales ([N]) or per-block ones ([N / bn, K / bk]). On CUDA: one decode
    row -> the GEMV reading FP8 weights (x stays in its dtype); more rows -> an FP8 GEMM with dynamic
    activation scales, per token (torch._scaled_mm) or per token and group of bk inputs for block scales
    (kernels/fp8_block_gemm.py). Elsewhere (and for shapes the FP8 GEMMs do not take) the weight is dequantized
    on the fly: the reference."""
    if _on_gpu(x) and x.dim() == 2:
        if _gemv_applies(x, weight, weight_scale):
            from kernels.gemv import gemv
            y = gemv(x, weight, scale=weight_scale)
            return y + bias if bias is not None else y
        if _fp8_gemm_applies(x, weight, x.shape[1]):
            return _fp8_gemm(x, weight, weight_scale, bias)
    return ref.fp8_linear_ref(x, weight, weight_scale, bias)
