// FP4 linears at large M on Hopper's warpgroup MMA with the weight dequantized tile by tile into shared memory inside
// the main loop: the backward's input gradient out (M, K) = g (M, N) @ W (N, K) (BWD) and the forward out (M, N) =
// x (M, K) @ Wᵀ (FWD), with no BF16 copy of the weight in global memory (the path before it, dequantize + cuBLAS,
// wrote and re-read all of Ŵ per call: 2 bytes a weight each way). qerl/kernels/cuda_dq.py launches it.
//
// Why not the forward GEMM's design (fp4_wgmma_gemm.cu: the weight as wgmma's register A operand, decoded straight
// from its loaded words): here the weight is the contraction's (N) side and its scale groups run along the OUTPUT
// (K). A register A fragment of Wᵀ would need, per thread, nibbles of four different weight rows; the re-laid-out
// words hold a row's 16 consecutive columns. So the weight goes through shared memory: each chunk of 64 contraction
// rows (four 16-row strips) x NB output columns is copied in its packed form (the same words and scale pairs as every
// other kernel reads: one resident layout), dequantized by every thread of the CTA into a BF16 tile (the values of
// csrc/fp4_dequant.cu bit for bit: float32 fp4 * scale rounded once), and read by the tensor cores from there as
// the MMA's B operand, MN-major (transpose-B: the tile's rows are contraction rows n, each NB output columns long).
// The A operand is g's tile, K-major (g's rows are contiguous along N), in the 128-byte swizzle. FWD runs the same
// loop over 64-column chunks of the contraction K with NB weight rows a tile: B is then the tile K-major (each weight
// row's 64 columns in its 128 bytes, the token tile's own layout).
//
// A CTA = two warpgroups over 128 token rows (64 each, the MMA's M) x NB output columns (the MMA's N: 128 or 256),
// the contraction in chunks of 64 (four k16 MMAs a chunk). Per chunk, a kStages-deep cp.async ring stages g's tile
// (128 rows x 128 B) and the weight's NB / 16 (strip, chunk) blocks (512 B of words + the scale pairs each); every
// thread waits for its copies, the CTA syncs (barrier A: also, every warpgroup has retired its MMAs of two chunks
// back), refills the stage of two chunks back, dequantizes this chunk's words into one of two BF16 tiles, fences them
// for the async proxy, syncs (barrier B), and issues the chunk's MMAs, keeping one chunk's MMAs in flight
// (wgmma.wait_group 1) while the next chunk is staged and dequantized. The tile's 16-byte unit u of row n lies at
// unit u ^ (n & 7) of the row's 128 bytes (every 64 output columns an 8 KB block): the swizzle the descriptor names.
//
// Splits of the contraction across CTAs (gridDim.z = kz > 1) write fp32 partials to a workspace (kz, M, out width);
// a second launch adds them in split order (deterministic) and rounds once to bf16. Grid: x = token tiles (fastest:
// the CTAs in flight together share a weight tile through L2), y = output column tiles, z = splits. Or stream-K
// (Args::sk > 0, see dq_gemm_kernel and fp4_dq_stream.h): one even range of the (tile, chunk) iterations a CTA, the
// tiles two ranges share added by a second launch in CTA order. CUDA-graph capturable.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdint>

#include "fp4_dq_stream.h"
#include "fp4_mma_common.cuh"
#include "fp4_wgmma_ops.cuh"

// QFP4_DQ_ABLATE (timing only, wrong results; QERL_DQ_ABLATE selects the build): bit 1 leaves the dequantization
// into the tile out (the MMAs read whatever it holds), bit 2 the MMAs, bit 4 the barrier between the dequantization
// and the MMAs. What a part costs is the time it takes away.
#ifndef QFP4_DQ_ABLATE
#define QFP4_DQ_ABLATE 0
#endif
// QFP4_DQ_MMA_DECODE (QERL_DQ_DECODE=mma selects the build): the tile holds the wgmma GEMM's decode (e2m1 x scale x
// 2^(bexp - 126), exact in bf16: one HMUL2 a pair, csrc/fp4_mma_common.cuh's scale_words / bmul2) and the epilogue
// multiplies by 2^(126 - bexp) (/ the NVFP4 global scale): the weight's values are not rounded to bf16, so the result
// differs from dequantize + cuBLAS by that rounding. 0: the exact dequantization (float32 products rounded once to
// bf16, cuda_fp4.dequantize's values bit for bit), ~5 instructions a pair more.
#ifndef QFP4_DQ_MMA_DECODE
#define QFP4_DQ_MMA_DECODE 0
#endif

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QFP4_DQ_WGMMA 1
#else
#define QFP4_DQ_WGMMA 0
#endif

namespace qfp4 {
namespace dq {

// QFP4_DQ_STAGES (QERL_DQ_STAGES selects the build): the plain loop's ring of copied stages, 3 to 6 (6 is the most
// whose shared memory fits with NB = 256); the copies run kStages - 2 chunks ahead of the MMAs
#ifndef QFP4_DQ_STAGES
#define QFP4_DQ_STAGES 4
#endif
constexpr int kStages = QFP4_DQ_STAGES;
static_assert(kStages >= 3, "QFP4_DQ_STAGES: at least 3 (the loop copies kStages - 2 chunks ahead)");
constexpr int kBM = 128;        // token rows a CTA (two warpgroups of 64)
constexpr int kThreads = 256;
constexpr int kGBytes = kBM * 128;  // g's tile a stage: 128 rows of 64 bf16

// a block's scale pairs: 8 rows x (4 | 2) groups x 2 B
template <int FMT>
__host__ __device__ constexpr int scale_bytes() { return FMT == 0 ? 64 : 32; }

template <int FMT, int NB>
struct Smem {
  static constexpr int CB = NB / 64;                      // output chunks a tile
  static constexpr int BLOCKS = 4 * CB;                   // (strip, chunk) blocks a stage
  static constexpr int WOFF = kGBytes;                    // the blocks' words
  static constexpr int SOFF = WOFF + BLOCKS * 512;        // their scale pairs
  static constexpr int STAGE = (SOFF + BLOCKS * scale_bytes<FMT>() + 1023) / 1024 * 1024;
  static constexpr int TILE = 64 * NB * 2;                // one dequantized BF16 tile (64 rows x NB)
  static constexpr int BYTES = kStages * STAGE + 2 * TILE + 1024;  // + the 1024-byte alignment of the base
};
static_assert(Smem<0, 256>::BYTES <= 232448 && Smem<1, 256>::BYTES <= 232448,
              "QFP4_DQ_STAGES: the stages and tiles exceed an sm_90 CTA's 227 KB of shared memory");

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Descriptor (low half) of the MN-major dequantized tile in the 128-byte swizzle: start address >> 4 | the leading
// byte offset (between the tile's 64-column blocks along N: 64 rows x 128 B = 8 KB) >> 4 in bits 16-29. The high half
// is kDescHi's: the stride byte offset (between 8-row groups along the contraction: 1024 B) and the swizzle mode.
__device__ __forceinline__ uint32_t desc_lo_mn(uint32_t saddr) {
  return ((saddr & 0x3FFFFu) >> 4) | ((8192u >> 4) << 16);
}

struct Args {
  const __nv_bfloat16* g;
  long ldg;
  const uint4* qw;         // (S, cs, 32) 16-byte word groups
  const unsigned char* sc;  // (S, cs) blocks of scale pairs
  const float* gs;
  __nv_bfloat16* out;
  long ldo;
  float* ws;  // grid splits (gridDim.z > 1): (kz, M, C) fp32 partials; stream-K (sk): (2 sk, kBM, NB) slots
  int M;
  int R;    // the contraction: the weight's N (BWD) or K (FWD)
  int C;    // output columns: the weight's K (BWD) or N (FWD)
  long cs;  // chunks between strips of the weight (its K / 64, or more for a column slice)
  int sk;   // > 0: stream-K over gridDim.x = sk CTAs (see dq_gemm_kernel); 0: the (tiles, tiles, splits) grid
  uint32_t bword;  // QFP4_DQ_MMA_DECODE: the weight's scale-word bias (cuda_fp4.CudaFP4Weight.bword) ...
  float out_mult;  // ... and accumulator multiplier 2^(126 - bexp)
};

// Unit u (lane u & 31 of block u / 32) of a chunk's packed weight blocks (words at wb: 512 B a block; scale pairs at
// sb) into the BF16 tile at shared address tile: the exact dequantization, or QFP4_DQ_MMA_DECODE's.
template <int FMT, bool HAS_G, int NB, bool FWD>
__device__ __forceinline__ void decode_unit(const unsigned char* wb, const unsigned char* sb, uint32_t tile, int u,
                                            float inv, uint32_t bword) {
  constexpr int SPB = scale_bytes<FMT>();
  constexpr int GPC = FMT == 0 ? 4 : 2;
  constexpr int CB = NB / 64;
  const int lane = u & 31, b = u >> 5, g = lane >> 2, t = lane & 3;
  const uint4 w = *reinterpret_cast<const uint4*>(wb + b * 512 + lane * 16);
  const uint32_t s16 = *reinterpret_cast<const uint16_t*>(sb + b * SPB + 2 * (g * GPC + (FMT == 0 ? t : t >> 1)));
  const uint32_t v[4] = {w.x, w.y, w.z, w.w};
  uint32_t ra[8], rb[8];
#if QFP4_DQ_MMA_DECODE
  uint32_t sg, sg8;
  scale_words<FMT>(s16, bword, sg, sg8);
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // dequant_unit's pairs, scaled as decode_word scales them
    ra[2 * j] = bmul2(v[j] & kMask, sg);
    rb[2 * j] = bmul2(rotr(v[j], 3) & kMask, sg8);
    ra[2 * j + 1] = bmul2(rotr(v[j], 6) & kMask, sg);
    rb[2 * j + 1] = bmul2(((v[j] & kRest) * kSpread) & kMask, sg8);
  }
#else
  float s0, s8;
  row_scales<FMT, HAS_G>(s16, inv, s0, s8);
  dequant_unit(v, s0, s8, ra, rb);
#endif
  // BWD: contraction row 16 (b / CB) + g of the 64-column block b % CB (MN-major); FWD: weight row 16 b + g of the
  // tile (K-major: its 64 contraction columns in the row's 128 bytes). Rows row and row + 8 share (row & 7).
  const int row = FWD ? 16 * b + g : 16 * (b / CB) + g;
  const uint32_t p = tile + (FWD ? 0 : (b % CB) * 8192) + row * 128;
  const uint32_t u0 = ((2 * t) ^ (row & 7)) << 4, u1 = ((2 * t + 1) ^ (row & 7)) << 4;
  st_shared_v4(p + u0, ra[0], ra[1], ra[2], ra[3]);
  st_shared_v4(p + u1, ra[4], ra[5], ra[6], ra[7]);
  st_shared_v4(p + 1024 + u0, rb[0], rb[1], rb[2], rb[3]);
  st_shared_v4(p + 1024 + u1, rb[4], rb[5], rb[6], rb[7]);
}

// A chunk's four k16 MMA steps (both main loops): A = the warpgroup's 64 token rows at descriptor alo (K-major, step
// j 16 columns on: +32 B), B = the BF16 tile at shared address tile (FWD: K-major, step j at +32 B; BWD: MN-major,
// step j 16 contraction rows on: +2 KB). QFP4_DQ_ABLATE bit 2 leaves them out.
template <int NB, bool FWD>
__device__ __forceinline__ void chunk_mmas(float (&acc)[NB / 2], uint32_t alo, uint32_t tile) {
  if constexpr (QFP4_DQ_ABLATE & 2) {
  } else if constexpr (FWD) {
    const uint32_t blo = desc_lo(tile);
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_ss<NB>(acc, alo + 2 * j, kDescHi, blo + 2 * j, kDescHi);
  } else {
    const uint32_t blo = desc_lo_mn(tile);
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_ss_tb<NB>(acc, alo + 2 * j, kDescHi, blo + 128 * j, kDescHi);
  }
}

// The tile's epilogue (warpgroup wg's 64 rows of the 128-row token tile tm, column tile tc): the mma decode's
// multiplier, then bf16 into out (fdst null) or fp32 into fdst (the tile's element (0, 0); row stride fld), rows
// below M only.
template <bool HAS_G, int NB>
__device__ __forceinline__ void epilogue(const Args& a, float (&acc)[NB / 2], int wg, int tm, int tc, float inv,
                                         float* fdst, long fld) {
  const int m0 = tm * kBM, col0 = tc * NB;
  const int lane = threadIdx.x & 31;
#if QFP4_DQ_MMA_DECODE
  {  // the decode's exponent offset and the global scale, once a tile (linear: partials may carry it)
    const float mult = HAS_G ? a.out_mult / inv : a.out_mult;
#pragma unroll
    for (int i = 0; i < NB / 2; ++i) acc[i] *= mult;
  }
#endif
  // acc[4 i + e]: row 64 wg + 16 warp + g + 8 (e >> 1), column 8 i + 2 t + (e & 1) of the tile
  const int w4 = (threadIdx.x >> 5) & 3, g = lane >> 2, t = lane & 3;
  const int rl = 64 * wg + 16 * w4 + g, r0 = m0 + rl;  // the tile's row, the output's
  if (fdst == nullptr) {
#pragma unroll
    for (int i = 0; i < NB / 8; ++i) {
      const int c = col0 + 8 * i + 2 * t;
      if (r0 < a.M)
        *reinterpret_cast<__nv_bfloat162*>(a.out + (long)r0 * a.ldo + c) =
            __floats2bfloat162_rn(acc[4 * i], acc[4 * i + 1]);
      if (r0 + 8 < a.M)
        *reinterpret_cast<__nv_bfloat162*>(a.out + (long)(r0 + 8) * a.ldo + c) =
            __floats2bfloat162_rn(acc[4 * i + 2], acc[4 * i + 3]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < NB / 8; ++i) {
      const int c = 8 * i + 2 * t;
      if (r0 < a.M) *reinterpret_cast<float2*>(fdst + (long)rl * fld + c) = make_float2(acc[4 * i], acc[4 * i + 1]);
      if (r0 + 8 < a.M)
        *reinterpret_cast<float2*>(fdst + (long)(rl + 8) * fld + c) = make_float2(acc[4 * i + 2], acc[4 * i + 3]);
    }
  }
}

// One output tile (token tile tm, column tile tc) over contraction chunks [c_begin, c_begin + nck): the main loop
// described at the top, then the epilogue: bf16 into out (fdst null) or fp32 into fdst (the tile's element (0, 0);
// row stride fld), rows below M only.
template <int FMT, bool HAS_G, int NB, bool FWD>
__device__ __forceinline__ void dq_tile(const Args& a, uint32_t sbase, unsigned char* gbase, int tm, int tc,
                                        int c_begin, int nck, float* fdst, long fld) {
  using L = Smem<FMT, NB>;
  constexpr int SPB = scale_bytes<FMT>();
  const uint32_t tbase = sbase + kStages * L::STAGE;  // the two BF16 tiles

  const int tid = threadIdx.x, wg = tid >> 7;
  const int m0 = tm * kBM;  // the tile's first token row
  const int oc0 = tc * L::CB;               // BWD: its first output chunk
  const int os0 = tc * (NB / 16);           // FWD: its first weight strip

  // g's staging: thread tid copies unit tid & 7 of rows tid / 8 + 32 j (j < 4); (row & 7) == ((tid >> 3) & 7)
  const int gu = tid & 7, gr = tid >> 3;
  const __nv_bfloat16* gsrc = a.g + (long)min(m0 + gr, a.M - 1) * a.ldg + 8 * gu + 64L * c_begin;
  const uint32_t gdst = gr * 128 + ((gu ^ (gr & 7)) << 4);
  auto stage = [&](int idx) {
    const uint32_t st = sbase + (idx % kStages) * L::STAGE;
    const long off = 64L * idx;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      cp_async16(st + gdst + j * 32 * 128, gsrc + off + (long)j * 32 * a.ldg, m0 + gr + 32 * j < a.M);
    // block b: BWD strip 4 (chunk) + b / CB of the contraction, output chunk oc0 + b % CB; FWD strip os0 + b of the
    // output, contraction chunk c_begin + idx
    auto block = [&](int b) -> long {
      return FWD ? (long)(os0 + b) * a.cs + c_begin + idx
                 : (long)(4 * (c_begin + idx) + b / L::CB) * a.cs + oc0 + b % L::CB;
    };
#pragma unroll
    for (int u = tid; u < L::BLOCKS * 32; u += kThreads)
      cp_async16(st + L::WOFF + (u >> 5) * 512 + (u & 31) * 16, a.qw + block(u >> 5) * 32 + (u & 31), true);
    constexpr int SU = SPB / 16;  // 16-byte units of a block's scale pairs
    if (tid < L::BLOCKS * SU) cp_async16(st + L::SOFF + tid * 16, a.sc + block(tid / SU) * SPB + (tid % SU) * 16, true);
  };
  const float inv = HAS_G ? *a.gs : 1.0f;
  auto dequant = [&](int idx) {
    const unsigned char* st = gbase + (idx % kStages) * L::STAGE;
    const uint32_t tile = tbase + (idx & 1) * L::TILE;
#pragma unroll
    for (int u = tid; u < L::BLOCKS * 32; u += kThreads)
      decode_unit<FMT, HAS_G, NB, FWD>(st + L::WOFF, st + L::SOFF, tile, u, inv, a.bword);
  };

  float acc[NB / 2];
#pragma unroll
  for (int i = 0; i < NB / 2; ++i) acc[i] = 0.f;
#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) {
    if (s < nck) stage(s);
    cp_async_commit();
  }
#pragma unroll
  for (int i = 0; i < NB / 2; ++i) fence_reg(acc[i]);
  for (int idx = 0; idx < nck; ++idx) {
    cp_async_wait<kStages - 3>();  // this thread's copies of chunk idx have landed
    fence_proxy_async();
    __syncthreads();  // (A) every thread's; and chunk idx - 2's MMAs are retired in both warpgroups
    if (idx + kStages - 2 < nck) stage(idx + kStages - 2);  // into chunk idx - 2's stage
    cp_async_commit();
    if constexpr (!(QFP4_DQ_ABLATE & 1)) dequant(idx);  // into the tile chunk idx - 2's MMAs read
    fence_proxy_async();
    if constexpr (!(QFP4_DQ_ABLATE & 4)) __syncthreads();  // (B) the tile is whole
    const uint32_t alo = desc_lo(sbase + (idx % kStages) * L::STAGE + wg * 64 * 128);
    wgmma_fence();
    chunk_mmas<NB, FWD>(acc, alo, tbase + (idx & 1) * L::TILE);
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
#pragma unroll
  for (int i = 0; i < NB / 2; ++i) fence_reg(acc[i]);
  cp_async_wait<0>();

  epilogue<HAS_G, NB>(a, acc, wg, tm, tc, inv, fdst, fld);
}

// The dynamic shared memory's base rounded up to 1024 bytes (the 128-byte swizzle's period): its shared-window
// address and its generic pointer.
__device__ __forceinline__ void smem_base(uint32_t& sbase, unsigned char*& gbase) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  sbase = (raw + 1023u) & ~1023u;
  gbase = smem_raw + (sbase - raw);
}

// Stream-K (a.sk > 0): the iterations (tile, chunk), tile-major with tiles numbered token tile fastest, are cut into
// gridDim.x equal contiguous ranges, CTA b taking [T b / G, T (b + 1) / G) (T = tiles x chunks, G = gridDim.x <= T): no
// wave of partly idle SMs whatever the tile count. A range covers the tail of one tile, whole tiles, the head of
// another: a whole tile is written in bf16 at once; a partial one, always the range's first (slot 0) or last
// (slot 1) segment, goes as fp32 into the CTA's slot 2 b + s of the workspace, and dq_stream_reduce_kernel adds each
// tile's slots in CTA order (deterministic). The grid mode (sk = 0): blockIdx = (token tile, column tile, split).
template <int FMT, bool HAS_G, int NB, bool FWD>
__global__ void __launch_bounds__(kThreads, 1) dq_gemm_kernel(const Args a) {
#if QFP4_DQ_WGMMA
  uint32_t sbase;
  unsigned char* gbase;
  smem_base(sbase, gbase);
  const int nc_all = a.R / 64;
  if (a.sk == 0) {
    const int kz = gridDim.z;
    const int per = (nc_all + kz - 1) / kz;
    const int c_begin = min(nc_all, (int)blockIdx.z * per), nck = min(nc_all, c_begin + per) - c_begin;
    float* fdst = kz > 1 ? a.ws + (long)blockIdx.z * a.M * a.C + (long)blockIdx.x * kBM * a.C + blockIdx.y * NB
                         : nullptr;
    dq_tile<FMT, HAS_G, NB, FWD>(a, sbase, gbase, blockIdx.x, blockIdx.y, c_begin, nck, fdst, a.C);
    return;
  }
  const int tm_n = (a.M + kBM - 1) / kBM;
  const long T = (long)tm_n * (a.C / NB) * nc_all;
  const long i1 = sk_begin(T, gridDim.x, blockIdx.x + 1);
  long i = sk_begin(T, gridDim.x, blockIdx.x);
  for (int seg = 0; i < i1; ++seg) {
    int tile, s, e;
    sk_segment(nc_all, i, i1, tile, s, e);
    const bool whole = s == 0 && e == nc_all;
    float* fdst = whole ? nullptr : a.ws + (2L * blockIdx.x + (seg == 0 ? 0 : 1)) * kBM * NB;
    dq_tile<FMT, HAS_G, NB, FWD>(a, sbase, gbase, tile % tm_n, tile / tm_n, s, e - s, fdst, NB);
    i += e - s;
    __syncthreads();  // every thread is done with the stages and tiles before the next segment refills them
  }
#endif
}

// ---------------------------------------------------------------------------------------------------------------
// QFP4_DQ_WS (QERL_DQ_WS=1 selects the build): the same products warp-specialized. Session 66's ablation of the
// kernel above found its parts adding up (staging skeleton ~1000 µs + decode ~600 + MMAs ~550 at 7B M 2048, against
// cuBLAS's 1300): every thread stages, decodes and multiplies in turn between CTA barriers, so nothing overlaps.
// Here a CTA is three warpgroups. Warpgroup 0 produces: it copies chunk j + 4's tokens and packed weight blocks by
// cp.async into copy slot (j + 4) % 6, then decodes chunk j's blocks (slot j % 6) into BF16 tile j % 2 and arrives on
// the tile's "full" mbarrier. Warpgroups 1 and 2 consume: each waits for "full", issues its 64 token rows' MMAs of
// the chunk (tokens read in place from the copy slot), keeps one chunk of MMAs in flight, and arrives on the previous
// chunk's tile and copy slot "empty" mbarriers once those retired; the producer waits for them before refilling a
// tile or a slot. So chunk j's decode runs while chunk j - 1's MMAs do, and the copies four chunks ahead (session 67
// measured it the same as two ahead, with the tokens in the tile's ring: 0.50-0.57x BF16 against the plain loop's
// 0.56-0.61x; the one decoding warpgroup looks like the critical path). A CTA works through a list of
// (tile, chunk) iterations -- one tile's chunks in the grid mode, an even range of them in stream-K -- the producer
// and the consumers walking the same list, the consumers writing each tile's epilogue as its last chunk retires.
// Same results as the kernel above bit for bit (same decode, same MMA order per output element).
#ifndef QFP4_DQ_WS
#define QFP4_DQ_WS 0
#endif
constexpr int kWsCopies = 6;   // copy slots: a chunk's tokens + packed weight blocks
constexpr int kWsAhead = kWsCopies - 2;  // chunks the copies run ahead of the decode
constexpr int kWsTiles = 2;    // BF16 tiles
constexpr int kWsThreads = 384;

template <int FMT, int NB>
struct WsSmem {
  static constexpr int CB = NB / 64;
  static constexpr int BLOCKS = 4 * CB;
  static constexpr int POFF = kGBytes;                                // a copy slot's packed blocks after its tokens
  static constexpr int SOFF = POFF + BLOCKS * 512;                    // and their scale pairs
  static constexpr int COPY = (SOFF + BLOCKS * scale_bytes<FMT>() + 1023) / 1024 * 1024;  // 21 KB (NB 128) | 25 KB
  static constexpr int TILE = 64 * NB * 2;                            // a BF16 tile: 16 KB | 32 KB
  static constexpr int TOFF = kWsCopies * COPY;                       // the tiles after the copy slots
  static constexpr int BAR = TOFF + kWsTiles * TILE;                  // full[tiles], empty tile[tiles], empty copy[copies]
  static constexpr int BYTES = BAR + (2 * kWsTiles + kWsCopies) * 8 + 1024;
};
static_assert(WsSmem<0, 256>::BYTES <= 232448 && WsSmem<1, 256>::BYTES <= 232448,
              "the warp-specialized loop's copy slots and tiles exceed an sm_90 CTA's 227 KB of shared memory");

// The CTA's iterations: j = 0 .. n - 1 -> (token tile, column tile, chunk); a tile's run of them is a segment.
struct WsWork {
  long i0;   // stream-K: the first global iteration; grid: unused
  int n;     // iterations
  int nc;    // chunks a whole tile
  int tm_n;  // token tiles
  int c0;    // grid: the split's first chunk
  bool sk;
  __device__ __forceinline__ void at(int j, int& tm, int& tc, int& c) const {
    if (sk) {
      const long gi = i0 + j;
      const int tile = (int)(gi / nc);
      tm = tile % tm_n;
      tc = tile / tm_n;
      c = (int)(gi % nc);
    } else {
      tm = blockIdx.x;
      tc = blockIdx.y;
      c = c0 + j;
    }
  }
};

// Before chunk q takes its place in a ring of N (empty mbarriers from empty0, 8 bytes apart): chunk q - N's
// consumers have released it (that place's phase q / N - 1); the first N chunks find it free.
template <int N>
__device__ __forceinline__ void await_free(uint32_t empty0, int q) {
  if (q >= N) mbar_wait(empty0 + (q % N) * 8, ((q / N) - 1) & 1);
}

template <int FMT, bool HAS_G, int NB, bool FWD>
__device__ __forceinline__ void dq_ws(const Args& a, uint32_t sbase, unsigned char* gbase, const WsWork& wk) {
  using L = WsSmem<FMT, NB>;
  constexpr int SPB = scale_bytes<FMT>();
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);  // warp-uniform, provably
  const uint32_t full0 = sbase + L::BAR, etile0 = full0 + kWsTiles * 8, ecopy0 = etile0 + kWsTiles * 8;
  const float inv = HAS_G ? *a.gs : 1.0f;
  if (wg == 0) {  // ------------------------------------------------------------------------- the producer
    const int pt = tid;  // 0 .. 127
    const int gu = pt & 7, gr = pt >> 3;  // token unit gu of rows gr + 16 i (i < 8); (row & 7) == (gr & 7)
    auto issue = [&](int q) {
      int tm, tc, c;
      wk.at(q, tm, tc, c);
      const uint32_t st = sbase + (q % kWsCopies) * L::COPY;
      const int m0 = tm * kBM;
      const __nv_bfloat16* src = a.g + (long)min(m0 + gr, a.M - 1) * a.ldg + 8 * gu + 64L * c;
      const uint32_t dst = st + gr * 128 + ((gu ^ (gr & 7)) << 4);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        cp_async16(dst + i * 16 * 128, src + (long)i * 16 * a.ldg, m0 + gr + 16 * i < a.M);
      auto block = [&](int b) -> long {
        return FWD ? (long)(tc * (NB / 16) + b) * a.cs + c : (long)(4 * c + b / L::CB) * a.cs + tc * L::CB + b % L::CB;
      };
#pragma unroll
      for (int u = pt; u < L::BLOCKS * 32; u += 128)
        cp_async16(st + L::POFF + (u >> 5) * 512 + (u & 31) * 16, a.qw + block(u >> 5) * 32 + (u & 31), true);
      constexpr int SU = SPB / 16;
      if (pt < L::BLOCKS * SU) cp_async16(st + L::SOFF + pt * 16, a.sc + block(pt / SU) * SPB + (pt % SU) * 16, true);
    };
#pragma unroll
    for (int q = 0; q < kWsAhead; ++q) {
      if (q < wk.n) issue(q);
      cp_async_commit();
    }
    for (int j = 0; j < wk.n; ++j) {
      cp_async_wait<kWsAhead - 1>();  // this thread's copies of chunk j have landed
      group_sync(1, 128);  // everyone's
      const int q = j + kWsAhead;
      if (q < wk.n) {
        await_free<kWsCopies>(ecopy0, q);
        issue(q);
      }
      cp_async_commit();
      await_free<kWsTiles>(etile0, j);
      const unsigned char* pk = gbase + (j % kWsCopies) * L::COPY;
      const uint32_t tile = sbase + L::TOFF + (j % kWsTiles) * L::TILE;
      if constexpr (!(QFP4_DQ_ABLATE & 1)) {
#pragma unroll
        for (int u = pt; u < L::BLOCKS * 32; u += 128)
          decode_unit<FMT, HAS_G, NB, FWD>(pk + L::POFF, pk + L::SOFF, tile, u, inv, a.bword);
      }
      fence_proxy_async();  // this thread's tokens (cp.async) and tile stores, for the tensor cores
      mbar_arrive(full0 + (j % kWsTiles) * 8);
    }
    cp_async_wait<0>();
    return;
  }
  // ------------------------------------------------------------------------------------------- the consumers
  const int cw = wg - 1;  // 64 token rows each
  float acc[NB / 2];
  if (wk.n == 0) {  // a grid split past the contraction's end (e.g. 9 chunks in 4 splits of 3): its partial is zero
    if (gridDim.z > 1) {
#pragma unroll
      for (int i = 0; i < NB / 2; ++i) acc[i] = 0.f;
      epilogue<HAS_G, NB>(a, acc, cw, blockIdx.x, blockIdx.y, inv,
                          a.ws + (long)blockIdx.z * a.M * a.C + (long)blockIdx.x * kBM * a.C + blockIdx.y * NB, a.C);
    }
    return;
  }
  auto retire = [&](int q) {  // chunk q's tile and copy slot are free again
    mbar_arrive(etile0 + (q % kWsTiles) * 8);
    mbar_arrive(ecopy0 + (q % kWsCopies) * 8);
  };
  // segment by segment (a tile's run of chunks), the accumulators zeroed before and read after each segment's loop
  // only: touching them on a branch inside the loop made ptxas serialize the MMAs (C7518, session 67)
  for (int j = 0, seg = 0; j < wk.n; ++seg) {
    int tm, tc, c_first;
    wk.at(j, tm, tc, c_first);
    const int len = wk.sk ? min(wk.n - j, wk.nc - c_first) : wk.n;  // grid: the split's chunks, one segment
#pragma unroll
    for (int i = 0; i < NB / 2; ++i) acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < NB / 2; ++i) fence_reg(acc[i]);
    for (int ci = 0; ci < len; ++ci, ++j) {
      mbar_wait(full0 + (j % kWsTiles) * 8, (j / kWsTiles) & 1);
      const uint32_t alo = desc_lo(sbase + (j % kWsCopies) * L::COPY + cw * 64 * 128);
      wgmma_fence();
      chunk_mmas<NB, FWD>(acc, alo, sbase + L::TOFF + (j % kWsTiles) * L::TILE);
      wgmma_commit();
      wgmma_wait<1>();
      if (ci > 0) retire(j - 1);  // chunk j - 1's MMAs have retired
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < NB / 2; ++i) fence_reg(acc[i]);
    retire(j - 1);  // the segment's last chunk
    float* fdst = nullptr;  // whole tile, one split: bf16 into out
    long fld = a.C;
    if (wk.sk) {
      if (!(c_first == 0 && len == wk.nc)) {  // part of a tile: the CTA's slot 0 (first segment) or 1
        fdst = a.ws + (2L * blockIdx.x + (seg == 0 ? 0 : 1)) * kBM * NB;
        fld = NB;
      }
    } else if (gridDim.z > 1) {
      fdst = a.ws + (long)blockIdx.z * a.M * a.C + (long)tm * kBM * a.C + tc * NB;
    }
    epilogue<HAS_G, NB>(a, acc, cw, tm, tc, inv, fdst, fld);
  }
}

template <int FMT, bool HAS_G, int NB, bool FWD>
__global__ void __launch_bounds__(kWsThreads, 1) dq_ws_kernel(const Args a) {
#if QFP4_DQ_WGMMA
  uint32_t sbase;
  unsigned char* gbase;
  smem_base(sbase, gbase);
  using L = WsSmem<FMT, NB>;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kWsTiles; ++s) {
      mbar_init(sbase + L::BAR + s * 8, 128);                   // full: every producer thread
      mbar_init(sbase + L::BAR + (kWsTiles + s) * 8, 256);      // empty tile: every consumer thread
    }
#pragma unroll
    for (int s = 0; s < kWsCopies; ++s) mbar_init(sbase + L::BAR + (2 * kWsTiles + s) * 8, 256);  // empty copy slot
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int nc_all = a.R / 64;
  WsWork wk;
  wk.nc = nc_all;
  wk.tm_n = (a.M + kBM - 1) / kBM;
  wk.sk = a.sk > 0;
  if (!wk.sk) {
    const int kz = gridDim.z;
    const int per = (nc_all + kz - 1) / kz;
    wk.c0 = min(nc_all, (int)blockIdx.z * per);
    wk.n = min(nc_all, wk.c0 + per) - wk.c0;
    wk.i0 = 0;
  } else {
    const long T = (long)wk.tm_n * (a.C / NB) * nc_all;
    wk.i0 = sk_begin(T, gridDim.x, blockIdx.x);
    wk.n = (int)(sk_begin(T, gridDim.x, blockIdx.x + 1) - wk.i0);
    wk.c0 = 0;
  }
  dq_ws<FMT, HAS_G, NB, FWD>(a, sbase, gbase, wk);
#endif
}

// out[r, c .. c + 3] = bf16(s): a reduction's four columns
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* out, long ldo, long r, long c, float4 s) {
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + r * ldo + c);
  o[0] = __floats2bfloat162_rn(s.x, s.y);
  o[1] = __floats2bfloat162_rn(s.z, s.w);
}

// out = bf16(sum over splits z = 0, 1, ... of ws[z]), four columns a thread
__global__ void dq_reduce_kernel(const float* __restrict__ ws, int kz, int M, int K, __nv_bfloat16* __restrict__ out,
                                 long ldo) {
  const long q = (long)blockIdx.x * blockDim.x + threadIdx.x;
  const long total = (long)M * K / 4;
  if (q >= total) return;
  const long e = 4 * q;
  float4 s = *reinterpret_cast<const float4*>(ws + e);
  for (int z = 1; z < kz; ++z) {
    const float4 v = *reinterpret_cast<const float4*>(ws + (long)z * M * K + e);
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
  }
  store_bf16x4(out, ldo, e / K, e % K, s);
}

// Stream-K's second launch: each output element of a tile that more than one CTA covered (four columns a thread) =
// bf16 of the sum of those CTAs' slots in CTA order (see dq_gemm_kernel); tiles one CTA covered whole are skipped.
__global__ void dq_stream_reduce_kernel(const float* __restrict__ ws, int G, long T, int nc, int tm_n, int nb, int M,
                                        int C, __nv_bfloat16* __restrict__ out, long ldo) {
  const long q = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (q >= (long)M * C / 4) return;
  const long e = 4 * q;
  const int r = (int)(e / C), c = (int)(e % C);
  const long j0 = (long)(r / kBM + tm_n * (c / nb)) * nc;  // the tile's first iteration
  const int b_lo = sk_owner(T, G, j0), b_hi = sk_owner(T, G, j0 + nc - 1);  // the CTAs of its first, last
  if (b_lo == b_hi) return;
  const long off = (long)(r % kBM) * nb + c % nb;
  float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int b = b_lo; b <= b_hi; ++b) {
    const int slot = sk_slot(T, G, b, j0);
    const float4 v = *reinterpret_cast<const float4*>(ws + (2L * b + slot) * kBM * nb + off);
    s.x += v.x;
    s.y += v.y;
    s.z += v.z;
    s.w += v.w;
  }
  store_bf16x4(out, ldo, r, c, s);
}

template <int FMT, int NB>
constexpr int smem_bytes() { return QFP4_DQ_WS ? WsSmem<FMT, NB>::BYTES : Smem<FMT, NB>::BYTES; }

// The build's kernel (only it is instantiated)
template <int FMT, bool HAS_G, int NB, bool FWD>
constexpr auto dq_kernel() {
  if constexpr (QFP4_DQ_WS != 0) {
    return dq_ws_kernel<FMT, HAS_G, NB, FWD>;
  } else {
    return dq_gemm_kernel<FMT, HAS_G, NB, FWD>;
  }
}

template <int FMT, bool HAS_G, int NB, bool FWD>
int launch(const Args& a, int kz, cudaStream_t st) {
  constexpr int bytes = smem_bytes<FMT, NB>();
  constexpr auto kernel = dq_kernel<FMT, HAS_G, NB, FWD>();
  static bool ready = false;  // the attribute, once per kernel and process (the launch itself is capturable)
  if (!ready) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    ready = true;
  }
  const int tm_n = (a.M + kBM - 1) / kBM;
  const dim3 grid = a.sk ? dim3(a.sk, 1, 1) : dim3(tm_n, a.C / NB, kz);
  kernel<<<grid, QFP4_DQ_WS ? kWsThreads : kThreads, bytes, st>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || (kz == 1 && !a.sk)) return (int)e;
  const long quads = (long)a.M * a.C / 4;
  if (a.sk) {
    const int nc = a.R / 64;
    dq_stream_reduce_kernel<<<(unsigned)((quads + 255) / 256), 256, 0, st>>>(
        a.ws, a.sk, (long)tm_n * (a.C / NB) * nc, nc, tm_n, NB, a.M, a.C, a.out, a.ldo);
  } else {
    dq_reduce_kernel<<<(unsigned)((quads + 255) / 256), 256, 0, st>>>(a.ws, kz, a.M, a.C, a.out, a.ldo);
  }
  return (int)cudaGetLastError();
}

template <int FMT, bool HAS_G, bool FWD>
int launch_nb(const Args& a, int nb, int kz, cudaStream_t st) {
  return nb == 256 ? launch<FMT, HAS_G, 256, FWD>(a, kz, st) : launch<FMT, HAS_G, 128, FWD>(a, kz, st);
}

template <bool FWD>
int launch_fmt(const Args& a, int fmt, int nb, int kz, cudaStream_t st) {
  if (fmt == 0) return a.gs ? launch_nb<0, true, FWD>(a, nb, kz, st) : launch_nb<0, false, FWD>(a, nb, kz, st);
  return launch_nb<1, false, FWD>(a, nb, kz, st);
}

}  // namespace dq
}  // namespace qfp4

// Shared-memory bytes of a (fmt, nb) kernel (the launch asks for them; > 227 KB would not launch).
extern "C" int qfp4_dq_smem(int fmt, int nb) {
  using namespace qfp4::dq;
  if (fmt == 0) return nb == 256 ? smem_bytes<0, 256>() : smem_bytes<0, 128>();
  return nb == 256 ? smem_bytes<1, 256>() : smem_bytes<1, 128>();
}

// fwd 0: out (M, K) = a (M, N) @ W (N, K) (the backward's input gradient, a = g); fwd 1: out (M, N) = a (M, K) @ Wᵀ
// (the forward, a = x). W is the re-laid-out FP4 weight (N, K): qw (S = N / 16, C, 32, 4) int32 word groups and sc
// (S, C, 8 * groups per chunk) int16 scale pairs whose strips lie cs >= K / 64 chunks apart (a column slice: more),
// gs the NVFP4 global scale (device float) or null. nb: 128 | 256 output columns a CTA (they divide the output
// width); kz: splits of the contraction across CTAs (1 .. its chunks of 64; > 1 needs ws, kz * M * out-width floats);
// sk > 0: stream-K over sk CTAs instead (kz must be 1; sk <= tiles x chunks; ws: 2 * sk * 128 * nb floats).
// a, out: bf16 with unit column stride, row strides multiples of 8, 16-byte aligned. 0, -1 (bad arguments) or a CUDA
// error code. sm_90a only (elsewhere the kernel is empty: the caller checks the device).
extern "C" int qfp4_dq_gemm(const void* act, long lda, const void* qw, const void* sc, const float* gs, void* out,
                            long ldo, void* ws, int M, int N, int K, long cs, int fmt, int nb, int kz, int sk, int fwd,
                            unsigned bword, float out_mult, void* stream) {
  using namespace qfp4::dq;
  const int R = fwd ? K : N, C = fwd ? N : K;
  if (M <= 0 || N % 64 || K % 64 || N <= 0 || K <= 0 || (nb != 128 && nb != 256) || C % nb || kz < 1 ||
      kz > R / 64 || (kz > 1 && !ws) || lda % 8 || ldo % 8 || cs < K / 64 || reinterpret_cast<uintptr_t>(act) % 16 ||
      reinterpret_cast<uintptr_t>(out) % 16 || reinterpret_cast<uintptr_t>(sc) % 16 || (fmt != 0 && fmt != 1))
    return -1;
  if (sk < 0 || (sk > 0 && (kz != 1 || !ws || (long)sk > (long)((M + kBM - 1) / kBM) * (C / nb) * (R / 64))))
    return -1;
  const Args a{static_cast<const __nv_bfloat16*>(act), lda, static_cast<const uint4*>(qw),
               static_cast<const unsigned char*>(sc), gs, static_cast<__nv_bfloat16*>(out), ldo,
               static_cast<float*>(ws), M, R, C, cs, sk, bword, out_mult};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  return fwd ? launch_fmt<true>(a, fmt, nb, kz, st) : launch_fmt<false>(a, fmt, nb, kz, st);
}
