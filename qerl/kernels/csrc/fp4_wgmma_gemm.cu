// W4A16 GEMM for NVFP4 / MXFP4 weights at M = 17 .. a few hundred tokens on Hopper's warpgroup MMA (sm_90a
// wgmma.mma_async, bf16 in, fp32 accumulators), over the SAME re-laid-out weights as the decode GEMV and the
// mma.sync GEMM (fp4_mma_gemv.cu / fp4_mma_gemm.cu): one resident layout for every kernel.
//
// out (M, N) = x (M, K) @ W^T with the weight as wgmma's A operand (the MMA's M = 64 weight rows per warpgroup,
// decoded into registers: warp w of a warpgroup holds strip w's A fragment, which is the mma.sync m16n8k16 A
// fragment the GEMV decodes) and the tokens as the B operand (the MMA's N = the CTA's token tile, read by the tensor
// cores straight from shared memory through a matrix descriptor). Per MMA instruction a warpgroup does 64 x N x 16
// multiply-adds, so the per-MMA instruction cost of the mma.sync kernel (token fragments loaded by every warp,
// ~4-13 instructions per m16n8k16) is gone; the weight decode (~3 instructions per 8 weights) is paid once per
// chunk and overlaps the asynchronous MMAs of the previous chunk.
//
// The K permutation. The weight word j of lane (g, t) for chunk c holds k = 64 c + 16 t + 4 j + 0..3 of rows g and
// g + 8 (see fp4_mma_gemv.cu); used as the A fragment of MMA step j, its logical k (2t, 2t+1 | 2t+8, 2t+9) stand for
// those real k. The mma.sync kernels read the tokens with the same permutation from registers; wgmma reads B from
// shared memory in its own fixed order, so the tokens are permuted ONCE per call instead (qfp4_permute_x; permuting
// inside the GEMM while staging, with one 4-byte cp.async per word, measured 10-18% slower on an H200, session 31):
// in the permuted copy xp, chunk c's 16-byte unit u (logical k 8u .. 8u+7) holds the real 32-bit pairs (k, k+1) at
// k = 64 c + 16 i + 2 u (i = 0..3), i.e. its four words are words u, u + 8, u + 16, u + 24 of the chunk: a 4 x 4
// transpose of 32-bit words, one thread per (token, chunk, half). Then logical k 16 j + kl of step j is real
// k 64 c + 16 (kl % 8 / 2) + 4 j + 2 (kl / 8) + kl % 2: exactly the weights' permutation.
//
// A CTA = KS split-K groups of RW warpgroups. A group owns a contiguous range of the K chunks; its RW warpgroups
// own RW * 64 weight rows and share one token tile (NTOK tokens x 64 k per stage). Per group a kStages-deep
// cp.async pipeline stages, per chunk: the tokens (NTOK rows of 128 B, 16-byte unit u of row r at unit u ^ (r & 7):
// the 128-byte swizzle wgmma's descriptor names, 1024-byte aligned 8-row atoms), then each strip's 32 lanes' weight
// words (512 B) and scale pairs (64 B). The MMAs of chunk i run asynchronously while chunk i + 1 is acquired and
// decoded; the stage of chunk i - 1 is refilled only after every warpgroup of the group has waited for its MMAs of
// chunk i - 1 (wgmma.wait_group 0 at the end of chunk i - 1, then the group barrier that acquires chunk i + 1):
// lookahead kStages - 2 chunks. (With QFP4_WGMMA_TMA, the library's default, the variants of 128+ tokens a CTA
// stage the same bytes by tensor copies and free a stage on an mbarrier instead: see QFP4_WGMMA_TMA below.) The
// groups' partials are reduced through shared memory at the end; with splits of K
// across CTAs (gridDim.z = KZ > 1) the CTAs of a tile then add theirs through a workspace (see the epilogue). One
// launch (two with qfp4_permute_x), CUDA-graph capturable. The LORA variants add a LoRA term in the epilogue
// (WgLora below: t = bf16(x A^T) computed beforehand, one more MMA per 16 ranks with the Bn rows as A).
// Grid: x = token tiles (fastest, so CTAs in flight together share a row block's weights through L2), y = row blocks,
// z = CTA splits of K; or, for the stream-K variants (SK), as many persistent CTAs as fit the device, walking the
// tiles in the same order (see the kernel's stream-K part).

#include "fp4_mma_common.cuh"
#include "fp4_wgmma_ops.cuh"

// QFP4_WGMMA_PIPE (the build's -D, set by QERL_WGMMA_PIPE; qerl/kernels/cuda_fp4.py): 2, the default, keeps two
// chunks' MMAs in flight per warpgroup (two register sets, wait_group 1), so a warpgroup issues chunk i + 1's MMAs
// before chunk i's complete; 1 keeps one (wait_group 0 every chunk). Both pass the SASS check (no write to an
// in-flight A register: benchmarks/wgmma_sass_check.py); 2 measured 3-5% faster on an H100 (session 32).
#ifndef QFP4_WGMMA_PIPE
#define QFP4_WGMMA_PIPE 2
#endif
#if QFP4_WGMMA_PIPE != 1 && QFP4_WGMMA_PIPE != 2
#error "QFP4_WGMMA_PIPE must be 1 or 2"
#endif

// QFP4_WGMMA_PDL (the build's -D, set by QERL_WGMMA_LORA=pdl, the default since session 37): 1 compiles a
// griddepcontrol.wait after each main loop of the LORA variants, so they can be launched under programmatic dependent
// launch (qfp4_wgmma_gemm's pdl); 0 (QERL_WGMMA_LORA=1 or 0) leaves them without it (the plain variants' machine code
// is the same in both builds).
#ifndef QFP4_WGMMA_PDL
#define QFP4_WGMMA_PDL 0
#endif

// QFP4_WGMMA_ABLATE (timing experiments only, benchmarks/wgmma_ablate.py: a module of its own that nothing else
// loads; its results are WRONG): bits that leave one part of the main loop out, to measure what it costs. 1: the
// token tile is staged for the pipeline's first chunks only (later chunks read stale tiles); 2: the same for the
// weight words and scales; 4: no decode (one XOR of the packed word with the scale pair per A register, which keeps
// the loads); 8: no group barrier when a chunk is acquired; 16: the MMAs' A operand from shared memory (SS; see
// mma_chunk). 0, the library's build, compiles exactly the kernel without these lines (same SASS, checked when they
// were added).
#ifndef QFP4_WGMMA_ABLATE
#define QFP4_WGMMA_ABLATE 0
#endif

// QFP4_WGMMA_TMA (the build's -D, set by QERL_WGMMA_TMA=1, the library's default since session 41): the grid
// variants of 128+ tokens a CTA (not stream-K) stage each chunk by the tensor memory accelerator instead of every
// thread's cp.async: the group's first thread issues three 2-D tensor copies per chunk (the token tile, 128-byte
// swizzled by the copy engine, rows past M filled with zeros; the group's RW * 4 strips' weight words; their scale
// pairs), completing on the stage's "full" mbarrier, and every thread of the group marks the stage free on its
// "empty" mbarrier once its MMAs of that chunk are retired; the group barrier of a chunk's acquisition is gone. Same
// data in shared memory (in this build the scale pairs of a strip SL * 2 bytes apart instead of 64), same MMAs in the
// same order: the same results. The tensor maps are encoded per launch on the host (cuTensorMapEncodeTiled from the
// driver, found through the runtime) and passed as a __grid_constant__ kernel parameter. Needs QFP4_WGMMA_PIPE 2.
// Measured on an H200 (session 41, raw/h200_s41_tma, A B B A): the 7B products at their tuned 128- and 256-token
// configs 2.9-8.8% faster; the same path in the 32/64-token variants made them 3-8% slower (issuing the copies from
// each warp in turn instead of the first: slower still), so those keep cp.async.
#ifndef QFP4_WGMMA_TMA
#define QFP4_WGMMA_TMA 0
#endif
#if QFP4_WGMMA_TMA && QFP4_WGMMA_PIPE != 2
#error "QFP4_WGMMA_TMA needs QFP4_WGMMA_PIPE 2"
#endif
// QFP4_WGMMA_TAIL (the build's -D, set by QERL_WGMMA_TAIL=1, the library's default since session 50): the grid
// variants take a "tail split" launch (kz < 0 at the launcher: kt = -kz): the output tiles up to the last whole wave
// of CTAs run whole, one CTA each, and each tile of the last, partial wave is split kt ways along K across CTAs (the
// split-K of kz > 1: fp32 partials, the last CTA to finish a tile adds them in split order). Session 50 measured the
// 7B gate|up product at 128 tokens (296 tiles on 132 SMs) at 3 x the time of one wave (raw/h200_s50_waves): the last
// 32 tiles cost a whole wave; split 4 ways, the product ran 9% faster (raw/h200_s50_tail). The kernel parameters
// tail_dp (tiles run whole; the grid is 1-D then) and tail_kt are in this build only: QERL_WGMMA_TAIL=0's kernels
// keep session 49's signature and machine code.
#ifndef QFP4_WGMMA_TAIL
#define QFP4_WGMMA_TAIL 0
#endif
#if QFP4_WGMMA_TAIL
#define QFP4_WG_TAIL_PARAM , int tail_dp, int tail_kt
#else
#define QFP4_WG_TAIL_PARAM
#endif
#if QFP4_WGMMA_TMA
#include <cuda.h>  // CUtensorMap and the encoder's types (the driver itself is reached through the runtime)
#endif
// QFP4_WGMMA_STSM (the build's -D, set by QERL_WGMMA_STSM=1; an experiment, 0 by default: the kernels without it):
// the epilogue writes the output tile through shared memory instead of one 2-byte store per element. A thread's
// accumulators hold weight rows g and g + 8 of two tokens each, so the plain epilogue's store instructions write 16
// bytes of each of 4 tokens (half of every 32-byte sector; 8 instructions per 512 bytes written). Here, per 16 tokens
// a warp rounds its 16 rows x 16 tokens to bf16 pairs, stores them transposed by one stmatrix.x4.trans into a
// 512-byte buffer of its own ([token][16 rows], in the group's second stage), reads them back 16 bytes a lane and
// writes them as one 16-byte store a lane: token lane / 2, rows 8 (lane % 2) ..: whole sectors, one instruction per
// 512 bytes. The same values (each element rounded once as before). The group synchronizes before (every warp done
// with the stages: the main loop's, the split-K reduction's, the LoRA tile's) and after (stream-K's next tile stages
// into them). Where out's row stride or start is not 16-byte aligned the plain stores run.
#ifndef QFP4_WGMMA_STSM
#define QFP4_WGMMA_STSM 0
#endif

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QFP4_WGMMA 1
#else
#define QFP4_WGMMA 0
#endif

namespace qfp4 {
namespace wg {

constexpr int kStages = 4;  // a power of 2; lookahead kStages - 2 chunks (see above)
constexpr int kSmemMax = 227 * 1024;

#if QFP4_WGMMA
// Launched under programmatic dependent launch (qfp4_wgmma_gemm's pdl, LORA variants only), the main loop ran while
// the previous grid (the one computing t) finished: wait for it before the first global store or read of t (a no-op
// when launched without PDL, and after the first wait).
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
#if QFP4_WGMMA_TMA
// The tensor copies of QFP4_WGMMA_TMA and their mbarriers (mbar_init / mbar_arrive / mbar_wait:
// fp4_mma_common.cuh). The producer's arrival, announcing the bytes its copies will complete on the barrier.
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// The box of the 2-D tensor map at (inner, outer) into shared memory at dst, completing on bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int inner, int outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(bar)
      : "memory");
}
#endif

// One chunk of 64 k: the four k16 MMAs of a warpgroup, A from a[j] (this thread's fragments), B from the K-major,
// 128-byte-swizzled tile at shared address b_s, committed as one group (the caller waits for it). QFP4_WGMMA_ABLATE &
// 16 (timing only, wrong results): A from shared memory instead, the first 64 rows at b_s read through the same kind of
// descriptor (SS MMAs; the fragments a[j] are computed and kept alive as before, but no MMA reads them).
template <int NTOK>
__device__ __forceinline__ void mma_chunk(float (&acc)[NTOK / 2], const uint32_t (&a)[4][4], uint32_t b_s) {
  wgmma_fence();
  const uint32_t lo = desc_lo(b_s);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if constexpr (QFP4_WGMMA_ABLATE & 16) {
      wgmma_ss<NTOK>(acc, lo + 2 * j, kDescHi, lo + 2 * j, kDescHi);
    } else {
      wgmma_rs<NTOK>(acc, a[j][0], a[j][1], a[j][2], a[j][3], lo + 2 * j, kDescHi);
    }
  }
  wgmma_commit();
}
#endif

#if QFP4_WGMMA_STSM
// QFP4_WGMMA_STSM's epilogue: four 8x8 bf16 matrices (lane (g, t) holds row g, columns 2 t, 2 t + 1 of each)
// stored transposed (column c of matrix i at the address lane 8 i + c gives), then 16 bytes of shared memory back,
// then 16 bytes to global memory in one instruction.
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ uint4 ld_shared16(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr)
               : "memory");
  return v;
}
__device__ __forceinline__ void st_global16(void* p, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint32_t bf16_pair(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (the low half) = lo, each rounded once
  return *reinterpret_cast<const uint32_t*>(&v);
}
#endif

// Whether a variant stages its chunks by tensor copies (QFP4_WGMMA_TMA): the kernel's path and the launcher's maps.
__host__ __device__ constexpr bool tma_staged(int ntok, bool sk) {
  return QFP4_WGMMA_TMA && !sk && ntok >= 128;
}

// Bytes of one pipeline stage of a group (a multiple of 1024: every token tile starts on a swizzle atom).
__host__ __device__ constexpr int stage_bytes(int ntok, int rw) {
  return (ntok * 128 + rw * 4 * (512 + 64) + 1023) / 1024 * 1024;
}

// The LoRA term of the LORA variants, added in the epilogue: out += t Bn^T per member, t = bf16(x A^T) (M, R)
// computed beforehand, Bn (N, rp) = each row's member's scaling * lora_B row, zero past its rank (the GEMV's Bn,
// cuda_fp4.LoraOperand); member i's rows (starting at 0, bound1, bound2; multiples of 16) use ranks
// [roff_i, roff_i + rk_i) of t. Ranks, offsets and R are multiples of 8 (16-byte staging of t, 32-bit Bn pairs).
struct WgLora {
  const __nv_bfloat16* t;
  const __nv_bfloat16* bn;
  int ldt, rp, R;
  int bound1, bound2;
  int roff[3], rk[3];
};

// The tensor maps of QFP4_WGMMA_TMA (the last kernel parameter, __grid_constant__, in that build only: the other
// builds' kernels keep their signature and machine code): xp (bf16, 64 C x M, boxes of 64 x NTOK, 128-byte swizzle),
// the weight words (64-bit units, 64 C x S: a strip's chunk is 64 units, boxes of 64 x 4 RW) and the scale pairs
// (16-bit, SL C x S, boxes of SL x 4 RW).
#if QFP4_WGMMA_TMA
struct WgMaps {
  CUtensorMap x, w, s;
};
#define QFP4_WG_MAPS_PARAM , const __grid_constant__ WgMaps maps
#else
#define QFP4_WG_MAPS_PARAM
#endif

// xp: x already permuted by qfp4_permute_x (M, 64 C contiguous), staged in 16-byte units. SK false: the grid is
// (token tiles, row blocks, CTA splits of K); SK true: stream-K (persistent CTAs, see the stream-K part below; its
// segment loop costs ~35 registers at 128 tokens per CTA, so it is a variant of its own).
template <int FMT, int NTOK, int RW, int KS, bool LORA, bool SK>
__global__ void __launch_bounds__(RW * KS * 128, 1)
fp4_wgmma_kernel(const uint4* __restrict__ qw, const uint16_t* __restrict__ sc, const __nv_bfloat16* __restrict__ xp,
                 __nv_bfloat16* __restrict__ out, int ldo, const float* __restrict__ gs, float out_mult,
                 uint32_t bword, int M, int S, int C, float* __restrict__ ws, int* __restrict__ ctr, const WgLora la
                 QFP4_WG_TAIL_PARAM QFP4_WG_MAPS_PARAM) {
#if QFP4_WGMMA
  constexpr int SL = FMT == 0 ? 32 : 16;  // scale pairs per (strip, chunk)
  constexpr int XB = NTOK * 128;          // bytes of one staged chunk of tokens
  constexpr int GT = RW * 128;            // threads of one split-K group
  constexpr int SB = stage_bytes(NTOK, RW);
  constexpr int NA = NTOK / 2;            // accumulators per thread
  // chunks staged by tensor copies (QFP4_WGMMA_TMA; the grid variants of 128+ tokens a CTA)
  [[maybe_unused]] constexpr bool TMA = tma_staged(NTOK, SK);
  constexpr int SP = QFP4_WGMMA_TMA ? SL * 2 : 64;  // bytes between two strips' scale pairs in a stage
  extern __shared__ unsigned char smem_raw[];
  // 1024-byte alignment of the stages (the launch asks for 1 KB more than the stages need)
  const uint32_t raw_s = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t pad = (1024u - (raw_s & 1023u)) & 1023u;
  unsigned char* smem = smem_raw + pad;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int wgi = warp >> 2, wq = warp & 3;
  const int grp = wgi / RW, wr = wgi - grp * RW;
  const int gtid = threadIdx.x - grp * GT;
  const int bar = 1 + grp;  // the group's named barrier
  unsigned char* gbase = smem + grp * kStages * SB;
  const uint32_t gbase_s = raw_s + pad + grp * kStages * SB;
  const int my_w = XB + (wr * 4 + wq) * 512;             // this warp's weight words inside a stage
  const int my_s = XB + RW * 4 * 512 + (wr * 4 + wq) * SP;  // and its scale pairs
#if QFP4_WGMMA_TMA
  // per split-K group and stage: "full" (the producer's arrival + the copies' bytes), "empty" (the group's threads)
  __shared__ alignas(8) uint64_t tma_bar[KS][2][kStages];
  const uint32_t full_s = static_cast<uint32_t>(__cvta_generic_to_shared(&tma_bar[grp][0][0]));
  const uint32_t empty_s = full_s + kStages * 8;
  if constexpr (TMA) {
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.x)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.w)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&maps.s)) : "memory");
#pragma unroll
      for (int k = 0; k < KS; ++k)
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
          const uint32_t f = static_cast<uint32_t>(__cvta_generic_to_shared(&tma_bar[k][0][s]));
          mbar_init(f, 1);
          mbar_init(f + kStages * 8, GT);
        }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
#endif

  float acc[NA];

  // acc = the product over chunks [c0, c0 + n) (n >= 1) of the token tile at tok0 and this warp's strip.
  auto mainloop = [&](int tok0, int strip, int c0, int n) {
#pragma unroll
    for (int i = 0; i < NA; ++i) acc[i] = 0.f;
    TokenStager<NTOK, GT> tokens(xp, C * 64, tok0, c0, M, gtid);
    const int st = max(0, min(strip, S - 1));  // strips past S compute garbage that is never stored
    const uint4* wq_p = qw + ((size_t)st * C + c0) * 32 + lane;
    const uint16_t* sq_p = sc + ((size_t)st * C + c0) * SL + lane * 8;

    auto stage = [&](int idx) {
#if QFP4_WGMMA_TMA
      if constexpr (TMA) {
        // the group's first thread: once every thread has released the stage's previous chunk (idx - kStages), the
        // three copies of chunk idx into it, completing on its full barrier
        if (idx < n && gtid == 0) {
          const int sidx = idx & (kStages - 1);
          if (idx >= kStages) mbar_wait(empty_s + sidx * 8, ((idx / kStages) - 1) & 1);
          const uint32_t dst = gbase_s + sidx * SB, fb = full_s + sidx * 8;
          mbar_expect(fb, XB + RW * 4 * (512 + SP));
          const int c = c0 + idx, strip0 = (strip - wr * 4 - wq);  // the group's first strip
          tma_load_2d(dst, &maps.x, 64 * c, tok0, fb);
          tma_load_2d(dst + XB, &maps.w, 64 * c, strip0, fb);
          tma_load_2d(dst + XB + RW * 4 * 512, &maps.s, SL * c, strip0, fb);
        }
        return;
      }
#endif
      if (idx < n) {
        const uint32_t dst = gbase_s + (idx & (kStages - 1)) * SB;
        if (!(QFP4_WGMMA_ABLATE & 1) || idx < kStages - 2) tokens.stage(dst);
        if (!(QFP4_WGMMA_ABLATE & 2) || idx < kStages - 2) {
          cp_async16(dst + my_w + lane * 16, wq_p, true);
          if (lane < SL / 8) cp_async16(dst + my_s + lane * 16, sq_p, true);
        }
        wq_p += 32;
        sq_p += SL;
      }
      cp_async_commit();
    };

    // Chunk idx + 1 is acquired (landed, visible to the async proxy, the group synchronized, the next stage
    // refilled) and decoded while chunk idx's MMAs run; then wgmma.wait_group 0. The asynchronous MMAs read their A
    // registers after issue, and ptxas reuses the physical registers of an operand after its last PTX use
    // (measured: with wait_group 1 at the end of the chunk the next chunk's decode overwrote the in-flight fragments
    // at 128 and 256 tokens per CTA), so each chunk's fragments are kept alive (keep_regs) until the wait that
    // completes them; holding the previous chunk's fragments across the loop's back edge instead makes ptxas
    // serialize every MMA.
    auto acquire = [&](int idx) {
#if QFP4_WGMMA_TMA
      if constexpr (TMA) {
        stage(idx + kStages - 2);  // into chunk idx - 2's stage, once the group has released it
        mbar_wait(full_s + (idx & (kStages - 1)) * 8, (idx / kStages) & 1);  // chunk idx's tokens have landed
        return;
      }
#endif
      cp_async_wait<kStages - 3>();  // this thread's copies of chunk idx have landed
      fence_proxy_async();            // ... and are visible to the tensor cores' (async proxy) reads
      if (!(QFP4_WGMMA_ABLATE & 8)) group_sync(bar, GT);  // every thread's; and chunk idx - 2's MMAs are done in
                                                         // every warpgroup
      stage(idx + kStages - 2);       // into chunk idx - 2's stage
    };
    auto decode = [&](int idx, uint32_t (&a)[4][4]) {
      const unsigned char* sb = gbase + (idx & (kStages - 1)) * SB;
      const uint4 w = *reinterpret_cast<const uint4*>(sb + my_w + lane * 16);
      const uint32_t s16 = *reinterpret_cast<const uint16_t*>(sb + my_s + 2 * (FMT == 0 ? lane : lane >> 1));
      uint32_t sg, sg8;
      if constexpr (QFP4_WGMMA_ABLATE & 4) {
        const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int o = 0; o < 4; ++o) a[j][o] = words[j] ^ s16;
        return;
      }
      scale_words<FMT>(s16, bword, sg, sg8);
      decode_word(w.x, sg, sg8, a[0]);
      decode_word(w.y, sg, sg8, a[1]);
      decode_word(w.z, sg, sg8, a[2]);
      decode_word(w.w, sg, sg8, a[3]);
    };
#pragma unroll
    for (int s = 0; s < kStages - 2; ++s) stage(s);
#pragma unroll
    for (int i = 0; i < NA; ++i) fence_reg(acc[i]);
    if constexpr (QFP4_WGMMA_PIPE == 2) {
      // chunk idx's MMAs retired and its decode read: this thread is done with its stage (QFP4_WGMMA_TMA)
      auto release = [&](int idx) {
#if QFP4_WGMMA_TMA
        if constexpr (TMA) mbar_arrive(empty_s + (idx & (kStages - 1)) * 8);
#endif
      };
      auto mma = [&](int idx, const uint32_t (&a)[4][4]) {
        mma_chunk<NTOK>(acc, a, gbase_s + (idx & (kStages - 1)) * SB);
      };
      // Two register sets, even chunks in a0, odd in a1 (the loop runs two chunks per pass, so neither set is
      // copied): chunk idx's MMAs are issued while chunk idx - 1's may still run; wait_group 1 then retires chunk
      // idx - 1's, and only after that its set is refilled with chunk idx + 1 (acquired and decoded while chunk
      // idx's MMAs run).
      uint32_t a0[4][4], a1[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int o = 0; o < 4; ++o) a1[j][o] = 0u;
      acquire(0);
      decode(0, a0);
      for (int idx = 0; idx < n; idx += 2) {
        mma(idx, a0);
        wgmma_wait<1>();  // chunk idx - 1's MMAs (a1) are done; chunk idx's may run
        keep_regs(a1);
        if (idx > 0) release(idx - 1);
        if (idx + 1 >= n) break;
        acquire(idx + 1);
        decode(idx + 1, a1);
        mma(idx + 1, a1);
        wgmma_wait<1>();  // chunk idx's (a0) are done
        keep_regs(a0);
        release(idx);
        if (idx + 2 < n) {
          acquire(idx + 2);
          decode(idx + 2, a0);
        }
      }
    } else {
      uint32_t a[4][4];
      acquire(0);
      decode(0, a);
      for (int idx = 0; idx < n; ++idx) {
        mma_chunk<NTOK>(acc, a, gbase_s + (idx & (kStages - 1)) * SB);
        uint32_t an[4][4];
        if (idx + 1 < n) {
          acquire(idx + 1);
          decode(idx + 1, an);
        }
        wgmma_wait<0>();
        keep_regs(a);
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int o = 0; o < 4; ++o) a[j][o] = an[j][o];
      }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < NA; ++i) fence_reg(acc[i]);
    cp_async_wait<0>();
  };

  // The finished tile (acc: the full sum over K, in fragment order) to out: the LoRA term first (LORA variants),
  // then the bf16 rounding. The group's warpgroups only; the group's stages are free (its caller synchronized it).
  auto epilogue = [&](int tok0, int strip) {
    const int st = max(0, min(strip, S - 1));
    if constexpr (LORA) {
      // The accumulators to output units, then the LoRA MMAs add t Bn^T onto them (stored with multiplier 1), 64
      // ranks per pass: t's tile staged like the tokens (128-byte swizzle, natural rank order, zero past M and R)
      // in the group's first stage, this warp's A fragments = its 16 Bn rows at the ranks of its member (zero
      // outside them).
      const float m0 = FMT == 0 ? out_mult / __ldg(gs) : out_mult;
#pragma unroll
      for (int i = 0; i < NA; ++i) acc[i] *= m0;
      const int nrow = st * 16;
      const int mb = nrow < la.bound1 ? 0 : nrow < la.bound2 ? 1 : 2;
      const int r0 = mb == 0 ? la.roff[0] : mb == 1 ? la.roff[1] : la.roff[2];
      const int rk = mb == 0 ? la.rk[0] : mb == 1 ? la.rk[1] : la.rk[2];
      const uint32_t* bg = reinterpret_cast<const uint32_t*>(la.bn + (size_t)(nrow + g) * la.rp);
      const uint32_t* b8 = bg + 4 * la.rp;  // row g + 8
      const uint32_t ts = gbase_s;          // the group's first stage (1024-aligned)
      for (int c0 = 0; c0 < la.R; c0 += 64) {
        group_sync(bar, GT);  // the stage free: the main loop's, the reduction's or the previous pass's reads done
        for (int u = gtid; u < NTOK * 8; u += GT) {
          const int row = u >> 3, unit = u & 7, r = c0 + 8 * unit;
          const bool ok = tok0 + row < M && r < la.R;
          cp_async16(ts + row * 128 + ((unit ^ (row & 7)) << 4),
                     ok ? la.t + (size_t)(tok0 + row) * la.ldt + r : la.t, ok);
        }
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async();
        group_sync(bar, GT);
        uint32_t a[4][4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int kk = c0 + 16 * j + 2 * t - r0;  // this lane's first rank pair in its member's Bn columns
          const bool lo = kk >= 0 && kk < rk, hi = kk + 8 >= 0 && kk + 8 < rk;
          a[j][0] = lo ? __ldg(bg + (kk >> 1)) : 0u;
          a[j][1] = lo ? __ldg(b8 + (kk >> 1)) : 0u;
          a[j][2] = hi ? __ldg(bg + ((kk + 8) >> 1)) : 0u;
          a[j][3] = hi ? __ldg(b8 + ((kk + 8) >> 1)) : 0u;
        }
        mma_chunk<NTOK>(acc, a, ts);
        wgmma_wait<0>();
        keep_regs(a);
      }
#pragma unroll
      for (int i = 0; i < NA; ++i) fence_reg(acc[i]);
    }
#if QFP4_WGMMA_STSM
    group_sync(bar, GT);  // every warp of the group done with the stages (see QFP4_WGMMA_STSM)
    const bool staged = (ldo & 7) == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0;
    if (staged && strip < S) {
      const float mu = LORA ? 1.f : FMT == 0 ? out_mult / __ldg(gs) : out_mult;
      const uint32_t buf = gbase_s + SB + (gtid >> 5) * 512;  // this warp's buffer in the group's second stage
      const int mi = lane >> 3, mr = lane & 7;  // the matrix and row whose address this lane gives
      __nv_bfloat16* dst = out + strip * 16 + 8 * (lane & 1);
#pragma unroll
      for (int j2 = 0; j2 < NTOK / 16; ++j2) {
        // matrices: rows 0-7 / 8-15 (v < 2 / v >= 2) of tokens 16 j2 + 0..7 (j = 2 j2), then of + 8..15 (j = 2 j2 + 1)
        const int a = 8 * j2;  // the accumulators of tokens 16 j2 .. 16 j2 + 15 (constant indices: registers)
        stmatrix_x4_trans(buf + ((mi >> 1) * 8 + mr) * 32 + (mi & 1) * 16, bf16_pair(acc[a] * mu, acc[a + 1] * mu),
                          bf16_pair(acc[a + 2] * mu, acc[a + 3] * mu), bf16_pair(acc[a + 4] * mu, acc[a + 5] * mu),
                          bf16_pair(acc[a + 6] * mu, acc[a + 7] * mu));
        __syncwarp();
        const uint4 v = ld_shared16(buf + lane * 16);  // token 16 j2 + lane / 2, rows 8 (lane % 2) .. + 7
        const int tok = tok0 + 16 * j2 + (lane >> 1);
        if (tok < M) st_global16(dst + (size_t)tok * ldo, v);
        __syncwarp();  // the buffer read before the next tokens overwrite it
      }
    }
    group_sync(bar, GT);  // the buffers read before the group stages again (stream-K's next tile)
    if (staged) return;
#endif
    if (strip >= S) return;
    float mult = out_mult;
    if (FMT == 0) mult = out_mult / __ldg(gs);
    if constexpr (LORA) mult = 1.f;  // applied before the LoRA term
    // accumulator 4 j + v: weight row 16 wq + g (+ 8 for v >= 2) of the warpgroup, token 8 j + 2 t (+ 1 for odd v)
    const int n0 = strip * 16;
#pragma unroll
    for (int j = 0; j < NTOK / 8; ++j) {
      const int tok = tok0 + 8 * j + 2 * t;
      if (tok < M) {
        out[(size_t)tok * ldo + n0 + g] = __float2bfloat16_rn(acc[4 * j + 0] * mult);
        out[(size_t)tok * ldo + n0 + g + 8] = __float2bfloat16_rn(acc[4 * j + 2] * mult);
      }
      if (tok + 1 < M) {
        out[(size_t)(tok + 1) * ldo + n0 + g] = __float2bfloat16_rn(acc[4 * j + 1] * mult);
        out[(size_t)(tok + 1) * ldo + n0 + g + 8] = __float2bfloat16_rn(acc[4 * j + 3] * mult);
      }
    }
  };

  if constexpr (!SK) {
#if QFP4_WGMMA_TAIL
    // the CTA's output tile (token tile bx, row block by), its split bz of K and the tile's splits kz: the grid's
    // (x, y, z), or in a tail split (tail_kt > 1, a 1-D grid) CTA b < tail_dp: tile b whole, then tail_kt CTAs a tile
    int bx = blockIdx.x, by = blockIdx.y, bz = blockIdx.z, kz = gridDim.z, tile_ = by * gridDim.x + bx;
    int tiles_ = gridDim.x * gridDim.y;
    if (tail_kt > 1) {
      const int tx_n = (M + NTOK - 1) / NTOK, u = (int)blockIdx.x - tail_dp;
      tiles_ = tx_n * ((S + 4 * RW - 1) / (4 * RW));
      tile_ = u < 0 ? (int)blockIdx.x : tail_dp + u / tail_kt;
      bz = u < 0 ? 0 : u - (u / tail_kt) * tail_kt;
      kz = u < 0 ? 1 : tail_kt;
      bx = tile_ % tx_n;
      by = tile_ / tx_n;
    }
#define QFP4_BX bx
#define QFP4_BY by
#define QFP4_BZ bz
#define QFP4_KZ kz
#define QFP4_TILE tile_
#define QFP4_TILES tiles_
#else
#define QFP4_BX blockIdx.x
#define QFP4_BY blockIdx.y
#define QFP4_BZ blockIdx.z
#define QFP4_KZ gridDim.z
#define QFP4_TILE blockIdx.y * gridDim.x + blockIdx.x
#define QFP4_TILES gridDim.x * gridDim.y
#endif
    const int tok0 = QFP4_BX * NTOK;
    const int strip = (QFP4_BY * RW + wr) * 4 + wq;
    // split q of the KZ * KS splits of K: CTA split QFP4_BZ (blockIdx.z; gridDim.z = KZ), group grp inside it
    const int KZ = QFP4_KZ, q = QFP4_BZ * KS + grp;
    const int c0 = (int)((long long)q * C / (KZ * KS)), c1 = (int)((long long)(q + 1) * C / (KZ * KS));
    mainloop(tok0, strip, c0, c1 - c0);  // >= 1 chunk: the caller keeps KZ * KS <= C
    if constexpr (LORA && QFP4_WGMMA_PDL) wait_prior_grid();

    if constexpr (KS > 1) {
      __syncthreads();  // every group is done with its stages: shared memory is free for the reduction
      float* red = reinterpret_cast<float*>(smem);
      const int tw = threadIdx.x & 127;  // thread within the warpgroup
      if (grp > 0) {
#pragma unroll
        for (int i = 0; i < NA; ++i) red[(((grp - 1) * RW + wr) * NA + i) * 128 + tw] = acc[i];
      }
      __syncthreads();
      if (grp > 0) return;
#pragma unroll
      for (int sp = 1; sp < KS; ++sp)
#pragma unroll
        for (int i = 0; i < NA; ++i) acc[i] += red[(((sp - 1) * RW + wr) * NA + i) * 128 + tw];
    }
    // Split-K across CTAs (KZ > 1): every CTA of an output tile writes its partial sums (fp32, in fragment order) to
    // the workspace; the last to finish (a per-tile counter) adds the KZ partials in split order -- deterministic,
    // no floating-point atomics -- and writes the tile; it leaves the counter at zero for the next launch.
    if (KZ > 1) {
      const int rt = threadIdx.x;  // group 0's threads: 0 .. GT - 1
      const int tile = QFP4_TILE;
      const size_t tile_floats = (size_t)NA * GT;
      float* mine = ws + ((size_t)QFP4_BZ * QFP4_TILES + tile) * tile_floats;
#pragma unroll
      for (int i = 0; i < NA; ++i) __stcg(mine + (size_t)i * GT + rt, acc[i]);
      if (!last_of_splits(ctr, tile, KZ, rt, GT)) return;
#pragma unroll
      for (int i = 0; i < NA; ++i) acc[i] = 0.f;
      for (int z = 0; z < KZ; ++z) {
        const float* part = ws + ((size_t)z * QFP4_TILES + tile) * tile_floats;
#pragma unroll
        for (int i = 0; i < NA; ++i) acc[i] += __ldcg(part + (size_t)i * GT + rt);
      }
      if (rt == 0) ctr[tile] = 0;
    }
    epilogue(tok0, strip);
#undef QFP4_BX
#undef QFP4_BY
#undef QFP4_BZ
#undef QFP4_KZ
#undef QFP4_TILE
#undef QFP4_TILES
  } else {
  // Stream-K (SK; a grid of P CTAs, at most as many as fit the device at once), after a data-parallel part: each
  // split-K group of each CTA is one of P KS workers; the tiles (token tile fastest) up to the last whole multiple
  // of P KS go round-robin, whole (worker w: tiles w, w + P KS, ...), and the U = rest x C (tile, chunk) units of
  // the rest are split evenly: W = min(P KS, U) workers, worker w takes units [w U / W, (w + 1) U / W) after those,
  // walking them as segments of one tile each. A tile a worker covers whole is stored at once; a tile shared by
  // several workers (at most the first and the last of a worker's segments) is written as an fp32 partial to slot
  // 2 w (its first tile) or 2 w + 1 (its last), and the last contributor to finish (a per-tile counter) adds the
  // partials in worker order -- deterministic -- runs the epilogue and leaves the counter at zero. So the last,
  // partial wave of tiles runs on every SM instead of a fraction of them, and only it pays for partials.
  const int tx_n = (M + NTOK - 1) / NTOK, ty_n = (S + 4 * RW - 1) / (4 * RW);
  const int tiles = tx_n * ty_n, P = (int)gridDim.x * KS;
  const int w = (int)blockIdx.x * KS + grp;
  const int DP = tiles / P * P;  // tiles done whole, round-robin
  for (int tile = w; tile < DP; tile += P) {
    const int tok0 = (tile % tx_n) * NTOK;
    const int strip = ((tile / tx_n) * RW + wr) * 4 + wq;
    mainloop(tok0, strip, 0, C);
    if constexpr (LORA && QFP4_WGMMA_PDL) wait_prior_grid();
    group_sync(bar, GT);  // every warp of the group is done with the stages (MMAs waited, decodes read)
    epilogue(tok0, strip);
    if constexpr (LORA) group_sync(bar, GT);  // and with the LoRA tile in the first stage
  }
  const int U = (tiles - DP) * C;  // the launcher keeps P * U < 2^31
  const int W = min(P, U), u0 = DP * C;
  if (w >= W) return;  // the whole group (no CTA-wide barrier follows)
  auto first_unit = [&](int v) { return u0 + v * U / W; };
  auto owner = [&](int u) {  // the worker whose units hold u
    int v = (u - u0) * W / U;
    while (v + 1 < W && first_unit(v + 1) <= u) ++v;
    return v;
  };
  __shared__ int last_sk[KS];
  const size_t tile_floats = (size_t)NA * GT;
  const int u_end = first_unit(w + 1), t_first = first_unit(w) / C;
  for (int u = first_unit(w); u < u_end;) {
    const int tile = u / C;
    const int a = u - tile * C;
    const int b = min(C, a + (u_end - u));
    u += b - a;
    const int tok0 = (tile % tx_n) * NTOK;
    const int strip = ((tile / tx_n) * RW + wr) * 4 + wq;
    mainloop(tok0, strip, a, b - a);
    if constexpr (LORA && QFP4_WGMMA_PDL) wait_prior_grid();
    group_sync(bar, GT);  // every warp of the group is done with the stages (MMAs waited, decodes read)
    if (a > 0 || b < C) {
      float* mine = ws + ((size_t)w * 2 + (tile == t_first ? 0 : 1)) * tile_floats;
#pragma unroll
      for (int i = 0; i < NA; ++i) __stcg(mine + (size_t)i * GT + gtid, acc[i]);
      __threadfence();
      group_sync(bar, GT);
      const int v0 = owner(tile * C), v1 = owner(tile * C + C - 1);
      if (gtid == 0) last_sk[grp] = atomicAdd(ctr + tile, 1) == v1 - v0;
      group_sync(bar, GT);
      if (!last_sk[grp]) continue;
      __threadfence();
#pragma unroll
      for (int i = 0; i < NA; ++i) acc[i] = 0.f;
      for (int v = v0; v <= v1; ++v) {
        const float* part = ws + ((size_t)v * 2 + (tile == first_unit(v) / C ? 0 : 1)) * tile_floats;
#pragma unroll
        for (int i = 0; i < NA; ++i) acc[i] += __ldcg(part + (size_t)i * GT + gtid);
      }
      if (gtid == 0) ctr[tile] = 0;
    }
    epilogue(tok0, strip);
    if constexpr (LORA) group_sync(bar, GT);  // every warp done with the LoRA tile before the next segment stages
  }
  }
#else
  __trap();  // compiled for sm_90a only (the launcher refuses other devices)
#endif
}

// The tokens in the kernels' K permutation (see the top of this file): xp[m, 64 c + 8 u + 2 i + e] =
// x[m, 64 c + 16 i + 2 u + e] (u = 0..7, i = 0..3, e = 0..1). One thread per (token, chunk, half h): it loads
// units h, h + 2, h + 4, h + 6 of the chunk and writes units 4 h .. 4 h + 3 (a 4 x 4 transpose of 32-bit words).
__global__ void permute_x_kernel(const __nv_bfloat16* __restrict__ x, int ldx, __nv_bfloat16* __restrict__ xp,
                                 int M, int C) {
  const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long per_row = 2ll * C;
  if (id >= (long long)M * per_row) return;
  const int m = (int)(id / per_row);
  const int rem = (int)(id - (long long)m * per_row);
  const int c = rem >> 1, h = rem & 1;
  const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)m * ldx + 64 * (size_t)c);
  uint4* dst = reinterpret_cast<uint4*>(xp + (size_t)m * C * 64 + 64 * (size_t)c);
  const uint4 l0 = src[h], l1 = src[h + 2], l2 = src[h + 4], l3 = src[h + 6];
  dst[4 * h + 0] = make_uint4(l0.x, l1.x, l2.x, l3.x);
  dst[4 * h + 1] = make_uint4(l0.y, l1.y, l2.y, l3.y);
  dst[4 * h + 2] = make_uint4(l0.z, l1.z, l2.z, l3.z);
  dst[4 * h + 3] = make_uint4(l0.w, l1.w, l2.w, l3.w);
}

// Stream-K variants: all but 128 tokens on 512 threads (128 registers: the segment loop spills there, and with two
// chunks in flight ptxas serializes the MMAs). qerl/kernels/cuda_fp4.py WGMMA_SK_VARIANTS.
// QFP4_WGMMA_NO_SK=1 (a -D for tools only: the SASS check's planted build) leaves every stream-K kernel out.
#ifndef QFP4_WGMMA_NO_SK
#define QFP4_WGMMA_NO_SK 0
#endif
constexpr bool sk_variant(int ntok, int rw, int ks) { return !QFP4_WGMMA_NO_SK && !(ntok >= 128 && rw * ks >= 4); }

// Compiled (tokens per CTA, warpgroups along the rows, split-K groups): see qerl/kernels/cuda_fp4.py WGMMA_VARIANTS.
template <int FMT, bool LORA, bool SK>
const void* pick_fmt(int ntok, int rw, int ks) {
#define QFP4_WG(N, R, K)                                                                          \
  if (ntok == N && rw == R && ks == K) {                                                         \
    if constexpr (!SK || sk_variant(N, R, K))                                                    \
      return reinterpret_cast<const void*>(&fp4_wgmma_kernel<FMT, N, R, K, LORA, SK>);           \
    else                                                                                         \
      return nullptr;                                                                            \
  }
  QFP4_WG(32, 1, 1) QFP4_WG(32, 2, 1) QFP4_WG(32, 1, 2) QFP4_WG(32, 1, 4) QFP4_WG(32, 2, 2)
  QFP4_WG(64, 1, 1) QFP4_WG(64, 2, 1) QFP4_WG(64, 1, 2) QFP4_WG(64, 1, 4) QFP4_WG(64, 2, 2)
  QFP4_WG(128, 1, 1) QFP4_WG(128, 2, 1) QFP4_WG(128, 1, 2) QFP4_WG(128, 2, 2)
  QFP4_WG(256, 1, 1) QFP4_WG(256, 2, 1)
#undef QFP4_WG
  return nullptr;
}

template <bool LORA, bool SK>
const void* pick_lora(int fmt, int ntok, int rw, int ks) {
  return fmt == 0 ? pick_fmt<0, LORA, SK>(ntok, rw, ks) : fmt == 1 ? pick_fmt<1, LORA, SK>(ntok, rw, ks) : nullptr;
}

const void* pick(int fmt, int ntok, int rw, int ks, bool lora = false, bool sk = false) {
  return sk ? (lora ? pick_lora<true, true>(fmt, ntok, rw, ks) : pick_lora<false, true>(fmt, ntok, rw, ks))
            : (lora ? pick_lora<true, false>(fmt, ntok, rw, ks) : pick_lora<false, false>(fmt, ntok, rw, ks));
}

size_t smem_bytes(int ntok, int rw, int ks) {
  const size_t pipe = (size_t)ks * kStages * stage_bytes(ntok, rw);
  const size_t red = (size_t)(ks - 1) * rw * 128 * (ntok / 2) * 4;
  return (pipe > red ? pipe : red) + 1024;  // + the 1024-byte alignment slack
}

#if QFP4_WGMMA_TMA
// cuTensorMapEncodeTiled, from the driver through the runtime (no link to libcuda); nullptr if unavailable.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
EncodeTiled encoder() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A 2-D tensor map over rows of `inner` elements (row pitch `pitch` bytes), boxes of box_in x box_out; false if the
// encoder refuses it (alignment, sizes).
bool map_2d(CUtensorMap& m, CUtensorMapDataType type, const void* base, unsigned long long inner,
            unsigned long long outer, unsigned long long pitch, unsigned box_in, unsigned box_out,
            CUtensorMapSwizzle swizzle) {
  const EncodeTiled enc = encoder();
  if (enc == nullptr) return false;
  const cuuint64_t dims[2] = {inner, outer}, strides[1] = {pitch};
  const cuuint32_t box[2] = {box_in, box_out}, step[2] = {1, 1};
  return enc(&m, type, 2, const_cast<void*>(base), dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
#endif

bool device_ok() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev))
    return false;
  return major == 9 && minor == 0;
}

}  // namespace wg
}  // namespace qfp4

// xp (M, 64 C) <- x (M, 64 C; row stride ldx) in the wgmma kernel's K permutation. Returns a cudaError_t, -1 on
// bad arguments.
extern "C" int qfp4_permute_x(const void* x, int ldx, void* xp, int M, int C, void* stream) {
  if (M < 1 || C < 1 || ldx < 64 * C || ldx % 8) return -1;
  const long long threads = (long long)M * 2 * C;
  const int block = 256;
  const long long blocks = (threads + block - 1) / block;
  if (blocks > 0x7FFFFFFFll) return -1;
  qfp4::wg::permute_x_kernel<<<(unsigned)blocks, block, 0, (cudaStream_t)stream>>>(
      static_cast<const __nv_bfloat16*>(x), ldx, static_cast<__nv_bfloat16*>(xp), M, C);
  return (int)cudaGetLastError();
}

// CTAs of a variant resident at once on the current device (every SM filled to the occupancy the variant allows:
// the grid variants' waves, with or without LoRA; the stream-K variants' grid); -1 on error.
extern "C" int qfp4_wgmma_ctas(int fmt, int ntok, int rw, int ks, int lora, int sk) {
  const void* fn = qfp4::wg::pick(fmt, ntok, rw, ks, lora != 0, sk != 0);
  int dev = 0, sms = 0, per = 0;
  if (fn == nullptr || cudaGetDevice(&dev) || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev))
    return -1;
  const size_t smem = qfp4::wg::smem_bytes(ntok, rw, ks);
  if (smem > (size_t)qfp4::wg::kSmemMax ||
      cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, fn, rw * ks * 128, smem) || per < 1)
    return -1;
  return sms * per;
}

// CTAs of a stream-K launch of a variant (qfp4_wgmma_ctas); the workspace of such a launch holds 2 x this x ks
// partial tiles.
extern "C" int qfp4_wgmma_sk_ctas(int fmt, int ntok, int rw, int ks) {
  return qfp4_wgmma_ctas(fmt, ntok, rw, ks, 0, 1);
}

// out (M, N) <- x @ W^T; same weight tensors as qfp4_gemv / qfp4_gemm; xp: x permuted by qfp4_permute_x (M, 64 C).
// ntok: tokens per CTA, rw: warpgroups per split-K group, ks: split-K groups inside a CTA, kz: splits of K across
// CTAs (kz > 1: ws holds >= kz * tiles * ntok / 2 * rw * 128 floats, ctr >= tiles zeroed ints, tiles = the
// output tiles; one GEMM at a time per counter buffer); kz = 0: stream-K over qfp4_wgmma_sk_ctas CTAs (ws holds
// >= 2 * ctas * ks * ntok / 2 * rw * 128 floats, ctr >= tiles zeroed ints); kz < 0 (a QFP4_WGMMA_TAIL build only):
// the tiles of the last partial wave (qfp4_wgmma_ctas CTAs a wave) split -kz ways, the rest whole (ws and ctr as for
// kz = -kz). sm_90 only.
// LoRA (lt != nullptr): out += t Bn^T per member in the epilogue (WgLora above): lt (M, R) bf16 with row stride ldt,
// 16-byte aligned; lbn (N, rp) bf16; members at rows 0, bound1, bound2 with ranks [roff_i, roff_i + rk_i).
// pdl (LoRA only, a QFP4_WGMMA_PDL build): launch with programmatic stream serialization: the main loop overlaps the
// previous kernel, which must write nothing this launch reads but t (t = x A^T by qerl.kernels.fused.lora_a,
// triggering its dependents, right after qfp4_permute_x wrote xp); every global store and the read of t wait for it.
// Returns a cudaError_t (0 = success), -1 = unsupported device / variant / configuration.
extern "C" int qfp4_wgmma_gemm(const void* qw, const void* sc, const void* xp, void* out, int ldo,
                               const float* gs, float out_mult, unsigned bword, int M, int S, int C, int fmt, int ntok,
                               int rw, int ks, int kz, void* ws, long long ws_floats, void* ctr, int ctr_len,
                               const void* lt, int ldt, const void* lbn, int rp, int R, int bound1, int bound2,
                               const int* roff, const int* rk, void* stream, int pdl) {
  const bool lora = lt != nullptr;
  if (pdl && (!lora || !QFP4_WGMMA_PDL)) return -1;  // the plain variants (and a build without the waits) never wait
  const void* fn = qfp4::wg::pick(fmt, ntok, rw, ks, lora, kz == 0);
  int tail_dp = 0, tail_kt = kz < 0 ? -kz : 1;  // a tail split's tiles run whole and its last wave's splits
  if (kz < 0 && !QFP4_WGMMA_TAIL) return -1;
  if (kz < 0) kz = tail_kt;
  if (fn == nullptr || !qfp4::wg::device_ok() || M < 1 || S < 1 || kz < 0 || kz * ks > C ||
      (unsigned long long)M * 64ull * (unsigned long long)C >= (1ull << 32))
    return -1;
  qfp4::wg::WgLora la = {};
  if (lora) {
    if (R % 8 || !qfp4::gemm_lora(la, lt, lbn, ldt, rp, R, bound1, bound2, roff, rk, S * 16, 16)) return -1;
    la.R = R;
  }
  const size_t smem = qfp4::wg::smem_bytes(ntok, rw, ks);
  if (smem > (size_t)qfp4::wg::kSmemMax) return -1;
  const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return (int)e;
  const int per = rw * 4;  // strips per CTA
  const long long tiles = (long long)((M + ntok - 1) / ntok) * ((S + per - 1) / per);
  const long long tile_floats = (long long)(ntok / 2) * (rw * 128);
  dim3 grid((unsigned)((M + ntok - 1) / ntok), (unsigned)((S + per - 1) / per), (unsigned)(kz > 0 ? kz : 1));
  if (kz == 0) {  // stream-K: as many CTAs as fit at once, never more workers than units
    const int ctas = qfp4_wgmma_sk_ctas(fmt, ntok, rw, ks);
    if (ctas < 1) return -1;
    const long long units = tiles * C;
    const long long need = (units + ks - 1) / ks;
    grid = dim3((unsigned)(need < ctas ? need : ctas), 1u, 1u);
    if ((long long)grid.x * ks * units >= (1ll << 31)) return -1;  // the kernel's 32-bit unit arithmetic (P U < U^2)
    if (ws == nullptr || ctr == nullptr || tiles > ctr_len || 2ll * grid.x * ks * tile_floats > ws_floats)
      return -1;
  } else {
    if (grid.y > 65535u || kz > 64) return -1;
    if (kz > 1 && (ws == nullptr || ctr == nullptr || tiles > ctr_len || (long long)kz * tiles * tile_floats > ws_floats))
      return -1;  // the workspace holds kz partial tiles of every output tile, the counters one int per tile
    if (tail_kt > 1) {  // a tail split: whole tiles up to the last whole wave, then tail_kt CTAs a tile (1-D grid)
      const int wave = qfp4_wgmma_ctas(fmt, ntok, rw, ks, lora, 0);
      if (wave < 1) return -1;
      const long long rest = tiles % wave;
      tail_dp = (int)(tiles - rest);
      if (rest == 0) tail_kt = 1;  // whole waves: no split
      grid = rest == 0 ? dim3(grid.x, grid.y, 1u) : dim3((unsigned)(tail_dp + rest * tail_kt), 1u, 1u);
    }
  }
#if QFP4_WGMMA_TMA
  qfp4::wg::WgMaps maps;
  if (qfp4::wg::tma_staged(ntok, kz == 0)) {
    const int sl = fmt == 0 ? 32 : 16;  // scale pairs (16-bit) per strip and chunk
    if (!qfp4::wg::map_2d(maps.x, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, xp, 64ull * C, (unsigned long long)M, 128ull * C,
                          64, (unsigned)ntok, CU_TENSOR_MAP_SWIZZLE_128B) ||
        !qfp4::wg::map_2d(maps.w, CU_TENSOR_MAP_DATA_TYPE_UINT64, qw, 64ull * C, (unsigned long long)S, 512ull * C,
                          64, (unsigned)per, CU_TENSOR_MAP_SWIZZLE_NONE) ||
        !qfp4::wg::map_2d(maps.s, CU_TENSOR_MAP_DATA_TYPE_UINT16, sc, (unsigned long long)sl * C,
                          (unsigned long long)S, 2ull * sl * C, (unsigned)sl, (unsigned)per,
                          CU_TENSOR_MAP_SWIZZLE_NONE))
      return -1;
  }
#endif
  void* args[] = {(void*)&qw, (void*)&sc, (void*)&xp, (void*)&out, (void*)&ldo, (void*)&gs,
                  (void*)&out_mult, (void*)&bword, (void*)&M, (void*)&S, (void*)&C, (void*)&ws, (void*)&ctr,
                  (void*)&la,
#if QFP4_WGMMA_TAIL
                  (void*)&tail_dp, (void*)&tail_kt,
#endif
#if QFP4_WGMMA_TMA
                  (void*)&maps
#endif
  };
  return (int)qfp4::launch_pdl(fn, grid, dim3((unsigned)(rw * ks * 128)), smem, (cudaStream_t)stream, args, pdl != 0);
}

// Registers and local-memory bytes per thread of one wgmma variant (-1 on error).
extern "C" int qfp4_wgmma_attributes(int fmt, int ntok, int rw, int ks, int* regs, int* local_bytes) {
  return qfp4::kernel_attributes(qfp4::wg::pick(fmt, ntok, rw, ks), regs, local_bytes);
}
