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

// Timing experiments only (benchmarks.dequant_variants builds this file alone with other values; the library's build
// leaves them unset, which compiles exactly the kernel without these switches): QFP4_DQ_CPW chunks per warp (4),
// QFP4_DQ_WARPS warps per CTA (8),
// QFP4_DQ_VEC 1: every 16-byte store as one st.global.v4 in inline PTX (st16; in the library's build the compiler's
// front end splits the first chunk's first store of each row into four 4-byte stores: 24 st.global.u32 beside 42
// st.global.v4.u32 in its PTX, so an eighth of the bytes go out in pieces of 4), QFP4_DQ_LINES 1: each store
// instruction writes whole 128-byte lines (4 rows x 128 bytes) instead of half lines (8 rows x 64 bytes; store_row),
// QFP4_DQ_STCS 1: the stores with the evict-first hint (st.global.cs); LINES and STCS store by st16 too.
// QFP4_DQ_PERSIST N > 0: N CTAs an SM walking the tasks, each warp loading its next task before storing this one.
// QFP4_DQ_BULK 1: a warp writes its task's 16 rows x kCPW chunks into shared memory, then 16 of its lanes hand one
// row each (kCPW * 128 contiguous bytes) to the tensor memory accelerator (cp.async.bulk, shared -> global): no
// store instructions for the data, whole lines; the staging must fit 48 KB of static shared memory (4 warps a CTA).
#ifndef QFP4_DQ_CPW
#define QFP4_DQ_CPW 4
#endif
#ifndef QFP4_DQ_WARPS
#define QFP4_DQ_WARPS 8
#endif
#ifndef QFP4_DQ_LINES
#define QFP4_DQ_LINES 0
#endif
#ifndef QFP4_DQ_STCS
#define QFP4_DQ_STCS 0
#endif
#ifndef QFP4_DQ_PERSIST
#define QFP4_DQ_PERSIST 0
#endif
#ifndef QFP4_DQ_VEC
#define QFP4_DQ_VEC 0
#endif
#ifndef QFP4_DQ_BULK
#define QFP4_DQ_BULK 0
#endif
#if QFP4_DQ_PERSIST > 0  // the registers for the grid's CTAs an SM
#define QFP4_DQ_BOUNDS __launch_bounds__(32 * kWarps, QFP4_DQ_PERSIST)
#else
#define QFP4_DQ_BOUNDS __launch_bounds__(32 * kWarps)
#endif

namespace {

constexpr int kCPW = QFP4_DQ_CPW;       // chunks per warp
constexpr int kWarps = QFP4_DQ_WARPS;   // warps per CTA

#if QFP4_DQ_VEC || QFP4_DQ_LINES || QFP4_DQ_STCS
// One 16-byte store instruction (see QFP4_DQ_VEC), with the evict-first hint under QFP4_DQ_STCS.
__device__ __forceinline__ void st16(__nv_bfloat16* p, const uint32_t (&v)[4]) {
#if QFP4_DQ_STCS
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
#else
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]));
#endif
}
#endif

#if !QFP4_DQ_BULK  // (the bulk variant stages the rows in shared memory instead)
// The four lanes t = 0..3 of a row hold its 128-byte chunk segment as 32 bytes each (lane t: bytes 32 t .. 32 t + 31,
// halves h0, h1). Two butterfly exchanges (xor 1, then xor 2; 8 shuffles) give lane t bytes 16 t .. and 64 + 16 t ..,
// so each of the two 16-byte store instructions writes whole 32-byte sectors (64 contiguous bytes per row) instead
// of half of every sector of the segment. p: the row's chunk segment (16-byte aligned).
#if QFP4_DQ_LINES
__device__ __forceinline__ void store_row(__nv_bfloat16* p, const uint32_t (&w)[8], int t, long ldo) {
#else
__device__ __forceinline__ void store_row(__nv_bfloat16* p, const uint32_t (&w)[8], int t) {
#endif
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
#if !(QFP4_DQ_VEC || QFP4_DQ_LINES || QFP4_DQ_STCS)
  *reinterpret_cast<uint4*>(p + 8 * t) = make_uint4(o1[0], o1[1], o1[2], o1[3]);
  *reinterpret_cast<uint4*>(p + 32 + 8 * t) = make_uint4(o2[0], o2[1], o2[2], o2[3]);
#elif QFP4_DQ_LINES == 0
  st16(p + 8 * t, o1);
  st16(p + 32 + 8 * t, o2);
#else
  // QFP4_DQ_LINES: p is row g & ~1's chunk segment and the row pair (g & ~1, g | 1) of lanes (g, t) and (g ^ 1, t)
  // (lane ^ 4) writes whole lines: this lane holds row g's bytes 16 t .. (o1) and 64 + 16 t .. (o2); the even row's
  // lane keeps o1 and gives o2, the odd row's keeps o2 and gives o1, so one store instruction writes rows
  // 0, 2, 4, 6's 128 bytes (the even lanes bytes 16 t .., the odd ones 64 + 16 t ..) and the next rows 1, 3, 5, 7's.
  const bool odd = (threadIdx.x >> 2) & 1;
  uint32_t e0[4], e1[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint32_t r = __shfl_xor_sync(0xFFFFFFFFu, odd ? o1[k] : o2[k], 4);
    e0[k] = odd ? r : o1[k];
    e1[k] = odd ? o2[k] : r;
  }
  const int col = 8 * t + (odd ? 32 : 0);
  st16(p + col, e0);
  st16(p + ldo + col, e1);
#endif
}

#endif

// One warp's task: strip s, chunks c0 .. c0 + nc - 1 (nc <= kCPW), this lane's words and scale pairs of them.
struct Task {
  uint4 w[kCPW];
  uint32_t pr[kCPW];
  int s, c0, nc;
};

template <int FMT>
__device__ __forceinline__ void load_task(Task& k, long task, int cb, int C, long cs, const uint4* __restrict__ qw,
                                          const uint16_t* __restrict__ sc, int lane) {
  constexpr int GPC = FMT == 0 ? 4 : 2;  // scale groups per 64-column chunk (G = 16 / 32)
  const int g = lane >> 2, t = lane & 3;
  k.s = (int)(task / cb);
  k.c0 = (int)(task % cb) * kCPW;
  k.nc = min(kCPW, C - k.c0);
  const long blk0 = (long)k.s * cs + k.c0;  // cs: the source's chunks per strip (C, or more for a column slice)
#pragma unroll
  for (int i = 0; i < kCPW; ++i) {
    if (i < k.nc) {
      k.w[i] = qfp4::ld_stream(qw + (blk0 + i) * 32 + lane);
      k.pr[i] = qfp4::ld_stream_u16(sc + (blk0 + i) * (8 * GPC) + g * GPC + (FMT == 0 ? t : t >> 1));
    }
  }
}

// Chunk i of task k, dequantized: rows g (a) and g + 8 (b), columns 16 t .. 16 t + 15 of the chunk in order as 8 bf16
// pairs (word j of the lane's group: columns 4 j + {0, 1}, {2, 3}).
template <int FMT, bool HAS_G>
__device__ __forceinline__ void decode_chunk(const Task& k, int i, float inv, uint32_t (&a)[8], uint32_t (&b)[8]) {
  float s0, s8;
  qfp4::row_scales<FMT, HAS_G>(k.pr[i], inv, s0, s8);
  const uint32_t v[4] = {k.w[i].x, k.w[i].y, k.w[i].z, k.w[i].w};
  qfp4::dequant_unit(v, s0, s8, a, b);
}

#if QFP4_DQ_BULK
constexpr int kRowBytes = kCPW * 128;     // one row's bytes of a task
constexpr int kRowPitch = kRowBytes + 16;  // its pitch in the staging (rows g of a store instruction in other banks)
static_assert(kWarps * 16 * kRowPitch <= 48 * 1024,
              "QFP4_DQ_BULK: the warps' staging must fit 48 KB of static shared memory (fewer warps or chunks)");

// Task k's rows by bulk copies: the lanes' decoded pieces into this warp's staging (row g at byte 32 t of each chunk),
// visible to the async proxy, then lane r < 16 copies row r's nc * 128 bytes to out. The previous task's copies have
// read the staging before it is written again (wait_group.read by the lanes that issued them).
template <int FMT, bool HAS_G>
__device__ __forceinline__ void store_task(const Task& k, float inv, __nv_bfloat16* __restrict__ out, long ldo,
                                           int lane) {
  __shared__ alignas(16) unsigned char staging[kWarps][16][kRowPitch];
  unsigned char* mine = &staging[threadIdx.x >> 5][0][0];
  const int g = lane >> 2, t = lane & 3;
  if (lane < 16) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kCPW; ++i) {
    if (i < k.nc) {
      uint32_t a[8], b[8];
      decode_chunk<FMT, HAS_G>(k, i, inv, a, b);
      unsigned char* ra = mine + g * kRowPitch + i * 128 + 32 * t;
      unsigned char* rb = ra + 8 * kRowPitch;
      reinterpret_cast<uint4*>(ra)[0] = make_uint4(a[0], a[1], a[2], a[3]);
      reinterpret_cast<uint4*>(ra)[1] = make_uint4(a[4], a[5], a[6], a[7]);
      reinterpret_cast<uint4*>(rb)[0] = make_uint4(b[0], b[1], b[2], b[3]);
      reinterpret_cast<uint4*>(rb)[1] = make_uint4(b[4], b[5], b[6], b[7]);
    }
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncwarp();
  if (lane < 16) {
    const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(mine + lane * kRowPitch));
    __nv_bfloat16* dst = out + (long)(16 * k.s + lane) * ldo + 64L * k.c0;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(k.nc * 128)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  }
}
#else
template <int FMT, bool HAS_G>
__device__ __forceinline__ void store_task(const Task& k, float inv, __nv_bfloat16* __restrict__ out, long ldo,
                                           int lane) {
  const int g = lane >> 2, t = lane & 3;
  __nv_bfloat16* r0 = out + (long)(16 * k.s + g) * ldo + 64L * k.c0;
  __nv_bfloat16* r8 = r0 + 8 * ldo;
#pragma unroll
  for (int i = 0; i < kCPW; ++i) {
    if (i < k.nc) {
      uint32_t a[8], b[8];
      decode_chunk<FMT, HAS_G>(k, i, inv, a, b);
#if QFP4_DQ_LINES
      store_row(r0 - (g & 1) * ldo + 64 * i, a, t, ldo);  // from row g & ~1 (see store_row)
      store_row(r8 - (g & 1) * ldo + 64 * i, b, t, ldo);
#else
      store_row(r0 + 64 * i, a, t);
      store_row(r8 + 64 * i, b, t);
#endif
    }
  }
}
#endif

template <int FMT, bool HAS_G>
__global__ void QFP4_DQ_BOUNDS dequant_kernel(const uint4* __restrict__ qw, const uint16_t* __restrict__ sc,
                                              const float* __restrict__ gs, __nv_bfloat16* __restrict__ out,
                                              long ldo, int S, int C, long cs) {
  const int lane = threadIdx.x & 31;
  const int cb = (C + kCPW - 1) / kCPW;  // chunk batches per strip
  const long total = (long)S * cb;
  long task = (long)blockIdx.x * kWarps + (threadIdx.x >> 5);
  if (task >= total) return;
  Task k;
  load_task<FMT>(k, task, cb, C, cs, qw, sc, lane);
  const float inv = HAS_G ? *gs : 1.0f;
#if QFP4_DQ_PERSIST
  // QFP4_DQ_PERSIST: a grid of QFP4_DQ_PERSIST CTAs an SM whose warps walk the tasks (stride: all the grid's warps),
  // each loading its next task's words before it decodes and stores the current one's.
  const long stride = (long)gridDim.x * kWarps;
  for (;;) {
    Task n;
    const long next = task + stride;
    if (next < total) load_task<FMT>(n, next, cb, C, cs, qw, sc, lane);
    store_task<FMT, HAS_G>(k, inv, out, ldo, lane);
    if (next >= total) break;
    k = n;
    task = next;
  }
#else
  store_task<FMT, HAS_G>(k, inv, out, ldo, lane);
#endif
#if QFP4_DQ_BULK
  if (lane < 16) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the copies done before the CTA ends
#endif
}

template <int FMT, bool HAS_G>
int launch(const void* qw, const void* sc, const float* gs, void* out, long ldo, int S, int C, long cs,
           cudaStream_t st) {
  const long tasks = (long)S * ((C + kCPW - 1) / kCPW);
  long grid = (tasks + kWarps - 1) / kWarps;
  if (grid <= 0) return 0;
  if (grid >= (1L << 31)) return -1;
#if QFP4_DQ_PERSIST
  static int sms = 0;
  if (!sms) {
    int dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  }
  grid = min(grid, (long)QFP4_DQ_PERSIST * sms);
#endif
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
