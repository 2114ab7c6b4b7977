"""Triton kernels for weight-only FP4 (NVFP4 / MXFP4) x BF16 matmuls, reading the compressed-tensors packing.

Packed layout (``qerl.quant``): ``weight_packed`` uint8 (N, K/2), element 2j in the low nibble, 2j+1 in the
high nibble; nibble bit 3 = sign, bits 0-2 index the E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}.
NVFP4: ``weight_scale`` E4M3 (N, K/16) and ``weight_global_scale`` g (1,), W = fp4 * s / g.
MXFP4: ``weight_scale`` E8M0 bytes (N, K/32), W = fp4 * 2^(e - 127).

The packed tile is loaded as (BN, BK/G, G/2) bytes, one row per scale group, with the group scales
(BN, BK/G, 1) broadcast in registers. ``_decode`` turns it into two tiles, the even (low-nibble) and odd
(high-nibble) elements, by bit manipulation (no lookup table), in one of two ways:

* pure Triton (any backend, also the CPU interpreter): the nibble's sign and magnitude bits are moved into
  an FP16 bit pattern (``sign<<15 | mag<<9`` is e2m1 * 2^-14, exact; the 0.5 code is an FP16 subnormal,
  which the FP16->FP32 conversion keeps), widened to FP32 and multiplied by the scale decoded from its bits
  (E4M3 normals and subnormals, E8M0). Values are exactly fp4 * s (NVFP4) or fp4 * 2^(e-127) (MXFP4);
  1/g is applied to the accumulator.
* inline PTX (sm_90, ``USE_ASM``; 4 bytes = 8 weights per call): ``prmt`` spreads two bytes into the two
  halves of a register, shift/and/or put each nibble's sign at bit 15 and its magnitude at bits 6-8 of a
  BF16 (value e2m1 * 2^-126; the 0.5 code is a BF16 subnormal, which BF16 arithmetic keeps) and one
  ``mul.rn.bf16x2`` per pair applies the group scale, built once per group (``_scale_word``) as a BF16
  equal to scale * 2^100: E4M3 through the exact hardware E4M3->FP16 conversion and an exponent shift,
  E8M0 e as the exponent field e + 100. Products are fp4 * s * 2^-26, exact in BF16; the
  accumulator is multiplied by 2^26 (/ g). Exact for every NVFP4 weight and for E8M0 exponents <= 154
  (``qerl.kernels.prepare`` checks MXFP4 once; otherwise the pure decoder is used).

Kernels: ``_qmm_dot_kernel`` (tiled, in-register dequantization feeding ``tl.dot``; BM=16 covers decode,
optional swap of the operands so the weight is the MMA's A operand, optional split-K with an in-kernel
"last CTA reduces" fix-up, so one launch and graph-capturable), ``_qgemv_kernel`` (CUDA-core FMA GEMV
for M of 1-2), ``_dequant_kernel`` (dense BF16/FP16/FP32 weight for cuBLAS), ``_relaid_dequant_kernel`` (the
same from the CUDA kernels' re-laid-out copy, ``qerl.kernels.cuda_fp4``). Block sizes are constexprs
from a small set, so a shape never compiles more than once per configuration.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Multiplier that undoes the 2^-26 of the asm decoder's products.
ASM_OUT_SCALE = float(2**26)
# The asm decoder's validity limits (checked by prepare()).
MX_ASM_MAX_EXP = 154

_UNPACK = """
prmt.b32 t0, $4, z, 0x1404;
prmt.b32 t1, $4, z, 0x3424;
shl.b32 a, t0, 4;
and.b32 a, a, 0x80008000;
shr.b32 c, t0, 2;
and.b32 c, c, 0x01C001C0;
or.b32 $0, a, c;
shl.b32 a, t1, 4;
and.b32 a, a, 0x80008000;
shr.b32 c, t1, 2;
and.b32 c, c, 0x01C001C0;
or.b32 $1, a, c;
and.b32 a, t0, 0x80008000;
shr.b32 c, t0, 6;
and.b32 c, c, 0x01C001C0;
or.b32 $2, a, c;
and.b32 a, t1, 0x80008000;
shr.b32 c, t1, 6;
and.b32 c, c, 0x01C001C0;
or.b32 $3, a, c;
mul.rn.bf16x2 $0, $0, s0;
mul.rn.bf16x2 $1, $1, s1;
mul.rn.bf16x2 $2, $2, s0;
mul.rn.bf16x2 $3, $3, s1;
}
"""

# $4: 4 packed bytes; $5..$8: each byte's scale as a ready bf16x2 word (both halves equal), built per
# group by _scale_word; the pair (0,1) takes the low half of byte 0's word and the high half of byte 1's.
_W_ASM = """
{
.reg .b32 z, t0, t1, s0, s1, a, c;
mov.b32 z, 0;
prmt.b32 s0, $5, $6, 0x7610;
prmt.b32 s1, $7, $8, 0x7610;
""" + _UNPACK


@triton.jit
def _nib_val(n):
    """int32 nibbles (sign<<3 | mag) -> float32 e2m1 values, by bit manipulation (no table)."""
    bits = ((n & 8) << 12) | ((n & 7) << 9)  # FP16 bit pattern of e2m1 * 2^-14 (0.5 is an FP16 subnormal)
    h = bits.to(tl.int16).to(tl.float16, bitcast=True)
    return h.to(tl.float32) * 16384.0


@triton.jit
def _scale_val(s, FMT: tl.constexpr):
    """uint8 scale bytes -> float32 scale values: E4M3 (FMT 0, normals and subnormals) or E8M0 (FMT 1)."""
    si = s.to(tl.int32)
    if FMT == 0:
        e = (si >> 3) & 15
        m = si & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
        v = tl.where(e == 0, sub, normal)
        v = tl.where((si & 128) != 0, -v, v)
    else:
        v = (si << 23).to(tl.float32, bitcast=True)  # 2^(e - 127); e == 0 gives 0 (2^-127 in the format)
    return v


@triton.jit
def _scale_word(s, FMT: tl.constexpr):
    """Scale bytes (any int dtype) -> int32 bf16x2 words, scale * 2^100 in both halves, for the asm decoder.

    E4M3: the hardware conversion to FP16 is exact (subnormals become FP16 normals); its exponent and top 7
    mantissa bits are the BF16's, with the exponent field moved by 127 - 15 + 100 = 212; zero stays zero,
    the sign is kept. E8M0: bits (e + 100) << 7 (exact for e <= 154).
    """
    if FMT == 0:
        h = s.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.int16, bitcast=True)
        h = h.to(tl.int32) & 0xFFFF
        mag = h & 0x7FFF
        v = tl.where(mag == 0, 0, (mag >> 3) + 0x6A00) | (h & 0x8000)
    else:
        si = s.to(tl.int32) & 0xFF
        v = (si << 7) + 0x3200
    return v | (v << 16)


_W_ASM_C = tl.constexpr(_W_ASM)


@triton.jit
def _decode(b, s, FMT: tl.constexpr, USE_ASM: tl.constexpr, OUT_F32: tl.constexpr):
    """Packed bytes b (..., GB) and their group scales s (..., 1) -> (even, odd) weights.

    USE_ASM: bfloat16 fp4 * s * 2^-26 from inline PTX; else exactly fp4 * s, float32 (OUT_F32) or bfloat16.
    """
    if USE_ASM:
        lo, hi = tl.inline_asm_elementwise(
            asm=_W_ASM_C, constraints="=r,=r,=r,=r,r,r,r,r,r", args=[b, _scale_word(s, FMT)],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        if OUT_F32:
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
    else:
        bi = b.to(tl.int32)
        sv = _scale_val(s, FMT)
        lo = _nib_val(bi & 15) * sv
        hi = _nib_val(bi >> 4) * sv
        if not OUT_F32:
            lo = lo.to(tl.bfloat16)
            hi = hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def _fence_gpu(FENCE: tl.constexpr):
    """Every thread: fence.acq_rel.gpu (orders this CTA's partial-sum stores before the split-K counter)."""
    if FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [tl.full([1], 0, tl.int32)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_tile(wq_ptr, sc_ptr, offs_n, k0, N, KH, KG, G: tl.constexpr, BK: tl.constexpr, MASKED: tl.constexpr,
               MODE: tl.constexpr, SC32: tl.constexpr = False):
    """Packed bytes as (BN, BK/G, G/2), one row per scale group, and the group scales (BN, BK/G, 1).

    MODE 1 loads the 3-D tile directly; MODE 2 loads (BN, BK/2) and reshapes it. Keeping the group axis
    lets the scale broadcast stay in registers and lets Triton convert the packed bytes (not the decoded
    BF16) into the MMA operand layout. SC32: ``sc_ptr`` is the scale tensor viewed as int32 (KG % 4 == 0)
    and four scales come per load, wide enough for Triton to pipeline them with cp.async."""
    NG: tl.constexpr = BK // G
    gcol = k0 // G + tl.arange(0, NG)
    s_ptrs = sc_ptr + offs_n[:, None] * KG + gcol[None, :]
    if SC32:
        gw = k0 // (4 * G) + tl.arange(0, NG // 4)
        sw_ptrs = sc_ptr + offs_n[:, None] * (KG // 4) + gw[None, :]
        if MASKED:
            sw = tl.load(sw_ptrs, mask=(offs_n < N)[:, None] & (gw < KG // 4)[None, :], other=0)
        else:
            sw = tl.load(sw_ptrs)  # (BN, NG/4) int32
        s4 = (sw[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF  # (BN, NG/4, 4)
    b = _load_bytes(wq_ptr, offs_n, k0, N, KH, G, BK, MASKED, MODE)
    if SC32:
        s = tl.reshape(s4, (offs_n.shape[0], NG))
    elif MASKED:
        s = tl.load(s_ptrs, mask=(offs_n < N)[:, None] & (gcol < KG)[None, :], other=0)
    else:
        s = tl.load(s_ptrs)
    return b, s[:, :, None]


@triton.jit
def _load_scales(sc_ptr, offs_n, k0, N, KG, G: tl.constexpr, BK: tl.constexpr, MASKED: tl.constexpr, live):
    """Group scale bytes (BN, BK/G, 1) of the K tile at k0; all zero (not loaded) where ``live`` is false."""
    NG: tl.constexpr = BK // G
    gcol = k0 // G + tl.arange(0, NG)
    s_ptrs = sc_ptr + offs_n[:, None] * KG + gcol[None, :]
    if MASKED:
        s = tl.load(s_ptrs, mask=((offs_n < N)[:, None] & (gcol < KG)[None, :]) & live, other=0)
    else:
        s = tl.load(s_ptrs, mask=live, other=0)
    return s[:, :, None]


@triton.jit
def _load_bytes(wq_ptr, offs_n, k0, N, KH, G: tl.constexpr, BK: tl.constexpr, MASKED: tl.constexpr,
                MODE: tl.constexpr):
    """Packed bytes of the K tile at k0 as (BN, BK/G, G/2): MODE 1 a 3-D load, MODE 2 a 2-D load reshaped."""
    NG: tl.constexpr = BK // G
    GB: tl.constexpr = G // 2
    if MODE == 1:
        jb = k0 // 2 + tl.arange(0, NG)[:, None] * GB + tl.arange(0, GB)[None, :]  # (NG, GB) byte columns
        w_ptrs = wq_ptr + offs_n[:, None, None] * KH + jb[None, :, :]
        if MASKED:
            b = tl.load(w_ptrs, mask=(offs_n < N)[:, None, None] & (jb < KH)[None, :, :], other=0)
        else:
            b = tl.load(w_ptrs)
    else:
        jb2 = k0 // 2 + tl.arange(0, BK // 2)
        w_ptrs2 = wq_ptr + offs_n[:, None] * KH + jb2[None, :]
        if MASKED:
            b2 = tl.load(w_ptrs2, mask=(offs_n < N)[:, None] & (jb2 < KH)[None, :], other=0)
        else:
            b2 = tl.load(w_ptrs2)
        b = tl.reshape(b2, (offs_n.shape[0], NG, GB))
    return b


@triton.jit
def _load_tile4(wq_ptr, sc_ptr, offs_n, k0, N, KH, KG, G: tl.constexpr, BK: tl.constexpr, MASKED: tl.constexpr):
    """MODE 3: packed bytes as (BN, BK/4G, 4, G/2) and scales (BN, BK/4G, 4, 1) from int32 words, so the
    four scales of a word broadcast over their groups without any reshape (``sc_ptr`` viewed as int32)."""
    NG: tl.constexpr = BK // G
    GB: tl.constexpr = G // 2
    gw = k0 // (4 * G) + tl.arange(0, NG // 4)
    sw_ptrs = sc_ptr + offs_n[:, None] * (KG // 4) + gw[None, :]
    jb4 = (k0 // 2 + (tl.arange(0, NG // 4)[:, None, None] * 4 + tl.arange(0, 4)[None, :, None]) * GB
           + tl.arange(0, GB)[None, None, :])  # (NG/4, 4, GB) byte columns
    w_ptrs = wq_ptr + offs_n[:, None, None, None] * KH + jb4[None, :, :, :]
    if MASKED:
        sw = tl.load(sw_ptrs, mask=(offs_n < N)[:, None] & (gw < KG // 4)[None, :], other=0)
        b = tl.load(w_ptrs, mask=(offs_n < N)[:, None, None, None] & (jb4 < KH)[None, :, :, :], other=0)
    else:
        sw = tl.load(sw_ptrs)
        b = tl.load(w_ptrs)
    s = (sw[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF  # (BN, NG/4, 4)
    return b, s[:, :, :, None]


@triton.jit
def _epilogue(res, out_ptr, ws_ptr, cnt_ptr, gs_ptr, offs_m, offs_n, M, N, stride_om, tile, pid_k,
              SPLIT_K: tl.constexpr, HAS_G: tl.constexpr, OUT_C: tl.constexpr, FENCE: tl.constexpr):
    """res (BM, BN) float32 -> out (scaled, cast); with split-K the last CTA of a tile sums the partials."""
    omask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if HAS_G:
        mult = OUT_C / tl.load(gs_ptr)
    else:
        mult = OUT_C
    if SPLIT_K == 1:
        tl.store(o_ptrs, (res * mult).to(out_ptr.dtype.element_ty), mask=omask)
    else:
        p_off = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + p_off, res, mask=omask)
        _fence_gpu(FENCE)
        tl.debug_barrier()
        cnt = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if cnt == SPLIT_K - 1:
            _fence_gpu(FENCE)
            tot = tl.load(ws_ptr + p_off, mask=omask, other=0.0, cache_modifier=".cg")
            for sk in tl.static_range(1, SPLIT_K):
                tot += tl.load(ws_ptr + sk * M * N + p_off, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(o_ptrs, (tot * mult).to(out_ptr.dtype.element_ty), mask=omask)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next launch (graph replays included)


@triton.jit(do_not_specialize=["M", "PER", "NITER"])
def _qmm_dot_kernel(
    x_ptr, wq_ptr, sc_ptr, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, PER, NITER,
    FMT: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr, HAS_G: tl.constexpr, OUT_C: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP: tl.constexpr, JOIN: tl.constexpr, MASKED: tl.constexpr, FENCE: tl.constexpr,
    DOT_F32: tl.constexpr = False, MODE: tl.constexpr = 1, SC32: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
):
    """out (M, N) = x (M, K) @ W^T, W dequantized tile by tile in registers and fed to tl.dot (fp32 acc).

    Grid (N/BN, M/BM, SPLIT_K); program (n, m, k) covers K tiles [k*PER, min((k+1)*PER, NITER)).
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_x = tl.arange(0, BK)
    KH = K // 2
    KG = K // G
    it0 = pid_k * PER
    n_it = tl.minimum(PER, NITER - it0)  # the last split may be shorter
    m_ok = offs_m < M
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PREFETCH:  # scale bytes are too narrow for cp.async: load them one iteration ahead by hand
        s_next = _load_scales(sc_ptr, offs_n, it0 * BK, N, KG, G, BK, MASKED, n_it > 0)
    for i in range(0, n_it):
        k0 = (it0 + i) * BK
        if PREFETCH:
            s3 = s_next
            b3 = _load_bytes(wq_ptr, offs_n, k0, N, KH, G, BK, MASKED, MODE)
            s_next = _load_scales(sc_ptr, offs_n, k0 + BK, N, KG, G, BK, MASKED, i + 1 < n_it)
        elif MODE == 3:
            b3, s3 = _load_tile4(wq_ptr, sc_ptr, offs_n, k0, N, KH, KG, G, BK, MASKED)
        else:
            b3, s3 = _load_tile(wq_ptr, sc_ptr, offs_n, k0, N, KH, KG, G, BK, MASKED, MODE, SC32)
        lo3, hi3 = _decode(b3, s3, FMT, USE_ASM, DOT_F32)  # (BN, BK/G, G/2) or MODE 3's 4-D tile
        lo = tl.reshape(lo3, (BN, BK // 2))  # even elements of the K tile
        hi = tl.reshape(hi3, (BN, BK // 2))  # odd elements
        kx = k0 + offs_x
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kx[None, :],
                    mask=m_ok[:, None] & (kx < K)[None, :], other=0.0)  # (BM, BK)
        if DOT_F32:  # CPU interpreter only: its bf16 tl.dot multiplies the raw uint16 storage
            x = x.to(tl.float32)
        else:
            x = x.to(tl.bfloat16)
        if JOIN:
            w = tl.reshape(tl.join(lo, hi), (BN, BK))
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)
        else:
            xe, xo = tl.split(tl.reshape(x, (BM, BK // 2, 2)))
            if SWAP:
                acc = tl.dot(lo, tl.trans(xe), acc)
                acc = tl.dot(hi, tl.trans(xo), acc)
            else:
                acc = tl.dot(xe, tl.trans(lo), acc)
                acc = tl.dot(xo, tl.trans(hi), acc)
    if SWAP:
        res = tl.trans(acc)
    else:
        res = acc
    tile = pid_m * tl.num_programs(0) + pid_n
    _epilogue(res, out_ptr, ws_ptr, cnt_ptr, gs_ptr, offs_m, offs_n, M, N, stride_om, tile, pid_k,
              SPLIT_K, HAS_G, OUT_C, FENCE)


@triton.jit(do_not_specialize=["M", "PER", "NITER"])
def _qgemv_kernel(
    x_ptr, wq_ptr, sc_ptr, gs_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K, stride_xm, stride_om, PER, NITER,
    FMT: tl.constexpr, G: tl.constexpr, USE_ASM: tl.constexpr, HAS_G: tl.constexpr, OUT_C: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, MASKED: tl.constexpr, FENCE: tl.constexpr,
    MODE: tl.constexpr = 1, SC32: tl.constexpr = False,
):
    """One row of x per program (grid axis 2): out[m] = W x[m] with CUDA-core FMAs (split-K, fp32 acc).

    Programs of different rows read the same weight tiles at about the same time, so L2 serves the
    repeats; meant for M of 1-2.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    NG: tl.constexpr = BK // G
    GB: tl.constexpr = G // 2
    KH = K // 2
    KG = K // G
    it0 = pid_k * PER
    n_it = tl.minimum(PER, NITER - it0)  # the last split may be shorter
    jl = tl.arange(0, NG)[:, None] * GB + tl.arange(0, GB)[None, :]  # (NG, GB) byte offsets in a tile
    acc = tl.zeros((BN, NG, GB), dtype=tl.float32)
    for i in range(0, n_it):
        k0 = (it0 + i) * BK
        b3, s3 = _load_tile(wq_ptr, sc_ptr, offs_n, k0, N, KH, KG, G, BK, MASKED, MODE, SC32)
        lo, hi = _decode(b3, s3, FMT, USE_ASM, True)
        jb = k0 // 2 + jl
        kmask = jb < KH
        xe = tl.load(x_ptr + m * stride_xm + 2 * jb, mask=kmask, other=0.0).to(tl.float32)  # (NG, GB)
        xo = tl.load(x_ptr + m * stride_xm + 2 * jb + 1, mask=kmask, other=0.0).to(tl.float32)
        acc += lo * xe[None, :, :] + hi * xo[None, :, :]
    res = tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]  # (1, BN)
    offs_m = m + tl.arange(0, 1)
    tile = m * tl.num_programs(0) + pid_n
    _epilogue(res, out_ptr, ws_ptr, cnt_ptr, gs_ptr, offs_m, offs_n, M, N, stride_om, tile, pid_k,
              SPLIT_K, HAS_G, OUT_C, FENCE)


@triton.jit
def _dequant_kernel(wq_ptr, sc_ptr, gs_ptr, out_ptr, N, K,
                    FMT: tl.constexpr, G: tl.constexpr, HAS_G: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, MASKED: tl.constexpr):
    """out (N, K) = fp4 * (s / g) (NVFP4) or fp4 * 2^(e-127) (MXFP4), in float32 exactly as the reference."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BN + tl.arange(0, BN)
    k0 = pid_k * BK
    b3, s3 = _load_tile(wq_ptr, sc_ptr, offs_n, k0, N, K // 2, K // G, G, BK, MASKED, 2)
    bi = b3.to(tl.int32)
    sv = _scale_val(s3, FMT)
    if HAS_G:
        sv = tl.math.div_rn(sv, tl.load(gs_ptr))
    lo = _nib_val(bi & 15) * sv
    hi = _nib_val(bi >> 4) * sv
    w = tl.reshape(tl.join(lo, hi), (BN, BK)).to(out_ptr.dtype.element_ty)  # (BN, NG, GB, 2) -> (BN, BK)
    offs_k = k0 + tl.arange(0, BK)
    o_ptrs = out_ptr + offs_n[:, None] * K + offs_k[None, :]
    if MASKED:
        tl.store(o_ptrs, w, mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])
    else:
        tl.store(o_ptrs, w)


@triton.jit
def _relaid_dequant_kernel(qw_ptr, ps_ptr, gs_ptr, out_ptr, N, K,
                           FMT: tl.constexpr, G: tl.constexpr, HAS_G: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr):
    """out (N, K) = Ŵ from the CUDA kernels' re-laid-out weight (``cuda_fp4.prepare``): int32 words (N/16, K/64,
    32, 4) of lane-major mma A fragments and int16 scale pairs (N/16, K/64, 8 * 64/G). Element (n, k) is nibble
    (o = 2 ob + rh, h) of word j of lane (g, t) in chunk c (n = 16 s + 8 rh + g, k = 64 c + 16 t + 4 j + 2 ob + h),
    its bit b at position (16 h + P[b] + 3 o) mod 32 for o < 3 (P = 6, 7, 8, 15) and 16 h + (3, 4, 0, 1)[b] for
    o = 3 (``cuda_fp4.SRC``); its scale is byte rh of pair (g, group) of the chunk. Values as ``_dequant_kernel``
    computes them from the compressed-tensors tensors: fp4 * (s / g) or fp4 * 2^(e-127) in float32."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    k = pid_k * BK + tl.arange(0, BK)
    mask = (n < N)[:, None] & (k < K)[None, :]
    s = n // 16
    rh = (n % 16) // 8
    g = n % 8
    c = k // 64
    t = (k % 64) // 16
    j = (k % 16) // 4
    ob = (k % 4) // 2
    h = k % 2
    C = K // 64
    row = s[:, None] * C + c[None, :]  # (BN, BK): the (strip, chunk) block
    word = tl.load(qw_ptr + ((row * 32 + g[:, None] * 4 + t[None, :]) * 4 + j[None, :]), mask=mask, other=0)
    o = 2 * ob[None, :] + rh[:, None]
    h16 = 16 * h[None, :]
    r3 = o == 3
    code = ((word >> tl.where(r3, h16 + 3, (h16 + 6 + 3 * o) % 32)) & 1)  # P = (6, 7, 8, 15), Q = (3, 4, 0, 1)
    code |= ((word >> tl.where(r3, h16 + 4, (h16 + 7 + 3 * o) % 32)) & 1) << 1
    code |= ((word >> tl.where(r3, h16, (h16 + 8 + 3 * o) % 32)) & 1) << 2
    code |= ((word >> tl.where(r3, h16 + 1, (h16 + 15 + 3 * o) % 32)) & 1) << 3
    GPC: tl.constexpr = 64 // G
    grp = (k % 64) // G
    pair = tl.load(ps_ptr + row * (8 * GPC) + g[:, None] * GPC + grp[None, :], mask=mask, other=0)
    sb = (pair.to(tl.int32) >> (8 * rh[:, None])) & 0xFF
    sv = _scale_val(sb, FMT)
    if HAS_G:
        sv = tl.math.div_rn(sv, tl.load(gs_ptr))
    w = (_nib_val(code) * sv).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n[:, None] * K + k[None, :], w, mask=mask)
