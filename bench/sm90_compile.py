"""Compile the batch-1 decode path's Triton kernels for sm_90 on a machine without a GPU, through the same
Python wrappers the engine calls, and report registers, spills and shared memory per kernel (and the SASS
with --sass). A kernel that does not compile for Hopper fails here, not in a device call.

    PYTHONPATH=/tmp/t36 python -m bench.sm90_compile [--pdl 0|1|2] [--sass NAME] [--fp8] [--no-split-norms]
                                                     [--rope-fusion] [--fp8-row] [--kv-before-wait] [--loops]
                                                     [--kv-cache-dtype fp8_e4m3|fp8_e5m2] [--fp8 --fp8-blocks] [--gate-up-epilogue]
                                                     [--two-rows] [--hashes]

Use the device's Triton version (3.6: `pip download --no-deps triton==3.6.0` and `pip install --no-deps
--target /tmp/t36` the wheel) so ptxas and the compiler match what runs there. Nothing is launched: each
kernel launch is intercepted, its arguments typed as Triton would specialize them (pointers and multiples of
16 divisible by 16, the integer 1 a constant) and compiled for GPUTarget("cuda", 90, 32).
"""
from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64", torch.int32: "i32",
           torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.uint8: "u8", torch.int8: "i8"}
compiled: list[tuple[str, object]] = []


def _compile(self: JITFunction, *args, grid, warmup, **kwargs):
    params = self.params
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    names = [p.name for p in params]
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(params):
        v = bound.get(p.name, p.default if p.default is not inspect.Parameter.empty else None)
        if p.is_constexpr or v is None or isinstance(v, (bool, str)):
            signature[p.name] = "constexpr"
            constexprs[(i,)] = v
        elif isinstance(v, torch.Tensor):
            signature[p.name] = "*" + _DTYPES[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, int):
            if v == 1:
                signature[p.name] = "constexpr"
                constexprs[(i,)] = 1
            else:
                signature[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[p.name] = "fp32"
        else:
            raise TypeError(f"{self.__name__}: cannot type argument {p.name}={v!r}")
    opts = {"num_warps": options.get("num_warps", 4), "num_stages": options.get("num_stages", 3)}
    kernel = triton.compile(ASTSource(self, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                            options=opts)
    compiled.append((self.__name__, kernel))
    return kernel


def _cuobjdump(kernel, flag: str) -> str:
    """Triton's own cuobjdump run on the kernel's cubin."""
    from triton.backends.nvidia import compiler as nv
    cuobjdump = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([cuobjdump, flag, f.name], capture_output=True, text=True).stdout


def _resources(kernel) -> str:
    return " ".join(line.strip() for line in _cuobjdump(kernel, "--dump-resource-usage").splitlines() if "REG" in line)


def loop_report(kernel) -> str:
    """Each backward branch of the kernel's SASS (a loop): its instructions, global loads, CTA barriers and spills
    (local memory), the per-iteration costs a GEMV's weight stream pays in instruction issue and stalls."""
    import re
    sass = _cuobjdump(kernel, "--dump-sass")
    ins = {int(a, 16): t.strip() for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)}
    rows = []
    for at, text in sorted(ins.items()):
        m = re.match(r"(@!?U?P\w+\s+)?BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(2), 16) < at:
            body = [t for a, t in ins.items() if int(m.group(2), 16) <= a <= at]
            rows.append(f"loop {len(body)} instructions, {sum('LDG' in t for t in body)} LDG, "
                        f"{sum('BAR.SYNC' in t for t in body)} BAR.SYNC, {sum('LDL' in t or 'STL' in t for t in body)} LDL/STL")
    return "; ".join(rows) or "no loop"


def decode_path(fp8: bool, split_norms: bool, rope_fusion: bool = False, kv_dtype: torch.dtype = torch.bfloat16,
                fp8_blocks: bool = False, gate_up_epilogue: bool = False) -> None:
    """The kernels of one Llama-3.1-8B decode layer at batch 1, through the engine's wrappers (split_norms:
    the residual norms split between the GEMVs around them, as the engine runs them by default; rope_fusion:
    rope and the KV store in the qkv GEMV's epilogue, --decode-rope-fusion; kv_dtype: the pool's,
    --kv-cache-dtype; gate_up_epilogue: the MLP gated in gate_up_proj's epilogue, GATE_UP_EPILOGUE)."""
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for, plan_max_kv_splits
    from kernels.gemv import gemv
    from kernels.norm import rms_norm
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    from kernels.rope import apply_rope_and_store_kv
    from kernels.rope_store import RopeStore
    bf = torch.bfloat16
    hidden, inter, hq, hkv, d = 4096, 14336, 32, 8, 128
    slots = 4096
    k_buf, v_buf = torch.zeros(slots, hkv, d, dtype=kv_dtype), torch.zeros(slots, hkv, d, dtype=kv_dtype)
    pos, loc, table = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), torch.zeros(4096, d)
    x = torch.zeros(1, hidden, dtype=bf)
    sums = torch.zeros(63, NORM_SLOTS, dtype=torch.float64)
    rms_norm(x, torch.zeros(hidden, dtype=bf), 1e-5, torch.zeros(1, hidden, dtype=bf))
    if split_norms:  # the embedding lookup and the first norm (LlamaModel._forward_row)
        from kernels.norm import embed_rms_norm
        embed_rms_norm(torch.zeros(1, dtype=torch.int64), torch.empty(128256, hidden, dtype=bf),
                       torch.zeros(hidden, dtype=bf), 1e-5, zero=sums)
    norm = ResidualNorm(torch.zeros(1, hidden, dtype=bf), torch.zeros(hidden, dtype=bf), sums[0], 1e-5)
    shapes = [("qkv", (hq + 2 * hkv) * d, hidden, False, "in"), ("o", hidden, hq * d, False, "add"),
              ("gate_up", 2 * inter, hidden, False, "in"), ("down", hidden, inter, True, "add")]
    for name, n, k, silu, role in shapes:
        silu = silu and not gate_up_epilogue
        wdt = torch.float8_e4m3fn if fp8 else bf
        w = torch.zeros(n, k, dtype=wdt)
        xin = torch.zeros(1, 2 * k if silu else k, dtype=bf)
        norms = {("norm_in" if role == "in" else "add_norm"): norm} if split_norms else {}
        if rope_fusion and n == (hq + 2 * hkv) * d:
            norms["rope"] = RopeStore(pos, table, k_buf, v_buf, loc, hq * d, hkv * d, d)
        scale = (torch.ones(n // 128, k // 128) if fp8_blocks else torch.ones(n)) if fp8 else None
        gemv(xin, w, scale=scale, silu_mul=silu, **norms, **({"gated_out": True} if gate_up_epilogue and name == "gate_up"
                                                            else {}))
    from kernels import prefetch
    prefetch.launch(torch.zeros(hidden, hidden, dtype=bf))  # --decode-l2-prefetch
    qkv = torch.zeros(1, (hq + 2 * hkv) * d, dtype=bf)
    q, k, v = qkv.view(1, -1, d).split([hq, hkv, hkv], dim=1)
    if not rope_fusion:
        apply_rope_and_store_kv(q, k, v, pos, table, d, k_buf, v_buf, loc)
    seq = torch.full((1,), 768, dtype=torch.int32)
    ms = plan_max_kv_splits(1, hkv, 32)  # the engine's default cap (--triton-attention-num-kv-splits)
    decode_attention(torch.zeros(1, hq, d, dtype=bf), k_buf, v_buf, torch.zeros(2, 4096, dtype=torch.int32),
                     torch.zeros(1, dtype=torch.int32), seq, num_kv_splits_for(seq, ms), ms, d ** -0.5,
                     tickets=torch.zeros(hkv, dtype=torch.int32))  # the engine's default: merged in one launch
    if kv_dtype.itemsize == 1:
        pool_path(kv_dtype)
    if fp8_blocks:
        block_fp8_gemm_path()


def two_row_path(fp8: bool) -> None:
    """Decode at batch 2 on the GEMV's two-row kernel with every two-row knob on (kernels.gemv.TWO_ROW_KERNEL,
    TWO_ROW_KERNEL_FP8, TWO_ROW_EPILOGUES, TWO_ROW_NORMS), at Llama-3.1-8B's shapes: each linear plain, and as the
    layer runs it with split norms (qkv with rope, o_proj and down_proj producing, gate_up gated)."""
    import kernels.gemv as kg
    from kernels.gemv import gemv
    from kernels.residual_norm import NORM_SLOTS, ResidualNorm
    from kernels.rope_store import RopeStore
    bf = torch.bfloat16
    hidden, inter, hq, hkv, d = 4096, 14336, 32, 8, 128
    k_buf, v_buf = torch.zeros(4096, hkv, d, dtype=bf), torch.zeros(4096, hkv, d, dtype=bf)
    pos, loc, table = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), torch.zeros(4096, d)
    kg.TWO_ROW_KERNEL = kg.TWO_ROW_KERNEL_FP8 = kg.TWO_ROW_EPILOGUES = kg.TWO_ROW_NORMS = True
    norm = ResidualNorm(torch.zeros(2, hidden, dtype=bf), torch.zeros(hidden, dtype=bf),
                        torch.zeros(2, NORM_SLOTS, dtype=torch.float64), 1e-5)
    rope = RopeStore(pos, table, k_buf, v_buf, loc, hq * d, hkv * d, d)
    wdt = torch.float8_e4m3fn if fp8 else bf
    for n, k, silu, fused in [((hq + 2 * hkv) * d, hidden, False, dict(norm_in=norm, rope=rope)),
                              (hidden, hq * d, False, dict(add_norm=norm)),
                              (2 * inter, hidden, False, dict(norm_in=norm, gated_out=True)),
                              (hidden, inter, True, dict(add_norm=norm))]:
        w, scale = torch.zeros(n, k, dtype=wdt), (torch.ones(n) if fp8 else None)
        x = torch.zeros(2, 2 * k if silu else k, dtype=bf)
        gemv(x, w, scale=scale, silu_mul=silu)
        gemv(x, w, scale=scale, silu_mul=silu, **fused)


def sass_hashes(kernels) -> list[tuple[str, str]]:
    """(name, a hash of its SASS without addresses) for each compiled kernel: two compiles that print the same hashes
    in the same order built the same machine code (a before / after check of a change meant to leave them)."""
    import hashlib
    import re
    out = []
    for name, kernel in kernels:
        body = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", line) for line in _cuobjdump(kernel, "--dump-sass").splitlines()
                         if "/*" in line)
        out.append((name, hashlib.md5(body.encode()).hexdigest()[:12]))
    return out


def block_fp8_gemm_path() -> None:
    """Block-scaled FP8 weights ([128, 128] blocks) at more than one row: the per-group activation quantization
    and the block GEMM at Llama-3.1-8B's gate_up shape, for each tile size default_tiles picks."""
    from kernels.fp8_block_gemm import block_fp8_gemm
    from kernels.quant import quantize_per_group
    f8 = torch.float8_e4m3fn
    quantize_per_group(torch.zeros(16, 4096, dtype=torch.bfloat16), 128)
    for m in (16, 32, 64, 256):
        block_fp8_gemm(torch.zeros(m, 4096, dtype=f8), torch.ones(m, 32), torch.zeros(28672, 4096, dtype=f8),
                       torch.ones(224, 32), None, torch.bfloat16)


def pool_path(kv_dtype: torch.dtype) -> None:
    """The other kernels that read or write an FP8 pool (--kv-cache-dtype), at Llama-3.1-8B shapes: the KV store,
    decode attention at batch 256 (one split), shared-prefix decode and extend attention over a cached prefix."""
    from kernels.attention.triton_cascade import cascade_decode_attention, plan_cascade
    from kernels.attention.triton_decode import decode_attention, num_kv_splits_for
    from kernels.attention.triton_extend import extend_attention
    from kernels.kv_store import store_kv
    bf, i32 = torch.bfloat16, torch.int32
    hq, hkv, d, slots = 32, 8, 128, 4096
    k_buf, v_buf = torch.zeros(slots, hkv, d, dtype=kv_dtype), torch.zeros(slots, hkv, d, dtype=kv_dtype)
    kv = torch.zeros(256, 2, hkv, d, dtype=bf)
    store_kv(k_buf, v_buf, torch.zeros(256, dtype=torch.int64), kv[:, 0], kv[:, 1], 0.5, 0.5)
    table, rows = torch.zeros(257, 4096, dtype=i32), torch.arange(1, 257, dtype=i32)
    seq = torch.full((256,), 640, dtype=i32)
    decode_attention(torch.zeros(256, hq, d, dtype=bf), k_buf, v_buf, table, rows, seq, num_kv_splits_for(seq, 1), 1,
                     d ** -0.5, k_scale=0.5, v_scale=0.5)
    plan = plan_cascade([(512, list(range(16)))], list(range(1, 17)), 16, hkv, hq // hkv, "cpu")
    seq = torch.full((16,), 640, dtype=i32)
    cascade_decode_attention(torch.zeros(16, hq, d, dtype=bf), k_buf, v_buf, table, rows[:16], seq, plan,
                             num_kv_splits_for(seq - plan.kv_start, 4), 4, d ** -0.5,
                             tickets=torch.zeros(16 * hkv, dtype=i32), k_scale=0.5, v_scale=0.5)
    T = 4 * 512
    q, k, v = torch.zeros(T, hq, d, dtype=bf), torch.zeros(T, hkv, d, dtype=bf), torch.zeros(T, hkv, d, dtype=bf)
    lens = torch.full((4,), 512, dtype=i32)
    extend_attention(q, k, v, k_buf, v_buf, table, rows[:4], lens, lens, torch.arange(0, T, 512, dtype=i32), 512,
                     d ** -0.5, k_scale=0.5, v_scale=0.5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pdl", type=int, default=2, help="0: off, 1: trigger after the wait, 2: before it")
    ap.add_argument("--fp8", action="store_true", help="FP8 weights in the GEMVs")
    ap.add_argument("--no-split-norms", action="store_true", help="every norm its own kernel (--no-decode-norm-fusion)")
    ap.add_argument("--kv-before-wait", action="store_true",
                    help="decode attention's first k/v tile before its PDL wait (kernels.attention.triton_decode.KV_BEFORE_WAIT)")
    ap.add_argument("--fp8-row", action="store_true", help="FP8 rows in the one-row kernel (kernels.gemv.FP8_ROW_KERNEL)")
    ap.add_argument("--rope-fusion", action="store_true", help="rope and the KV store in the qkv GEMV (--decode-rope-fusion)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                    help="the KV pool's dtype; FP8 also compiles the other kernels that touch the pool")
    ap.add_argument("--fp8-blocks", action="store_true",
                    help="with --fp8: block-scaled weights ([128, 128] blocks), and the block FP8 GEMM")
    ap.add_argument("--gate-up-epilogue", action="store_true",
                    help="the MLP gated in gate_up_proj's epilogue (shared.models.llama.GATE_UP_EPILOGUE: the "
                         "engine's default for bf16 weights since 2026-12-06; GATE_UP_EPILOGUE_FP8, off, for FP8)")
    ap.add_argument("--two-rows", action="store_true",
                    help="batch 2 on the two-row kernel with every two-row knob on (kernels.gemv.TWO_ROW_*), instead of "
                         "the batch-1 path")
    ap.add_argument("--hashes", action="store_true", help="each kernel's SASS hash (compare two compiles' lists)")
    ap.add_argument("--sass", default="", help="print the SASS of kernels whose name contains this")
    ap.add_argument("--loops", action="store_true", help="each kernel's loops: instructions, global loads, barriers")
    args = ap.parse_args()
    import kernels._utils as ku
    ku.pdl_supported = lambda: True  # type: ignore[assignment]
    ku.num_sms.cache_clear()
    ku.num_sms = lambda device_index=None: 132  # type: ignore[assignment]
    import kernels.attention.triton_decode as td
    import kernels.gemv as kg
    kg.num_sms = td.num_sms = ku.num_sms
    kg.FP8_ROW_KERNEL = args.fp8_row
    td.KV_BEFORE_WAIT = args.kv_before_wait
    ku.set_pdl(args.pdl > 0, early_trigger=args.pdl == 2)
    JITFunction.run = _compile  # type: ignore[method-assign]
    from shared.cache.kv_pool import kv_cache_dtype
    if args.two_rows:
        two_row_path(args.fp8)
    else:
        decode_path(args.fp8, not args.no_split_norms, args.rope_fusion,
                    kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16), args.fp8 and args.fp8_blocks,
                    args.gate_up_epilogue)
    hashes = dict(enumerate(sass_hashes(compiled))) if args.hashes else {}
    for i, (name, kernel) in enumerate(compiled):
        print(f"{name}: {_resources(kernel)}" + (f" sass {hashes[i][1]}" if i in hashes else ""))
        if args.loops:
            print(f"    {loop_report(kernel)}")
        if args.sass and args.sass in name:
            print(_cuobjdump(kernel, "--dump-sass"))


if __name__ == "__main__":
    main()
