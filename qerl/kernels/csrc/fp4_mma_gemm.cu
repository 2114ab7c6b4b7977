// W4A16 GEMM for NVFP4 / MXFP4 weights at M = 17 .. a few hundred tokens (rollouts of 32-256 sequences, short
// prefills) on tensor cores (mma.sync m16n8k16, bf16 in, fp32 acc), over the SAME re-laid-out weights as the decode
// GEMV (fp4_mma_gemv.cu): one resident layout for both.
//
// out (M, N) = x (M, K) @ W^T. A CTA is KS groups of R warps. Warp w of a group owns SW strips of 16 weight rows
// (the MMA's M); the CTA owns TM = 8 * NT tokens (the MMA's N: NT n8 tiles); each group owns a contiguous range of
// the K chunks (split-K inside the CTA, partial sums reduced through shared memory at the end: one launch, no
// workspace, CUDA-graph capturable).
//  * Tokens: chunk by chunk (TM tokens x 64 k, bf16) into shared memory by a kStages-deep cp.async pipeline per
//    group (one stage: tokens, then the group's weight words and scale pairs, ``stage_bytes``); 16-byte unit u of
//    token row r is stored at unit u ^ (r & 7), so a quarter warp's 128-bit fragment reads (rows g, g+1; units 2t,
//    2t+1) hit 8 distinct units: no bank conflicts. Rows >= M are zero-filled.
//  * Weights and scales go through the same pipeline (each lane copies its own 16-byte word per strip; 64 bytes of
//    scale pairs per strip), so kStages - 1 chunks of weights, scales and tokens are in flight per group; a chunk's
//    weights are decoded once into the 16 A registers of its 4 MMA steps and reused by NT MMAs each: the decode cost
//    per MMA is 1/NT of the GEMV's.
//  * Lane (g, t) of n8 tile nt reads token row 8 nt + g, k = 64 c + 16 t + 0..15: its B registers of the 4 MMA
//    steps, the same K permutation as the A fragments (see fp4_mma_gemv.cu).
// Grid: x = token tiles (fastest, so CTAs in flight together share a strip group's weights through L2),
// y = strip groups of R * SW strips.
// LoRA in the epilogue (the LORA variants, `GemmLora`): out = bf16((acc + t Bn^T / mult) * mult) with t = bf16(x A^T)
// (M, R) computed before the launch and Bn (N, rp) the members' scaling * lora_B rows (zero past each member's rk
// ranks); after the split-K reduction each warp adds, per strip and 16 ranks of its member, one m16n8k16 per n8
// tile (A = Bn rows g, g + 8 from global memory, B = t of its tokens), as the decode GEMV's LoRA term does.

#include "fp4_mma_common.cuh"

// QFP4_GEMM_KZ (the build's -D, set by QERL_GEMM_KZ=1; session 68's experiment): the kernel also splits K across
// CTAs (gridDim.z = KZ): CTA z's KS groups take splits z KS .. z KS + KS - 1 of KZ KS even splits of the chunks; each
// CTA of an output tile writes its fp32 partial (after its groups' reduction) to a workspace, and the last to finish
// (a per-tile counter) adds the KZ partials in split order -- deterministic, no floating-point atomics -- runs the
// epilogue (LoRA term, bf16 store) and leaves the counter at zero. Why: Nsight Compute at M = 32 (session 68,
// results/speed/raw/h100_s68_ncu32) found the 7B gate product's 296 CTAs spread 2-3 an SM and q / o's 112 CTAs
// leaving 20 SMs empty, the SMs active 61-71% of the time: more, smaller CTAs of the same shape spread the work
// evenly. 0 compiles exactly the kernel without it (its parameters too).
#ifndef QFP4_GEMM_KZ
#define QFP4_GEMM_KZ 0
#endif
#if QFP4_GEMM_KZ
#define QFP4_GEMM_KZ_PARAM , float* __restrict__ ws, int* __restrict__ ctr
#else
#define QFP4_GEMM_KZ_PARAM
#endif

namespace qfp4 {

constexpr int kStages = 4;  // a power of 2 (stage of chunk idx = idx & (kStages - 1))
constexpr int kGemmMaxWarps = 8;
constexpr int kSmemMax = 227 * 1024;  // opt-in dynamic shared memory per CTA on sm_90


// Bytes of one pipeline stage of a group: TM x 64 tokens (bf16), then per strip of the group its 32 lanes' 16-byte
// weight words (512 B) and its scale pairs (64 B: 32 for NVFP4, 16 used for MXFP4).
__host__ __device__ constexpr int stage_bytes(int nt, int strips) { return 8 * nt * 128 + strips * (512 + 64); }

struct GemmLora {
  const __nv_bfloat16* t;   // (M, R) bf16, row stride ldt (even; ranks of member i from roff[i])
  const __nv_bfloat16* bn;  // (N, rp) bf16 row-major: row n = its member's scaling * lora_B row, zero past rk
  int ldt, rp, bound1, bound2;  // output rows where members 1 and 2 start (N when absent)
  int roff[3], rk[3];           // first rank and rank count (multiples of 8) of each member
};

// acc += (t Bn^T) / mult for this warp's SW strips and NT n8 token tiles (the mma fragments of the main loop).
template <int NT, int SW>
__device__ __forceinline__ void gemm_lora_term(const GemmLora& lo, int M, int tok0, int strip0, int S, float inv,
                                               float (&acc)[SW][NT][4]) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < SW; ++i) {
    const int n0 = (strip0 + i) * 16;
    if (strip0 + i >= S) continue;
    const int mb = member_of(lo, n0);  // member rows are multiples of 16
    const int r0 = pick3(lo.roff, mb), rk = pick3(lo.rk, mb);
    const uint32_t* b0 = reinterpret_cast<const uint32_t*>(lo.bn + (size_t)(n0 + g) * lo.rp + 2 * t);
    const uint32_t* b8 = b0 + 4 * lo.rp;  // 8 rows on
    float c[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
    for (int j = 0; j < rk; j += 16) {
      const bool lo_ok = j + 2 * t < rk, hi_ok = j + 2 * t + 8 < rk;  // rk % 8 == 0: whole pairs
      const uint32_t a0 = lo_ok ? __ldg(b0 + j / 2) : 0u, a1 = lo_ok ? __ldg(b8 + j / 2) : 0u;
      const uint32_t a2 = hi_ok ? __ldg(b0 + j / 2 + 4) : 0u, a3 = hi_ok ? __ldg(b8 + j / 2 + 4) : 0u;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int tok = tok0 + nt * 8 + g;
        const uint32_t* tp = reinterpret_cast<const uint32_t*>(lo.t + (size_t)tok * lo.ldt + r0 + j + 2 * t);
        const uint32_t v0 = tok < M && lo_ok ? __ldg(tp) : 0u, v1 = tok < M && hi_ok ? __ldg(tp + 4) : 0u;
        mma_bf16(c[nt], a0, a1, a2, a3, v0, v1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][nt][e] = fmaf(c[nt][e], inv, acc[i][nt][e]);
  }
}

template <int FMT, int NT, int SW, int R, bool LORA>
__global__ void __launch_bounds__(kGemmMaxWarps * 32)
fp4_gemm_kernel(const uint4* __restrict__ qw, const uint16_t* __restrict__ sc, const __nv_bfloat16* __restrict__ x,
                int ldx, __nv_bfloat16* __restrict__ out, int ldo, const float* __restrict__ gs, float out_mult,
                uint32_t bword, int M, int S, int C, int KS, GemmLora lo QFP4_GEMM_KZ_PARAM) {
  constexpr int TM = 8 * NT;
  constexpr int SL = FMT == 0 ? 32 : 16;  // scale pairs per (strip, chunk)
  constexpr int XB = TM * 128;            // bytes of one staged chunk of tokens
  constexpr int GT = R * 32;              // threads of one split-K group
  constexpr int SB = stage_bytes(NT, R * SW);
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int grp = warp / R, wr = warp - grp * R;
  const int gtid = threadIdx.x - grp * GT;
  const int tok0 = blockIdx.x * TM;
  const int strip0 = (blockIdx.y * R + wr) * SW;
#if QFP4_GEMM_KZ
  const int KZ = gridDim.z, q = blockIdx.z * KS + grp;  // split q of KZ * KS (the caller keeps KZ * KS <= C)
  const int c0 = (int)((long long)q * C / (KZ * KS)), c1 = (int)((long long)(q + 1) * C / (KZ * KS));
#else
  const int c0 = (int)((long long)grp * C / KS), c1 = (int)((long long)(grp + 1) * C / KS);
#endif
  const int n = c1 - c0;  // chunks of this group (>= 1: the caller keeps KS <= C)
  unsigned char* gs_base = smem + grp * kStages * SB;
  const uint32_t gs_s = static_cast<uint32_t>(__cvta_generic_to_shared(gs_base));
  const int my_w = XB + (wr * SW) * 512;            // this warp's weight words inside a stage
  const int my_s = XB + R * SW * 512 + (wr * SW) * 64;  // and its scale pairs

  float acc[SW][NT][4];
#pragma unroll
  for (int i = 0; i < SW; ++i)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.f;

  // The staging plan (R is a template parameter, so every trip count is known): TokenStager (fp4_mma_common.cuh) for
  // the tokens; the weights, the lane's own 16-byte word per strip, and the scales, lanes 0..SL/8-1, through
  // loop-carried pointers too. Copying a real row into the padding rows instead of zero-filling them (row M - 1 for
  // all of them) was measured 25% slower at M = 48 (many CTAs hitting one L2 line at once).
  TokenStager<TM, GT> tokens(x, ldx, tok0, c0, M, gtid);
  const uint4* wq[SW];
  const uint16_t* sq[SW];
#pragma unroll
  for (int i = 0; i < SW; ++i) {
    const int st = max(0, min(strip0 + i, S - 1));  // strips past S compute garbage that is never stored
    wq[i] = qw + ((size_t)st * C + c0) * 32 + lane;
    sq[i] = sc + ((size_t)st * C + c0) * SL + lane * 8;
  }

  // cp.async of the next chunk (staged in order 0, 1, 2, ...) into stage idx % kStages. Always one commit group
  // (maybe empty), so wait_group<kStages - 2> at chunk idx means "chunk idx has landed" for this thread.
  auto stage = [&](int idx) {
    if (idx < n) {
      const uint32_t dst = gs_s + (idx & (kStages - 1)) * SB;
      tokens.stage(dst);
#pragma unroll
      for (int i = 0; i < SW; ++i) {
        cp_async16(dst + my_w + i * 512 + lane * 16, wq[i], true);
        if (lane < SL / 8) cp_async16(dst + my_s + i * 64 + lane * 16, sq[i], true);
        wq[i] += 32;
        sq[i] += SL;
      }
    }
    cp_async_commit();
  };

#pragma unroll
  for (int st = 0; st < kStages - 1; ++st) stage(st);
  for (int idx = 0; idx < n; ++idx) {
    cp_async_wait<kStages - 2>();
    group_sync(1 + grp, GT);  // chunk idx visible to the group; stage (idx - 1) % kStages free again
    stage(idx + kStages - 1);
    const unsigned char* sb = gs_base + (idx & (kStages - 1)) * SB;
    uint32_t a[SW][4][4];
#pragma unroll
    for (int i = 0; i < SW; ++i) {
      const uint4 w = *reinterpret_cast<const uint4*>(sb + my_w + i * 512 + lane * 16);
      const uint32_t s16 = *reinterpret_cast<const uint16_t*>(sb + my_s + i * 64 + 2 * (FMT == 0 ? lane : lane >> 1));
      uint32_t sg, sg8;
      scale_words<FMT>(s16, bword, sg, sg8);
      decode_word(w.x, sg, sg8, a[i][0]);
      decode_word(w.y, sg, sg8, a[i][1]);
      decode_word(w.z, sg, sg8, a[i][2]);
      decode_word(w.w, sg, sg8, a[i][3]);
    }
    const unsigned char* base = sb + g * 128;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const unsigned char* row = base + nt * 8 * 128;  // token row 8 nt + g; (row & 7) == g
      const uint4 lo = *reinterpret_cast<const uint4*>(row + (((2 * t) ^ g) << 4));
      const uint4 hi = *reinterpret_cast<const uint4*>(row + (((2 * t + 1) ^ g) << 4));
      const uint32_t b[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < SW; ++i)
          mma_bf16(acc[i][nt], a[i][j][0], a[i][j][1], a[i][j][2], a[i][j][3], b[2 * j], b[2 * j + 1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every group done with its stages: shared memory is free for the reduction

  if (KS > 1) {
    float4* red = reinterpret_cast<float4*>(smem);
    if (grp > 0) {
#pragma unroll
      for (int i = 0; i < SW; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          red[((((grp - 1) * R + wr) * SW + i) * NT + nt) * 32 + lane] =
              make_float4(acc[i][nt][0], acc[i][nt][1], acc[i][nt][2], acc[i][nt][3]);
    }
    __syncthreads();
    if (grp > 0) return;
    for (int sp = 1; sp < KS; ++sp) {
#pragma unroll
      for (int i = 0; i < SW; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const float4 v = red[((((sp - 1) * R + wr) * SW + i) * NT + nt) * 32 + lane];
          acc[i][nt][0] += v.x;
          acc[i][nt][1] += v.y;
          acc[i][nt][2] += v.z;
          acc[i][nt][3] += v.w;
        }
    }
  }
#if QFP4_GEMM_KZ
  if (KZ > 1) {  // group 0's threads (the others returned): the tile's KZ partials, added by the last CTA
    const int rt = threadIdx.x;  // 0 .. GT - 1
    const int tile = blockIdx.y * gridDim.x + blockIdx.x, tiles = gridDim.x * gridDim.y;
    constexpr int TF = SW * NT * 4 * GT;  // floats of one partial tile
    float* mine = ws + ((size_t)blockIdx.z * tiles + tile) * TF;
#pragma unroll
    for (int i = 0; i < SW; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) __stcg(mine + ((i * NT + nt) * 4 + e) * GT + rt, acc[i][nt][e]);
    if (!last_of_splits(ctr, tile, KZ, rt, GT)) return;
#pragma unroll
    for (int i = 0; i < SW; ++i)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[i][nt][0] = acc[i][nt][1] = acc[i][nt][2] = acc[i][nt][3] = 0.f;
    for (int z = 0; z < KZ; ++z) {
      const float* part = ws + ((size_t)z * tiles + tile) * TF;
#pragma unroll
      for (int i = 0; i < SW; ++i)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[i][nt][e] += __ldcg(part + ((i * NT + nt) * 4 + e) * GT + rt);
    }
    if (rt == 0) ctr[tile] = 0;
  }
#endif
  float mult = out_mult;
  if (FMT == 0) mult = out_mult / __ldg(gs);
  if constexpr (LORA) {
    // Launched under programmatic dependent launch (qfp4_gemm's pdl), the main loop above ran while the previous
    // grid (the one computing t) finished: wait for it before reading t or storing out (a no-op otherwise).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    gemm_lora_term<NT, SW>(lo, M, tok0, strip0, S, 1.f / mult, acc);
  }
#pragma unroll
  for (int i = 0; i < SW; ++i) {
    if (strip0 + i >= S) continue;
    const int n0 = (strip0 + i) * 16;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tok = tok0 + nt * 8 + 2 * t;
      if (tok < M) {
        out[(size_t)tok * ldo + n0 + g] = __float2bfloat16_rn(acc[i][nt][0] * mult);
        out[(size_t)tok * ldo + n0 + g + 8] = __float2bfloat16_rn(acc[i][nt][2] * mult);
      }
      if (tok + 1 < M) {
        out[(size_t)(tok + 1) * ldo + n0 + g] = __float2bfloat16_rn(acc[i][nt][1] * mult);
        out[(size_t)(tok + 1) * ldo + n0 + g + 8] = __float2bfloat16_rn(acc[i][nt][3] * mult);
      }
    }
  }
}

template <int FMT, int NT, int SW, int R>
const void* gemm_ptr(bool lora) {
  return lora ? reinterpret_cast<const void*>(&fp4_gemm_kernel<FMT, NT, SW, R, true>)
              : reinterpret_cast<const void*>(&fp4_gemm_kernel<FMT, NT, SW, R, false>);
}

template <int FMT, int NT, int SW>
const void* pick_gemm_r(int r, bool lora) {
  if constexpr (NT == 16) {  // 128 tokens: at least 2 warps per group (a lone warp would stage 32 units per chunk)
    return r == 2 ? gemm_ptr<FMT, NT, SW, 2>(lora) : r == 4 ? gemm_ptr<FMT, NT, SW, 4>(lora)
         : r == 8 ? gemm_ptr<FMT, NT, SW, 8>(lora) : nullptr;
  } else if constexpr (SW == 2) {  // 2 strips per warp: at most 4 warps per group
    return r == 1 ? gemm_ptr<FMT, NT, SW, 1>(lora) : r == 2 ? gemm_ptr<FMT, NT, SW, 2>(lora)
         : r == 4 ? gemm_ptr<FMT, NT, SW, 4>(lora) : nullptr;
  } else {
    return r == 1 ? gemm_ptr<FMT, NT, SW, 1>(lora) : r == 2 ? gemm_ptr<FMT, NT, SW, 2>(lora)
         : r == 4 ? gemm_ptr<FMT, NT, SW, 4>(lora) : r == 8 ? gemm_ptr<FMT, NT, SW, 8>(lora) : nullptr;
  }
}

// Compiled variants: NT in {2, 4, 8} n8 token tiles (16, 32, 64 tokens per CTA) with SW in {1, 2} strips per warp,
// and NT = 16 (128 tokens) with SW = 1; R (warps per split-K group) in {1, 2, 4, 8}, but 2-4 for NT = 16 and 1-4
// for SW = 2; each without and with the LoRA epilogue.
template <int FMT>
const void* pick_gemm_fmt(int nt, int sw, int r, bool lora) {
  if (sw == 1) return nt == 2 ? pick_gemm_r<FMT, 2, 1>(r, lora) : nt == 4 ? pick_gemm_r<FMT, 4, 1>(r, lora)
                    : nt == 8 ? pick_gemm_r<FMT, 8, 1>(r, lora) : nt == 16 ? pick_gemm_r<FMT, 16, 1>(r, lora) : nullptr;
  if (sw == 2) return nt == 2 ? pick_gemm_r<FMT, 2, 2>(r, lora) : nt == 4 ? pick_gemm_r<FMT, 4, 2>(r, lora)
                    : nt == 8 ? pick_gemm_r<FMT, 8, 2>(r, lora) : nullptr;
  return nullptr;
}

const void* pick_gemm(int fmt, int nt, int sw, int r, bool lora = false) {
  return fmt == 0 ? pick_gemm_fmt<0>(nt, sw, r, lora) : fmt == 1 ? pick_gemm_fmt<1>(nt, sw, r, lora) : nullptr;
}

size_t gemm_smem(int nt, int sw, int r, int ks) {
  const size_t pipe = (size_t)ks * kStages * stage_bytes(nt, r * sw);
  const size_t red = (size_t)(ks - 1) * r * sw * nt * 32 * 16;
  return pipe > red ? pipe : red;
}

}  // namespace qfp4

// out (M, N) <- x (M, K) @ W^T for any M >= 1; same weight tensors as qfp4_gemv. nt: n8 token tiles per CTA,
// sw: strips per warp, r: warps per split-K group, ks: split-K groups (r * ks <= 8, ks <= C).
// t != nullptr: + the LoRA term in the epilogue (GemmLora above): t (M, R) bf16 with an even row stride ldt >= R,
// bn (N, rp) bf16 (rp a multiple of 16), members starting at rows 0, bound1, bound2 (multiples of 16) with ranks
// [roff_i, roff_i + rk_i) (multiples of 8; qfp4::lora_members).
// pdl (LoRA only): launch with programmatic stream serialization, so the main loop overlaps the previous kernel
// and only the LoRA epilogue waits for it (griddepcontrol.wait). Only for a previous kernel that writes t and nothing
// else this launch reads, itself launched after x's producer finished (t = x A^T by qerl.kernels.fused.lora_a just
// before, which triggers its dependents as it starts); nothing is stored before the wait.
// Returns a cudaError_t (0 = success), -1 = unsupported variant / configuration.
extern "C" int qfp4_gemm(const void* qw, const void* sc, const void* x, int ldx, void* out, int ldo, const float* gs,
                         float out_mult, unsigned bword, int M, int S, int C, int fmt, int nt, int sw, int r, int ks,
                         void* stream, const void* t, int ldt, const void* bn, int rp, int R, int bound1,
                         int bound2, const int* roff, const int* rk, int pdl, int kz, void* ws, long long ws_floats,
                         void* ctr, int ctr_len) {
  qfp4::GemmLora lo = {};
  if (pdl && t == nullptr) return -1;  // the plain variants never wait: under PDL they could read x early
  // kz > 1 (a QFP4_GEMM_KZ build only): K split across kz CTAs a tile; ws >= kz x tiles x the tile's r * 32 * sw * nt * 4
  // floats, ctr >= tiles zeroed ints (left zero); not under PDL (the launch before could still hold the workspace)
  if (kz < 1 || (kz > 1 && (!QFP4_GEMM_KZ || pdl || ws == nullptr || ctr == nullptr || kz * ks > C))) return -1;
  if (t != nullptr && !qfp4::gemm_lora(lo, t, bn, ldt, rp, R, bound1, bound2, roff, rk, S * 16, 4)) return -1;
  const void* fn = qfp4::pick_gemm(fmt, nt, sw, r, t != nullptr);
  // token rows are addressed by 32-bit element offsets (M * ldx < 2^32)
  if (fn == nullptr || M < 1 || S < 1 || ks < 1 || r * ks > qfp4::kGemmMaxWarps || ks > C ||
      (unsigned long long)M * (unsigned long long)ldx >= (1ull << 32))
    return -1;
  const size_t smem = qfp4::gemm_smem(nt, sw, r, ks);
  if (smem > (size_t)qfp4::kSmemMax) return -1;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
  }
  const int tm = 8 * nt, per = r * sw;
  const dim3 grid((unsigned)((M + tm - 1) / tm), (unsigned)((S + per - 1) / per), (unsigned)kz);
  if (grid.y > 65535u || kz > 64) return -1;
  if (kz > 1) {
    const long long tiles = (long long)grid.x * grid.y;
    if (tiles > ctr_len || (long long)kz * tiles * r * 32 * sw * nt * 4 > ws_floats) return -1;
  }
  float* wsf = static_cast<float*>(ws);
  int* ctri = static_cast<int*>(ctr);
  void* args[] = {(void*)&qw, (void*)&sc, (void*)&x, (void*)&ldx, (void*)&out, (void*)&ldo, (void*)&gs,
                  (void*)&out_mult, (void*)&bword, (void*)&M, (void*)&S, (void*)&C, (void*)&ks, (void*)&lo,
                  (void*)&wsf, (void*)&ctri};  // the last two are read by a QFP4_GEMM_KZ build's kernels only
  return (int)qfp4::launch_pdl(fn, grid, dim3((unsigned)(r * ks * 32)), smem, (cudaStream_t)stream, args, pdl != 0);
}

// Max resident CTAs per SM of one GEMM variant and launch shape (-1: unsupported).
extern "C" int qfp4_gemm_occupancy(int fmt, int nt, int sw, int r, int ks) {
  const void* fn = qfp4::pick_gemm(fmt, nt, sw, r);
  if (fn == nullptr) return -1;
  const size_t smem = qfp4::gemm_smem(nt, sw, r, ks);
  if (smem > 48 * 1024 && cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))
    return -1;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, r * ks * 32, smem)) return -1;
  return blocks;
}

// Registers and local-memory bytes per thread of one GEMM variant (-1 on error).
extern "C" int qfp4_gemm_attributes(int fmt, int nt, int sw, int r, int* regs, int* local_bytes) {
  return qfp4::kernel_attributes(qfp4::pick_gemm(fmt, nt, sw, r), regs, local_bytes);
}
