// Decode attention (one new token per row, GQA) with mma.sync: softmax(q·Kᵀ·scale + bias)·V over cache slots
// [0, S), one CTA per (row, KV head) over all keys -- for decode batches with enough (row, KV head) pairs to fill the
// GPU without splitting the keys (qerl.kernels.cuda_attn.usable; below that the Triton split kernel + combine runs).
// A version that split the keys too (partials merged by a second launch, or by the last CTA of each pair) measured
// no faster than Triton's at small batches, where a launch's fixed cost, not the bytes, sets the time
// (benchmarks/NOTES.md, session 18).
//
// Each warp streams its own 16-key subtiles through a ring of NST shared-memory stages with cp.async (no CTA barrier
// in the main loop), so a CTA has up to 4·NST subtiles (NST·32 KB) in flight from its first instruction; and under
// programmatic dependent launch the first stages are requested *before* griddepcontrol.wait: the previous kernel
// (RoPE + cache write) writes only q and cache slot `slot`, so every other key is already final. The slot's K and V
// rows, if they fall into a stage requested early, are skipped then and stored from registers after the wait.
//
// Per warp and subtile (16 keys): scores (16 head rows × 16 keys) = Q (16 × D, the G ≤ 16 heads of the KV group,
// zero rows above G) · Kᵀ as 2·D/16 m16n8k16 MMAs (K fragments by ldmatrix from the swizzled stage), an online
// softmax in the log2 domain (fp32; scores clamped to NEG as the Triton kernel does), then O (16 × D) += P · V with
// P's accumulator fragments reused as the A operand (bf16) and V by ldmatrix.trans: D/8 MMAs. The 4 warps' states are
// merged through shared memory at the end. Rounding points are the Triton kernel's: fp32 scores and sums, P rounded to
// bf16 for the P·V product, fp32 accumulators.
#include "fp4_mma_common.cuh"  // the bf16 mma.sync and the cp.async helpers

namespace qattn {

using qfp4::cp_async16;
using qfp4::cp_async_commit;
using qfp4::cp_async_wait;
using qfp4::mma_bf16;

constexpr int kWarps = 4;
constexpr int kKeys = 16;  // keys per subtile: one MMA k-step of P·V
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNeg = -1.0e30f;  // qerl.kernels.fused_triton.NEG: finite "minus infinity"

template <int D>
struct Stage {  // one warp's subtile: K and V rows (swizzled 16-byte units), the keys' bias
  static constexpr int kUnits = D / 8;  // 16-byte units per row
  static constexpr int kRow = D * 2;    // bytes per row
  static constexpr int kK = 0, kV = kKeys * kRow, kBias = 2 * kKeys * kRow;
  static constexpr int kBytes = kBias + kKeys * 4;
};

template <int NST, int D>
constexpr int smem_bytes() {
  constexpr int ring = kWarps * NST * Stage<D>::kBytes;
  constexpr int merge = kWarps * (16 * D + 32) * 4;  // per warp: acc (16 × D), m (16), l (16), fp32
  return ring > merge ? ring : merge;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp4(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte offset of 16-byte unit u of row r inside a K or V block (unit u stored at u ^ (r & 7): the 8 rows an
// ldmatrix reads at one unit hit 8 different bank groups).
template <int D>
__device__ __forceinline__ int swz(int r, int u) {
  return r * Stage<D>::kRow + ((u ^ (r & 7)) << 4);
}

struct Args {
  const __nv_bfloat16* q;   // (M, H, D)
  const __nv_bfloat16* kc;  // (M, HKV, S_max, D)
  const __nv_bfloat16* vc;
  const float* bias;        // (M, S_max): 0 valid, -inf masked
  const long long* slot;    // the cache slot the previous launch wrote (nullptr: load everything after the wait)
  __nv_bfloat16* o;         // (M, H·D)
  __nv_bfloat16* op;        // nullptr, or (M, H·D): o again in the FP4 wgmma GEMM's K permutation (its next reader)
  int hkv, g, s, s_max;
  float qk_scale;           // scale · log2(e)
};

// grid (M·HKV), kWarps warps: a CTA per (row, KV head) over all S keys.
template <int NST, int D>
__global__ void __launch_bounds__(kWarps * 32) decode_attn_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  using St = Stage<D>;
  constexpr int U = St::kUnits;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int pid = blockIdx.x;
  const int row = pid / a.hkv;
  const int start = 0, stop = a.s;
  const int nsub = (stop - start + kKeys - 1) / kKeys;
  const int mine = nsub > warp ? (nsub - warp + kWarps - 1) / kWarps : 0;  // subtiles warp, warp + 4, ...
  const long long base = (long long)pid * a.s_max;
  const __nv_bfloat16* kg = a.kc + base * D;
  const __nv_bfloat16* vg = a.vc + base * D;
  const float* bg = a.bias + (long long)row * a.s_max;
  unsigned char* ring = smem + warp * NST * St::kBytes;
  // The slot was written by a launch long finished (before the layer's kernels). A coherent load: ptxas moves
  // griddepcontrol.wait above non-coherent (ld.global.nc) loads, and every early request depends on this value.
  long long slot = -1;
  if (a.slot) asm volatile("ld.global.b64 %0, [%1];" : "=l"(slot) : "l"(a.slot) : "memory");

  // Request subtile i (the warp's i-th) into its ring stage; skip = the slot not to read yet (-1: none).
  auto issue = [&](int i, long long skip) {
    if (i < mine) {
      const int key0 = start + (warp + i * kWarps) * kKeys;
      unsigned char* st = ring + (i % NST) * St::kBytes;
      const uint32_t sk = smem_u32(st + St::kK), sv = smem_u32(st + St::kV);
#pragma unroll
      for (int j = 0; j < kKeys * U / 32; ++j) {
        const int idx = lane + 32 * j, r = idx / U, u = idx % U, key = key0 + r;
        const bool ok = key < stop;
        if (key != skip) {
          const long long off = (long long)(ok ? key : start) * D + u * 8;
          cp_async16(sk + swz<D>(r, u), kg + off, ok);
          cp_async16(sv + swz<D>(r, u), vg + off, ok);
        }
      }
      if (lane < kKeys) {
        const int key = key0 + lane;
        cp4(smem_u32(st + St::kBias + 4 * lane), bg + (key < stop ? key : start), key < stop);
      }
    }
    cp_async_commit();  // always: every iteration's wait counts NST groups
  };

#pragma unroll
  for (int i = 0; i < NST; ++i) issue(i, slot);
  asm volatile("griddepcontrol.wait;" ::: "memory");

  // The slot's rows, if a stage requested above holds them: lanes [0, U) carry K's units, [U, 2U) V's.
  int fresh = -1, fresh_r = 0;
  uint4 fresh_v = make_uint4(0, 0, 0, 0);
  if (slot >= start && slot < stop) {
    const int t = (int)(slot - start) / kKeys;
    if (t % kWarps == warp && t / kWarps < NST) {
      fresh = t / kWarps;
      fresh_r = (int)(slot - start) % kKeys;
      if (lane < 2 * U) {
        const __nv_bfloat16* src = (lane < U ? kg : vg) + slot * D + (lane % U) * 8;
        fresh_v = *reinterpret_cast<const uint4*>(src);
      }
    }
  }

  // Q fragments (A operand, rows = the KV group's heads; rows >= G are zero).
  const int gr = lane >> 2, gc = lane & 3;
  const __nv_bfloat16* qg = a.q + (long long)pid * a.g * D;
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int hr = gr + 8 * h;
      const uint32_t* p = reinterpret_cast<const uint32_t*>(qg + hr * D + kk * 16 + 2 * gc);
      qa[kk][h] = hr < a.g ? p[0] : 0u;      // k 2c, 2c + 1
      qa[kk][h + 2] = hr < a.g ? p[4] : 0u;  // k 2c + 8, 2c + 9
    }
  }
  asm volatile("griddepcontrol.launch_dependents;");

  float acc[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float m0 = kNeg, m1 = kNeg, l0 = 0.f, l1 = 0.f;  // rows gr, gr + 8 (log2 domain)

  for (int i = 0; i < mine; ++i) {
    cp_async_wait<NST - 1>();
    __syncwarp();
    unsigned char* st = ring + (i % NST) * St::kBytes;
    if (i == fresh) {
      if (lane < 2 * U)
        *reinterpret_cast<uint4*>(st + (lane < U ? St::kK : St::kV) + swz<D>(fresh_r, lane % U)) = fresh_v;
      __syncwarp();
    }
    const uint32_t sk = smem_u32(st + St::kK), sv = smem_u32(st + St::kV);
    const int key0 = start + (warp + i * kWarps) * kKeys;
    // scores: n-tile 0 keys 0-7, n-tile 1 keys 8-15
    float sc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    const int mat = lane >> 3, mr = lane & 7;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b0, b1, b2, b3;  // (keys 0-7, units 2kk, 2kk+1), (keys 8-15, ...)
      ldsm_x4(sk + swz<D>((mat >> 1) * 8 + mr, 2 * kk + (mat & 1)), b0, b1, b2, b3);
      mma_bf16(sc[0], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
      mma_bf16(sc[1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b2, b3);
    }
    const float* bs = reinterpret_cast<const float*>(st + St::kBias);
    float mx0 = kNeg, mx1 = kNeg;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int kr = n * 8 + 2 * gc + e;
        const bool ok = key0 + kr < stop;
        const float b = ok ? bs[kr] * kLog2e : kNeg;
        sc[n][e] = fmaxf(fmaf(sc[n][e], a.qk_scale, b), kNeg);
        sc[n][e + 2] = fmaxf(fmaf(sc[n][e + 2], a.qk_scale, b), kNeg);
        mx0 = fmaxf(mx0, sc[n][e]);
        mx1 = fmaxf(mx1, sc[n][e + 2]);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float al0 = exp2f(m0 - n0), al1 = exp2f(m1 - n1);
    m0 = n0;
    m1 = n1;
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[n][e] = exp2f(sc[n][e] - n0);
        sc[n][e + 2] = exp2f(sc[n][e + 2] - n1);
        s0 += sc[n][e];
        s1 += sc[n][e + 2];
      }
    }
    l0 = l0 * al0 + s0;
    l1 = l1 * al1 + s1;
    const uint32_t p0 = pack_bf16(sc[0][0], sc[0][1]), p1 = pack_bf16(sc[0][2], sc[0][3]);
    const uint32_t p2 = pack_bf16(sc[1][0], sc[1][1]), p3 = pack_bf16(sc[1][2], sc[1][3]);
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      acc[j][0] *= al0;
      acc[j][1] *= al0;
      acc[j][2] *= al1;
      acc[j][3] *= al1;
    }
#pragma unroll
    for (int j = 0; j < D / 8; j += 2) {
      uint32_t b0, b1, b2, b3;  // (keys 0-7, unit j), (keys 8-15, unit j), (keys 0-7, unit j+1), (keys 8-15, j+1)
      ldsm_x4_t(sv + swz<D>((mat & 1) * 8 + mr, j + (mat >> 1)), b0, b1, b2, b3);
      mma_bf16(acc[j], p0, p1, p2, p3, b0, b1);
      mma_bf16(acc[j + 1], p0, p1, p2, p3, b2, b3);
    }
    __syncwarp();
    issue(i + NST, -1);
  }
  cp_async_wait<0>();
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  __syncthreads();  // every warp's ring drained: the merge area overlays it

  float* mw = reinterpret_cast<float*>(smem) + warp * (16 * D + 32);  // acc (16 × D), m (16), l (16)
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    *reinterpret_cast<float2*>(mw + gr * D + 8 * j + 2 * gc) = make_float2(acc[j][0], acc[j][1]);
    *reinterpret_cast<float2*>(mw + (gr + 8) * D + 8 * j + 2 * gc) = make_float2(acc[j][2], acc[j][3]);
  }
  if (gc == 0) {
    mw[16 * D + gr] = m0;
    mw[16 * D + gr + 8] = m1;
    mw[16 * D + 16 + gr] = l0;
    mw[16 * D + 16 + gr + 8] = l1;
  }
  __syncthreads();
  const float* ms = reinterpret_cast<const float*>(smem);
  for (int idx = threadIdx.x; idx < a.g * D; idx += kWarps * 32) {
    const int h = idx / D, d = idx % D;
    float mx = kNeg;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, ms[w * (16 * D + 32) + 16 * D + h]);
    float num = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float* b = ms + w * (16 * D + 32);
      const float wt = exp2f(b[16 * D + h] - mx);
      num += wt * b[h * D + d];
      den += wt * b[16 * D + 16 + h];
    }
    const long long at = ((long long)pid * a.g + h) * D;  // row · H + head
    const __nv_bfloat16 v = __float2bfloat16_rn(num / den);
    a.o[at + d] = v;
    if (a.op != nullptr) {  // inside each 64-chunk, d = 16 i + 2 u + e lands at 8 u + 2 i + e (fp4_wgmma_gemm.cu)
      const int r = d & 63;
      a.op[at + (d - r) + ((r >> 1) & 7) * 8 + (r >> 4) * 2 + (r & 1)] = v;
    }
  }
}

template <int NST, int D>
int launch(const Args& a, int rows, int pdl, cudaStream_t stream) {
  constexpr int smem = smem_bytes<NST, D>();
  cudaError_t e = cudaFuncSetAttribute(decode_attn_kernel<NST, D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e != cudaSuccess) return (int)e;
  Args arg = a;
  void* args[] = {(void*)&arg};
  return (int)qfp4::launch_pdl(reinterpret_cast<const void*>(&decode_attn_kernel<NST, D>), dim3(rows),
                               dim3(kWarps * 32), smem, stream, args, pdl != 0);
}

template <int NST>
int launch_d(const Args& a, int d, int rows, int pdl, cudaStream_t stream) {
  if (d == 128) return launch<NST, 128>(a, rows, pdl, stream);
  if (d == 64) return launch<NST, 64>(a, rows, pdl, stream);
  return -1;
}

}  // namespace qattn

// Returns 0, -1 for unsupported arguments, else a cudaError_t. Shapes: q (M, HKV·g, d) contiguous, kc/vc (M, HKV,
// s_max, d) contiguous, bias (M, s_max) fp32 contiguous, o (M, HKV·g·d) bf16, op nullptr or as o (o in the wgmma
// GEMM's K permutation too); d in {64, 128}, 1 <= g <= 16, nst in {2, 3, 4}.
extern "C" int qattn_decode(const void* q, const void* kc, const void* vc, const float* bias, const long long* slot,
                            void* o, void* op, int rows_m, int hkv, int g, int d, int s, int s_max, float scale,
                            int nst, int pdl, void* stream) {
  using namespace qattn;
  if (g < 1 || g > 16 || s < 1 || s > s_max) return -1;
  Args a{static_cast<const __nv_bfloat16*>(q), static_cast<const __nv_bfloat16*>(kc),
         static_cast<const __nv_bfloat16*>(vc), bias, slot, static_cast<__nv_bfloat16*>(o),
         static_cast<__nv_bfloat16*>(op), hkv, g, s, s_max, scale * kLog2e};
  const int rows = rows_m * hkv;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  switch (nst) {
    case 2: return launch_d<2>(a, d, rows, pdl, st);
    case 3: return launch_d<3>(a, d, rows, pdl, st);
    case 4: return launch_d<4>(a, d, rows, pdl, st);
    default: return -1;
  }
}
