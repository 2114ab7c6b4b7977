"""Hand-written CUDA decode attention (``csrc/decode_attn.cu``): the split kernel of
:func:`qerl.kernels.fused.decode_attention` on CUDA for head dims 64 and 128 (every Qwen2.5 size) and up to 16
query heads per KV head.

One CTA per (row, KV head, key split): its four warps stream 16-key subtiles of K and V through per-warp rings of
``nst`` shared-memory stages (cp.async), with the scores and P·V on mma.sync; under programmatic dependent launch the
first stages are requested before ``griddepcontrol.wait`` (everything but q and the cache slot ``slot`` the
preceding RoPE launch writes is final by then). It writes the same (max, sum, accumulator) partials as the Triton
split kernel, but the last CTA of each (row, KV head) to finish merges them (a counter; in split order, so the
result does not depend on which CTA is last): one launch instead of the Triton path's two. ``QERL_ATTN``: ``auto`` (default: this kernel where it applies), ``cuda`` (this kernel or an error),
``triton`` (the Triton split kernel).
"""

from __future__ import annotations

import os

import torch

from qerl.kernels import cuda_build

ATTN_MODES = ("auto", "cuda", "triton")
NST_CHOICES = (2, 3, 4)
# launch defaults: ring stages per warp; CTAs the key splits aim for and keys per split a multiple of
# (``fused.attention_splits``'s target_programs and block); benchmarks.attn_bench --kernel cuda sweeps them
NST = 2
TARGET_CTAS = 264
BLOCK = 64

_BINDING = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

extern "C" int qattn_decode(const void*, const void*, const void*, const float*, const long long*, float*, float*,
                            float*, int*, void*, int, int, int, int, int, int, int, int, float, int, int, void*);
extern "C" int qattn_smem_bytes(int, int);

// q (M, H, d) bf16; kc, vc (M, HKV, S_max, d) bf16; bias (M, S_max) fp32; slot (1,) int64 or empty; o (M, H·d)
// bf16; when nsplit > 1 part: fp32 partials (M·H·nsplit·(d + 2)) and ctr: int32 zeros (M·HKV at least).
void attend(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor bias, torch::Tensor slot,
            torch::Tensor part, torch::Tensor ctr, torch::Tensor o, int64_t s, int64_t chunk, int64_t nsplit,
            double scale, int64_t nst, bool pdl) {
  for (const auto* t : {&q, &kc, &vc, &bias, &part, &ctr, &o})
    TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "decode attention: CUDA tensors, contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kc.scalar_type() == at::kBFloat16 &&
              vc.scalar_type() == at::kBFloat16 && o.scalar_type() == at::kBFloat16, "q, kc, vc, o: bf16");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && part.scalar_type() == at::kFloat, "bias, partials: fp32");
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && kc.sizes() == vc.sizes() && bias.dim() == 2, "bad ranks");
  const int64_t m = q.size(0), h = q.size(1), d = q.size(2), hkv = kc.size(1), smax = kc.size(2);
  TORCH_CHECK(kc.size(0) == m && kc.size(3) == d && h % hkv == 0 && bias.size(0) == m && bias.size(1) == smax,
              "shapes: q (M, H, d), kc/vc (M, HKV, S_max, d), bias (M, S_max)");
  TORCH_CHECK(o.numel() == m * h * d && o.scalar_type() == at::kBFloat16, "o: (M, H·d) bf16");
  TORCH_CHECK(nsplit == 1 || (part.numel() >= m * h * nsplit * (d + 2) && ctr.numel() >= m * hkv &&
                              ctr.scalar_type() == at::kInt), "partials or counters too small");
  TORCH_CHECK(slot.numel() == 0 || (slot.is_cuda() && slot.scalar_type() == at::kLong), "slot: int64 CUDA (1,)");
  const c10::cuda::CUDAGuard guard(q.device());
  float* pm = part.data_ptr<float>();
  const int64_t np = m * h * nsplit;
  const long long* sl = slot.numel() ? reinterpret_cast<const long long*>(slot.data_ptr<int64_t>()) : nullptr;
  const int err = qattn_decode(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), bias.data_ptr<float>(), sl, pm, pm + np,
                               pm + 2 * np, nsplit > 1 ? ctr.data_ptr<int>() : nullptr, o.data_ptr(), (int)m, (int)hkv, (int)(h / hkv), (int)d, (int)s, (int)smax,
                               (int)chunk, (int)nsplit, (float)scale, (int)nst, pdl ? 1 : 0,
                               (void*)c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == 0, "qattn_decode: ", err == -1 ? "unsupported arguments" : cudaGetErrorString((cudaError_t)err));
}

int64_t smem_bytes(int64_t nst, int64_t d) { return qattn_smem_bytes((int)nst, (int)d); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend);
  m.def("smem_bytes", &smem_bytes);
}
"""

_CU = (cuda_build.CSRC / "decode_attn.cu",)
_STATE: dict = {}


MODE: str | None = None  # overrides QERL_ATTN when set (benchmarks.attn_bench)


def attn_mode() -> str:
    """``QERL_ATTN`` (or :data:`MODE`): auto, cuda or triton."""
    v = MODE if MODE is not None else os.environ.get("QERL_ATTN", "auto")
    if v not in ATTN_MODES:
        raise ValueError(f"QERL_ATTN={v!r}; valid: {', '.join(ATTN_MODES)}")
    return v


def _ext():
    return cuda_build.load_extension("qerl_attn", _CU, (), _BINDING, ["-O3", *cuda_build.arch_flags()], _STATE)


def shape_ok(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bias: torch.Tensor) -> bool:
    """The shapes and dtypes the kernel takes: bf16 q and contiguous caches, head dim 64 or 128, <= 16 query heads
    per KV head, a contiguous fp32 bias."""
    d, h, hkv = q.shape[-1], q.shape[1], kc.shape[1]
    return (q.dtype == kc.dtype == vc.dtype == torch.bfloat16 and d in (64, 128) and h % hkv == 0
            and h // hkv <= 16 and kc.is_contiguous() and vc.is_contiguous() and bias.dtype == torch.float32
            and bias.is_contiguous())


def usable(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bias: torch.Tensor) -> bool:
    """True where :func:`qerl.kernels.fused.decode_attention` runs this kernel (``QERL_ATTN``; a CUDA device of
    compute capability 8.0+ on which the extension builds); ``QERL_ATTN=cuda`` raises instead of falling back."""
    mode = attn_mode()
    if mode == "triton":
        return False
    ok = q.is_cuda and shape_ok(q, kc, vc, bias) and torch.cuda.get_device_capability(q.device)[0] >= 8
    if ok:
        try:
            _ext()
        except Exception:
            ok = False
    if not ok and mode == "cuda":
        raise RuntimeError(f"QERL_ATTN=cuda but the CUDA decode attention does not apply (q {tuple(q.shape)} "
                           f"{q.dtype} on {q.device}, {kc.shape[1]} KV heads; build error: {_STATE.get('error')})")
    return ok


MAX_SPLIT = 256  # csrc/decode_attn.cu's kMaxSplit
COUNTERS = 1 << 16


def _counters(device: torch.device) -> torch.Tensor:
    """The device's merge counters (int32, zero; every launch leaves the ones it used at zero)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    c = _STATE.get(("ctr", idx))
    if c is None:
        c = _STATE[("ctr", idx)] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return c


def attend(q, kc, vc, bias, s: int, scale: float, slot: torch.Tensor | None, pdl: bool, nst: int | None = None,
           target: int | None = None, block: int | None = None) -> torch.Tensor:
    """softmax(q·Kᵀ·scale + bias)·V over cache slots [0, s) in one launch (see the module docstring): q (M, H, d),
    kc/vc (M, HKV, S_max, d), bias (M, S_max) fp32. Returns (M, H·d) bf16. ``nst``, ``target``, ``block``: ring
    stages and the split policy (default :data:`NST`, :data:`TARGET_CTAS`, :data:`BLOCK`)."""
    from qerl.kernels.fused import attention_splits
    nst = NST if nst is None else nst
    if nst not in NST_CHOICES:
        raise ValueError(f"nst={nst}; valid: {NST_CHOICES}")
    m, h, d = q.shape
    rows = m * kc.shape[1]
    if rows > COUNTERS:
        raise ValueError(f"{rows} (row, KV head) pairs; the merge counters hold {COUNTERS}")
    target = min(TARGET_CTAS if target is None else target, MAX_SPLIT * rows)
    nsplit, chunk = attention_splits(rows, s, block=BLOCK if block is None else block, target_programs=target)
    o = torch.empty((m, h * d), dtype=q.dtype, device=q.device)
    part = torch.empty((m * h * nsplit * (d + 2),) if nsplit > 1 else (0,), dtype=torch.float32, device=q.device)
    ctr = _counters(q.device) if nsplit > 1 else torch.empty(0, dtype=torch.int32, device=q.device)
    empty = torch.empty(0, dtype=torch.long, device=q.device)
    _ext().attend(q, kc, vc, bias, empty if slot is None else slot, part, ctr, o, int(s), int(chunk), int(nsplit),
                  float(scale), int(nst), bool(pdl))
    return o
