"""FP4 linears at large M with the weight dequantized inside the GEMM (``csrc/fp4_dq_gemm.cu``, sm_90a wgmma):
issue 10's item 2. The backward's input gradient g (M, N) @ Ŵ (N, K) (``gemm_t``) and the forward x (M, K) @ Ŵᵀ
(``gemm``) until now rebuilt all of Ŵ in BF16 (2 bytes a weight written and read again) and called cuBLAS.

Each CTA stages the activations' tile (128 token rows) and the packed weight's blocks for one 64-wide contraction
chunk x ``nb`` output columns (128 or 256) in a cp.async ring; every thread dequantizes the chunk into a BF16 tile in
shared memory (the values of ``cuda_fp4.dequantize`` bit for bit), and two warpgroups multiply from there (A = the
activations, K-major; B = the tile: MN-major for the backward, whose contraction runs over the weight's rows, K-major
for the forward). ``kz`` > 1 splits the contraction across CTAs: fp32 partials in a workspace, added in split order by
a second launch (deterministic); ``kz`` = 0 is stream-K: the (tile, chunk) iterations cut into one even range per SM
(no partly idle last wave at any tile count), the tiles a range shares written as fp32 slots and added in CTA order by
a second launch (``csrc/fp4_dq_stream.h``). The result differs from dequantize + cuBLAS only by the fp32 summation
order; with ``QERL_DQ_DECODE=mma`` (:func:`decode`) the tile holds the wgmma GEMM's cheaper decode instead and the
weight is not rounded to bf16 at all.

Shapes are given as (m, r, c): m tokens, r the contraction (the weight's N for the backward, K for the forward), c
the output width (K, or N). ``enabled(op)`` (``QERL_DQ_GEMM``) decides whether ``qerl.kernels`` takes the kernel;
``configs`` lists the launch configurations a sweep times (``benchmarks.dq_gemm_bench``), whose ``--write-table``
installs the fastest per shape and M (``tuned_config``); ``pick_config`` is the rule without one.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from qerl.kernels import cuda_build, cuda_fp4
from qerl.kernels.configs import device_slug, nearest_measured

NBS = (128, 256)  # output columns a CTA
MAX_KZ = 8        # splits of the contraction across CTAs
MIN_SPLIT_CHUNKS = 4  # contraction chunks (of 64) a split keeps at least
BM = 128          # token rows a CTA

# The in-loop dequantizing GEMM's torch wrapper: C++ compiled as the extension's binding.cpp
_BINDING = (cuda_build.CSRC / "fp4_dq_binding.cpp").read_text()

_CSRC = cuda_build.CSRC
_CU = (_CSRC / "fp4_dq_gemm.cu",)
_HEADERS = (_CSRC / "fp4_mma_common.cuh", _CSRC / "fp4_wgmma_ops.cuh", _CSRC / "fp4_dq_stream.h")
_STATE: dict = {}
_TABLE_DIR = Path(__file__).resolve().parent / "tuned"
_TABLES: dict = {}

OPS = ("bwd", "fwd")
DQ_MODES = ("0", "bwd", "fwd", "all")


def enabled(op: str = "bwd") -> bool:
    """``QERL_DQ_GEMM``: which products of a weight in the kernels' layout (bf16 activations, an sm_90 device) take
    the kernel instead of dequantize + cuBLAS: ``bwd`` the backward's g @ Ŵ (``qerl.kernels.qmm_t``), ``fwd`` the
    forward x @ Ŵᵀ where the dispatcher would dequantize (large M; the wgmma GEMM's M range keeps that kernel),
    ``all`` both; ``0`` (the default until it is measured faster on a GPU) neither."""
    from qerl.kernels.switches import _gemm_lora_switch  # one check of a value against its choices
    if op not in OPS:
        raise ValueError(f"dq op {op!r}; valid: {', '.join(OPS)}")
    v = _gemm_lora_switch("QERL_DQ_GEMM", "0", DQ_MODES)
    return v == "all" or v == op


ABLATE_BITS = {1: "no dequantization", 2: "no MMAs", 4: "no barrier before the MMAs"}


def ablate() -> int:
    """``QERL_DQ_ABLATE`` (timing only: the results are wrong; ``benchmarks.dq_gemm_bench`` then skips its check): a
    sum of ``ABLATE_BITS``, the parts its build of the kernel leaves out; 0 (the default) leaves nothing out."""
    text = os.environ.get("QERL_DQ_ABLATE", "0")
    if not text.isdigit() or int(text) >= 2 * max(ABLATE_BITS):
        raise ValueError(f"QERL_DQ_ABLATE={text!r}: a sum of {', '.join(f'{b} ({w})' for b, w in ABLATE_BITS.items())}"
                         f", 0 to {2 * max(ABLATE_BITS) - 1}")
    return int(text)


DECODES = ("exact", "mma")


def decode() -> str:
    """``QERL_DQ_DECODE``: how the kernel fills its BF16 tile. ``exact`` (the default): the exact dequantization,
    float32 products rounded once to bf16 (``cuda_fp4.dequantize``'s values: the result is dequantize + cuBLAS's up to
    the fp32 summation order); ``mma``: the wgmma GEMM's decode, e2m1 x scale exact in bf16 with the weight's
    exponent offset (one HMUL2 a pair), the offset and the NVFP4 global scale applied to the fp32 accumulators: the
    weight is not rounded to bf16 at all (as in ``cuda_fp4.gemm``)."""
    from qerl.kernels.switches import _gemm_lora_switch
    return _gemm_lora_switch("QERL_DQ_DECODE", "exact", DECODES)


LOOPS = ("plain", "ws")


def loop() -> str:
    """``QERL_DQ_LOOP``: the kernel's main loop. ``plain`` (the default): every thread of the CTA's two warpgroups
    stages, decodes and multiplies in turn between CTA barriers; ``ws``: warp-specialized, a third warpgroup copying
    four chunks ahead (six copy slots) and decoding into two BF16 tiles on mbarriers while the two MMA warpgroups
    multiply (session 66: the plain loop's staging, decode and MMAs were measured adding up, not overlapping). Same
    results bit for bit; a build of its own (``-DQFP4_DQ_WS=1``). Measured slower than plain so far (session 67,
    ``results/speed/raw/h100_s67_*``)."""
    from qerl.kernels.switches import _gemm_lora_switch
    return _gemm_lora_switch("QERL_DQ_LOOP", "plain", LOOPS)


STAGES = ("4", "3", "5", "6")


def stages() -> int:
    """``QERL_DQ_STAGES``: the plain loop's ring of copied stages (tokens + packed weight), its copies running stages
    - 2 chunks ahead of the MMAs; 3 to 6 (6: the most whose shared memory fits at 256 output columns a tile), 4 the
    default. Session 67 measured 4, 5 and 6 the same within 2% (``results/speed/raw/h100_s67_dqstages``); a build of
    its own (``-DQFP4_DQ_STAGES``)."""
    from qerl.kernels.switches import _gemm_lora_switch
    return int(_gemm_lora_switch("QERL_DQ_STAGES", "4", STAGES))


def _ext():
    abl = ablate()
    st = stages()
    flags = ["-O3", *cuda_build.arch_flags()] + ([f"-DQFP4_DQ_ABLATE={abl}"] if abl else []) \
        + (["-DQFP4_DQ_MMA_DECODE=1"] if decode() == "mma" else []) + (["-DQFP4_DQ_WS=1"] if loop() == "ws" else []) \
        + ([f"-DQFP4_DQ_STAGES={st}"] if st != 4 else [])
    return cuda_build.load_extension("qerl_fp4_dq", _CU, _HEADERS, _BINDING, flags, _STATE)


def available(device: torch.device | int | None = None) -> bool:
    """True on an sm_90 device where the extension builds and loads."""
    return cuda_fp4.wgmma_supported(device) and cuda_build.builds(_ext)


def dims(w: cuda_fp4.CudaFP4Weight, op: str) -> tuple[int, int]:
    """(r, c): the contraction and the output width of ``op`` on ``w``."""
    return (w.n, w.k) if op == "bwd" else (w.k, w.n)


def supported(w: cuda_fp4.CudaFP4Weight, op: str = "bwd") -> bool:
    """Shapes the kernel takes: an FP4 weight whose contraction is whole 64-wide chunks (N % 64 == 0) and whose
    output width is whole 128-column tiles."""
    r, c = dims(w, op)
    return w.fmt in cuda_fp4.FORMATS and w.n % 64 == 0 and r % 64 == 0 and c % 128 == 0


def tiles(m: int, c: int, nb: int) -> int:
    """Output tiles (CTAs before splits) at M = m over c output columns, nb a tile."""
    return math.ceil(m / BM) * (c // nb)


def configs(m: int, r: int, c: int) -> list[tuple[int, int]]:
    """Every (nb, kz) the kernel runs for a contraction r and output width c: nb dividing c, kz up to
    :data:`MAX_KZ` with at least :data:`MIN_SPLIT_CHUNKS` contraction chunks a split, and kz = 0: stream-K (the
    tiles' iterations cut evenly over the device's SMs, :func:`stream_ctas`)."""
    out = []
    for nb in NBS:
        if c % nb:
            continue
        for kz in range(0, MAX_KZ + 1):
            if kz <= 1 or r // 64 >= kz * MIN_SPLIT_CHUNKS:
                out.append((nb, kz))
    return out


def check_config(config, m: int, r: int, c: int) -> tuple[int, int]:
    """``config`` as (nb, kz), or a ValueError naming it and the valid ones."""
    valid = configs(m, r, c)
    try:
        nb, kz = (int(v) for v in config)
    except (TypeError, ValueError):
        raise ValueError(f"dq config {config!r}: expected (nb, kz), one of {valid}") from None
    if (nb, kz) not in valid:
        raise ValueError(f"dq config {(nb, kz)} for contraction {r}, output width {c}: valid {valid}")
    return nb, kz


#: Time model of :func:`pick_config` (µs): one 64-wide contraction chunk of a CTA's tile at ~70% of the H100's dense
#: BF16 peak per SM (2 x 128 x nb x 64 FLOP over 989.4 / 132 TFLOP/s / 0.7), the split partials' fp32 bytes (written
#: once, read once) at 2.5 TB/s, the reduction launch, and (stream-K) each segment after a CTA's first: the pipeline's
#: refill and an epilogue.
CHUNK_US = {128: 0.45, 256: 0.80}
SPLIT_TBPS = 2.5
REDUCE_US = 3.0
SEGMENT_US = 1.0


def stream_ctas(m: int, r: int, c: int, nb: int, sms: int) -> int:
    """The CTAs of a stream-K launch (kz = 0): one an SM, at most one per iteration (tile, contraction chunk)."""
    return max(1, min(sms, tiles(m, c, nb) * (r // 64)))


def stream_segments(m: int, r: int, c: int, nb: int, sms: int) -> list[list[tuple[int, int, int]]]:
    """Per stream-K CTA, its (tile, first chunk, end chunk) segments: the kernel's walk (``csrc/fp4_dq_stream.h``:
    range b = [T b / G, T (b + 1) / G) of the T = tiles x chunks iterations, tile-major)."""
    nc, g = r // 64, stream_ctas(m, r, c, nb, sms)
    t = tiles(m, c, nb) * nc
    out = []
    for b in range(g):
        i, i1, segs = t * b // g, t * (b + 1) // g, []
        while i < i1:
            tile, s = divmod(i, nc)
            e = min(nc, s + (i1 - i))
            segs.append((tile, s, e))
            i += e - s
        out.append(segs)
    return out


def estimate_us(m: int, r: int, c: int, nb: int, kz: int, sms: int) -> float:
    """The rule's estimate of one launch: whole waves of CTAs times a CTA's chunks, plus the split partials' traffic
    and the reduction launch when kz > 1; stream-K (kz = 0): the most chunks any CTA runs, its extra segments, and
    the partial tiles' slots and reduction."""
    if kz == 0:
        segs = stream_segments(m, r, c, nb, sms)
        chunks = max(sum(e - s for _, s, e in sg) for sg in segs)
        t = chunks * CHUNK_US[nb] + (max(len(sg) for sg in segs) - 1) * SEGMENT_US
        partial = sum(1 for sg in segs for _, s, e in sg if e - s < r // 64)
        if partial:
            t += 2 * partial * BM * nb * 4 / (SPLIT_TBPS * 1e6) + REDUCE_US
        return t
    waves = math.ceil(tiles(m, c, nb) * kz / sms)
    t = waves * math.ceil(r // 64 / kz) * CHUNK_US[nb]
    if kz > 1:
        t += 2 * kz * m * c * 4 / (SPLIT_TBPS * 1e6) + REDUCE_US
    return t


def pick_config(m: int, r: int, c: int, sms: int) -> tuple[int, int]:
    """The rule without a sweep: the config of the least :func:`estimate_us` (ties: 256-column tiles, which re-read
    the activations' tiles half as often through L2, then fewer splits, stream-K last)."""
    cands = configs(m, r, c)
    if not cands:
        raise ValueError(f"dq_gemm: no config for contraction {r}, output width {c} (multiples of 64 and 128)")
    return min(cands, key=lambda cf: (round(estimate_us(m, r, c, cf[0], cf[1], sms), 3), -cf[0],
                                      cf[1] if cf[1] else MAX_KZ + 1))


def _table_path(device_name: str) -> Path:
    return _TABLE_DIR / f"dq_gemm_{device_slug(device_name)}.json"


def load_table(device_name: str) -> dict:
    """The device's measured launch configs (``qerl/kernels/tuned/dq_gemm_<device>.json``, written by ``python -m
    benchmarks.dq_gemm_bench --write-table``): {(op, r, c): [(M, (nb, kz)), ...] sorted by M}; empty without a file.
    An entry whose op or config the kernel does not have is an error naming the file and the entry."""
    if device_name in _TABLES:
        return _TABLES[device_name]
    path, table = _table_path(device_name), {}
    if path.exists():
        for e in json.loads(path.read_text())["entries"]:
            op, r, c, m = e.get("op"), int(e["r"]), int(e["c"]), int(e["M"])
            cfg = (int(e["nb"]), int(e["kz"]))
            if op not in OPS or cfg not in configs(m, r, c):
                raise ValueError(f"{path}: entry {e}: op must be one of {OPS} and (nb, kz) one of "
                                 f"{configs(m, r, c)}")
            table.setdefault((op, r, c), []).append((m, cfg))
        for v in table.values():
            v.sort()
    _TABLES[device_name] = table
    return table


def install_table(device_name: str, text: str) -> Path:
    """Write a config table (the JSON of ``benchmarks.dq_gemm_bench --write-table``) as the device's and forget this
    process's cached one."""
    path = _table_path(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    _TABLES.pop(device_name, None)
    return path


def tuned_config(op: str, m: int, r: int, c: int, device_name: str) -> tuple[int, int] | None:
    """The measured config of the entry whose M is nearest to m in ratio (a tie: the larger), None for a shape the
    table lacks or above its largest measured M (:func:`pick_config` then decides)."""
    return nearest_measured(load_table(device_name).get((op, r, c), ()), m)


def _run(op: str, a: torch.Tensor, w: cuda_fp4.CudaFP4Weight, out: torch.Tensor | None, config) -> torch.Tensor:
    if not supported(w, op):
        raise ValueError(f"dq_gemm {op}: weight {w.fmt} {(w.n, w.k)} not supported (FP4, N % 64 == 0, the output "
                         f"width a multiple of 128)")
    r, c = dims(w, op)
    if not (a.is_cuda and a.dtype == torch.bfloat16 and a.dim() == 2 and a.shape[1] == r and a.stride(1) == 1
            and a.stride(0) % 8 == 0 and a.data_ptr() % 16 == 0):
        raise ValueError(f"dq_gemm {op}: the activations must be a CUDA bf16 (M, {r}) tensor with unit column stride, "
                         f"row stride a multiple of 8, 16-byte aligned; got {a.dtype} {tuple(a.shape)} strides "
                         f"{tuple(a.stride())} on {a.device}")
    m = a.shape[0]
    if out is None:
        out = torch.empty((m, c), device=a.device, dtype=torch.bfloat16)
    if m == 0:
        return out
    dev = a.device
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if config is None:
        key = ("cfg", idx, op, r, c, m)
        config = _STATE.get(key)
        if config is None:
            props = torch.cuda.get_device_properties(idx)
            config = tuned_config(op, m, r, c, props.name) or pick_config(m, r, c, props.multi_processor_count)
            _STATE[key] = config
    nb, kz = check_config(config, m, r, c)
    sk = 0
    if kz == 0:  # stream-K: two slots of a tile's fp32 partials a CTA
        sk = stream_ctas(m, r, c, nb, torch.cuda.get_device_properties(idx).multi_processor_count)
    if kz > 1 or sk:  # the partials: the kernels' reusable per-device buffer (float32), used within this call
        from qerl import kernels as qk
        ws = qk._workspace(dev, torch.float32, 2 * sk * BM * nb if sk else kz * m * c)
    else:
        ws = out
    has_g = w.global_scale is not None
    _ext().gemm(a, w.qweight, w.scales, w.global_scale if has_g else w.qweight, out, ws,
                0 if w.fmt == "nvfp4" else 1, has_g, nb, max(kz, 1), sk, op == "fwd", w.bword, w.out_mult)
    return out


def gemm_t(g: torch.Tensor, w: cuda_fp4.CudaFP4Weight, out: torch.Tensor | None = None,
           config: tuple[int, int] | None = None) -> torch.Tensor:
    """out (M, K) = g (M, N) @ Ŵ, Ŵ the re-laid-out FP4 weight ``w`` (N, K), by the in-loop dequantizing wgmma GEMM.
    g: CUDA bf16 (M, N), unit column stride, row stride a multiple of 8, 16-byte aligned. ``config``: (nb, kz)
    (:func:`configs` of (M, N, K)); None: :func:`tuned_config`, else :func:`pick_config`. ``out``: bf16 (M, K) with
    g's constraints (allocated when None). The split workspace is a per-device buffer grown to the largest use
    (capturable once warmed up)."""
    return _run("bwd", g, w, out, config)


def gemm(x: torch.Tensor, w: cuda_fp4.CudaFP4Weight, out: torch.Tensor | None = None,
         config: tuple[int, int] | None = None) -> torch.Tensor:
    """out (M, N) = x (M, K) @ Ŵᵀ by the same kernel with the weight tile K-major (the forward); as :func:`gemm_t`
    otherwise (``config`` from :func:`configs` of (M, K, N))."""
    return _run("fwd", x, w, out, config)


__all__ = ["gemm_t", "gemm", "enabled", "decode", "ablate", "loop", "stages", "available", "supported", "dims", "configs", "check_config",
           "pick_config", "estimate_us", "tiles", "stream_ctas", "stream_segments", "load_table", "install_table", "tuned_config",
           "NBS", "MAX_KZ", "OPS", "DQ_MODES"]
