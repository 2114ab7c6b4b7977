"""L2 prefetch of the next weights during the decode step's latency-bound kernels (``csrc/l2_prefetch.cu``; issue 11,
session 46; an opt-in until measured).

At decode batch sizes a layer's RoPE, attention, o GEMV and add + RMSNorm are bound by latency: HBM idles between
the q|k|v GEMV and the gate|up GEMV, which then streams its weights (7B: 76 MB of NVFP4, 152 MB of BF16) at the
bandwidth limit. ``QERL_L2_PREFETCH=<MB>`` makes the fused decode step launch one small kernel after RoPE that asks
L2 for up to that many MB of the layer's o and gate|up weights: all of o first, then the same leading fraction of
every split-K range of gate|up (the chunks each of its warps loads first), so those loads hit L2 when the GEMVs come.
The kernel reads and writes nothing itself, so every result is unchanged; what it can cost is HBM traffic beside the
attention and one launch per layer. ``0`` (default): no prefetch launch. The L2 of an H100 / H200 holds 50 MB.

Measured on an H200 (session 46; 7B, 256 + 512, rank 32). In the decode chain under PDL the attention waited for the
launch (~9 µs each): decode 3-7% slower for every format (``results/speed/raw/h200_s46_l2pf``). On a side stream (this
code): NVFP4 batch 8 +2.4% with 32 MB (two passes against three), BF16-LoRA −0.9%; the step profile at KV 1024 (one
pass) had gate|up 2.4 µs a layer faster and the step 1.1% slower (``raw/h200_s46_l2pf2``). Inconclusive: an opt-in.
"""

from __future__ import annotations

import os

import torch

from qerl.kernels import cuda_build

_BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <vector>

extern "C" int ql2_prefetch(const long long*, int, void*);

void prefetch(std::vector<int64_t> desc, int64_t device) {
  const c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  const int err = ql2_prefetch(reinterpret_cast<const long long*>(desc.data()), (int)desc.size(),
                               (void*)c10::cuda::getCurrentCUDAStream((c10::DeviceIndex)device).stream());
  TORCH_CHECK(err == 0, "ql2_prefetch: ", err == -1 ? "bad span descriptors" : cudaGetErrorString((cudaError_t)err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefetch", &prefetch);
}
"""

_CU = (cuda_build.CSRC / "l2_prefetch.cu",)
_STATE: dict = {}
MAX_SPANS, MAX_SEGS = 4, 16  # csrc/l2_prefetch.cu's kMaxSpans, kMaxSegs


def budget_mb() -> float:
    """``QERL_L2_PREFETCH``: MB of weights the fused decode step prefetches into L2 per layer (0, the default: off)."""
    v = os.environ.get("QERL_L2_PREFETCH", "0")
    try:
        mb = float(v)
    except ValueError:
        mb = -1.0
    if not 0 <= mb <= 1024:
        raise ValueError(f"QERL_L2_PREFETCH={v!r}: a number of MB from 0 (off, the default) to 1024")
    return mb


ORDERS = ("o-gu", "gu", "gu-o")


def order() -> tuple[str, ...]:
    """``QERL_L2_PREFETCH_ORDER``: which of the layer's weights the budget goes to, in order: ``o-gu`` (default: all
    of o, then gate|up), ``gu`` (gate|up only), ``gu-o`` (gate|up, then o). Session 46's profile had gate|up gain
    ~0.1 µs a layer per MB prefetched and o ~0.06."""
    v = os.environ.get("QERL_L2_PREFETCH_ORDER", "o-gu")
    if v not in ORDERS:
        raise ValueError(f"QERL_L2_PREFETCH_ORDER={v!r}; valid: {', '.join(ORDERS)}")
    return tuple(v.split("-"))


def _ext():
    return cuda_build.load_extension("qerl_l2pf", _CU, (), _BINDING, ["-O3", *cuda_build.arch_flags()], _STATE)


def _split_ranges(c: int, splits: int) -> list[tuple[int, int]]:
    """The K chunk range [c0, c1) of each split of the decode GEMV (``csrc/fp4_mma_gemv.cu``: split * C / splits)."""
    return [(j * c // splits, (j + 1) * c // splits) for j in range(splits)]


def weight_bytes(w) -> int:
    """Bytes the GEMV reads of ``w`` (a ``cuda_fp4.CudaFP4Weight``): packed words and scales, or the dense rows."""
    return w.qweight.numel() * w.qweight.element_size() + w.scales.numel() * w.scales.element_size()


def spans(w, splits: int, fraction: float) -> list[list[int]]:
    """Span descriptors (``csrc/l2_prefetch.cu``) for the leading ``fraction`` of each of the ``splits`` K ranges of
    every row block of ``w`` (at least one chunk where the fraction is above 0): the words a GEMV launch with that
    many splits loads first. FP4: per 16-row strip, 512 bytes of words and 32 / 64 bytes of scale pairs a chunk of 64
    k; BF16 (dense rows): per row, 128 bytes a chunk."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction={fraction}: from 0 to 1")
    if not 1 <= splits <= MAX_SEGS:
        raise ValueError(f"splits={splits}: from 1 to {MAX_SEGS}")
    if fraction == 0:
        return []
    c = w.k // 64
    segs = [(c0, max(1, round(fraction * (c1 - c0)))) for c0, c1 in _split_ranges(c, splits) if c1 > c0]
    if w.fmt == "bf16":  # cuda_fp4.dense_weight: contiguous rows
        t = w.qweight
        rows = [(t.data_ptr(), t.stride(0) * 2, t.shape[0], 128)]
    else:
        rows = [(t.data_ptr(), t.stride(0) * t.element_size(), t.shape[0], t.stride(1) * t.element_size())
                for t in (w.qweight, w.scales)]
    out = []
    for base, stride, count, cb in rows:
        d = [base, stride, count, len(segs)]
        for c0, n in segs:
            d += [c0 * cb, n * cb]
        out.append(d)
    return out


def layer_spans(parts, budget_bytes: float) -> list[list[int]]:
    """Spans for one layer: ``parts`` = [(weight, splits), ...] in the order they are read; each takes as large a
    fraction of itself as the budget left allows (all of it when it fits)."""
    out, left = [], budget_bytes
    for w, splits in parts:
        if left <= 0:
            break
        size = weight_bytes(w)
        f = min(1.0, left / size)
        out += spans(w, splits, f)
        left -= f * size
    if len(out) > MAX_SPANS:
        raise ValueError(f"layer_spans: {len(out)} spans, the kernel takes {MAX_SPANS}")
    return out


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _side(device: torch.device) -> torch.cuda.Stream:
    key = ("side", _index(device))
    if key not in _STATE:
        _STATE[key] = torch.cuda.Stream(device)
    return _STATE[key]


def prefetch(desc: list[list[int]], device: torch.device) -> None:
    """One launch that prefetches the spans ``desc`` into L2, on a side stream that first waits for the current
    stream's work so far (graph capturable: a branch of the captured graph), so no later kernel of the current stream
    waits for it; :func:`join` before the work that must follow every prefetch (the end of a captured step).
    Session 46's first version launched it in the decode chain under PDL, where the attention after it waited for
    it: the step 6.5% slower (H200, ``results/speed/raw/h200_s46_l2pf``)."""
    if not desc:
        return
    flat = [v for d in desc for v in d]
    _STATE["launches"] = _STATE.get("launches", 0) + 1
    side = _side(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _ext().prefetch(flat, _index(device))


def join(device: torch.device) -> None:
    """The current stream waits for the side stream's prefetch launches (see :func:`prefetch`)."""
    torch.cuda.current_stream(device).wait_stream(_side(device))


def launches() -> int:
    """Prefetch launches made in this process (graph replays not counted: they repeat captured ones)."""
    return _STATE.get("launches", 0)
