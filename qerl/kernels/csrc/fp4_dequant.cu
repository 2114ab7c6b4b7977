// Dense BF16 weight from the re-laid-out FP4 weight (the layout of fp4_mma_gemv.cu), for cuBLAS at large M (the
// update's forward, its gradient-checkpointing recompute and its backward, the prefill): out (N, K) row-major.
//
// One warp per (16-row strip, CPW consecutive 64-column chunks): lane (g, t) loads its 16-byte word group of each
// chunk (the warp reads 512 contiguous bytes per chunk) and its 16-bit scale pair, decodes its 32 nibbles with the
// GEMV's bit masks (e2m1 * 2^-126 as bf16 halves, times 2^126 in one bf16x2 multiply: exact), and writes rows g and
// g + 8 of the chunk, exchanged within the row's four lanes (store_row) so that every store covers whole sectors. The values are the reference's, bit for bit:
// float32 fp4 * scale (NVFP4: E4M3 / global scale, as Triton's _scale_val and div_rn compute it; MXFP4: 2^(e-127)),
// rounded once to bf16 (no fast-math: float32 subnormals are kept).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "fp4_mma_common.cuh"

namespace {

constexpr int kCPW = 4;                 // chunks per warp
constexpr int kWarps = 8;               // warps per CTA

// The four lanes t = 0..3 of a row hold its 128-byte chunk segment as 32 bytes each (lane t: bytes 32 t .. 32 t + 31,
// halves h0, h1). Two butterfly exchanges (xor 1, then xor 2; 8 shuffles) give lane t bytes 16 t .. and 64 + 16 t ..,
// so each of the two 16-byte store instructions writes whole 32-byte sectors (64 contiguous bytes per row) instead
// of half of every sector of the segment. p: the row's chunk segment (16-byte aligned).
__device__ __forceinline__ void store_row(__nv_bfloat16* p, const uint32_t (&w)[8], int t) {
  uint32_t s1[4], s2[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // even t keeps its h0 and takes its partner's h0; odd t: the partner's h1, its own
    const uint32_t r = __shfl_xor_sync(0xFFFFFFFFu, (t & 1) ? w[k] : w[4 + k], 1);
    s1[k] = (t & 1) ? r : w[k];
    s2[k] = (t & 1) ? w[4 + k] : r;
  }
  uint32_t o1[4], o2[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // lanes t, t ^ 2: t < 2 keep s1 for bytes 16 t and take s1 of t + 2 for 64 + 16 t
    const uint32_t r = __shfl_xor_sync(0xFFFFFFFFu, (t & 2) ? s1[k] : s2[k], 2);
    o1[k] = (t & 2) ? r : s1[k];
    o2[k] = (t & 2) ? s2[k] : r;
  }
  *reinterpret_cast<uint4*>(p + 8 * t) = make_uint4(o1[0], o1[1], o1[2], o1[3]);
  *reinterpret_cast<uint4*>(p + 32 + 8 * t) = make_uint4(o2[0], o2[1], o2[2], o2[3]);
}

template <int FMT, bool HAS_G>
__global__ void __launch_bounds__(32 * kWarps) dequant_kernel(const uint4* __restrict__ qw,
                                                              const uint16_t* __restrict__ sc,
                                                              const float* __restrict__ gs,
                                                              __nv_bfloat16* __restrict__ out, long ldo, int S,
                                                              int C, long cs) {
  constexpr int GPC = FMT == 0 ? 4 : 2;  // scale groups per 64-column chunk (G = 16 / 32)
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int cb = (C + kCPW - 1) / kCPW;  // chunk batches per strip
  const long task = (long)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (task >= (long)S * cb) return;
  const int s = (int)(task / cb), c0 = (int)(task % cb) * kCPW;
  const int nc = min(kCPW, C - c0);
  const long blk0 = (long)s * cs + c0;  // cs: the source's chunks per strip (C, or more for a column slice)
  uint4 w[kCPW];
  uint32_t pr[kCPW];
#pragma unroll
  for (int i = 0; i < kCPW; ++i) {
    if (i < nc) {
      w[i] = qfp4::ld_stream(qw + (blk0 + i) * 32 + lane);
      pr[i] = qfp4::ld_stream_u16(sc + (blk0 + i) * (8 * GPC) + g * GPC + (FMT == 0 ? t : t >> 1));
    }
  }
  const float inv = HAS_G ? *gs : 1.0f;
  __nv_bfloat16* r0 = out + (long)(16 * s + g) * ldo + 64L * c0;
  __nv_bfloat16* r8 = r0 + 8 * ldo;
#pragma unroll
  for (int i = 0; i < kCPW; ++i) {
    if (i < nc) {
      float s0, s8;
      qfp4::row_scales<FMT, HAS_G>(pr[i], inv, s0, s8);
      const uint32_t v[4] = {w[i].x, w[i].y, w[i].z, w[i].w};
      uint32_t a[8], b[8];  // row g / row g + 8: columns 4 j + {0, 1}, {2, 3} of word j
      qfp4::dequant_unit(v, s0, s8, a, b);
      store_row(r0 + 64 * i, a, t);
      store_row(r8 + 64 * i, b, t);
    }
  }
}

template <int FMT, bool HAS_G>
int launch(const void* qw, const void* sc, const float* gs, void* out, long ldo, int S, int C, long cs,
           cudaStream_t st) {
  const long tasks = (long)S * ((C + kCPW - 1) / kCPW);
  const long grid = (tasks + kWarps - 1) / kWarps;
  if (grid <= 0) return 0;
  if (grid >= (1L << 31)) return -1;
  dequant_kernel<FMT, HAS_G><<<(unsigned)grid, 32 * kWarps, 0, st>>>(
      static_cast<const uint4*>(qw), static_cast<const uint16_t*>(sc), gs, static_cast<__nv_bfloat16*>(out), ldo,
      S, C, cs);
  return (int)cudaGetLastError();
}

}  // namespace

// out (16 S, 64 C) bf16 with row stride ldo (elements, a multiple of 8) = the weight of qw (S, C, 32, 4) int32 and
// sc (S, C, 8 * groups per chunk) int16, whose strips lie cs >= C chunks apart (C: the whole weight; more: its
// column slice of C chunks, e.g. for the backward's column slices); gs: the NVFP4 global scale (device float) or
// null. 0, -1 (bad arguments) or a CUDA error code.
extern "C" int qfp4_dequant(const void* qw, const void* sc, const float* gs, void* out, long ldo, int S, int C,
                            long cs, int fmt, void* stream) {
  if (ldo % 8 || reinterpret_cast<uintptr_t>(out) % 16 || ldo < 64L * C || cs < C) return -1;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (fmt == 0) {
    return gs ? launch<0, true>(qw, sc, gs, out, ldo, S, C, cs, st)
              : launch<0, false>(qw, sc, gs, out, ldo, S, C, cs, st);
  }
  return launch<1, false>(qw, sc, nullptr, out, ldo, S, C, cs, st);
}
