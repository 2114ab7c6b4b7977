// W4A16 decode GEMV for NVFP4 / MXFP4 weights on tensor cores (mma.sync m16n8k16, bf16 in, fp32 acc).
//
// out (M, N) = x (M, K) @ W^T for M <= 16. W is re-laid out once by qerl/kernels/cuda_fp4.py (prepare) so that
// one 128-bit load per lane and K chunk of 64 is that lane's A fragments for four MMAs:
//   weight rows = the MMA's M (a strip of 16 rows per warp), x rows (tokens) = the MMA's N (one n8 tile, or two
//   for M > 8), K chunk c of 64: lane (g = lane/4, t = lane%4) holds rows g and g+8, k = 64c + 16t + 0..15, so its
//   x operand is 16 contiguous bf16 of one token row (two 128-bit loads). MMA step j (0..3) of the chunk uses
//   k = 64c + 16t + 4j + {0,1} (A regs 0/1, B reg 0) and + {2,3} (A regs 2/3, B reg 1); the sum over K is
//   order-free, so this permutation of K inside the chunk changes nothing but the accumulation order.
// Word j of the lane's 16 bytes holds the 8 nibbles of MMA step j, placed so that each A register is
//   reg0 = w & MASK, reg1 = rotr(w, 3) & MASK, reg2 = rotr(w, 6) & MASK,
//   reg3 = ((w & 0x001B001B) * (2^3 + 2^8 + 2^14)) & MASK       (three disjoint shifted copies, no carries)
// with MASK = 0x81C081C0: in each bf16 half the nibble's sign at bit 15 and its magnitude (e1 e0 m) at bits 8..6,
// i.e. the bf16 value e2m1 * 2^-126 (the 0.5 code is a bf16 subnormal, which bf16 arithmetic keeps). One
// mul.bf16x2 per register by the group's scale word (scale * 2^B as bf16, both halves) gives e2m1 * s * 2^(B-126),
// exact; the fp32 accumulator is multiplied by 2^(126-B) (and 1/g for NVFP4) at the end.
// Scale words: NVFP4 E4M3 through the exact hardware E4M3->FP16 conversion, exponent moved by 112 + B (B = 119:
// 448 * 2^119 < bf16 max); zero scales are remapped at prepare time (codes zeroed, scale 1). MXFP4 E8M0 e gives
// the bf16 exponent field e + B, B chosen per tensor at prepare time (exactness window e + B in [128, 254]).
//
// Split-K inside the CTA: each strip is worked on by `splits` warps (contiguous K ranges), partial sums are
// reduced through shared memory, so one launch, no workspace, no atomics: CUDA-graph capturable.

#include "fp4_mma_common.cuh"

namespace qfp4 {

// Warps per CTA at most: 16 while a warp keeps <= 4 chunk loads per batch (<= 128 registers), else 8.
template <int U, int SW>
constexpr int max_warps() { return U * SW >= 8 ? 8 : 16; }

template <int NT>
struct XFrag {
  uint32_t r[NT][8];
};

// x fragment of the chunk at p (16 bf16 of token g, and of token g+8 for NT = 2); rows >= M keep stale values,
// which only reach output columns that are never stored.
template <int NT>
__device__ __forceinline__ void load_x(XFrag<NT>& f, const __nv_bfloat16* p, int ldx8, bool v0, bool v1) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt == 0 ? v0 : v1) {
      const uint4 a = ld_x(p + nt * ldx8), b = ld_x(p + nt * ldx8 + 8);
      f.r[nt][0] = a.x; f.r[nt][1] = a.y; f.r[nt][2] = a.z; f.r[nt][3] = a.w;
      f.r[nt][4] = b.x; f.r[nt][5] = b.y; f.r[nt][6] = b.z; f.r[nt][7] = b.w;
    }
  }
}

// One K chunk of one strip: decode the lane's 16 bytes into 4 MMA steps' A fragments, accumulate into acc
// (two accumulator sets alternate between steps when A2 = 2: half the HMMA dependency chain).
template <int FMT, int NT, int A2>
__device__ __forceinline__ void chunk_mma(float (&acc)[A2][NT][4], const uint4& w, uint32_t s16, uint32_t bword,
                                          const XFrag<NT>& xf) {
  uint32_t sg, sg8;
  scale_words<FMT>(s16, bword, sg, sg8);
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a[4];
    decode_word(ws[j], sg, sg8, a);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      mma_bf16(acc[j % A2][nt], a[0], a[1], a[2], a[3], xf.r[nt][2 * j], xf.r[nt][2 * j + 1]);
  }
}

// grid: ceil(S / (R * SW)) CTAs of R * splits warps; warp w works on the SW strips starting at
// (blockIdx.x * R + w / splits) * SW (clamped to S - 1 for loads), K chunks [split * C / splits,
// (split + 1) * C / splits). Each x fragment load serves SW strips. With programmatic dependent launch the
// CTAs start during the previous grid's tail and wait (griddepcontrol.wait) before reading anything that grid
// may write; the source asks for the first weight batch before the wait, but ptxas (13.0) schedules the wait
// first, so the gain is the overlapped launch only.
template <int FMT, int NT, int U, int SW>
__global__ void __launch_bounds__(max_warps<U, SW>() * 32)
fp4_gemv_kernel(const uint4* __restrict__ qw, const uint16_t* __restrict__ sc, const __nv_bfloat16* __restrict__ x,
                int ldx, __nv_bfloat16* __restrict__ out, int ldo, const float* __restrict__ gs, float out_mult,
                uint32_t bword, int M, int S, int C, int splits, int R) {
  extern __shared__ float red[];  // (warps, SW, 16 rows, 8 * NT tokens), only when splits > 1
  constexpr int SL = FMT == 0 ? 32 : 16;  // scale pairs per (strip, chunk)
  constexpr int A2 = SW == 1 ? 2 : 1;
  constexpr int TOK = 8 * NT;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int strip0 = (blockIdx.x * R + warp / splits) * SW, split = warp % splits;
  const bool active = strip0 < S;
  const int c0 = split * C / splits;  // C * splits < 2^31 (checked by the caller)
  const int c1 = (split + 1) * C / splits;

  float acc[SW][A2][NT][4];
#pragma unroll
  for (int i = 0; i < SW; ++i)
#pragma unroll
    for (int a = 0; a < A2; ++a)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[i][a][nt][0] = acc[i][a][nt][1] = acc[i][a][nt][2] = acc[i][a][nt][3] = 0.f;

  const bool work = active && c0 < c1;
  // Pointers advance one batch of U chunks at a time; inside a batch the offsets are compile-time constants.
  const uint4* wq[SW];
  const uint16_t* sq[SW];
#pragma unroll
  for (int i = 0; i < SW; ++i) {
    const int st = max(0, min(strip0 + i, S - 1));
    wq[i] = qw + ((size_t)st * C + c0) * 32 + lane;
    sq[i] = sc + ((size_t)st * C + c0) * SL + (FMT == 0 ? lane : (lane >> 1));
  }
  const __nv_bfloat16* xq = x + (size_t)g * ldx + 16 * t + 64 * c0;
  const int ldx8 = 8 * ldx;
  const bool xv0 = g < M, xv1 = g + 8 < M;
  uint4 wa[U][SW], wb[U][SW];
  uint32_t sa[U][SW], sb[U][SW];
  XFrag<NT> xf[2];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 8; ++e) xf[i].r[nt][e] = 0u;

  // Loads of the batch at the current pointers (n valid chunks, warp-uniform).
  auto load_batch = [&](uint4 (&w)[U][SW], uint32_t (&s)[U][SW], int n) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < n) {
#pragma unroll
        for (int i = 0; i < SW; ++i) {
          w[u][i] = ld_stream(wq[i] + u * 32);
          s[u][i] = ld_stream_u16(sq[i] + u * SL);
        }
      }
    }
  };
  auto advance = [&]() {
#pragma unroll
    for (int i = 0; i < SW; ++i) {
      wq[i] += U * 32;
      sq[i] += U * SL;
    }
  };
  // Chunk u uses x fragment (u & 1) and prefetches chunk u + 1's (possibly the next batch's first) into the
  // other one; U is even, so parities carry over between batches.
  auto compute_batch = [&](const uint4 (&w)[U][SW], const uint32_t (&s)[U][SW], int left) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < left) {
        if (u + 1 < left) load_x<NT>(xf[(u + 1) & 1], xq + 64 * (u + 1), ldx8, xv0, xv1);
#pragma unroll
        for (int i = 0; i < SW; ++i) chunk_mma<FMT, NT, A2>(acc[i], w[u][i], s[u][i], bword, xf[u & 1]);
      }
    }
  };

  int left = work ? c1 - c0 : 0;  // chunks not yet computed
  load_batch(wa, sa, left);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (work) {
    load_x<NT>(xf[0], xq, ldx8, xv0, xv1);
    while (true) {
      advance();
      load_batch(wb, sb, left - U);
      compute_batch(wa, sa, left);
      xq += 64 * U;
      left -= U;
      if (left <= 0) break;
      advance();
      load_batch(wa, sa, left - U);
      compute_batch(wb, sb, left);
      xq += 64 * U;
      left -= U;
      if (left <= 0) break;
    }
  }

#pragma unroll
  for (int i = 0; i < SW; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (A2 == 2) acc[i][0][nt][e] += acc[i][A2 - 1][nt][e];
  float mult = out_mult;
  if (FMT == 0) mult = out_mult / __ldg(gs);
  if (splits == 1) {
#pragma unroll
    for (int i = 0; i < SW; ++i) {
      const int n0 = (strip0 + i) * 16;
      if (strip0 + i >= S) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = nt * 8 + 2 * t;
        if (tok < M) {
          out[(size_t)tok * ldo + n0 + g] = __float2bfloat16_rn(acc[i][0][nt][0] * mult);
          out[(size_t)tok * ldo + n0 + g + 8] = __float2bfloat16_rn(acc[i][0][nt][2] * mult);
        }
        if (tok + 1 < M) {
          out[(size_t)(tok + 1) * ldo + n0 + g] = __float2bfloat16_rn(acc[i][0][nt][1] * mult);
          out[(size_t)(tok + 1) * ldo + n0 + g + 8] = __float2bfloat16_rn(acc[i][0][nt][3] * mult);
        }
      }
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < SW; ++i) {
    float* r = red + (warp * SW + i) * 16 * TOK;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tok = nt * 8 + 2 * t;
      r[g * TOK + tok] = acc[i][0][nt][0];
      r[g * TOK + tok + 1] = acc[i][0][nt][1];
      r[(g + 8) * TOK + tok] = acc[i][0][nt][2];
      r[(g + 8) * TOK + tok + 1] = acc[i][0][nt][3];
    }
  }
  __syncthreads();
  const int per_strip = 16 * M;
  for (int idx = threadIdx.x; idx < R * SW * per_strip; idx += blockDim.x) {
    const int ls = idx / per_strip, rem = idx - ls * per_strip;  // ls = local strip (group * SW + i)
    const int tok = rem >> 4, row = rem & 15;
    const int grp = ls / SW, i = ls - grp * SW;
    const int st = (blockIdx.x * R + grp) * SW + i;
    if (st >= S) continue;
    float v = 0.f;
    for (int sp = 0; sp < splits; ++sp) v += red[(((grp * splits + sp) * SW + i) * 16 + row) * TOK + tok];
    out[(size_t)tok * ldo + st * 16 + row] = __float2bfloat16_rn(v * mult);
  }
}

template <int FMT, int NT, int U, int SW>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&fp4_gemv_kernel<FMT, NT, U, SW>);
}

// Compiled variants: (U, SW) in {(2,1), (4,1), (8,1), (2,2), (4,2), (2,4)} for both formats and 1 or 2 n8 tiles.
template <int FMT, int NT>
const void* pick_us(int unroll, int sw) {
  if (sw == 1) return unroll == 2 ? kernel_ptr<FMT, NT, 2, 1>() : unroll == 4 ? kernel_ptr<FMT, NT, 4, 1>()
                    : unroll == 8 ? kernel_ptr<FMT, NT, 8, 1>() : nullptr;
  if (sw == 2) return unroll == 2 ? kernel_ptr<FMT, NT, 2, 2>() : unroll == 4 ? kernel_ptr<FMT, NT, 4, 2>() : nullptr;
  if (sw == 4) return unroll == 2 ? kernel_ptr<FMT, NT, 2, 4>() : nullptr;
  return nullptr;
}

const void* pick(int fmt, int nt, int unroll, int sw) {
  if (fmt == 0) return nt == 1 ? pick_us<0, 1>(unroll, sw) : nt == 2 ? pick_us<0, 2>(unroll, sw) : nullptr;
  if (fmt == 1) return nt == 1 ? pick_us<1, 1>(unroll, sw) : nt == 2 ? pick_us<1, 2>(unroll, sw) : nullptr;
  return nullptr;
}

int warp_cap(int unroll, int sw) { return unroll * sw >= 8 ? 8 : 16; }

size_t smem_bytes(int nt, int warps, int splits, int sw) {
  return splits > 1 ? (size_t)warps * sw * 16 * 8 * nt * 4 : 0;
}

}  // namespace qfp4

// C entry points for the torch binding (cuda_fp4.py): plain pointers, the caller checks shapes.
// Return a cudaError_t (0 = success); -1 = unsupported variant / configuration.

// out (M, N) <- x (M, K) @ W^T; qw (S, C, 32) uint4, sc (S, C, 32 | 16) uint16, gs (1,) f32 (nvfp4 only).
// pdl: launch with programmatic stream serialization (overlaps the previous kernel's tail).
extern "C" int qfp4_gemv(const void* qw, const void* sc, const void* x, int ldx, void* out, int ldo,
                         const float* gs, float out_mult, unsigned bword, int M, int S, int C, int fmt, int splits,
                         int strips_per_cta, int unroll, int sw, int pdl, void* stream) {
  const int nt = M > 8 ? 2 : 1;
  const void* fn = qfp4::pick(fmt, nt, unroll, sw);
  const int warps = splits * strips_per_cta;
  if (fn == nullptr || M < 1 || M > 16 || splits < 1 || strips_per_cta < 1 || warps > qfp4::warp_cap(unroll, sw))
    return -1;
  const int per_cta = strips_per_cta * sw;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)((S + per_cta - 1) / per_cta));
  cfg.blockDim = dim3((unsigned)(warps * 32));
  cfg.dynamicSmemBytes = qfp4::smem_bytes(nt, warps, splits, sw);
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  void* args[] = {(void*)&qw, (void*)&sc, (void*)&x, (void*)&ldx, (void*)&out, (void*)&ldo, (void*)&gs,
                  (void*)&out_mult, (void*)&bword, (void*)&M, (void*)&S, (void*)&C, (void*)&splits,
                  (void*)&strips_per_cta};
  return (int)cudaLaunchKernelExC(&cfg, fn, args);
}

// Max resident CTAs per SM of one variant with `warps` warps per CTA (-1: unsupported variant).
extern "C" int qfp4_occupancy(int fmt, int nt, int unroll, int sw, int warps, int splits) {
  const void* fn = qfp4::pick(fmt, nt, unroll, sw);
  if (fn == nullptr) return -1;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, warps * 32,
                                                    qfp4::smem_bytes(nt, warps, splits, sw)))
    return -1;
  return blocks;
}

// Registers and local-memory bytes per thread of one variant (-1 on error).
extern "C" int qfp4_attributes(int fmt, int nt, int unroll, int sw, int* regs, int* local_bytes) {
  return qfp4::kernel_attributes(qfp4::pick(fmt, nt, unroll, sw), regs, local_bytes);
}
