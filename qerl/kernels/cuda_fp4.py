"""Hand-written CUDA W4A16 kernels for NVFP4 / MXFP4 weights (decode GEMV, mma.sync and sm_90a wgmma GEMMs, the
dense-weight rebuild): their build, configurations and launches. The weight they read, its re-layout and their CPU
emulator are :mod:`qerl.kernels.fp4_layout` (re-exported here).

``prepare`` re-lays out a compressed-tensors FP4 weight once (pure torch, any device) so that each lane's
128-bit load is its ``mma.sync.m16n8k16`` A fragments for one K chunk of 64 (see ``csrc/fp4_mma_gemv.cu`` for
the fragment map and the decode); ``gemv`` runs y (M, N) = x (M, K) @ Ŵᵀ for M <= 16 in one launch (split-K
reduced inside the CTA, CUDA-graph capturable); ``emulate`` computes the same thing on any device by decoding
the re-laid-out tensors lane by lane with the kernel's own bit operations. Shapes: N % 16 == 0, K % 64 == 0.
``dense_weight`` wraps a BF16 (N, K) weight as stored (no copy) for the same ``gemv`` (format "bf16": the BF16
baseline's decode products, with the same LoRA and SwiGLU epilogues). ``gemm`` serves M > 16 on the FP4 tensors
(``csrc/fp4_mma_gemm.cu``; on sm_90 also ``csrc/fp4_wgmma_gemm.cu``, whose token permutation ``permute_x_reference``
and ``wgmma_weight`` check on the CPU); ``dequantize`` rebuilds Ŵ for large M.

Decoded weights are exactly fp4 * s (NVFP4, E4M3 s; 1/g is applied to the fp32 accumulator) and
fp4 * 2^(e - 127) (MXFP4), scaled by 2^(B - 126) inside the kernel (B = 119 for NVFP4; per tensor for MXFP4).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from qerl.kernels import cuda_build
from qerl.kernels.configs import device_slug as _device_slug
from qerl.kernels.fp4_layout import (  # noqa: F401  (re-exported: the kernels' weight, re-layout and emulator)
    _FID,
    _GROUP,
    ACTS,
    FORMATS,
    GEMV_FORMATS,
    LORA_MAX_RANKS,
    LORA_MAX_UNITS,
    NV_BEXP,
    REST,
    SPREAD,
    SRC,
    CudaFP4Weight,
    LoraOperand,
    _check_act,
    _check_fmt,
    _fragment_values,
    dense_weight,
    emulate,
    emulate_lora,
    emulate_weight,
    lora_bn,
    lora_direct,
    lora_parts,
    lora_rp,
    lora_workspace_sizes,
    pack_words,
    prepare,
    relayout_is_exact,
    to_compressed,
    unpack_words,
    weight_from,
)

# ----------------------------------------------------------------------------------------- build

# The GEMV / GEMM / dequantize / wgmma launchers' torch wrappers: C++ compiled as the extension's binding.cpp
_BINDING = (cuda_build.CSRC / "fp4_mma_binding.cpp").read_text()
_WS_FLOATS, _WS_INTS = lora_workspace_sizes()  # the binding's workspace check: what lora_workspace allocates
_BINDING = _BINDING.replace("QERL_LORA_WS_FLOATS", str(_WS_FLOATS)).replace("QERL_LORA_WS_INTS", str(_WS_INTS))

_CSRC = cuda_build.CSRC
_CU = (_CSRC / "fp4_mma_gemv.cu", _CSRC / "fp4_mma_gemm.cu", _CSRC / "fp4_dequant.cu", _CSRC / "fp4_wgmma_gemm.cu")
_HEADERS = (_CSRC / "fp4_mma_common.cuh", _CSRC / "fp4_wgmma_ops.cuh")
_STATE: dict = {}


def _arch_flags() -> list[str]:
    return cuda_build.arch_flags()


WGMMA_PIPES = ("1", "2")


def wgmma_pipe() -> int:
    """``QERL_WGMMA_PIPE``: chunks of MMAs a warpgroup of the wgmma GEMM keeps in flight, fixed when the extension is
    built (a separate build per value). ``2`` (default since session 32): two register sets and ``wgmma.wait_group
    1``, chunk i + 1's MMAs issued while chunk i's run -- on an H100 the 7B layer 3-5% faster at M = 48-512 than
    ``1`` at the same configurations (three runs; `results/speed/raw/h100_s32`), rollouts 1-2%. ``1``: it waits for
    chunk i's MMAs before issuing chunk i + 1's. Both pass ``benchmarks.wgmma_sass_check``."""
    v = os.environ.get("QERL_WGMMA_PIPE", "2")
    if v not in WGMMA_PIPES:
        raise ValueError(f"QERL_WGMMA_PIPE={v!r}; valid: {', '.join(WGMMA_PIPES)}")
    return int(v)


WGMMA_TMA = ("0", "1")


def wgmma_tma() -> str:
    """``QERL_WGMMA_TMA``: ``1`` (default since session 41; decode mode ``fused-tma`` spells it out) stages the wgmma
    grid variants' chunks by the tensor memory accelerator: one thread of a split-K group issues three 2-D tensor
    copies a chunk (the token tile, swizzled by the copy engine; the weight words; the scale pairs) completing on an
    mbarrier, and the group's threads free a stage on another, instead of every thread's cp.async and a group barrier
    per chunk. Same data, same MMAs in the same order: the same results
    (``test_gpu_wgmma_tma_is_bit_identical``). Only the variants of 128+ tokens a CTA: on an H200 (session 41,
    `results/speed/raw/h200_s41_tma`, A B B A) the 7B products at their tuned 128- and 256-token configs ran
    2.9-8.8% faster with it (1.7-7.2% in the two calls before), the 64-token ones 3-8% slower when they took it too;
    7B NVFP4 rollouts +2.0-3.3% tokens/s at 128 sequences and +2.2-2.7% at 256 (decode rate +2.5% / +2.9%). ``0`` (a build of its own, decode mode ``fused-no-tma``): cp.async, session
    40's kernel. Experiments measured and removed (session 48; the code is at b686701): the same path in every grid
    variant, with or without the "empty" mbarrier, and the token tile alone by a tensor copy (sessions 41-43,
    `results/speed/raw/h200_s42_tma`, `h200_s43_tok`): the 64-token configs 1.9-7% slower, the 128+-token ones within
    ~1% of this default. Measured and removed in session 49 / 50: the producer refilling after its own chunk's MMAs
    (1.3-4.7% slower at 128 / 256 tokens; the code is at f40a905), and ``la3`` / ``la4``, the copies 3 chunks ahead
    with the same 4 stages (0.3-1.7% slower) or 4 ahead with 5 stages (up to 13% slower;
    `results/speed/raw/h200_s50_la3`, the code at 5d33040).
    The tensor copies need the two-chunk main loop: with ``QERL_WGMMA_PIPE=1`` the default is ``0`` and ``1`` is an
    error (the build would stop at the kernel's ``#error``; before session 52 it did, for pipe 1 with the defaults)."""
    from qerl.kernels.switches import _gemm_lora_switch  # one check of a value against its choices
    pipe = wgmma_pipe()
    v = _gemm_lora_switch("QERL_WGMMA_TMA", "1" if pipe == 2 else "0", WGMMA_TMA)
    if v != "0" and pipe != 2:
        raise ValueError(f"QERL_WGMMA_TMA={v!r} needs QERL_WGMMA_PIPE=2 (the two-chunk main loop); with "
                         f"QERL_WGMMA_PIPE={pipe} valid: 0")
    return v


WGMMA_TAIL = ("0", "1")


def wgmma_tail() -> bool:
    """``QERL_WGMMA_TAIL``: ``1`` (default since session 50, ``-DQFP4_WGMMA_TAIL=1``; decode mode ``fused-tail``
    spells it out) lets the wgmma grid variants take tail-split configs (nt, :func:`wgmma_tail_sw` (kt), r, ks): the
    output tiles up to the last whole wave of CTAs run whole, one CTA each, and each tile of the last, partial wave is
    split kt ways along K across CTAs (:func:`wgmma_tail_ctas`). The tuner times them where whole waves run first
    (``benchmarks.cuda_gemm_bench.configs``, since session 52) and marks its table ``"tail_splits"``; for a table
    swept before that, or the heuristic's config, the dispatcher turns a grid config into the one that fills its
    last wave (:func:`wgmma_tail_pick`, :func:`gemm_table_tails`). Measured
    on an H200 (session 50, `results/speed/raw/h200_s50_tail`, two passes): the 7B gate|up product with a rank-32
    LoRA 8.8-9.0% faster at 128 tokens (kt 4), 10.5-10.8% at 256 (kt 4), 2.8-3.5% at 64 (kt 2); session 51: 3.6-3.7%
    at 512 (kt 2), q|k|v 17% at 1024 (kt 4); MXFP4 gate|up 3-11% at 64-512. 7B NVFP4 rollouts +1.6 / +2.8% tokens/s
    at 128 sequences and +1.2 / +1.6% at 256 (+3.1 / -0.8% at 64). ``0`` (a build of its own, decode mode
    ``fused-no-tail``): no such configs, session 49's kernel."""
    from qerl.kernels.switches import _gemm_lora_switch  # one check of a value against its choices
    return _gemm_lora_switch("QERL_WGMMA_TAIL", "1", WGMMA_TAIL) == "1"


GEMM_KZ = ("0", "1")
GEMM_MAX_KZ = 8  # splits of K across CTAs the mma.sync GEMM's kz takes at most


def gemm_kz() -> bool:
    """``QERL_GEMM_KZ``: ``1`` (session 68's experiment, ``-DQFP4_GEMM_KZ=1``, a build of its own) lets the mma.sync
    GEMM split K across CTAs as well (:func:`gemm`'s ``kz``), so that more, smaller CTAs of the same shape spread over
    the SMs evenly (Nsight Compute at M = 32 found the 7B products' SMs active 61-71% of the time,
    ``results/speed/raw/h100_s68_ncu32``). Measured on an H100 (session 69, ``results/speed/raw/h100_s69_kz``): kz 2-4
    slower than kz 1 at every 7B product at M = 32 and 64 (0.59-0.98x), and this build's kernels 1.4-2.3x slower
    than the default build's even at kz 1 (not explained; ``scripts/gpu_bench.sh kzab`` compares the two). Kept as
    an opt-in experiment until that is explained. ``0`` (default): the kernel without it; ``kz`` must be 1."""
    from qerl.kernels.switches import _gemm_lora_switch  # one check of a value against its choices
    return _gemm_lora_switch("QERL_GEMM_KZ", "0", GEMM_KZ) == "1"


BF16_LOADS = ("pair", "sector")


def bf16_loads() -> str:
    """``QERL_BF16_LOADS``: how the decode GEMV over a dense BF16 weight (the BF16 baseline's decode products) loads a
    row's 128 bytes of a chunk, fixed when the extension is built. ``sector`` (default since session 43;
    ``-DQFP4_DENSE_SECTOR=1``; decode mode ``fused-bf16-sector`` spells it out): each load instruction's lanes cover
    whole 32-byte sectors (a lane holds k 8 t .. 8 t + 7 and 32 + 8 t .. 32 + 8 t + 7 of a chunk, its x fragment the
    same). ``pair`` (session 34's loads, a build of its own, decode mode ``fused-bf16-pair``): a lane holds 16
    contiguous bf16, so each of a row's two load instructions covers every other 16 bytes and each sector is
    requested twice. The same products summed in another order. The FP4 kernels are unchanged. Measured on an H200
    (session 43, `results/speed/raw/h200_s43_bf16sec`, pair / sector / sector / pair): the 7B layer's seven BF16
    GEMVs +2.6% / +7.5% at M = 8 and +1.7% / +5.6% at M = 1 in the two passes (cuBLAS in the same runs: -2.5…+1.0%);
    BF16-LoRA rollouts' decode rate +3.6% at batch 8 and +2.0…2.2% at batch 2 in both passes. Not measured on an
    H100."""
    from qerl.kernels.switches import _gemm_lora_switch  # one check of a value against its choices
    return _gemm_lora_switch("QERL_BF16_LOADS", "sector", BF16_LOADS)


WGMMA_STSM = ("0", "1")


def wgmma_stsm() -> bool:
    """``QERL_WGMMA_STSM``: ``1`` (session 72's experiment, ``-DQFP4_WGMMA_STSM=1``, a build of its own; not yet run
    on a GPU) makes the wgmma GEMM's epilogue write its output tile through shared memory (one ``stmatrix.trans`` per
    16 tokens a warp, then one 16-byte store a lane: whole 32-byte sectors) instead of one 2-byte store per element
    (16 bytes of each of 4 tokens an instruction: half sectors, 8 instructions per 512 bytes), with a group barrier
    before and after it. Why it might pay: a CTA's fixed cost outside its main loop was ~2 µs (session 49) and the
    epilogue's stores are part of it, paid once a tile at 128-512 tokens (issue 10's missed targets). The same
    values bit for bit. ``0`` (default): the kernel without it. Measure with ``scripts/gpu_bench.sh abk``
    (``ABK_SWITCH=QERL_WGMMA_STSM``)."""
    from qerl.kernels.switches import _gemm_lora_switch  # one check of a value against its choices
    return _gemm_lora_switch("QERL_WGMMA_STSM", "0", WGMMA_STSM) == "1"


# the environment switches _build_flags reads (each value a build of its own)
BUILD_SWITCHES = ("QERL_WGMMA_PIPE", "QERL_WGMMA_LORA", "QERL_WGMMA_TMA", "QERL_WGMMA_TAIL", "QERL_GEMM_KZ",
                  "QERL_BF16_LOADS", "QERL_WGMMA_STSM")


def _build_flags() -> list[str]:
    """nvcc flags of the extension (part of its build's name): the wgmma main loop's pipe depth;
    ``QERL_WGMMA_LORA=pdl``'s waits in the wgmma LoRA variants (a build of its own, so the default's machine code
    stays the measured one); ``QERL_WGMMA_TMA=1`` (default) the chunks staged by tensor copies
    (``-DQFP4_WGMMA_TMA=1``; ``0`` another build); ``QERL_WGMMA_TAIL=1`` (default) the tail-split configs
    (``-DQFP4_WGMMA_TAIL=1``; ``0`` another build);
    ``QERL_BF16_LOADS=sector`` (default) the BF16 GEMV's sector-wide
    loads (``-DQFP4_DENSE_SECTOR=1``; ``pair`` another build). Opt-ins measured and not adopted were removed with
    their builds in session 48 (the code is at b686701): the wgmma tail launch (``QERL_WGMMA_LORA=pdl-tail``), the
    split-K groups' halves of the epilogue (``QERL_WGMMA_SPLIT_EPI``), the TMA experiments (``QERL_WGMMA_TMA=all |
    bar | all-bar | tok | all-tok``), two CTAs an SM (``QERL_WGMMA_OCC=2``) and the GEMV LoRA's K skew
    (``QERL_LORA_SKEW``); in session 49 (the code is at 38b0e06 / f40a905), the weights prefetched into L2 ahead of
    their tensor copies (``QERL_WGMMA_L2PF``, 5-14% slower) and the producer refilling after its own MMAs
    (``QERL_WGMMA_TMA=late``, 1-5% slower); in session 50 (the code is at 5d33040) the copies 3 or 4 chunks ahead
    (``QERL_WGMMA_TMA=la3 | la4``, 0.3-13% slower); in session 68 (the code is at 8d96cac; H100,
    `results/speed/raw/h100_s68_wgexp`) every CTA walking its K range from chunk ``tile % n`` (``QERL_WGMMA_ROT=1``,
    0.3-8.6% slower) and one arrival a warp releasing a stage (``QERL_WGMMA_ARRIVE=warp``, level to 2.8% slower)."""
    return ["-O3", *_arch_flags(), *switch_defines()]


def switch_defines() -> list[str]:
    """The -D flags the kernel switches set (:func:`_build_flags` without the device's arch flags; the SASS checks
    build with them)."""
    from qerl.kernels.switches import wgmma_lora_mode
    pipe, tma = wgmma_pipe(), wgmma_tma()
    return [*([f"-DQFP4_WGMMA_PIPE={pipe}"] if pipe != 2 else []),
            *(["-DQFP4_WGMMA_PDL=1"] if wgmma_lora_mode() == "pdl" else []),
            *(["-DQFP4_WGMMA_TMA=1"] if tma != "0" else []),
            *(["-DQFP4_WGMMA_TAIL=1"] if wgmma_tail() else []),
            *(["-DQFP4_GEMM_KZ=1"] if gemm_kz() else []),
            *(["-DQFP4_WGMMA_STSM=1"] if wgmma_stsm() else []),
            *(["-DQFP4_DENSE_SECTOR=1"] if bf16_loads() == "sector" else [])]


def _ext():
    """The compiled extension (built once per source/arch into ~/.cache/qerl_kernels or TORCH_EXTENSIONS_DIR)."""
    return cuda_build.load_extension("qerl_fp4_mma", _CU, _HEADERS, _BINDING, _build_flags(), _STATE)


def available() -> bool:
    """True when a CUDA device (sm_80+) is present and the extension builds and loads."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8:
        return False
    return cuda_build.builds(_ext)


def build_error() -> str | None:
    """Why the last build failed (None when it did not)."""
    return _STATE.get("error")


def _gemv_fid(fmt: str) -> int:
    if fmt not in _FID:
        raise ValueError(f"unknown GEMV weight format {fmt!r}; valid: {list(GEMV_FORMATS)}")
    return _FID[fmt]


def kernel_attributes(fmt: str, m: int, unroll: int, sw: int = 1) -> tuple[int, int]:
    """(registers, local-memory bytes) per thread of the GEMV variant (unroll, strips per warp) at M rows."""
    r = _ext().attributes(_gemv_fid(fmt), 2 if m > 8 else 1, unroll, sw)
    return int(r[0]), int(r[1])


# ----------------------------------------------------------------------------------------- launch

def variant_for(s: int, c: int, m: int = 1, fmt: str = "nvfp4") -> tuple[int, int]:
    """(unroll U, strips per warp SW) for S = N/16 strips, C = K/64 chunks and M rows: many strips take two
    strips per warp (one x fragment serves both) with batches of 2 chunks, the rest one strip with batches of 4
    (measured on the H100: ``cuda_bench --sweep``, 7B shapes, M = 1..16). Few strips over a long K (down_proj) at
    M <= 8 take one strip per warp: two per warp left them too few strip groups to fill the GPU (7B: 112 CTAs of 16
    warps on 132 SMs) and the sweep of s24 measured them 10-13% slower than the best one-strip configuration (M = 8:
    7B 22.3 vs 19.8 µs, 14B 23.4 vs 20.5, 32B 37.8 vs 33.7; the heuristic's one-strip pick: 7B 20.0, 14B and 32B not
    in the top 6; ``raw/h100_s24_sweep``). At M = 16 the two are within 2-4% and keep the rule of s22.
    A BF16 weight (four words a lane per chunk) takes one strip per warp in batches of 2 chunks: the bytes of FP4's
    (8, 1) batches, 116-146 registers (sm_90a), two CTAs of 8 warps per SM."""
    if fmt == "bf16":
        return 2, 1
    if s >= 512 or (c >= 128 and m > 8):
        return 2, 2
    return 4, 1


def pick_config(s: int, c: int, sms: int, unroll: int, occupancy, sw: int = 1,
                extra_ctas=None, words: int = 1) -> tuple[int, int, int, int]:
    """(splits, strip groups per CTA, unroll, strips per warp) for S = N/16 strips, C = K/64 chunks.

    Enough warps for the loads in flight to cover HBM latency (~16 warps per SM with 4 loads a batch, 8 with 8),
    each with at least one full batch, the whole grid resident in one wave (``occupancy(warps, splits)`` =
    resident CTAs per SM). ``extra_ctas(warps, splits)``: CTAs the launch adds (the LoRA CTAs), which must fit in
    the same wave — a second wave of output CTAs costs a whole CTA's main loop (measured: gate|up at M = 8 took
    53 µs instead of 34 when its LoRA variant, four registers more per thread, fitted 4 CTAs per SM instead of 5).
    ``words``: 128-bit weight words a lane loads per (strip, chunk) (1 for FP4, 4 for BF16).
    """
    groups = math.ceil(s / sw)
    target = sms * (16 if unroll * sw * words <= 4 else 8)
    maxw = gemv_warp_cap(unroll, sw, words)
    splits = max(1, min(math.ceil(target / groups), max(1, c // unroll), maxw))
    while True:
        per = max(1, min(maxw // splits, 4 // splits))
        blocks = math.ceil(groups / per)
        if extra_ctas is not None:
            blocks += extra_ctas(per * splits, splits)
        if splits == 1 or blocks <= occupancy(per * splits, splits) * sms:
            return splits, per, unroll, sw
        splits -= 1


GEMV_VARIANTS = ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4))  # compiled (unroll, strips per warp), FP4
GEMV_VARIANTS_BF16 = ((2, 1), (4, 1), (2, 2))  # the same for a BF16 weight (four words a lane per chunk)


def gemv_variants(fmt: str) -> tuple[tuple[int, int], ...]:
    """The compiled (unroll, strips per warp) of the GEMV for a weight format."""
    return GEMV_VARIANTS_BF16 if _gemv_fid(fmt) == 2 else GEMV_VARIANTS


def gemv_words(fmt: str) -> int:
    """128-bit weight words a lane loads per (strip, chunk): 1 for FP4, 4 for BF16 (csrc ``wwords``)."""
    return 4 if _gemv_fid(fmt) == 2 else 1


def gemv_warp_cap(unroll: int, sw: int, words: int = 1) -> int:
    """Warps per CTA at most (csrc ``max_warps``): 16 while a warp keeps <= 4 weight words per batch, else 8."""
    return 8 if unroll * sw * words >= 8 else 16


def check_gemv_config(config, act: str | None = None, fmt: str = "nvfp4") -> tuple[int, int, int, int]:
    """``config`` = (splits, strip groups per CTA, unroll, strips per warp) as ints, or ValueError naming what is
    wrong: a compiled (unroll, strips per warp) of ``fmt``'s kernels, splits x groups within the variant's warps
    per CTA, two strips per warp with an epilogue (``act``)."""
    try:
        splits, per, unroll, sw = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"a GEMV config is (splits, strip groups per CTA, unroll, strips per warp), got {config!r}") \
            from None
    if (unroll, sw) not in gemv_variants(fmt):
        raise ValueError(f"GEMV config {tuple(config)}: (unroll, strips per warp) = {(unroll, sw)} is not compiled "
                         f"for {fmt}; valid: {list(gemv_variants(fmt))}")
    cap = gemv_warp_cap(unroll, sw, gemv_words(fmt))
    if splits < 1 or per < 1 or splits * per > cap:
        raise ValueError(f"GEMV config {tuple(config)}: splits x strip groups = {splits} x {per} must be in [1, "
                         f"{cap}] warps for {fmt}, unroll {unroll}, {sw} strips per warp")
    if act is not None and sw != 2:
        raise ValueError(f"GEMV config {tuple(config)}: act={act!r} runs with two strips per warp, got {sw}")
    return splits, per, unroll, sw


def _gemv_table_path(device_name: str) -> Path:
    return _GEMM_TABLE_DIR / f"cuda_gemv_{_device_slug(device_name)}.json"


def load_gemv_table(device_name: str) -> dict:
    """The tuned GEMV table of a device (``qerl/kernels/tuned/cuda_gemv_<device>.json``, written by ``python -m
    benchmarks.gemv_tune --write-table``) as {(fmt, N, K, lora rank, Bn row length, act): [(M, config), ...]} sorted
    by M (rank 0: the plain GEMV; act "" for none); {} when the device has none. Every config is checked on load."""
    key = ("gemv_table", device_name)
    if key in _STATE:
        return _STATE[key]
    path = _gemv_table_path(device_name)
    table: dict = {}
    if path.exists():
        import json
        for e in json.loads(path.read_text())["entries"]:
            act = e.get("act") or None
            cfg = check_gemv_config(e["config"], act, e["fmt"])
            table.setdefault((e["fmt"], e["N"], e["K"], e["rank"], e["rp"], act or ""), []).append((e["M"], cfg))
        for v in table.values():
            v.sort()
    _STATE[key] = table
    return table


def install_gemv_table(device_name: str, text: str) -> Path:
    """Write a tuned GEMV table (the JSON ``benchmarks.gemv_tune --write-table`` makes) as the device's table and
    forget this process's cached table and launch choices, so the next launch dispatches by it."""
    path = _gemv_table_path(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    _STATE.pop(("gemv_table", device_name), None)
    forget_gemv_configs()
    return path


def forget_gemv_configs() -> None:
    """Drop this process's cached GEMV launch choices (after a table or ``lora_parts`` change)."""
    for key in [k for k in _STATE if isinstance(k, tuple) and k and k[0] == "gemv"]:
        del _STATE[key]


def gemv_table_enabled() -> bool:
    """Whether launches take their configuration from the device's tuned table (``QERL_GEMV_TABLE=0``: the
    heuristic, for same-run comparisons)."""
    return os.environ.get("QERL_GEMV_TABLE", "1") != "0"


def tuned_gemv_config(fmt: str, n: int, k: int, m: int, lora_sig: tuple[int, int] | None, act: str | None,
                      device_name: str) -> tuple[int, int, int, int] | None:
    """The config measured for the smallest tuned M >= m of this (fmt, N, K, LoRA (rank, Bn row length) or None,
    act) on the device, among the tuned M on m's side of the 8-row boundary (one or two n8 token tiles: other kernel
    variants); None when there is none (the heuristic then decides)."""
    rank, rp = lora_sig if lora_sig is not None else (0, 0)
    rows = load_gemv_table(device_name).get((fmt, n, k, rank, rp, act or ""))
    for mm, cfg in rows or ():
        if mm >= m and (mm > 8) == (m > 8):
            return cfg
    return None


BF16_WARPS_PER_SM = 10  # the BF16 rule's warps per SM (one strip group per CTA, splits of K to reach them)


def bf16_gemv_config(s: int, c: int, sms: int, act: str | None = None) -> tuple[int, int, int, int]:
    """The rule for a BF16 weight (S = N/16 strips, C = K/64 chunks): batches of 2 chunks, one strip per warp (two
    with an epilogue over strip pairs), one strip group per CTA, K split until the grid has ~``BF16_WARPS_PER_SM``
    warps per SM (at most 8 splits, each >= one batch). It reproduces the tuner's best on the H100 for 7B's q|k|v
    (5 splits), o (6) and gate|up + SwiGLU (2, two waves of CTAs); down's best took 8 (rule: 6) — the tuner's best
    against the FP4 rule applied to BF16: 15.0 / 12.2 / 103 / 51 µs against 17.8 / 14.4 / 120 / 55 at M = 2
    (``raw/h100_s34_bf16/call2/tune``)."""
    unroll, sw = (2, 2) if act is not None else variant_for(s, c, fmt="bf16")
    groups = math.ceil(s / sw)
    splits = max(1, min(math.ceil(BF16_WARPS_PER_SM * sms / groups), max(1, c // unroll),
                        gemv_warp_cap(unroll, sw, gemv_words("bf16"))))
    return splits, 1, unroll, sw


def heuristic_gemv_config(w: CudaFP4Weight, m: int, dev: torch.device, lora: LoraOperand | None = None,
                          act: str | None = None) -> tuple[int, int, int, int]:
    """The launch configuration by rule (``variant_for`` + ``pick_config`` with the variant's occupancy on ``dev``;
    an epilogue over strip pairs takes two strips per warp; a BF16 weight: :func:`bf16_gemv_config`), what an
    untuned point gets."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if w.fmt == "bf16":
        return bf16_gemv_config(w.n // 16, w.k // 64, torch.cuda.get_device_properties(idx).multi_processor_count,
                                act)
    unroll, sw = variant_for(w.n // 16, w.k // 64, m) if act is None else (2, 2)
    sms = torch.cuda.get_device_properties(idx).multi_processor_count
    ext, fid, nt, words = _ext(), _gemv_fid(w.fmt), 2 if m > 8 else 1, gemv_words(w.fmt)
    c = w.k // 64
    if lora is None:
        return pick_config(w.n // 16, c, sms, unroll,
                           lambda warps, splits: ext.occupancy(fid, nt, unroll, sw, warps, splits, 0), sw,
                           words=words)
    # the LoRA variant's own occupancy, with its LoRA CTAs in the same wave
    return pick_config(w.n // 16, c, sms, unroll,
                       lambda warps, splits: ext.occupancy(fid, nt, unroll, sw, warps, splits, 1), sw,
                       extra_ctas=lambda warps, splits: -(-lora.rank // 16) * lora_parts(lora.rank, c, warps),
                       words=words)


def _config(w: CudaFP4Weight, m: int, dev: torch.device, lora: LoraOperand | None = None,
            act: str | None = None) -> tuple[int, int, int, int]:
    """The device's tuned table's configuration for this point, else the heuristic's (cached per point)."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    sig = None if lora is None else (lora.rank, lora.bn.shape[1])
    use_table = gemv_table_enabled()
    key = ("gemv", idx, w.fmt, m, w.n, w.k, sig, act, use_table)
    cfg = _STATE.get(key)
    if cfg is None:
        if use_table:
            cfg = tuned_gemv_config(w.fmt, w.n, w.k, m, sig, act, torch.cuda.get_device_properties(idx).name)
        if cfg is None:
            cfg = heuristic_gemv_config(w, m, dev, lora, act)
        _STATE[key] = cfg
    return cfg


def rows_aligned(x: torch.Tensor) -> bool:
    """Whether the kernels read x's rows in place: unit column stride, rows and start 16-byte aligned (bf16)."""
    return x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0


def _operands(op: str, x: torch.Tensor, w: CudaFP4Weight, out: torch.Tensor | None, cols: int | None = None):
    """The checked (x, out) of ``gemv`` (M in [1, 16]) or ``gemm`` (M >= 1, rows addressed by 32-bit offsets): x
    2-D bf16 on CUDA with w's K, copied when its rows are not 16-byte aligned; out bf16 (M, cols) (cols = N unless
    given) with unit stride along its columns, allocated when None."""
    cols = w.n if cols is None else cols
    if not x.is_cuda or not w.qweight.is_cuda:
        raise ValueError(f"{op} needs CUDA tensors (use emulate() elsewhere)")
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError(f"{op}: x must be a 2-D bfloat16 tensor, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if op == "gemv" and not 1 <= m <= 16:
        raise ValueError(f"gemv handles M in [1, 16] rows, got M={m}")
    if op == "gemm" and m < 1:
        raise ValueError(f"gemm needs M >= 1 rows, got M={m}")
    if op == "gemm" and m * max(x.stride(0), k) >= 2 ** 32:
        raise ValueError(f"gemm addresses token rows with 32-bit offsets: M * row stride must be < 2^32, got "
                         f"{m} * {max(x.stride(0), k)}")
    if k != w.k:
        raise ValueError(f"{op}: x has K={k}, the weight is {(w.n, w.k)}")
    if not rows_aligned(x):
        x = x.contiguous() if x.stride(1) != 1 or x.stride(0) % 8 else x.clone()
    if out is None:
        out = torch.empty((m, cols), device=x.device, dtype=torch.bfloat16)
    elif out.shape != (m, cols) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"{op}: out must be bf16 {(m, cols)} with unit stride along its columns, got {out.dtype} "
                         f"{tuple(out.shape)}")
    return x, out


def gemv(x: torch.Tensor, w: CudaFP4Weight, out: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None, pdl: bool = False,
         lora: LoraOperand | None = None, act: str | None = None) -> torch.Tensor:
    """y (M, N) bf16 = x (M, K) bf16 @ Ŵᵀ (+ ``lora``'s term, same launch) for M <= 16 on the current CUDA stream
    (graph capturable).

    ``config`` = (splits, strip groups per CTA, unroll, strips per warp) overrides :func:`pick_config` (tuning).
    ``pdl``: programmatic dependent launch; the CTAs start during the previous kernel's tail and wait for it
    (griddepcontrol.wait) before reading (measured: ~5 µs less per 7B layer of consecutive GEMVs at M = 1).
    ``lora``: extra CTAs compute x·Aᵀ (fp32) into a per-stream workspace (:func:`lora_workspace`) while the others
    run the FP4 product; those add the LoRA term before their one bf16 rounding (see ``csrc/fp4_mma_gemv.cu``).
    ``act="silu_mul"``: the weight's rows are gate then up (a fused gate|up, N/2 each, N/2 a multiple of 16) and
    the launch returns silu(gate) · up (M, N/2) — each warp takes row block i of both halves, so the SwiGLU is applied
    in the epilogue, rounded as ``silu_mul`` rounds it (a ``config`` must have two strips per warp).
    """
    _check_act(act)
    if act is not None and w.n % 32:
        raise ValueError(f"gemv(act={act!r}) needs N/2 = {w.n / 2:g} to be a multiple of 16 rows")
    x, out = _operands("gemv", x, w, out, w.n // 2 if act is not None else None)
    m = x.shape[0]
    splits, per, unroll, sw = (check_gemv_config(config, act, w.fmt) if config is not None else
                               _config(w, m, x.device, lora, act))
    code = 0 if act is None else 1 + ACTS.index(act)
    gs = w.global_scale if w.global_scale is not None else w.qweight
    fid = _gemv_fid(w.fmt)
    if lora is None:
        _ext().gemv(x, w.qweight, w.scales, gs, out, fid, w.out_mult, w.bword, splits, per, unroll, sw, pdl, code)
        return out
    a, bn = _lora_tensors(lora, w)
    _STATE["lora_launches"] = _STATE.get("lora_launches", 0) + 1
    part, ctr = lora_workspace(x.device)
    bound1, bound2, roff, rk = lora.launch_args()
    _ext().gemv_lora(x, w.qweight, w.scales, gs, out, fid, w.out_mult, w.bword, splits, per, unroll, sw, pdl, code,
                     a, bn, part, ctr, lora_parts(lora.rank, w.k // 64, splits * per), bound1, bound2, roff, rk)
    return out


def _lora_tensors(lora: LoraOperand, w: CudaFP4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    a, bn = lora.a, lora.bn
    if a.shape[1] != w.k or bn.shape[0] != w.n:
        raise ValueError(f"gemv: LoRA a {tuple(a.shape)} / bn {tuple(bn.shape)} do not fit the weight {(w.n, w.k)}")
    if a.dtype != torch.bfloat16 or bn.dtype != torch.bfloat16 or a.device != w.qweight.device \
            or bn.device != w.qweight.device:
        raise ValueError(f"gemv: LoRA a, bn must be bfloat16 on {w.qweight.device}, got {a.dtype} on {a.device}, "
                         f"{bn.dtype} on {bn.device}")
    if not a.is_contiguous() or a.data_ptr() % 16:
        a = a.contiguous() if not a.is_contiguous() else a.clone()
    if not bn.is_contiguous() or bn.data_ptr() % 16:
        bn = bn.contiguous() if not bn.is_contiguous() else bn.clone()
    return a, bn


def lora_launches() -> int:
    """How many GEMV launches with LoRA this process has issued (host side: a captured graph's count once)."""
    return _STATE.get("lora_launches", 0)


def zero_lora_counters() -> None:
    """Zero every LoRA workspace (:func:`lora_workspace`, each device and stream), counters and values, after a launch
    that may have left them set: a timing-only build (``benchmarks.lora_gemv_bench --ablate``) breaks the rule that
    every launch leaves the counters zero. The values go too."""
    for key, ws in _STATE.items():
        if isinstance(key, tuple) and key[0] == "lora_ws":
            ws[0].zero_()
            ws[1].zero_()


def lora_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, counters) of the LoRA-in-GEMV launches on this device and the current stream
    (:func:`lora_workspace_sizes`), zeroed once; every launch overwrites the values it reads and leaves the counters
    zero. Launches on one stream run one after the other (under PDL the next grid waits for the previous one before
    touching them)."""
    stream = torch.cuda.current_stream(device).cuda_stream
    key = ("lora_ws", device, stream)
    ws = _STATE.get(key)
    if ws is None:
        floats, ints = lora_workspace_sizes()
        ws = (torch.zeros(floats, dtype=torch.float32, device=device),
              torch.zeros(ints, dtype=torch.int32, device=device))
        _STATE[key] = ws
    return ws


# ----------------------------------------------------------------------------------------- GEMM (M > 16)

GEMM_NT = (2, 4, 8, 16)  # n8 token tiles per CTA: 16, 32, 64, 128 tokens (16: one strip per warp only)
GEMM_SW = (1, 2)  # strips of 16 weight rows per warp
GEMM_R = (1, 2, 4, 8)  # warps per split-K group (a template parameter of the kernel: the staging plan is static)
GEMM_MAX_WARPS = 8
GEMM_STAGES = 4  # csrc/fp4_mma_gemm.cu kStages
GEMM_SMEM_MAX = 227 * 1024  # opt-in dynamic shared memory per CTA (sm_90)


def gemm_smem_bytes(nt: int, sw: int, r: int, ks: int) -> int:
    """Dynamic shared memory of a GEMM launch (as ``gemm_smem`` in the kernel source): ks groups x GEMM_STAGES stages
    of (8 nt tokens x 128 B + r sw strips x (512 B weights + 64 B scales)), or the split-K reduction if larger."""
    pipe = ks * GEMM_STAGES * (8 * nt * 128 + r * sw * (512 + 64))
    return max(pipe, (ks - 1) * r * sw * nt * 32 * 16)
_GEMM_TABLE_DIR = Path(__file__).with_name("tuned")


def gemm_variant_ok(nt: int, sw: int, r: int) -> bool:
    """Whether the kernel is compiled for (n8 token tiles, strips per warp, warps per split-K group): nt in GEMM_NT,
    sw in GEMM_SW, r in GEMM_R; nt 16 only with sw 1 and r >= 2; sw 2 only with r <= 4 (csrc/fp4_mma_gemm.cu)."""
    return (nt in GEMM_NT and sw in GEMM_SW and r in GEMM_R and not (nt == 16 and (sw != 1 or r < 2))
            and not (sw == 2 and r > 4))


def gemm_variants() -> list[tuple[int, int, int]]:
    """Every compiled (nt, sw, r)."""
    return [(nt, sw, r) for nt in GEMM_NT for sw in GEMM_SW for r in GEMM_R if gemm_variant_ok(nt, sw, r)]


def gemm_kernel_attributes(fmt: str, nt: int, sw: int, r: int = 4, ks: int = 1) -> tuple[int, int]:
    """(registers, local-memory bytes) per thread of the GEMM variant (n8 token tiles, strips per warp, warps per
    split-K group); sw <= 0: the wgmma variant (8 nt tokens, r warpgroups, ks groups)."""
    _check_fmt(fmt)
    if sw <= 0:
        if (8 * nt, r, ks) not in WGMMA_VARIANTS:
            raise ValueError(f"no wgmma variant (tokens={8 * nt}, r={r}, ks={ks}); compiled: {list(WGMMA_VARIANTS)}")
        a = _ext().wgmma_attributes(0 if fmt == "nvfp4" else 1, 8 * nt, r, ks)
        return int(a[0]), int(a[1])
    if not gemm_variant_ok(nt, sw, r):
        raise ValueError(f"no GEMM variant (nt={nt}, sw={sw}, r={r}); compiled: {gemm_variants()}")
    a = _ext().gemm_attributes(0 if fmt == "nvfp4" else 1, nt, sw, r)
    return int(a[0]), int(a[1])


def check_gemm_config(config, s: int, c: int) -> tuple[int, int, int, int]:
    """Validate ``(nt, sw, r, ks)`` = (n8 token tiles per CTA, strips per warp, warps per split-K group, split-K
    groups) for a weight of S strips and C chunks; returns it as a tuple of ints. ``sw <= 0`` names the sm_90a wgmma
    kernel instead: (8 nt tokens per CTA, 1 - kz, r warpgroups of 64 rows per split-K group, ks groups per CTA) with
    (8 nt, r, ks) one of :data:`WGMMA_VARIANTS` and kz = 1 - sw splits of K across CTAs (1..WGMMA_MAX_KZ), or
    sw = :data:`WGMMA_SK`: stream-K (persistent CTAs; whole waves of tiles, the last partial wave's (tile, chunk) units
    split evenly between the split-K groups: :func:`streamk_segments`), or sw = :func:`wgmma_tail_sw` (kt), kt in
    2..WGMMA_MAX_KZ, in a ``QERL_WGMMA_TAIL=1`` build: the last partial wave's tiles split kt ways
    (:func:`wgmma_tail_ctas`)."""
    try:
        nt, sw, r, ks = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"GEMM config must be (nt, sw, r, ks), got {config!r}") from None
    if kt := wgmma_tail_kt(sw):
        if (8 * nt, r, ks) not in WGMMA_VARIANTS or kt * ks > c or not wgmma_tail():
            raise ValueError(f"wgmma tail-split config {config!r} invalid for C={c} chunks: needs a "
                             f"QERL_WGMMA_TAIL=1 build (this one: {wgmma_tail()}), (8 nt, r, ks) one of "
                             f"{list(WGMMA_VARIANTS)} and kt * ks <= C (kt = {kt})")
        return nt, sw, r, ks
    if sw <= 0:
        kz = 1 if sw == WGMMA_SK else 1 - sw
        if ((8 * nt, r, ks) not in (WGMMA_SK_VARIANTS if sw == WGMMA_SK else WGMMA_VARIANTS) or kz > WGMMA_MAX_KZ
                or kz * ks > c):
            raise ValueError(f"wgmma GEMM config {config!r} invalid for S={s} strips, C={c} chunks: (8 nt, r, ks) "
                             f"must be one of {list(WGMMA_VARIANTS)} (tokens per CTA, warpgroups per group, split-K "
                             f"groups), kz = 1 - sw in 1..{WGMMA_MAX_KZ} CTA splits (or sw = {WGMMA_SK}: "
                             f"stream-K, variants {list(WGMMA_SK_VARIANTS)}), kz * ks <= C")
        return nt, sw, r, ks
    if (not gemm_variant_ok(nt, sw, r) or ks < 1 or r * ks > GEMM_MAX_WARPS or ks > c
            or gemm_smem_bytes(nt, sw, r, ks) > GEMM_SMEM_MAX):
        raise ValueError(f"GEMM config {config!r} invalid for S={s} strips, C={c} chunks: nt in {list(GEMM_NT)}, "
                         f"sw in {list(GEMM_SW)} (or <= 0: the wgmma kernel), r in {list(GEMM_R)} (nt 16: sw 1 and "
                         f"r >= 2; sw 2: r <= 4), 1 <= ks <= C, r * ks <= {GEMM_MAX_WARPS}, shared memory <= "
                         f"{GEMM_SMEM_MAX} B")
    return nt, sw, r, ks


# The sm_90a wgmma GEMM (csrc/fp4_wgmma_gemm.cu): compiled (tokens per CTA, warpgroups along the rows per split-K
# group, split-K groups); a warpgroup owns 64 weight rows (4 strips).
# Four warpgroups along the rows (32/64/128 tokens x 256 rows) were built and swept in session 32 and chosen at none
# of the 72 (format, shape, M) points on an H100 or an H200 (fewer, longer CTAs: 1.12 waves at 128 tokens); removed.
WGMMA_VARIANTS = ((32, 1, 1), (32, 2, 1), (32, 1, 2), (32, 1, 4), (32, 2, 2),
                  (64, 1, 1), (64, 2, 1), (64, 1, 2), (64, 1, 4), (64, 2, 2),
                  (128, 1, 1), (128, 2, 1), (128, 1, 2), (128, 2, 2),
                  (256, 1, 1), (256, 2, 1))
# the variants with a stream-K kernel (csrc sk_variant: not 128 tokens on 512 threads, where its loop spills)
WGMMA_SK_VARIANTS = tuple(v for v in WGMMA_VARIANTS if not (v[0] >= 128 and v[1] * v[2] >= 4))
WGMMA_STAGES = 4  # csrc kStages
WGMMA_MAX_KZ = 4  # splits of K across CTAs the tuner tries (csrc allows 64)
# sw of a stream-K wgmma config (nt, WGMMA_SK, r, ks): as many CTAs as fit the device at once, each split-K group a
# worker; whole waves of tiles round-robin, then an even share of the rest's (output tile, chunk) units; shared tiles
# reduced in worker order (csrc kz = 0; streamk_segments)
WGMMA_SK = -16
WGMMA_COUNTERS = 1 << 16  # per-device tile counters of the split-K across CTAs (zeroed once, left zero by the kernel)


def wgmma_tail_sw(kt: int) -> int:
    """sw of a tail-split wgmma config (nt, sw, r, ks), kt = 2..WGMMA_MAX_KZ splits of the last partial wave's tiles
    (a ``QERL_WGMMA_TAIL=1`` build; csrc kz = -kt): WGMMA_SK - kt."""
    if not 2 <= kt <= WGMMA_MAX_KZ:
        raise ValueError(f"tail split kt={kt}; valid: 2..{WGMMA_MAX_KZ}")
    return WGMMA_SK - kt


def wgmma_tail_kt(sw: int) -> int:
    """The splits kt of a tail-split config's sw (:func:`wgmma_tail_sw`), 0 for any other sw."""
    return WGMMA_SK - sw if WGMMA_SK - WGMMA_MAX_KZ <= sw <= WGMMA_SK - 2 else 0


def wgmma_tail_pick(cfg: tuple[int, int, int, int], tiles: int, c: int, wave: int,
                    sms: int) -> tuple[int, int, int, int]:
    """A grid wgmma config (nt, 0, r, ks) of ``tiles`` output tiles and C chunks as the tail-split config that fills
    its last partial wave of ``wave`` CTAs on ``sms`` SMs: kt = min(WGMMA_MAX_KZ, sms // rest, C // (4 ks)) splits of
    each of the rest's tiles, where at least one whole wave runs first and kt >= 2; else ``cfg`` itself. The rule
    follows from the mechanism (the rest's tiles spread over the SMs, at most one split CTA an SM), not from a sweep;
    session 51 replaced session 50's ``wave // rest``, which split 4 ways where two CTAs fit an SM and 2 ways measured
    4% faster. Measured against kt 2..4 and no split: `results/speed/raw/h200_s50_tail`, `h200_s51_tail`."""
    nt, sw, r, ks = cfg
    rest = tiles % wave
    if sw != 0 or tiles < wave or rest == 0:
        return cfg
    kt = min(WGMMA_MAX_KZ, sms // rest, c // (4 * ks))
    return (nt, wgmma_tail_sw(kt), r, ks) if kt >= 2 else cfg


def wgmma_tail_ctas(tiles: int, wave: int, kt: int) -> list[tuple[int, int, int]]:
    """The CTAs of a tail-split launch (csrc, QFP4_WGMMA_TAIL) in pure Python, as (tile, split, splits) per CTA in
    launch order: the tiles up to the last whole multiple of ``wave`` (the CTAs resident at once) one CTA each
    (split 0 of 1), then each tile of the rest kt CTAs (splits 0..kt-1 of kt); no split when the tiles fill whole
    waves."""
    rest = tiles % wave
    dp = tiles - rest
    if rest == 0 or kt < 2:
        return [(t, 0, 1) for t in range(tiles)]
    return [(t, 0, 1) for t in range(dp)] + [(dp + u // kt, u % kt, kt) for u in range(rest * kt)]


def wgmma_smem_bytes(ntok: int, rw: int, ks: int) -> int:
    """Dynamic shared memory of a wgmma launch (csrc ``smem_bytes``): ks groups x WGMMA_STAGES stages of (ntok x
    128 B tokens + 4 rw strips x 576 B weights and scales, rounded up to 1 KB), or the split-K reduction if larger,
    + 1 KB of alignment slack."""
    stage = -(-(ntok * 128 + rw * 4 * (512 + 64)) // 1024) * 1024
    return max(ks * WGMMA_STAGES * stage, (ks - 1) * rw * 128 * (ntok // 2) * 4) + 1024


def wgmma_supported(device: torch.device | int | None = None) -> bool:
    """Whether the wgmma GEMM runs on this CUDA device (compute capability 9.0, built for sm_90a)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


def wgmma_tiles(m: int, s: int, nt: int, r: int) -> int:
    """Output tiles (CTAs per split of K) of a wgmma launch: token tiles of 8 nt x row blocks of 4 r strips."""
    return gemm_tiles(m, s, nt, 4 * r)


def gemm_tiles(m: int, s: int, nt: int, strips: int) -> int:
    """Output tiles (CTAs per split of K) of a GEMM launch: token tiles of 8 nt x row blocks of ``strips`` strips
    (the mma.sync GEMM's r x sw; the wgmma GEMM's 4 r)."""
    return -(-m // (8 * nt)) * -(-s // strips)


def wgmma_configs(s: int, c: int) -> list[tuple[int, int, int, int]]:
    """Every wgmma config (nt, 1 - kz, r, ks) that fits a weight of S strips and C chunks (shared memory <= the
    opt-in limit, every split of K >= 4 chunks), then every variant's stream-K config (nt, WGMMA_SK, r, ks), then (a
    ``QERL_WGMMA_TAIL=1`` build) the tail-split ones (nt, wgmma_tail_sw(kt), r, ks)."""
    fits = [(ntok, rw, ks) for ntok, rw, ks in WGMMA_VARIANTS if wgmma_smem_bytes(ntok, rw, ks) <= GEMM_SMEM_MAX]
    return ([(ntok // 8, 1 - kz, rw, ks) for kz in range(1, WGMMA_MAX_KZ + 1) for ntok, rw, ks in fits
             if kz * ks == 1 or c // (kz * ks) >= 4]
            + [(ntok // 8, WGMMA_SK, rw, ks) for ntok, rw, ks in fits if ks <= c and (ntok, rw, ks) in WGMMA_SK_VARIANTS]
            + [(ntok // 8, wgmma_tail_sw(kt), rw, ks) for kt in range(2, WGMMA_MAX_KZ + 1) for ntok, rw, ks in fits
               if wgmma_tail() and c // (kt * ks) >= 4])


def streamk_segments(tiles: int, c: int, workers: int) -> list[tuple[int, int, int, int, int]]:
    """The stream-K schedule of the wgmma kernel (csrc, the SK part), in pure Python: the tiles up to the last whole
    multiple of ``workers`` round-robin, whole (worker w: tiles w, w + workers, ...); then the U = rest x c (tile,
    chunk) units of the rest split between W = min(workers, U) workers, worker w taking the units [w U / W,
    (w + 1) U / W) after those. Returns (worker, tile, first chunk, end chunk, slot) per segment, slot -1 for a
    tile the worker covers whole (stored at once), else the fp32 partial's workspace slot 2 w (the worker's first
    tile of the split part) or 2 w + 1 (its last)."""
    dp = tiles // workers * workers
    out = [(w, t, 0, c, -1) for w in range(workers) for t in range(w, dp, workers)]
    u_all, u0 = (tiles - dp) * c, dp * c
    nw = min(workers, u_all)
    first = [u0 + v * u_all // nw for v in range(nw + 1)] if nw else [u0]
    for w in range(nw):
        u, t_first = first[w], first[w] // c
        while u < first[w + 1]:
            tile, a = divmod(u, c)
            b = min(c, a + first[w + 1] - u)
            u += b - a
            out.append((w, tile, a, b, -1 if (a, b) == (0, c) else 2 * w + (0 if tile == t_first else 1)))
    return out


def wgmma_sk_ctas(fmt: str, ntok: int, rw: int, ks: int) -> int:
    """CTAs of a stream-K launch of the variant on the current device (SMs x the blocks per SM its registers and
    shared memory allow), from the extension; cached."""
    return wgmma_ctas(fmt, ntok, rw, ks, lora=False, sk=True)


def wgmma_ctas(fmt: str, ntok: int, rw: int, ks: int, lora: bool, sk: bool = False) -> int:
    """CTAs of a variant (with or without its LoRA epilogue; a grid or a stream-K one) resident at once on the current
    device: one wave of a grid launch, a stream-K launch's grid (SMs x the blocks per SM its registers and shared
    memory allow), from the extension; cached."""
    # per build too: one process may load several builds (registers and shared memory may differ)
    key = ("wgmma_ctas", torch.cuda.current_device(), fmt, ntok, rw, ks, lora, sk, tuple(_build_flags()))
    if key not in _STATE:
        n = int(_ext().wgmma_ctas(0 if fmt == "nvfp4" else 1, ntok, rw, ks, lora, sk))
        if n < 1:
            raise RuntimeError(f"wgmma{' stream-K' if sk else ''}: no occupancy for (tokens={ntok}, r={rw}, ks={ks}, "
                               f"lora={lora}) ({n})")
        _STATE[key] = n
    return _STATE[key]


def _wgmma_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K tile counters (int32, zero; every launch leaves the ones it used at zero)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    key = ("wgmma_ctr", idx)
    ctr = _STATE.get(key)
    if ctr is None:
        ctr = _STATE[key] = torch.zeros(WGMMA_COUNTERS, device=device, dtype=torch.int32)
    return ctr


def permute_x_reference(x: torch.Tensor) -> torch.Tensor:
    """The tokens in the wgmma kernel's K permutation (csrc ``permute_x_kernel``), in pure torch: inside every chunk
    of 64, xp[64 c + 8 u + 2 i + e] = x[64 c + 16 i + 2 u + e]."""
    m, k = x.shape
    return x.reshape(m, k // 64, 4, 8, 2).permute(0, 1, 3, 2, 4).reshape(m, k)


def wgmma_weight(w: CudaFP4Weight) -> torch.Tensor:
    """float32 (N, K) in the wgmma kernel's logical K order: column 64 c + 16 j + kl holds what lane (g, t) of strip
    s feeds MMA step j of chunk c as A element (row, kl) -- the mma.sync A fragment order (registers 0/1: k 2t + h,
    registers 2/3: k 2t + 8 + h; 1/3: row g + 8). ``wgmma_weight(w) @ permute_x_reference(x)ᵀ`` = ``x @ Ŵᵀ`` up to
    summation order: the check, on the CPU, that the permutation of the tokens matches the weights'."""
    dec = _fragment_values(w)
    s, c = dec.shape[0], dec.shape[1]
    # o = 2 kh + rh (kh: k + 8, rh: row + 8); logical k = 16 j + 8 kh + 2 t + h, row = 8 rh + g
    d = dec.reshape(s, c, 8, 4, 4, 2, 2, 2)  # (S, C, g, t, j, kh, rh, h)
    return (d.permute(0, 6, 2, 1, 4, 5, 3, 7).reshape(w.n, w.k) * (2.0 ** (126 - w.bexp)))


def pick_gemm_config(s: int, c: int, m: int, sms: int, wgmma: bool = False) -> tuple[int, int, int, int]:
    """Heuristic (nt, sw, r, ks) for S strips, C chunks and M tokens on ``sms`` SMs, used where the tuned table
    (:func:`tuned_gemm_config`) has no entry: 64-token tiles from M > 32 (the decode of a weight chunk is shared by
    NT MMAs), 4 warps along the strips, and split-K inside the CTA until about two CTAs' worth of warps per SM.
    ``wgmma`` (an sm_90 device) and M > 32: the wgmma kernel instead, as the H100 sweep chose it for most 7B
    shapes at M = 64-512 (it beats the mma.sync heuristic at 23 of that NVFP4 sweep's 24 shape x M points, by up to
    2x; the exception: k/v 512 x 3584 at M = 512, 5% slower; `raw/h100_s30_splitk`): 64-token tiles and
    one warpgroup up to M = 64, else 128-token tiles and 2 warpgroups (128 rows) per CTA; 2 split-K groups; splits
    of K across CTAs while the grid has fewer CTAs than SMs (every split >= 4 chunks)."""
    if wgmma and m > 32:
        ntok, r = (64, 1) if m <= 64 else (128, 2 if s >= 8 else 1)
        ks = 2 if c >= 8 else 1
        kz = max(1, min(WGMMA_MAX_KZ, sms // wgmma_tiles(m, s, ntok // 8, r), c // (4 * ks)))
        return ntok // 8, 1 - kz, r, ks
    nt = 2 if m <= 16 else 4 if m <= 32 else 8
    tiles = math.ceil(m / (8 * nt))
    r, sw = 4, 1
    ctas = tiles * math.ceil(s / (r * sw))
    ks = max(1, min(GEMM_MAX_WARPS // r, c, math.ceil(2 * sms / max(1, ctas))))
    return nt, sw, r, ks


def _table_path(device_name: str) -> Path:
    return _GEMM_TABLE_DIR / f"cuda_gemm_{_device_slug(device_name)}.json"


def load_gemm_table(device_name: str) -> dict:
    """The tuned GEMM table of a device (``qerl/kernels/tuned/cuda_gemm_<device>.json``, written by
    ``python -m benchmarks.cuda_bench --gemm-sweep``), as {(fmt, N, K): [(M, config, wins), ...]} sorted by M;
    {} when the device has none. ``wins``: the CUDA GEMM beat the other FP4 paths at that M in the sweep."""
    key = ("table", device_name)
    if key in _STATE:
        return _STATE[key]
    path = _table_path(device_name)
    table: dict = {}
    doc = {"entries": []}
    if path.exists():
        import json
        doc = json.loads(path.read_text())
    _STATE[("table_tails", device_name)] = bool(doc.get("tail_splits"))
    for e in doc["entries"]:
        table.setdefault((e["fmt"], e["N"], e["K"]), []).append((e["M"], tuple(e["config"]), bool(e["wins"])))
    for v in table.values():
        v.sort()
    _STATE[key] = table
    return table


def gemm_table_tails(device_name: str) -> bool:
    """Whether the device's tuned GEMM table was swept with tail splits (``"tail_splits": true``, session 52's
    tuner on): its grid configs (sw 0) then beat every tail split that could fill their last wave, and the
    dispatcher keeps them as they are instead of applying :func:`wgmma_tail_pick`."""
    load_gemm_table(device_name)
    return _STATE[("table_tails", device_name)]


def install_gemm_table(device_name: str, text: str) -> Path:
    """Write a tuned GEMM table (the JSON ``benchmarks.cuda_gemm_bench --write-table`` makes) as the device's table
    and forget this process's cached table and per-shape choices, so the next call dispatches by it."""
    path = _table_path(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    _STATE.pop(("table", device_name), None)
    _STATE.pop(("table_tails", device_name), None)
    for key in [k for k in _STATE if isinstance(k, tuple) and k and k[0] == "gemm"]:
        _STATE.pop(key)
    return path


def tuned_gemm_config(fmt: str, n: int, k: int, m: int, device_name: str) -> tuple[tuple, bool] | None:
    """(config, wins) measured for the smallest tuned M >= m of this (fmt, N, K) on the device, or None when the
    shape was not tuned. Above the largest tuned M nothing was measured: the largest M's configuration with
    ``wins`` False, so the dispatcher leaves that M to the large-M path (dequantize + cuBLAS). Extrapolating a
    win instead sent the update's M ~ 8 K rows through the mid-M GEMM on an H200 whose sweep stopped at M = 256,
    where it won (log-probs + update 22 s -> 32 s per GRPO step)."""
    rows = load_gemm_table(device_name).get((fmt, n, k))
    if not rows:
        return None
    for mm, cfg, wins in rows:
        if mm >= m:
            return cfg, wins
    return rows[-1][1], False


def wgmma_lora_ok(lora: LoraOperand) -> bool:
    """Whether the GEMMs' epilogues take this LoRA (:func:`gemm` with ``lora``, the wgmma and the mma.sync kernel):
    every member's rank and so the total a multiple of 8 (16-byte staging of t = x·Aᵀ, whole bf16 pairs of Bn)."""
    return lora.rank % 8 == 0 and all(r % 8 == 0 for _, r in lora.members)


def gemm(x: torch.Tensor, w: CudaFP4Weight, out: torch.Tensor | None = None,
         config: tuple[int, int, int, int] | None = None, lora: LoraOperand | None = None,
         t: torch.Tensor | None = None, pdl: bool = False, xp: torch.Tensor | None = None,
         kz: int = 1) -> torch.Tensor:
    """y (M, N) bf16 = x (M, K) bf16 @ Ŵᵀ for any M >= 1 on the current CUDA stream (graph capturable), on the same
    re-laid-out weight as :func:`gemv`. Meant for M > 16 (rollouts of many sequences, prefill); ``config`` =
    (nt, sw, r, ks) overrides the tuned table / heuristic. The mma.sync kernel (sw >= 1) allocates nothing but
    ``out``; the wgmma kernel (sw <= 0, sm_90) also takes the permuted tokens (M, K) and, split across CTAs, its fp32
    partial tiles from the caching allocator (the graph's pool under capture) and the device's tile counters.
    ``lora`` (:func:`wgmma_lora_ok`): + the LoRA term (:func:`emulate_lora`) before the one bf16 rounding, t·Bnᵀ per
    member by the GEMM's epilogue MMAs (both kernels); t = x·Aᵀ (M, R) bf16 as given (``t``: e.g.
    ``qerl.kernels.fused.lora_a``'s) or by cuBLAS. ``xp`` (a wgmma config): x already in the kernel's K permutation
    (:func:`permute_tokens`), instead of a permute launch here. ``pdl`` (with ``lora`` and ``t``; a wgmma config also
    with ``xp``; sm_90): launch under programmatic dependent launch, so the main loop runs while the kernel that
    computed ``t`` finishes and every global store and the read of t wait for it; only right after that kernel
    (``lora_a(x, a, trigger=True)``), which itself started after x (and xp) were written: the main loop reads them
    before the wait. ``kz`` > 1 (an mma.sync config, a ``QERL_GEMM_KZ=1`` build, not with ``pdl``; session 68's
    experiment): K split across kz CTAs an output tile as well (fp32 partials from the caching allocator, the device's
    tile counters; the last CTA of a tile adds them in split order)."""
    _check_fmt(w.fmt)  # the GEMMs take the FP4 layouts only (a BF16 weight above M = 16: cuBLAS)
    x, out = _operands("gemm", x, w, out)
    m = x.shape[0]
    s, c = w.n // 16, w.k // 64
    if config is None:
        config = _gemm_config(w, m, x.device)
    nt, sw, r, ks = check_gemm_config(config, s, c)
    if kz != 1 and (not gemm_kz() or sw <= 0 or not isinstance(kz, int) or kz < 1 or kz > GEMM_MAX_KZ
                    or kz * ks > c or pdl):
        raise ValueError(f"gemm: kz={kz!r} (K split across CTAs) needs a QERL_GEMM_KZ=1 build (this one: "
                         f"{gemm_kz()}), an mma.sync config (sw >= 1), 1 <= kz <= {GEMM_MAX_KZ}, kz * ks <= {c} "
                         f"chunks and no pdl; config {config!r}")
    if lora is not None and not wgmma_lora_ok(lora):
        raise ValueError(f"gemm: LoRA in the GEMM needs ranks that are multiples of 8 (members {lora.members})")
    lora_args = (False, x, x, 0, 0, [0, 0, 0], [0, 0, 0])  # no LoRA (the tensors are not read)
    if pdl and (lora is None or t is None or (sw <= 0 and xp is None)):
        raise ValueError(f"gemm: pdl=True needs lora, a given t and, for a wgmma config (sw <= 0), the permuted xp; "
                         f"got lora={lora is not None}, t={t is not None}, xp={xp is not None}, config={config!r}")
    if xp is not None and (sw > 0 or xp.shape != (m, w.k) or xp.dtype != torch.bfloat16 or xp.device != x.device
                           or not xp.is_contiguous()):
        raise ValueError(f"gemm: xp (the permuted tokens) needs a wgmma config and a contiguous bf16 {(m, w.k)} "
                         f"tensor on {x.device}; got config={config!r}, xp {xp.dtype} {tuple(xp.shape)}")
    pdl = pdl and torch.cuda.get_device_capability(x.device)[0] >= 9  # PDL: sm_90 on
    if lora is not None:
        a, bn = _lora_tensors(lora, w)
        if t is None:
            t = torch.nn.functional.linear(x, a)  # (M, R) bf16: the rounding the GEMV's LoRA MMAs use too
        elif t.shape != (m, a.shape[0]) or t.dtype != torch.bfloat16 or t.device != x.device or t.stride(1) != 1:
            raise ValueError(f"gemm: t must be bf16 {(m, a.shape[0])} on {x.device} with unit column stride, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
        lora_args = (True, t, bn, *lora.launch_args())
    gs = w.global_scale if w.global_scale is not None else w.qweight
    fmt = 0 if w.fmt == "nvfp4" else 1
    if sw <= 0:
        if not wgmma_supported(x.device):
            raise ValueError(f"GEMM config {config!r} names the sm_90a wgmma kernel; this device is "
                             f"{torch.cuda.get_device_name(x.device)} (compute capability "
                             f"{torch.cuda.get_device_capability(x.device)})")
        permuted = xp is not None
        if not permuted:
            xp = torch.empty((m, w.k), device=x.device, dtype=torch.bfloat16)  # x in the kernel's K permutation
        kt = wgmma_tail_kt(sw)
        wkz = -kt if kt else 0 if sw == WGMMA_SK else 1 - sw  # the launcher's kz, from the config (not ``kz``)
        ws = ctr = xp
        if wkz != 1:  # fp32 partial tiles; counters shared by the device's launches (one stream)
            tiles = wgmma_tiles(m, s, nt, r)
            slots = abs(wkz) * tiles if wkz != 0 else 2 * wgmma_sk_ctas(w.fmt, 8 * nt, r, ks) * ks
            ws, ctr = _split_workspace(x.device, slots * 4 * nt * r * 128, tiles, "wgmma split-K")
        _ext().wgmma_gemm(x, w.qweight, w.scales, gs, out, xp, fmt, w.out_mult, w.bword, 8 * nt, r, ks, wkz, ws, ctr,
                          *lora_args, permuted, pdl)
        return out
    ws = ctr = x
    if kz != 1:
        tiles = gemm_tiles(m, s, nt, r * sw)
        ws, ctr = _split_workspace(x.device, kz * tiles * r * 32 * sw * nt * 4, tiles, "gemm split-K")
    _ext().gemm(x, w.qweight, w.scales, gs, out, fmt, w.out_mult, w.bword, nt, sw, r, ks, *lora_args, pdl, kz, ws,
                ctr)
    return out


def _split_workspace(dev: torch.device, floats: int, tiles: int, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partial tiles: ``floats`` from the caching allocator, the graph's pool under capture; the device's tile
    counters, shared by its launches on one stream) for a split of K across CTAs over ``tiles`` output tiles; more
    tiles than counters is an error naming ``what``."""
    ctr = _wgmma_counters(dev)
    if tiles > ctr.numel():
        raise ValueError(f"{what}: {tiles} output tiles exceed the {ctr.numel()} counters")
    return torch.empty(floats, device=dev, dtype=torch.float32), ctr


def permute_tokens(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 in the wgmma kernel's K permutation (:func:`permute_x_reference`'s values) by the CUDA permute
    launch, for :func:`gemm`'s ``xp``. x: CUDA bf16 (M, K), K a multiple of 64, rows read in place (:func:`rows_aligned`)."""
    if not x.is_cuda or x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 64 or not rows_aligned(x):
        raise ValueError(f"permute_tokens: x must be a CUDA bf16 (M, K) tensor, K % 64 == 0, unit column stride, rows "
                         f"and start 16-byte aligned; got {x.dtype} {tuple(x.shape)} strides {tuple(x.stride())} on "
                         f"{x.device}")
    xp = torch.empty(x.shape, device=x.device, dtype=torch.bfloat16)
    _ext().permute_x(x, xp)
    return xp


def dequantize(w: CudaFP4Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """Ŵ (N, K) bf16 from the re-laid-out weight alone, by the CUDA kernel of ``csrc/fp4_dequant.cu`` (one warp per
    16-row strip and 4 chunks of 64 columns, the GEMV's bit decode, ~4 instructions per element): the values of
    ``qerl.kernels.dequantize_relaid`` (the Triton kernel) bit for bit, at the copy bandwidth. ``w`` may be a column
    slice of a weight (``qweight[:, c0:c1]`` and ``scales[:, c0:c1]`` as views: its strips are read where they lie).
    ``out``: bf16 (N, K) with unit column stride, a row stride that is a multiple of 8 and a 16-byte aligned start
    (allocated when None). On the current CUDA stream; graph capturable."""
    _check_fmt(w.fmt)
    if not w.qweight.is_cuda:
        raise ValueError("dequantize needs CUDA tensors (qerl.kernels.dequantize_relaid runs elsewhere)")
    if out is None:
        out = torch.empty((w.n, w.k), device=w.qweight.device, dtype=torch.bfloat16)
    if out.shape != (w.n, w.k) or out.dtype != torch.bfloat16 or out.stride(1) != 1 or out.stride(0) % 8 \
            or out.data_ptr() % 16:
        raise ValueError(f"dequantize: out must be bf16 {(w.n, w.k)}, unit column stride, row stride a multiple of 8, "
                         f"16-byte aligned; got {out.dtype} {tuple(out.shape)} strides {tuple(out.stride())}")
    has_g = w.global_scale is not None
    _ext().dequant(w.qweight, w.scales, w.global_scale if has_g else w.qweight, out, 0 if w.fmt == "nvfp4" else 1,
                   has_g)
    return out


def _gemm_config(w: CudaFP4Weight, m: int, dev: torch.device) -> tuple[int, int, int, int]:
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    key = ("gemm", idx, w.fmt, w.n, w.k, m, wgmma_tail())  # per build: QERL_WGMMA_TAIL=1 picks tail splits
    cfg = _STATE.get(key)
    if cfg is None:
        props = torch.cuda.get_device_properties(idx)
        hit = tuned_gemm_config(w.fmt, w.n, w.k, m, props.name)
        cfg = hit[0] if hit is not None else pick_gemm_config(w.n // 16, w.k // 64, m, props.multi_processor_count,
                                                              wgmma=wgmma_supported(idx))
        nt, sw, r, ks = cfg
        # fill the last partial wave (session 50), unless a sweep with tail splits measured the grid config faster.
        # The wave is the plain variant's, the launcher splits by its own variant's: on sm_90 every grid variant of
        # the default build holds as many CTAs an SM with its LoRA epilogue as without (ptxas's registers, checked
        # by tests/test_wgmma_sass_check.py's TMA-build test), so the two agree
        if wgmma_tail() and sw == 0 and not (hit is not None and gemm_table_tails(props.name)):
            cfg = wgmma_tail_pick(cfg, wgmma_tiles(m, w.n // 16, nt, r), w.k // 64,
                                  wgmma_ctas(w.fmt, 8 * nt, r, ks, lora=False), props.multi_processor_count)
        elif wgmma_tail_kt(sw) and not wgmma_tail():  # a table tuned with tail splits, in QERL_WGMMA_TAIL=0's build
            cfg = (nt, 0, r, ks)
        _STATE[key] = cfg
    return cfg


__all__ = ["CudaFP4Weight", "dequantize", "LoraOperand", "lora_parts", "lora_workspace", "lora_workspace_sizes", "lora_launches", "lora_bn", "lora_rp", "emulate_lora", "available", "prepare",
           "gemv", "emulate", "ACTS", "GEMV_VARIANTS", "check_gemv_config", "load_gemv_table",
           "install_gemv_table", "tuned_gemv_config", "heuristic_gemv_config", "forget_gemv_configs", "gemv_table_enabled", "gemv_warp_cap", "emulate_weight", "pick_config", "variant_for",
           "pack_words", "build_error", "kernel_attributes", "gemm", "pick_gemm_config", "check_gemm_config",
           "tuned_gemm_config", "load_gemm_table", "gemm_table_tails", "install_gemm_table", "gemm_kernel_attributes", "gemm_smem_bytes", "gemm_variant_ok",
           "gemm_variants", "WGMMA_VARIANTS", "wgmma_smem_bytes", "wgmma_supported", "wgmma_configs",
           "permute_x_reference", "permute_tokens", "rows_aligned", "wgmma_weight", "WGMMA_MAX_KZ", "wgmma_tiles", "wgmma_lora_ok",
           "WGMMA_PIPES", "wgmma_pipe"]
