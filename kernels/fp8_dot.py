"""One-row FP8 GEMV products on packed registers: e4m3 weights four to an int32, the 16-bit activations four to an
int64, multiplied as f16 pairs in PTX.

Triton has no packed f16x2 type: its FP8 path (kernels/gemv.py, _accumulate's F16 branch) converts weights and x
element by element, regroups them with byte permutes and, in sm_90 SASS, sends the weights or x through shared
memory to agree on a register layout (4 to 8 CTA barriers a loop step). Here both operands are loaded as integers
whose element counts match (one int32 of weights against one int64 of x, two a thread), so they share one layout
with no conversion, and one inline-assembly block per eight weights does the arithmetic:

    cvt.rn.f16x2.e4m3x2 (4)  ->  mul/fma.rn.f16x2 (4)  ->  add lo + hi (f16)  ->  to f32, added into acc

Eight products are summed in f16 before the fp32 accumulator, as in the F16 branch (x scaled by 2^-8 first, so
|w| <= 448 times x stays in f16's range; the caller multiplies the sums by 256). Each f16 half accumulates four
products by fused multiply-adds (one rounding each) and the halves are added last.

The interpreter has no inline assembly: there (ASM False) the same sums are formed in fp32 from the same f16
operands, which is what the CPU tests check; the GPU tests compare the assembly with the torch reference.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.activation import silu_mul_f32

# Four fp32 values (x * 2^-8) rounded to f16 and packed into one int64, element 0 in the low bits.
_PACK_F16X4 = tl.constexpr("""{
 .reg .b32 lo, hi;
 cvt.rn.f16x2.f32 lo, $2, $1;
 cvt.rn.f16x2.f32 hi, $4, $3;
 mov.b64 $0, {lo, hi};
}""")

# Two neighbouring elements (pack=2): acc0 += w0 . x0 + w1 . x1 (eight products), acc1 passed through.
# $0 $1: acc out; $2 $3: acc in; $4 $5: int32 of four e4m3 weights each; $6 $7: int64 of four f16 x each. Every
# input is read before an output is written (no assumption about which registers the outputs share with inputs).
_DOT8 = tl.constexpr("""{
 .reg .b32 a0, a1, a2, a3, x0, x1, x2, x3, p;
 .reg .b16 h0, h1, h2, h3, lo, hi;
 .reg .f32 f, t;
 mov.b32 {h0, h1}, $4;
 mov.b32 {h2, h3}, $5;
 cvt.rn.f16x2.e4m3x2 a0, h0;
 cvt.rn.f16x2.e4m3x2 a1, h1;
 cvt.rn.f16x2.e4m3x2 a2, h2;
 cvt.rn.f16x2.e4m3x2 a3, h3;
 mov.b64 {x0, x1}, $6;
 mov.b64 {x2, x3}, $7;
 mul.rn.f16x2 p, a0, x0;
 fma.rn.f16x2 p, a1, x1, p;
 fma.rn.f16x2 p, a2, x2, p;
 fma.rn.f16x2 p, a3, x3, p;
 mov.b32 {lo, hi}, p;
 add.rn.f16 lo, lo, hi;
 cvt.f32.f16 f, lo;
 add.f32 f, $2, f;
 mov.b32 t, $3;
 mov.b32 $0, f;
 mov.b32 $1, t;
}""")

X_SCALE = 0.00390625  # 2^-8; the sums come out times this


@triton.jit
def _field(v, i: tl.constexpr, XDT: tl.constexpr):
    """The i-th 16-bit float (dtype XDT) of an int64 of four, as fp32."""
    return (v >> (16 * i)).to(tl.int16).to(XDT, bitcast=True).to(tl.float32)


@triton.jit
def _gated(g, u, i: tl.constexpr, XDT: tl.constexpr):
    """silu(gate) * up of field i, rounded to x's dtype as the unfused activation's output is."""
    return silu_mul_f32(_field(g, i, XDT), _field(u, i, XDT)).to(XDT).to(tl.float32)


@triton.jit
def x_fields(x, up, XDT: tl.constexpr, SILU_MUL: tl.constexpr):
    """int64 tiles of four 16-bit x (and of the up half where SILU_MUL: x is the gate) -> the four fields, fp32."""
    if SILU_MUL:
        return _gated(x, up, 0, XDT), _gated(x, up, 1, XDT), _gated(x, up, 2, XDT), _gated(x, up, 3, XDT)
    else:
        return _field(x, 0, XDT), _field(x, 1, XDT), _field(x, 2, XDT), _field(x, 3, XDT)


@triton.jit
def _e4m3(w, i: tl.constexpr):
    return ((w >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def dot_accumulate(acc, w, x0, x1, x2, x3, ASM: tl.constexpr):
    """acc [R, C] fp32 += (w . x) * 2^-8 per element group: w [R, C] int32 of four e4m3 weights, x0..x3 [1, C] the
    matching x fields (fp32). With ASM the sums of each pair of neighbouring groups land in the pair's first
    element (the caller sums acc's columns at the end)."""
    s = 0.00390625
    if ASM:
        xh = tl.inline_asm_elementwise(_PACK_F16X4, "=l,f,f,f,f", [x0 * s, x1 * s, x2 * s, x3 * s], dtype=tl.int64,
                                       is_pure=True, pack=1)
        acc = tl.inline_asm_elementwise(_DOT8, "=f,=f,f,f,r,r,l,l", [acc, w, xh], dtype=tl.float32, is_pure=True,
                                        pack=2)
    else:
        h0 = (x0 * s).to(tl.float16).to(tl.float32)
        h1 = (x1 * s).to(tl.float16).to(tl.float32)
        h2 = (x2 * s).to(tl.float16).to(tl.float32)
        h3 = (x3 * s).to(tl.float16).to(tl.float32)
        acc += _e4m3(w, 0) * h0 + _e4m3(w, 1) * h1 + _e4m3(w, 2) * h2 + _e4m3(w, 3) * h3
    return acc
