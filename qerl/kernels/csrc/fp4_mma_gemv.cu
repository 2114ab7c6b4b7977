// W4A16 decode GEMV for NVFP4 / MXFP4 weights on tensor cores (mma.sync m16n8k16, bf16 in, fp32 acc), and the
// same kernel over a dense BF16 weight (FMT = 2, the BF16 baseline's decode products; see "BF16 weights" below).
//
// out (M, N) = x (M, K) @ W^T for M <= 16. W is re-laid out once by qerl/kernels/fp4_layout.py (prepare) so that
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
// BF16 weights (FMT = 2): W (N, K) row-major as stored (no re-layout, no second copy), strip = 16 rows, chunk = 64
//   K. Lane (g, t) reads 16 contiguous bf16 of rows g and g+8 at k = 64c + 16t (four 128-bit loads; the four lanes of
//   a row cover 128 contiguous bytes), i.e. the same K permutation as the FP4 chunks: register 2j / 2j+1 of a row's 8
//   words is MMA step j's A register 0 (1 for row g+8) / 2 (3); no scales, the accumulator is the result.
//
// Split-K inside the CTA: each strip is worked on by `splits` warps (contiguous K ranges), partial sums are
// reduced through shared memory, so one launch, no workspace, no atomics: CUDA-graph capturable.
//
// LoRA in the same launch (optional, `LoraArgs`): out = x W^T + bf16(x A^T) Bn^T with A (R, K) bf16 (the group's
// stacked lora_A) and Bn (N, RP) bf16 (scaling * lora_B of the row's member, zero past its rk ranks; member i's
// rows use ranks [roff_i, roff_i + rk_i) of t). The first `nlora` CTAs compute t = x A^T split over K: CTA = one
// 16-rank strip x one K part (A rows are a bf16 "weight" fed to the same m16n8k16 MMA with the same K permutation
// as the FP4 chunks; its warps take ~2 chunks each: lora_parts), reduce in shared memory and write one fp32 partial. With few
// parts per strip (`direct`) they count themselves done and the output warps sum the parts; with more, the last
// CTA of a strip to finish (a per-strip counter) sums the strip's partials into its finished t and counts the strip
// done — either way in part order (deterministic: no floating-point atomics). The other CTAs prefetch their Bn rows
// into L2 during the main loop; after it their split-0 warps load their Bn words, wait for the count, load the t
// values of their own MMA fragments straight from global memory (no shared memory, no CTA barrier), and add the
// LoRA term with one more m16n8k16 per 16 ranks on their accumulators (A = Bn rows, B = bf16(t)), before the split-K
// reduction and the one bf16 rounding. The counters are left zero for the next launch (each strip's by its last
// CTA, the count by the last output CTA). Waiting relies on CTAs being dispatched in blockIdx order (as CUB's
// decoupled look-back does): the LoRA CTAs, lowest in blockIdx, are resident before any CTA that waits for them.

#include <algorithm>
#include <type_traits>

#include "fp4_mma_common.cuh"

// QFP4_DENSE_SECTOR (the build's -D, set by QERL_BF16_LOADS=sector, the default since session 43): the BF16 weight's four
// 128-bit loads of a lane and (strip, chunk) read, per load instruction, whole 32-byte sectors: lane (g, t) holds
// k = 64 c + 8 t + 0..7 (words 0 / 2 of rows g / g + 8) and 64 c + 32 + 8 t + 0..7 (words 1 / 3), so the four lanes
// of a row read 64 contiguous bytes per instruction, and its x fragment the same two 16-byte pieces. With 0
// (QERL_BF16_LOADS=pair, session 34's loads) a lane holds the 16 contiguous bf16 at 64 c + 16 t (as the FP4 chunks are laid out), so each of its two loads a
// row covers every other 16 bytes of the row's 128 and each 32-byte sector is requested by two instructions. Same
// products per chunk, summed in another order (not bit-identical to the default; both within the float64 bound of
// test_gpu_bf16_gemv_every_config_lora_epilogue_graphs). The FP4 formats and the LoRA CTAs are unchanged.
#ifndef QFP4_DENSE_SECTOR
#define QFP4_DENSE_SECTOR 0
#endif

// QFP4_LORA_ABLATE (timing experiments only, benchmarks/lora_gemv_bench.py --ablate: a module of its own that nothing
// else loads; its results are WRONG): bits that leave one part of the LoRA in the launch out, to measure what it
// costs. 1: the output warps add no LoRA term (no Bn prefetch or loads, no wait, no t loads, no MMA); 2: the LoRA CTAs
// only count themselves done (after their PDL wait: no x or A loads, no MMAs, no partials); 4: the output warps do
// not wait for the count (they read t whenever they get there); 8 (session 45): the output warps add the term before
// their main loop, without waiting (t whatever the workspace holds): with 2, what the launch would cost if the kernel
// before it had written t (no LoRA CTA work, no wait, the term's loads beside the first batch's). 0, the library's
// build, compiles exactly the kernel without these lines. Measured on an H200: raw/h200_s44_lora (session 44);
// raw/h200_s46_lora44 (session 46: with 10 the 7B layer at M = 8 is only ~3.5 us faster than the default's ~65).
// (Session 46 removed two refuted opt-ins on how the output warps learn that t is ready, QFP4_LORA_EARLY_POLL and
// QFP4_LORA_TAG, and QFP4_LORA_A_L2's prefetch of A; their code is at 6624238.)
#ifndef QFP4_LORA_ABLATE
#define QFP4_LORA_ABLATE 0
#endif


namespace qfp4 {

// 128-bit weight words per lane and (strip, chunk): one for FP4 (16 rows x 64 K x 4 bits = 512 bytes a warp), four
// for BF16 (2 KB a warp).
template <int FMT>
__host__ __device__ constexpr int wwords() { return FMT == 2 ? 4 : 1; }

// Warps per CTA at most: 16 while a warp keeps <= 4 weight words per batch (<= 128 registers), else 8.
template <int U, int SW, int WN = 1>
constexpr int max_warps() { return U * SW * WN >= 8 ? 8 : 16; }

template <int NT>
struct XFrag {
  uint32_t r[NT][8];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 8; ++e) r[nt][e] = 0u;
  }
};

constexpr int kLoraMaxUnits = 512;   // LoRA CTAs per launch: la.part holds 512 x 16 x 16 fp32 partials, then
constexpr int kLoraMaxStrips = 24;   // the finished t of up to 24 16-rank strips (384 ranks)
constexpr int kLoraDirectParts = 4;  // parts per strip up to which the output warps sum them (one hop less)


struct LoraArgs {
  const __nv_bfloat16* a;   // (R, K) row-major; nullptr: no LoRA
  const __nv_bfloat16* bn;  // (N, rp) row-major: row n = its member's scaling * lora_B row, zero past rk
  float* part;              // (kLoraMaxUnits + kLoraMaxStrips, 16 tokens, 16 ranks) fp32: partials, finished t
  unsigned* ctr;            // [0] strips of t finished, [1] output CTAs done, [2 + s] parts of strip s done: zero
                            // on entry, left zero
  int R, rp, parts, nlora;  // ranks, Bn row length (multiple of 16), K parts per 16-rank strip, LoRA CTAs
  int direct;               // 1: the output warps sum the parts (one strip per warp, parts <= kLoraDirectParts);
                            // 0: each strip's last LoRA CTA does
  int bound1, bound2;       // output rows where members 1 and 2 start (N when absent)
  int roff[3], rk[3];       // first rank and rank count of each member (member rows are multiples of 16)
};

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// x fragment of the chunk at p (16 bf16 of token g, and of token g+8 for NT = 2: the 8 at p and the 8 at p + X2, 8
// unless QFP4_DENSE_SECTOR's dense chunks); rows >= M keep stale values, which only reach output columns that are
// never stored.
template <int NT, int X2 = 8>
__device__ __forceinline__ void load_x(XFrag<NT>& f, const __nv_bfloat16* p, int ldx8, bool v0, bool v1) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    if (nt == 0 ? v0 : v1) {
      const uint4 a = ld_x(p + nt * ldx8), b = ld_x(p + nt * ldx8 + X2);
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

// One K chunk of one strip of a BF16 weight (or of LoRA A): w[0..1] the lane's 16 bf16 of row g, w[2..3] of row
// g+8 (see "BF16 weights" above).
template <int NT, int A2>
__device__ __forceinline__ void chunk_mma_dense(float (&acc)[A2][NT][4], const uint4 (&w)[4], const XFrag<NT>& xf) {
  const uint32_t w0[8] = {w[0].x, w[0].y, w[0].z, w[0].w, w[1].x, w[1].y, w[1].z, w[1].w};
  const uint32_t w1[8] = {w[2].x, w[2].y, w[2].z, w[2].w, w[3].x, w[3].y, w[3].z, w[3].w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      mma_bf16(acc[j % A2][nt], w0[2 * j], w1[2 * j], w0[2 * j + 1], w1[2 * j + 1], xf.r[nt][2 * j],
               xf.r[nt][2 * j + 1]);
}

// One thread of a finished output CTA counts it done. The last one (every one has passed its wait by then) resets the
// counters for the next launch.
__device__ __forceinline__ void lora_count_done(const LoraArgs& la) {
  const unsigned ctas = gridDim.x - la.nlora;
  if (atomicAdd(la.ctr + 1, 1u) == ctas - 1) {
    la.ctr[0] = 0u;
    la.ctr[1] = 0u;
  }
}

// A LoRA CTA: CTA c takes 16-rank strip c / parts and K part c % parts; its warps split the part's chunks (two in
// flight), reduce through shared memory into one partial la.part[c] (16 tokens x 16 ranks). Direct: it counts itself
// done and the output warps sum the parts (the chain from the launch to the LoRA term: the A loads, one reduction,
// one counter update). Otherwise the strip's last CTA sums the parts into the strip's finished t and counts it.
template <int NT>
__device__ __forceinline__ void lora_cta(const LoraArgs& la, const __nv_bfloat16* __restrict__ x, int ldx, int M,
                                         int C, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int K = 64 * C;
  const int rs = blockIdx.x / la.parts, p = blockIdx.x - rs * la.parts;
#if QFP4_LORA_ABLATE & 2
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // the counters are the previous launch's until it completes (its last output CTA zeroes them)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (threadIdx.x == 0 && (la.direct || p == 0)) atomicAdd(la.ctr, 1u);  // the count the output warps wait for
  return;
#endif
  const int p0 = p * C / la.parts, p1 = (p + 1) * C / la.parts;
  const int c0 = p0 + warp * (p1 - p0) / warps, c1 = p0 + (warp + 1) * (p1 - p0) / warps;
  const int r0 = rs * 16 + g, r1 = r0 + 8;
  const bool v0 = r0 < la.R, v1 = r1 < la.R;
  const __nv_bfloat16* a0p = la.a + (size_t)(v0 ? r0 : 0) * K + 16 * t;
  const __nv_bfloat16* a1p = la.a + (size_t)(v1 ? r1 : 0) * K + 16 * t;
  const __nv_bfloat16* xq = x + (size_t)g * ldx + 16 * t;
  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
  XFrag<NT> xf[2];
  xf[0].zero();
  xf[1].zero();
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
  uint4 w[2][4];
  auto load_a = [&](int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool ok = c + h < c1;
      const int off = 64 * (c + h);
      w[h][0] = ok && v0 ? ld_x(a0p + off) : z;
      w[h][1] = ok && v0 ? ld_x(a0p + off + 8) : z;
      w[h][2] = ok && v1 ? ld_x(a1p + off) : z;
      w[h][3] = ok && v1 ? ld_x(a1p + off + 8) : z;
    }
  };
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");  // before A too: a copy into A may be the previous kernel
#endif
  load_a(c0);
  for (int c = c0; c < c1; c += 2) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (c + h < c1) load_x<NT>(xf[h], xq + 64 * (c + h), 8 * ldx, g < M, g + 8 < M);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the MMAs of chunk_mma_dense, kept inline: that call compiles these kernels
      if (c + h >= c1) break;      // (SW = 1) to other, not measured, machine code
      const uint32_t w0[8] = {w[h][0].x, w[h][0].y, w[h][0].z, w[h][0].w, w[h][1].x, w[h][1].y, w[h][1].z, w[h][1].w};
      const uint32_t w1[8] = {w[h][2].x, w[h][2].y, w[h][2].z, w[h][2].w, w[h][3].x, w[h][3].y, w[h][3].z, w[h][3].w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_bf16(acc[nt], w0[2 * j], w1[2 * j], w0[2 * j + 1], w1[2 * j + 1], xf[h].r[nt][2 * j],
                   xf[h].r[nt][2 * j + 1]);
    }
    if (c + 2 < c1) load_a(c + 2);
  }
  // warp partials -> shared memory [warp][token][rank], summed in warp order into la.part[blockIdx.x]
  float* wp = red + warp * 256;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + 2 * t;
    wp[tok * 16 + g] = acc[nt][0];
    wp[(tok + 1) * 16 + g] = acc[nt][1];
    wp[tok * 16 + g + 8] = acc[nt][2];
    wp[(tok + 1) * 16 + g + 8] = acc[nt][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 16 * M; i += blockDim.x) {  // token rows >= M are never read
    float v = 0.f;
    for (int w2 = 0; w2 < warps; ++w2) v += red[w2 * 256 + i];
    la.part[(size_t)blockIdx.x * 256 + i] = v;
  }
  if (!la.direct) {  // the last CTA of the strip sums its parts (the threadFenceReduction pattern)
    __shared__ unsigned last;
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      last = atomicAdd(la.ctr + 2 + rs, 1u) == (unsigned)la.parts - 1;
      if (last) la.ctr[2 + rs] = 0u;  // every part has counted: left zero for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* src = la.part + (size_t)rs * la.parts * 256;
    float* tsum = la.part + (size_t)(kLoraMaxUnits + rs) * 256;  // the strip's finished t
    for (int i = threadIdx.x; i < 16 * M; i += blockDim.x) {
      float v = 0.f;
      for (int q = 0; q < la.parts; ++q) v += __ldcg(src + (size_t)q * 256 + i);
      tsum[i] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // the stores, then the count (the pattern of a cooperative grid sync)
    atomicAdd(la.ctr, 1u);
  }
}

// The end of an output CTA with LoRA: count it done (lora_count_done).
__device__ __forceinline__ void lora_done(const LoraArgs& la) {
  __syncthreads();  // every warp of the CTA is past its wait for t
  if (threadIdx.x == 0) lora_count_done(la);
}

// silu(gate) * up as the unfused path rounds it: gate and up to bf16 (the GEMV's output), silu in fp32 (x / (1 +
// exp(-x)), IEEE division and expf, as torch's CUDA silu) rounded to bf16, the product in fp32 rounded to bf16.
__device__ __forceinline__ __nv_bfloat16 silu_mul_bf16(float gate, float up) {
  const float g = __bfloat162float(__float2bfloat16_rn(gate));
  const float u = __bfloat162float(__float2bfloat16_rn(up));
  const float a = __bfloat162float(__float2bfloat16_rn(g / (1.f + expf(-g))));
  return __float2bfloat16_rn(a * u);
}

// t[tok][r] = (x A^T)[tok][r] as the MMA operand reads it: the sum of the strip's parts in part order (direct: one
// strip per warp only, where the registers allow all the loads in flight), or the strip's finished t; zero for
// token rows >= M and ranks >= R.
template <bool DIRECT, int NT>
__device__ __forceinline__ float lora_t(const LoraArgs& la, int M, int tok, int r) {
  if (tok >= M || r >= la.R) return 0.f;
  const int off = tok * 16 + (r & 15);
  if (!DIRECT || !la.direct) return __ldcg(la.part + (size_t)(kLoraMaxUnits + (r >> 4)) * 256 + off);
  const float* p = la.part + (size_t)(r >> 4) * la.parts * 256 + off;
  float v = 0.f;
#pragma unroll
  for (int q = 0; q < kLoraDirectParts; ++q)
    if (q < la.parts) v += __ldcg(p + q * 256);
  return v;
}

// Prefetch into L2 the Bn rows of a warp's SW strips (strip0 + i * sstep: 16 rows of rp bf16 each), one 128-byte
// line per lane.
template <int SW>
__device__ __forceinline__ void lora_prefetch_bn(const LoraArgs& la, int strip0, int sstep, int S) {
  const int lane = threadIdx.x & 31, lines = la.rp / 4;  // per strip: 16 rows x 2 rp bytes / 128
#pragma unroll
  for (int i = 0; i < SW; ++i)
    if (strip0 + i * sstep < S)
      for (int l = lane; l < lines; l += 32)
        prefetch_l2(reinterpret_cast<const char*>(la.bn + (size_t)(strip0 + i * sstep) * 16 * la.rp) + 128 * l);
}

// The LoRA term of a split-0 warp's SW strips (16 output rows each from (strip0 + i * sstep) * 16): wait until every strip
// of t is finished, then per 32 ranks load this lane's fragments straight from global memory — Bn rows g, g + 8 of
// each strip (A) and t of token rows g (+ 8 for NT = 2) at the member's ranks (B) — all loads of the round in
// flight at once, and accumulate Bn[rows, ranks] x bf16(t)[ranks, tokens] into acc times `inv` (1 / the
// accumulator's output multiplier).
template <int NT, int SW, int A2>
__device__ __forceinline__ void lora_term(const LoraArgs& la, int M, int strip0, int sstep, int S, float inv,
                                          float (&acc)[SW][A2][NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  int r0[SW], rk[SW], rkmax = 0;
#pragma unroll
  for (int i = 0; i < SW; ++i) {
    const int mb = member_of(la, (strip0 + i * sstep) * 16);
    r0[i] = pick3(la.roff, mb);
    rk[i] = strip0 + i * sstep < S ? pick3(la.rk, mb) : 0;
    rkmax = max(rkmax, rk[i]);
  }
  float c[SW][NT][4];
#pragma unroll
  for (int i = 0; i < SW; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) c[i][nt][0] = c[i][nt][1] = c[i][nt][2] = c[i][nt][3] = 0.f;
  bool waited = false;
  for (int jb = 0; jb < rkmax; jb += 32) {
    uint32_t a[SW][2][4];
    float v[SW][2][NT][4];
#pragma unroll
    for (int i = 0; i < SW; ++i) {  // the Bn words first: they do not depend on the LoRA CTAs
      const uint32_t* b0 =
          reinterpret_cast<const uint32_t*>(la.bn + (size_t)((strip0 + i * sstep) * 16 + g) * la.rp + 2 * t);
      const uint32_t* b8 = b0 + 4 * la.rp;  // 8 rows on (rp bf16 = rp / 2 words per row)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = jb + 16 * jj;
        const bool ok = j < rk[i];
        a[i][jj][0] = ok ? __ldg(b0 + j / 2) : 0u;
        a[i][jj][1] = ok ? __ldg(b8 + j / 2) : 0u;
        a[i][jj][2] = ok ? __ldg(b0 + j / 2 + 4) : 0u;
        a[i][jj][3] = ok ? __ldg(b8 + j / 2 + 4) : 0u;
      }
    }
    if (!waited) {  // a launch whose LoRA CTAs never finish (a broken scheduling assumption) traps, not hangs
      const unsigned need = (unsigned)(la.direct ? la.nlora : (la.R + 15) >> 4);
      const long long start = clock64();
      while (!(QFP4_LORA_ABLATE & 12) && ld_acquire(la.ctr) < need) {
        __nanosleep(20);
        if (clock64() - start > (1LL << 32)) __trap();
      }
      waited = true;
    }
#pragma unroll
    for (int i = 0; i < SW; ++i) {
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = jb + 16 * jj;
        const bool ok = j < rk[i];
        const int r = r0[i] + j + 2 * t;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int tok = nt * 8 + g;
          v[i][jj][nt][0] = ok ? lora_t<SW == 1, NT>(la, M, tok, r) : 0.f;
          v[i][jj][nt][1] = ok ? lora_t<SW == 1, NT>(la, M, tok, r + 1) : 0.f;
          v[i][jj][nt][2] = ok ? lora_t<SW == 1, NT>(la, M, tok, r + 8) : 0.f;
          v[i][jj][nt][3] = ok ? lora_t<SW == 1, NT>(la, M, tok, r + 9) : 0.f;
        }
      }
    }
#pragma unroll
    for (int i = 0; i < SW; ++i)
#pragma unroll
      for (int jj = 0; jj < 2; ++jj)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma_bf16(c[i][nt], a[i][jj][0], a[i][jj][1], a[i][jj][2], a[i][jj][3],
                   pack_bf16(v[i][jj][nt][0], v[i][jj][nt][1]), pack_bf16(v[i][jj][nt][2], v[i][jj][nt][3]));
  }
#pragma unroll
  for (int i = 0; i < SW; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][0][nt][e] = fmaf(c[i][nt][e], inv, acc[i][0][nt][e]);
}

// grid: ceil(S / (R * SW)) CTAs of R * splits warps; warp w works on the SW strips starting at
// (blockIdx.x * R + w / splits) * SW (clamped to S - 1 for loads), K chunks [split * C / splits,
// (split + 1) * C / splits). Each x fragment load serves SW strips. With programmatic dependent launch the
// CTAs start during the previous grid's tail and wait (griddepcontrol.wait) before reading anything that grid
// may write; the first weight batch is loaded before the wait (the wait depends on its words, else ptxas 13.0
// schedules the wait first), so its HBM latency overlaps the previous kernel.
constexpr int kPrefetch = 8;  // chunks per strip a warp prefetches into L2 before griddepcontrol.wait

template <int FMT, int NT, int U, int SW, bool LORA>
__device__ __forceinline__ void gemv_body(const uint4* __restrict__ qw, const uint16_t* __restrict__ sc,
                                          const __nv_bfloat16* __restrict__ x, int ldx,
                                          __nv_bfloat16* __restrict__ out, int ldo, const float* __restrict__ gs,
                                          float out_mult, uint32_t bword, int M, int S, int C, int splits, int R,
                                          int act, const LoraArgs& la) {
  // dynamic shared memory: the split-K partials (warps, SW, 16 rows, 8 * NT tokens) when splits > 1 (with LoRA at
  // least the LoRA CTAs' per-warp partials: launch_smem)
  extern __shared__ __align__(16) float red[];
  constexpr int SL = FMT == 0 ? 32 : 16;  // scale pairs per (strip, chunk)
  constexpr bool DENSE = FMT == 2;        // a BF16 weight: row-major, no scales
  constexpr int WN = wwords<FMT>();       // weight words per lane and (strip, chunk)
  constexpr int WSTEP = DENSE ? 8 : 32;   // uint4 from one chunk to the next along a lane's pointer
  constexpr int A2 = SW == 1 ? 2 : 1;
  constexpr int TOK = 8 * NT;
  constexpr bool SECTOR = DENSE && QFP4_DENSE_SECTOR;
  constexpr int LT = SECTOR ? 8 : 16;  // bf16 from lane t - 1's first k of a chunk to lane t's (x and BF16 rows)
  constexpr int X2 = SECTOR ? 32 : 8;  // bf16 from a lane's first 8 k to its second 8
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  constexpr bool has_lora = LORA;
  if (has_lora && (int)blockIdx.x < la.nlora) {
    lora_cta<NT>(la, x, ldx, M, C, red);  // waits for the previous grid itself
    return;
  }
  const int blk = has_lora ? (int)blockIdx.x - la.nlora : (int)blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  // act (SW = 2 only): the warp's two strips are g and g + S / 2 of strip pair g — the same rows of the weight's
  // two halves (gate|up) — and the output is silu(gate) * up (M, N / 2); else strips g * SW + i
  const bool pair = SW == 2 && act != 0;
  const int grp_all = blk * R + warp / splits, split = warp % splits;
  const int strip0 = pair ? grp_all : grp_all * SW, sstep = pair ? S >> 1 : 1;
  const bool active = strip0 < (pair ? S >> 1 : S);
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
  const int soff = FMT == 0 ? lane : (lane >> 1);  // this lane's scale pair in a (strip, chunk)
  const size_t r8 = (size_t)64 * C;  // BF16: uint4 from row g to row g + 8 (8 rows of 8 C)
#pragma unroll
  for (int i = 0; i < SW; ++i) {
    const int st = max(0, min(strip0 + i * sstep, S - 1));
    if constexpr (DENSE) {
      wq[i] = qw + ((size_t)(st * 16 + g) * C + c0) * 8 + LT / 8 * t;
    } else {
      wq[i] = qw + ((size_t)st * C + c0) * 32 + lane;
      sq[i] = sc + ((size_t)st * C + c0) * SL + soff;
    }
  }
  const __nv_bfloat16* xq = x + (size_t)g * ldx + LT * t + 64 * c0;
  const int ldx8 = 8 * ldx;
  const bool xv0 = g < M, xv1 = g + 8 < M;
  uint4 wa[U][SW][WN], wb[U][SW][WN];
  uint32_t sa[U][SW], sb[U][SW];
  XFrag<NT> xf[2];
  xf[0].zero();
  xf[1].zero();

  // Loads of the batch at the current pointers (n valid chunks, warp-uniform); early: the first batch, issued
  // before griddepcontrol.wait through the coherent path (see ld_stream_early).
  auto load_batch = [&](uint4 (&w)[U][SW][WN], uint32_t (&s)[U][SW], int n, auto early) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < n) {
#pragma unroll
        for (int i = 0; i < SW; ++i) {
          if constexpr (DENSE) {  // rows g (words 0, 1) and g + 8 (words 2, 3)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const uint4* p = wq[i] + u * WSTEP + (q >> 1) * r8 + (q & 1) * (X2 / 8);
              w[u][i][q] = decltype(early)::value ? ld_stream_early(p) : ld_stream(p);
            }
          } else if constexpr (decltype(early)::value) {
            w[u][i][0] = ld_stream_early(wq[i] + u * 32);
            s[u][i] = ld_stream_early_u16(sq[i] + u * SL);
          } else {
            w[u][i][0] = ld_stream(wq[i] + u * 32);
            s[u][i] = ld_stream_u16(sq[i] + u * SL);
          }
        }
      }
    }
  };
  auto advance = [&]() {
#pragma unroll
    for (int i = 0; i < SW; ++i) {
      wq[i] += U * WSTEP;
      if constexpr (!DENSE) sq[i] += U * SL;
    }
  };
  // Chunk u uses x fragment (u & 1) and prefetches chunk u + 1's (possibly the next batch's first) into the
  // other one; U is even, so parities carry over between batches.
  auto compute_batch = [&](const uint4 (&w)[U][SW][WN], const uint32_t (&s)[U][SW], int left) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u < left) {
        if (u + 1 < left) load_x<NT, X2>(xf[(u + 1) & 1], xq + 64 * (u + 1), ldx8, xv0, xv1);
#pragma unroll
        for (int i = 0; i < SW; ++i) {
          if constexpr (DENSE)
            chunk_mma_dense<NT, A2>(acc[i], w[u][i], xf[u & 1]);
          else
            chunk_mma<FMT, NT, A2>(acc[i], w[u][i][0], s[u][i], bword, xf[u & 1]);
        }
      }
    }
  };

  int left = work ? c1 - c0 : 0;  // chunks not yet computed
  load_batch(wa, sa, left, std::true_type{});
  {  // and the next kPrefetch chunks of each strip into L2 (lane: chunk U + lane / 4, 128-byte line lane % 4; the
     // scale lines by the first lanes): under programmatic dependent launch they arrive while the previous grid runs
    if constexpr (DENSE) {  // the same bytes: two chunks of 16 rows x 128 bytes (lane: row lane % 16)
      const int pc = U + (lane >> 4), row = lane & 15;
      if (pc < left) {
#pragma unroll
        for (int i = 0; i < SW; ++i)
          prefetch_l2(wq[i] - ((size_t)g * C * 8 + LT / 8 * t) + (size_t)row * C * 8 + pc * 8);
      }
    } else {
      const int pc = U + (lane >> 2);
      if (pc < left && pc < U + kPrefetch) {
#pragma unroll
        for (int i = 0; i < SW; ++i) {
          prefetch_l2(wq[i] - lane + pc * 32 + (lane & 3) * 8);
          if ((lane & 3) == 0) prefetch_l2(sq[i] - soff + pc * SL);
        }
      }
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  if (has_lora && !(QFP4_LORA_ABLATE & 9) && split == 0 && active) lora_prefetch_bn<SW>(la, strip0, sstep, S);
#if QFP4_LORA_ABLATE & 8
  if (has_lora && split == 0 && active)  // the term first, with no wait (timing only)
    lora_term<NT, SW, A2>(la, M, strip0, sstep, S, FMT == 0 ? __ldg(gs) / out_mult : 1.f / out_mult, acc);
#endif
  if (work) {
    load_x<NT, X2>(xf[0], xq, ldx8, xv0, xv1);
    while (true) {
      advance();
      load_batch(wb, sb, left - U, std::false_type{});
      compute_batch(wa, sa, left);
      xq += 64 * U;
      left -= U;
      if (left <= 0) break;
      advance();
      load_batch(wa, sa, left - U, std::false_type{});
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
  if (has_lora && !(QFP4_LORA_ABLATE & 9) && split == 0 && active)
    lora_term<NT, SW, A2>(la, M, strip0, sstep, S, 1.f / mult, acc);
  if (pair && splits == 1) {  // both strips of the pair are this warp's: silu(gate) * up from the registers
    if (active) {
      const int n0 = strip0 * 16;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = nt * 8 + 2 * t;
        if (tok < M) {
          out[(size_t)tok * ldo + n0 + g] = silu_mul_bf16(acc[0][0][nt][0] * mult, acc[SW - 1][0][nt][0] * mult);
          out[(size_t)tok * ldo + n0 + g + 8] = silu_mul_bf16(acc[0][0][nt][2] * mult, acc[SW - 1][0][nt][2] * mult);
        }
        if (tok + 1 < M) {
          out[(size_t)(tok + 1) * ldo + n0 + g] = silu_mul_bf16(acc[0][0][nt][1] * mult, acc[SW - 1][0][nt][1] * mult);
          out[(size_t)(tok + 1) * ldo + n0 + g + 8] =
              silu_mul_bf16(acc[0][0][nt][3] * mult, acc[SW - 1][0][nt][3] * mult);
        }
      }
    }
    if (has_lora) lora_done(la);
    return;
  }
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
    if (has_lora) lora_done(la);
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
  if (pair) {  // strip pair grp of the CTA: its two sums, then silu(gate) * up
    for (int idx = threadIdx.x; idx < R * per_strip; idx += blockDim.x) {
      const int grp = idx / per_strip, rem = idx - grp * per_strip;
      const int tok = rem >> 4, row = rem & 15;
      const int pg = blk * R + grp;
      if (pg >= (S >> 1)) continue;
      float v0 = 0.f, v1 = 0.f;
      for (int sp = 0; sp < splits; ++sp) {
        v0 += red[(((grp * splits + sp) * SW) * 16 + row) * TOK + tok];
        v1 += red[(((grp * splits + sp) * SW + SW - 1) * 16 + row) * TOK + tok];
      }
      out[(size_t)tok * ldo + pg * 16 + row] = silu_mul_bf16(v0 * mult, v1 * mult);
    }
    if (has_lora) lora_done(la);
    return;
  }
  for (int idx = threadIdx.x; idx < R * SW * per_strip; idx += blockDim.x) {
    const int ls = idx / per_strip, rem = idx - ls * per_strip;  // ls = local strip (group * SW + i)
    const int tok = rem >> 4, row = rem & 15;
    const int grp = ls / SW, i = ls - grp * SW;
    const int st = (blk * R + grp) * SW + i;
    if (st >= S) continue;
    float v = 0.f;
    for (int sp = 0; sp < splits; ++sp) v += red[(((grp * splits + sp) * SW + i) * 16 + row) * TOK + tok];
    out[(size_t)tok * ldo + st * 16 + row] = __float2bfloat16_rn(v * mult);
  }
  if (has_lora) lora_done(la);
}

#define QFP4_GEMV_PARAMS                                                                                          \
  const uint4 *__restrict__ qw, const uint16_t *__restrict__ sc, const __nv_bfloat16 *__restrict__ x, int ldx,      \
      __nv_bfloat16 *__restrict__ out, int ldo, const float *__restrict__ gs, float out_mult, uint32_t bword, int M, \
      int S, int C, int splits, int R, int act, LoraArgs la

template <int FMT, int NT, int U, int SW>
__global__ void __launch_bounds__(max_warps<U, SW, wwords<FMT>()>() * 32) fp4_gemv_kernel(QFP4_GEMV_PARAMS) {
  gemv_body<FMT, NT, U, SW, false>(qw, sc, x, ldx, out, ldo, gs, out_mult, bword, M, S, C, splits, R, act, la);
}

// Registers of the LoRA variant: at most the plain variant's allocation where the LoRA code would push it over a
// granule and cost a resident CTA per SM (one n8 tile, U = 2, SW = 2: 97 -> 104 registers would fit 4 CTAs of 4 warps
// per SM instead of 5, and 7B's gate|up grid then ran in two waves); elsewhere the launch bound's own limit.
template <int FMT, int NT, int U, int SW>
constexpr int lora_max_regs() {
  return FMT != 2 && NT == 1 && U == 2 && SW == 2 ? 96
         : max_warps<U, SW, wwords<FMT>()>() == 16 ? 128 : 255;
}

template <int FMT, int NT, int U, int SW>
__global__ void __launch_bounds__(max_warps<U, SW, wwords<FMT>()>() * 32) __maxnreg__((lora_max_regs<FMT, NT, U, SW>()))
    fp4_gemv_lora_kernel(QFP4_GEMV_PARAMS) {
  gemv_body<FMT, NT, U, SW, true>(qw, sc, x, ldx, out, ldo, gs, out_mult, bword, M, S, C, splits, R, act, la);
}
#undef QFP4_GEMV_PARAMS

template <int FMT, int NT, int U, int SW>
const void* kernel_ptr(bool lora) {
  return lora ? reinterpret_cast<const void*>(&fp4_gemv_lora_kernel<FMT, NT, U, SW>)
              : reinterpret_cast<const void*>(&fp4_gemv_kernel<FMT, NT, U, SW>);
}

// Compiled variants: (U, SW) in {(2,1), (4,1), (8,1), (2,2), (4,2), (2,4)} for both FP4 formats, {(2,1), (4,1),
// (2,2)} for BF16 (four words a chunk: the same registers as FP4's (8,1), (16,1), (8,2)), and 1 or 2 n8 tiles, each
// with and without LoRA (a separate instantiation: the LoRA code costs the plain kernel no registers).
template <int NT>
const void* pick_us_dense(int unroll, int sw, bool lora) {
  if (sw == 1) return unroll == 2 ? kernel_ptr<2, NT, 2, 1>(lora) : unroll == 4 ? kernel_ptr<2, NT, 4, 1>(lora) : nullptr;
  if (sw == 2) return unroll == 2 ? kernel_ptr<2, NT, 2, 2>(lora) : nullptr;
  return nullptr;
}

template <int FMT, int NT>
const void* pick_us(int unroll, int sw, bool lora) {
  if (sw == 1) return unroll == 2 ? kernel_ptr<FMT, NT, 2, 1>(lora) : unroll == 4 ? kernel_ptr<FMT, NT, 4, 1>(lora)
                    : unroll == 8 ? kernel_ptr<FMT, NT, 8, 1>(lora) : nullptr;
  if (sw == 2)
    return unroll == 2 ? kernel_ptr<FMT, NT, 2, 2>(lora) : unroll == 4 ? kernel_ptr<FMT, NT, 4, 2>(lora) : nullptr;
  if (sw == 4) return unroll == 2 ? kernel_ptr<FMT, NT, 2, 4>(lora) : nullptr;
  return nullptr;
}

const void* pick(int fmt, int nt, int unroll, int sw, bool lora = false) {
  if (fmt == 0) return nt == 1 ? pick_us<0, 1>(unroll, sw, lora) : nt == 2 ? pick_us<0, 2>(unroll, sw, lora) : nullptr;
  if (fmt == 1) return nt == 1 ? pick_us<1, 1>(unroll, sw, lora) : nt == 2 ? pick_us<1, 2>(unroll, sw, lora) : nullptr;
  if (fmt == 2) return nt == 1 ? pick_us_dense<1>(unroll, sw, lora) : nt == 2 ? pick_us_dense<2>(unroll, sw, lora)
                                                                            : nullptr;
  return nullptr;
}

int warp_cap(int fmt, int unroll, int sw) { return unroll * sw * (fmt == 2 ? 4 : 1) >= 8 ? 8 : 16; }

size_t smem_bytes(int nt, int warps, int splits, int sw) {
  return splits > 1 ? (size_t)warps * sw * 16 * 8 * nt * 4 : 0;
}

// Dynamic shared memory of a launch: the split-K partials, with LoRA at least the LoRA CTAs' per-warp partials.
inline size_t launch_smem(int nt, int warps, int splits, int sw, bool lora) {
  const size_t smem = smem_bytes(nt, warps, splits, sw);
  return lora ? std::max(smem, (size_t)warps * 256 * 4) : smem;
}

// Allow `smem` bytes of dynamic shared memory for kernel fn (an opt-in above 48 KB); 0 or a cudaError_t.
inline int opt_in_smem(const void* fn, size_t smem) {
  return smem > 48 * 1024 ? (int)cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) : 0;
}

int launch_gemv(const void* qw, const void* sc, const void* x, int ldx, void* out, int ldo, const float* gs,
                float out_mult, unsigned bword, int M, int S, int C, int fmt, int splits, int strips_per_cta,
                int unroll, int sw, int pdl, int act, void* stream, LoraArgs la) {
  const int nt = M > 8 ? 2 : 1;
  const void* fn = pick(fmt, nt, unroll, sw, la.a != nullptr);
  const int warps = splits * strips_per_cta;
  if (fn == nullptr || M < 1 || M > 16 || splits < 1 || strips_per_cta < 1 || warps > warp_cap(fmt, unroll, sw))
    return -1;
  if (act < 0 || act > 1 || (act && (sw != 2 || S % 2))) return -1;  // silu * up: strip pairs, two per warp
  const int per_cta = strips_per_cta * sw;
  int lora_ctas = 0;
  if (la.a != nullptr) {
    if (la.R < 1 || la.R > 16 * kLoraMaxStrips || la.rp < 16 || la.rp % 16 || la.parts < 1 || la.parts > C)
      return -1;
    const int units = ((la.R + 15) / 16) * la.parts;  // one LoRA CTA per (16-rank strip, K part)
    if (units > kLoraMaxUnits) return -1;
    lora_ctas = la.nlora = units;
    la.direct = sw == 1 && la.parts <= kLoraDirectParts ? 1 : 0;
  }
  const size_t smem = launch_smem(nt, warps, splits, sw, la.a != nullptr);
  if (smem > 200 * 1024) return -1;
  if (const int e = opt_in_smem(fn, smem)) return e;
  void* args[] = {(void*)&qw, (void*)&sc, (void*)&x, (void*)&ldx, (void*)&out, (void*)&ldo, (void*)&gs,
                  (void*)&out_mult, (void*)&bword, (void*)&M, (void*)&S, (void*)&C, (void*)&splits,
                  (void*)&strips_per_cta, (void*)&act, (void*)&la};
  return (int)launch_pdl(fn, dim3((unsigned)((S + per_cta - 1) / per_cta + lora_ctas)), dim3((unsigned)(warps * 32)),
                         smem, (cudaStream_t)stream, args, pdl != 0);
}

}  // namespace qfp4

// C entry points for the torch binding (cuda_fp4.py): plain pointers, the caller checks shapes.
// Return a cudaError_t (0 = success); -1 = unsupported variant / configuration.

// out (M, N) <- x (M, K) @ W^T; qw (S, C, 32) uint4, sc (S, C, 32 | 16) uint16, gs (1,) f32 (nvfp4 only); fmt 2:
// qw the BF16 weight (N, K) = (16 S, 64 C) row-major, 16-byte aligned, sc and gs unused (out_mult 1).
// pdl: launch with programmatic stream serialization (overlaps the previous kernel's tail). act = 1: out (M, N / 2)
// <- silu(y[:, :N/2]) * y[:, N/2:] (the rows of W are gate then up; sw = 2, S even).
extern "C" int qfp4_gemv(const void* qw, const void* sc, const void* x, int ldx, void* out, int ldo,
                         const float* gs, float out_mult, unsigned bword, int M, int S, int C, int fmt, int splits,
                         int strips_per_cta, int unroll, int sw, int pdl, int act, void* stream) {
  qfp4::LoraArgs la = {};
  return qfp4::launch_gemv(qw, sc, x, ldx, out, ldo, gs, out_mult, bword, M, S, C, fmt, splits, strips_per_cta,
                           unroll, sw, pdl, act, stream, la);
}

// The same plus LoRA in the launch: out += bf16(x A^T)[member ranks] Bn^T; a (R, K) bf16, bn (N, rp) bf16, workspaces
// part ((512 + 24) x 256) fp32, ctr (2 + 24) u32 zeroed (left zeroed); `parts` K parts per 16-rank strip;
// members start at output rows 0, bound1, bound2 with ranks [roff_i, roff_i + rk_i).
extern "C" int qfp4_gemv_lora(const void* qw, const void* sc, const void* x, int ldx, void* out, int ldo,
                              const float* gs, float out_mult, unsigned bword, int M, int S, int C, int fmt,
                              int splits, int strips_per_cta, int unroll, int sw, int pdl, int act, void* stream,
                              const void* a, const void* bn, void* part, void* ctr, int R, int rp,
                              int parts, int bound1, int bound2, const int* roff, const int* rk) {
  qfp4::LoraArgs la = {};
  la.a = static_cast<const __nv_bfloat16*>(a);
  la.bn = static_cast<const __nv_bfloat16*>(bn);
  la.part = static_cast<float*>(part);
  la.ctr = static_cast<unsigned*>(ctr);
  la.R = R;
  la.rp = rp;
  la.parts = parts;
  la.bound1 = bound1;
  la.bound2 = bound2;
  for (int i = 0; i < 3; ++i) {
    la.roff[i] = roff[i];
    la.rk[i] = rk[i];
  }
  if (a == nullptr || bn == nullptr || part == nullptr || ctr == nullptr) return -1;
  return qfp4::launch_gemv(qw, sc, x, ldx, out, ldo, gs, out_mult, bword, M, S, C, fmt, splits, strips_per_cta,
                           unroll, sw, pdl, act, stream, la);
}

// Max resident CTAs per SM of one variant with `warps` warps per CTA (-1: unsupported variant); lora != 0: the
// LoRA variant.
extern "C" int qfp4_occupancy(int fmt, int nt, int unroll, int sw, int warps, int splits, int lora) {
  const void* fn = qfp4::pick(fmt, nt, unroll, sw, lora != 0);
  if (fn == nullptr) return -1;
  const size_t smem = qfp4::launch_smem(nt, warps, splits, sw, lora != 0);
  if (qfp4::opt_in_smem(fn, smem)) return -1;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, warps * 32, smem)) return -1;
  return blocks;
}

// Registers and local-memory bytes per thread of one variant (-1 on error).
extern "C" int qfp4_attributes(int fmt, int nt, int unroll, int sw, int* regs, int* local_bytes) {
  return qfp4::kernel_attributes(qfp4::pick(fmt, nt, unroll, sw), regs, local_bytes);
}
