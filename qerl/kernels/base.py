"""What the kernels' dispatch modules share: whether Triton is here (and its interpreter), the device's facts, the
switches that pick the CUDA kernels (programmatic dependent launch, the CUDA FP4 GEMV and GEMM and their M ranges),
the FP4 family's kernel constants, and the reusable per-device buffers. Imported by ``qerl.kernels`` (whose
``pdl_enabled``, ``cuda_gemv_enabled`` and ``cuda_gemm_choice`` are these) and by its other modules; it imports none
of them at load time (``cuda_fp4`` only inside ``cuda_gemv_enabled`` / ``cuda_gemm_choice``)."""

from __future__ import annotations

import os

import torch

from qerl.quant import get_format

try:  # Triton is optional: CPU hosts without it use the reference path.
    import triton

    from qerl.kernels import fp4_triton as _k
    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the host
    triton, _k, HAS_TRITON = None, None, False

# The Triton/CUDA kernels' FMT switch: how a block scale byte decodes (E4M3 with an FP32 divisor, or E8M0).
_SCALE_KIND_ID = {"e4m3": 0, "e8m0": 1}
_COUNTER_SLOTS = 1 << 16


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _fp4_id(fmt) -> int:
    """The kernels' FMT constant of an FP4-family format, from the scale type the format declares."""
    kind = getattr(fmt, "scale_kind", None)
    if kind not in _SCALE_KIND_ID:
        raise ValueError(f"{fmt!r} is not an FP4-family format (scale_kind {kind!r}; the FP4 kernels take "
                         f"{sorted(_SCALE_KIND_ID)})")
    return _SCALE_KIND_ID[kind]


_WORKSPACE: dict[tuple, torch.Tensor] = {}
_COUNTERS: dict[tuple, torch.Tensor] = {}
_DEV_INFO: dict[int, tuple[str, int, int]] = {}


def _stamp(*ts: torch.Tensor | None) -> tuple:
    return tuple((t.data_ptr(), t._version) for t in ts if t is not None)


def _device_info(dev: torch.device) -> tuple[str, int, int]:
    """(name, SM count, compute capability major*10+minor) of a CUDA device, cached."""
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    info = _DEV_INFO.get(idx)
    if info is None:
        p = torch.cuda.get_device_properties(idx)
        info = (p.name, p.multi_processor_count, p.major * 10 + p.minor)
        _DEV_INFO[idx] = info
    return info


# programmatic dependent launch for the decode step's kernels when QERL_PDL is unset / "auto": on, measured faster on
# the H100 in every same-run A/B (7B batch 8 NVFP4 2442 vs 2363 and 2372 vs 2276 tokens/s, batch 2 672 vs 625, 32B
# batch 8 683 vs 663; results/speed/raw/h100_s23_pdl, h100_s23_prefetch) and bit-identical in output
PDL_DEFAULT = True


def pdl_enabled(t: torch.Tensor) -> bool:
    """Launch the decode step's kernels (the fused Triton kernels and the CUDA FP4 GEMV) with programmatic dependent
    launch: each starts while its predecessor drains and waits (``griddepcontrol.wait``) before reading anything.
    ``QERL_PDL``: "1" on, "0" off, "auto" (default) :data:`PDL_DEFAULT`; only on CUDA devices of compute
    capability 9.0+ (elsewhere the launch attribute does not exist) and never under the Triton interpreter."""
    mode = os.environ.get("QERL_PDL", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"QERL_PDL={mode!r}: choose 1 (on), 0 (off) or auto")
    if not (PDL_DEFAULT if mode == "auto" else mode == "1"):
        return False
    return t.is_cuda and not _interpret() and _device_info(t.device)[2] >= 90


# ----------------------------------------------------------------------------------------- CUDA decode GEMV

CUDA_GEMV_MAX_M = 16
CUDA_GEMM_DEFAULT_MAX_M = 192  # the CUDA GEMM's range on shapes/devices without a tuned table (7B H100 crossover)
_CUDA_ENCODINGS = {(0, 16): "nvfp4", (1, 32): "mxfp4"}  # (scale kind id, block) -> cuda_fp4's encoding


_CUDA: dict = {}


def cuda_gemv_enabled(dev: torch.device) -> bool:
    """True when the hand-written CUDA FP4 GEMV (``qerl.kernels.cuda_fp4``) serves decode-size M on ``dev``:
    a CUDA device, ``QERL_CUDA_GEMV`` not "0", and the extension built (once; a failure warns and falls back
    to Triton)."""
    if dev.type != "cuda" or _interpret() or os.environ.get("QERL_CUDA_GEMV", "1") == "0":
        return False
    ok = _CUDA.get("ok")
    if ok is None:
        try:
            from qerl.kernels import cuda_fp4
            ok = cuda_fp4.available()
            err = cuda_fp4.build_error()
        except Exception as e:  # pragma: no cover - depends on the host
            ok, err = False, f"{type(e).__name__}: {e}"
        if not ok:
            import warnings
            warnings.warn(f"CUDA FP4 GEMV unavailable ({err}); decode uses the Triton kernels", stacklevel=2)
        _CUDA["ok"] = ok
    return ok


def _cuda_gemv_ok(x: torch.Tensor, m: int, n: int, k: int) -> bool:
    return (m <= CUDA_GEMV_MAX_M and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 64 == 0
            and cuda_gemv_enabled(x.device))


def cuda_gemm_choice(fmt, n: int, k: int, m: int, dev: torch.device) -> bool:
    """True when the CUDA FP4 GEMM (``cuda_fp4.gemm``) serves this (format, shape, M > 16) on ``dev``:
    ``QERL_CUDA_GEMM=1`` forces it (where it can run), ``0`` turns it off; by default the device's tuned table
    (measured crossover against the Triton / dequantize + cuBLAS paths, ``qerl/kernels/tuned/``) decides, and an
    untuned shape or device uses it for M <= ``CUDA_GEMM_DEFAULT_MAX_M``."""
    mode = os.environ.get("QERL_CUDA_GEMM", "auto")
    if mode == "0" or m <= CUDA_GEMV_MAX_M or n % 16 or k % 64 or not cuda_gemv_enabled(dev):
        return False
    if mode == "1":
        return True
    from qerl.kernels import cuda_fp4
    encoding = _CUDA_ENCODINGS.get((_fp4_id(fmt), get_format(fmt).block))
    if encoding is None:
        return False
    hit = cuda_fp4.tuned_gemm_config(encoding, n, k, m, _device_info(dev)[0])
    if hit is None:
        return m <= CUDA_GEMM_DEFAULT_MAX_M
    return hit[1]


def _triton_ok(x: torch.Tensor) -> bool:
    return HAS_TRITON and ((x.is_cuda and torch.cuda.is_available()) or _interpret())


# ----------------------------------------------------------------------------------------- buffers

def _workspace(device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A flat reusable buffer per (device, dtype), grown to the largest weight seen (old one released)."""
    key = (device, dtype)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        _WORKSPACE.pop(key, None)
        buf = torch.empty(numel, device=device, dtype=dtype)
        _WORKSPACE[key] = buf
    return buf[:numel]


def _counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 split-K tile counters per (device, stream); each kernel leaves them zero again."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    c = _COUNTERS.get(key)
    if c is None:
        c = torch.zeros(_COUNTER_SLOTS, device=device, dtype=torch.int32)
        _COUNTERS[key] = c
    return c
