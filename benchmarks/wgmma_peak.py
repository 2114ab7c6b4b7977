"""The tensor cores' ceiling for the FP4 wgmma GEMM's MMA schedule, with no copies to wait for (issue 10).

    python -m benchmarks.wgmma_peak [--n 64,128,256] [--ops rs,ss,rsdec] [--wgs 1,2,4] [--depth 0,1] [--iters 4096]
                                    [--ctas 1] [--grid CTAS] [--out results/speed] [--tag NAME]

Every CTA's warpgroups loop over "chunks" as the GEMM's main loop does (``csrc/fp4_wgmma_gemm.cu``): a
``wgmma.fence``, four ``m64nNk16`` bf16 MMAs into one set of N/2 fp32 accumulators (``rs``: A from four registers a
thread, B from a 128-byte-swizzled shared-memory tile, the GEMM's ``wgmma_rs``; ``ss``: A from shared memory too,
``wgmma_ss``; ``rsdec``: rs with each chunk's A registers made by the GEMM's own decode, ``scale_words`` and
``decode_word``, from a 16-byte word and a scale pair read from shared memory where the GEMM reads its staged chunk:
the main loop without its staging, mbarriers and waits for copies), one commit group, then ``wgmma.wait_group
depth`` (1: the group before may still run, the GEMM's pipe 2; 0: none). Nothing is copied: the operands sit in
registers and in a zeroed shared-memory tile for the whole loop (rs and ss decode nothing either). ``wgs``
warpgroups a CTA (1, 2 or 4: the GEMM's RW x KS), ``ctas`` CTAs an SM, one wave on every SM; or ``--grid`` CTAs in
all (e.g. 296 with ``--iters 28``: the grid and the chunks a warpgroup of the GEMM's 128-token gate|up launch, 7B,
with nothing but its MMAs; session 49's ``scripts/gpu_bench.sh kfix``).

The measure is TFLOPS (2 x 64 x N x 16 x 4 per chunk and warpgroup) against the dense BF16 peak the roofline uses
(``benchmarks.decode_floor``: 989 TFLOPS on an H100 / H200 SXM): what a CTA of this shape reaches when nothing but its
MMAs runs. Session 48's ablation (``raw/h200_s48_ablate``) left ~87% of the 128-token GEMM's time with no decode; set
against this ceiling, it separates what the instruction stream can do from what the GEMM's schedule (staging, waits,
epilogue, waves) costs. Writes ``wgmma_peak_<gpu><tag>.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import torch

from benchmarks import decode_floor
from benchmarks import kernel_bench as bench

CSRC = Path(__file__).resolve().parents[1] / "qerl" / "kernels" / "csrc"
WIDTHS = (64, 128, 256)  # token-tile widths N (the GEMM's 64-, 128- and 256-token tiles)
OPS = ("rs", "ss", "rsdec")
DEPTHS = (0, 1)
WGS = (1, 2, 4)
# the compiled (N, warpgroups a CTA): a CTA of W warpgroups is compiled for W x 128 threads (its registers: N / 2
# accumulators a thread; 4 warpgroups of 256 tokens would need more than the 128 registers 512 threads leave)
VARIANTS = tuple((n, w) for n in WIDTHS for w in WGS if n * w <= 512)

# Device code: sm_90a only (the wrappers assert nothing; the host refuses other devices).
DEVICE_SRC = r"""
#include <cstdint>
#include "fp4_mma_common.cuh"
#include "fp4_wgmma_ops.cuh"
using namespace qfp4;

template <int N, bool SS, bool DEC, int DEPTH, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) wgmma_peak_kernel(int iters, float* sink) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  // the B tile (N rows x 128 bytes) and, after it, a 64-row A tile, from the first 1024-byte boundary (a swizzle
  // atom): zeros (0 x 0 = 0: no NaN, no denormal path)
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
  for (int i = threadIdx.x; i < (N * 128 + 64 * 128) / 16; i += blockDim.x)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0u, 0u, 0u, 0u);
  __syncthreads();
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t blo = desc_lo(base), alo = desc_lo(base + N * 128);  // the GEMM's descriptors
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    acc[i] = 0.f;
    fence_reg(acc[i]);
  }
  // The register A operand of rs as the GEMM holds it (its pipe 2): one set of four registers per MMA of a chunk, two
  // chunks' sets, even chunks in a[0], odd in a[1]; each chunk's set written afresh before its MMAs (bf16 zeros by
  // an opaque mov where the GEMM decodes; rsdec: by the GEMM's decode) and kept alive until the wait that retires
  // them (a set held across the loop's back edge instead makes ptxas serialize the MMAs).
  uint32_t a[2][4][4];
  // DEC: this thread's 16-byte weight word and scale pair of the chunk, as the GEMM's decode reads them from its
  // stage (here from the zeroed A tile, by volatile loads that stay in the loop), decoded by the GEMM's functions
  const uint32_t wsrc = base + N * 128 + (threadIdx.x & 127) * 16;
  const uint32_t ssrc = base + N * 128 + 2048 + (threadIdx.x & 31) * 4;
  constexpr uint32_t kBword = (112u << 7) * 0x10001u;  // an NVFP4 weight's scale bias (bexp 0)
  auto fresh = [&](uint32_t (&r)[4][4]) {
    if constexpr (DEC) {
      uint32_t w0, w1, w2, w3, s16, sg, sg8;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(w0), "=r"(w1), "=r"(w2), "=r"(w3) : "r"(wsrc));
      asm volatile("ld.shared.u32 %0, [%1];" : "=r"(s16) : "r"(ssrc));
      scale_words<0>(s16 & 0xFFFFu, kBword, sg, sg8);
      decode_word(w0, sg, sg8, r[0]);
      decode_word(w1, sg, sg8, r[1]);
      decode_word(w2, sg, sg8, r[2]);
      decode_word(w3, sg, sg8, r[3]);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int o = 0; o < 4; ++o) asm volatile("mov.b32 %0, 0;" : "=r"(r[j][o]));
    }
  };
  auto chunk = [&](const uint32_t (&r)[4][4]) {
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (SS) {
        wgmma_ss<N>(acc, alo + 2 * j, kDescHi, blo + 2 * j, kDescHi);
      } else {
        wgmma_rs<N>(acc, r[j][0], r[j][1], r[j][2], r[j][3], blo + 2 * j, kDescHi);
      }
    }
    wgmma_commit();
    wgmma_wait<DEPTH>();
  };
  fresh(a[1]);
#pragma unroll 1  // unrolled further, the 512-thread rs kernels run out of registers and ptxas serializes
  for (int it = 0; it < iters; it += 2) {  // two chunks a pass (iters even)
    fresh(a[0]);
    chunk(a[0]);
    keep_regs(a[DEPTH]);  // the set the wait retired: this chunk's (depth 0) or the one before (depth 1)
    fresh(a[1]);
    chunk(a[1]);
    keep_regs(a[1 - DEPTH]);
  }
  wgmma_wait<0>();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < N / 2; ++i) s += acc[i];
  if (s != 0.f) sink[blockIdx.x] = s;  // never true (zeros): keeps the MMAs
#endif
}
"""



def host_src() -> str:
    """The launcher: one case per compiled (N, warpgroups) x A operand x wait depth."""
    cases = "\n".join(
        f"  if (n == {n} && wgs == {w} && op == {i} && depth == {d}) "
        f"return launch<{n}, {str(op == 'ss').lower()}, {str(op == 'rsdec').lower()}, {d}, {128 * w}>"
        f"(grid, iters, p, stream);"
        for n, w in VARIANTS for i, op in enumerate(OPS) for d in DEPTHS)
    return r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

template <int N, bool SS, bool DEC, int DEPTH, int THREADS>
static void launch(int grid, int iters, float* sink, cudaStream_t stream) {
  const int smem = N * 128 + 64 * 128 + 1024;  // + 1024: the tiles start on a swizzle atom
  auto k = wgmma_peak_kernel<N, SS, DEC, DEPTH, THREADS>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<grid, THREADS, smem, stream>>>(iters, sink);
}

void run(int64_t n, int64_t op, int64_t depth, int64_t grid, int64_t wgs, int64_t iters, torch::Tensor sink) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  float* p = sink.data_ptr<float>();
""" + cases + r"""
  TORCH_CHECK(false, "wgmma_peak: no variant n=", n, " wgs=", wgs, " op=", op, " depth=", depth);
}
"""



def parse_list(text: str, name: str, valid: tuple) -> list:
    """``"a,b"`` -> the values, each one of ``valid`` (ints where ``valid`` holds ints), or ValueError naming the flag,
    the bad value and the choices."""
    kind = type(valid[0])
    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = None
    if not vals or any(v not in valid for v in vals):
        raise ValueError(f"--{name} {text!r}: each must be one of {', '.join(map(str, valid))}")
    return list(dict.fromkeys(vals))


def chunk_flops(n: int) -> int:
    """FLOPs of one chunk of one warpgroup: four m64nNk16 MMAs."""
    return 2 * 64 * n * 16 * 4


def tflops(n: int, wgs: int, grid: int, iters: int, ms: float) -> float:
    """TFLOPS of a launch of ``grid`` CTAs of ``wgs`` warpgroups, each looping ``iters`` chunks, in ``ms``."""
    return chunk_flops(n) * wgs * grid * iters / (ms * 1e-3) / 1e12


def _ext():
    from torch.utils.cpp_extension import load_inline
    cpp = "void run(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, torch::Tensor);"  # the binding's declaration
    return load_inline("qerl_wgmma_peak", cpp_sources=cpp, cuda_sources=DEVICE_SRC + host_src(), functions=["run"],
                       extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", f"-I{CSRC}"],
                       verbose=False)


def peak_tflops(device_name: str) -> float:
    """The dense BF16 peak of the roofline (``decode_floor.PEAK_TFLOPS``) for this GPU model (an H100's where the name
    names neither model)."""
    return decode_floor.PEAK_TFLOPS[decode_floor._gpu_model(device_name) or "H100"]


def run(widths, ops, wgs_list, depths, iters: int, ctas: int, rep_ms: float, grid: int = 0) -> list[dict]:
    """Each variant timed over ``grid`` CTAs (0: one wave, ``ctas`` an SM on every SM)."""
    ext = _ext()
    peak = peak_tflops(torch.cuda.get_device_name())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = grid or sms * ctas
    sink = torch.zeros(grid, device="cuda")
    rows = []
    for n, op, wgs, depth in itertools.product(widths, ops, wgs_list, depths):
        if (n, wgs) not in VARIANTS:
            continue
        call = functools.partial(ext.run, n, OPS.index(op), depth, grid, wgs, iters, sink)
        ms = bench._graph_ms([call], rep_ms)[0]
        tf = tflops(n, wgs, grid, iters, ms)
        rows.append(dict(N=n, op=op, warpgroups=wgs, depth=depth, ctas_per_sm=ctas, grid=grid, iters=iters,
                         us=round(ms * 1e3, 2), tflops=round(tf, 1), of_peak=round(tf / peak, 3)))
        print(f"[peak] m64n{n}k16 {op} wgs={wgs} depth={depth} ctas/SM={ctas} grid={grid} iters={iters}: "
              f"{ms * 1e3:8.1f} us {tf:6.1f} TFLOPS ({tf / peak:.3f} of {peak:.0f})", flush=True)
    return rows


def markdown(rows, header: str) -> str:
    out = [header, "", "| N | A operand | warpgroups / CTA | wait_group | CTAs / SM | CTAs | chunks | µs | TFLOPS | "
           "of peak |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['N']} | {r['op']} | {r['warpgroups']} | {r['depth']} | {r['ctas_per_sm']} | {r['grid']} | "
                   f"{r['iters']} | {r['us']:.1f} | "
                   f"{r['tflops']:.1f} | {r['of_peak']:.3f} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="64,128,256")
    ap.add_argument("--ops", default="rs,ss,rsdec")
    ap.add_argument("--wgs", default="1,2,4")
    ap.add_argument("--depth", default="0,1")
    ap.add_argument("--iters", type=int, default=4096)
    ap.add_argument("--ctas", type=int, default=1, help="CTAs an SM (one wave: SMs x ctas)")
    ap.add_argument("--grid", type=int, default=0, help="CTAs in all (0: one wave, SMs x ctas)")
    ap.add_argument("--rep", type=float, default=20.0)
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    try:
        widths = parse_list(a.n, "n", WIDTHS)
        ops = parse_list(a.ops, "ops", OPS)
        wgs = parse_list(a.wgs, "wgs", WGS)
        depths = parse_list(a.depth, "depth", DEPTHS)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if a.iters < 2 or a.iters % 2 or a.ctas not in (1, 2) or a.grid < 0:
        raise SystemExit(f"--iters must be even and >= 2, --ctas 1 or 2 and --grid >= 0 (0: one wave), got "
                         f"{a.iters} / {a.ctas} / {a.grid}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise SystemExit("wgmma_peak needs an sm_90 GPU (H100 / H200)")
    rows = run(widths, ops, wgs, depths, a.iters, a.ctas, a.rep, a.grid)
    gpu = torch.cuda.get_device_name()
    header = (f"## The wgmma GEMM's MMA schedule alone: TFLOPS with no copies (rsdec: with its decode)\n\n"
              f"{gpu}, torch {torch.__version__}, dense BF16 peak {peak_tflops(gpu):.0f} TFLOPS, "
              f"`{' '.join(sys.argv)}`.")
    bench.write_report(a.out, f"wgmma_peak_{bench.gpu_tag(a.tag)}", rows, markdown(rows, header))


if __name__ == "__main__":
    main()
