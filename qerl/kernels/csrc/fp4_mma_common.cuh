// Shared by the FP4 mma kernels (fp4_mma_gemv.cu: M <= 16, fp4_mma_gemm.cu: larger M): the A-fragment decode
// of the re-laid-out weight words (see fp4_mma_gemv.cu for the layout), the scale words, the bf16 MMA and the
// streaming loads; decode_attn.cu takes the bf16 MMA and the cp.async helpers from here too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace qfp4 {

constexpr uint32_t kMask = 0x81C081C0u;
constexpr uint32_t kRest = 0x001B001Bu;
constexpr uint32_t kSpread = (1u << 3) + (1u << 8) + (1u << 14);
__device__ __forceinline__ uint32_t rotr(uint32_t w, int s) { return __funnelshift_r(w, w, s); }

__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
#endif
  return d;
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Weights: streamed once, keep them out of L1 (x lives there).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// The same through the coherent path: issued before griddepcontrol.wait, ptxas keeps these below it only when they
// are not .nc loads (it hoists the wait above every ld.global.nc). The weights are never written by a kernel.
__device__ __forceinline__ uint4 ld_stream_early(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t ld_stream_early_u16(const uint16_t* p) {
  unsigned short r;
  asm volatile("ld.global.L1::no_allocate.u16 %0, [%1];\n" : "=h"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
}

__device__ __forceinline__ uint32_t ld_stream_u16(const uint16_t* p) {
  unsigned short r;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(r) : "l"(p));
  return r;
}

// Activations: a coherent load (not ld.global.nc), issued only after griddepcontrol.wait: under programmatic
// dependent launch x is written by the previous grid while this one is already running, and the
// non-coherent path may then return stale lines.
__device__ __forceinline__ uint4 ld_x(const __nv_bfloat16* p) {
  uint4 r;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p) : "memory");
  return r;
}

// Scale words of rows g (sg) and g+8 (sg8), both halves equal, from the lane's 16-bit scale pair.
template <int FMT>
__device__ __forceinline__ void scale_words(uint32_t s16, uint32_t bword, uint32_t& sg, uint32_t& sg8) {
  if constexpr (FMT == 0) {
    __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(s16), __NV_E4M3);
    const uint32_t h2 = static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
    uint32_t t = ((h2 >> 3) & 0x0FFF0FFFu) + bword;  // exponent 15-biased -> 127-biased + B
    t |= h2 & 0x80008000u;
    sg = __byte_perm(t, 0u, 0x1010);
    sg8 = __byte_perm(t, 0u, 0x3232);
  } else {
    sg = __byte_perm(s16, 0u, 0x4040) * 128u + bword;
    sg8 = __byte_perm(s16, 0u, 0x4141) * 128u + bword;
  }
}

// Decode of one 32-bit weight word (one MMA step) into its four A registers, scaled by the group words.
__device__ __forceinline__ void decode_word(uint32_t v, uint32_t sg, uint32_t sg8, uint32_t (&a)[4]) {
  a[0] = bmul2(v & kMask, sg);
  a[1] = bmul2(rotr(v, 3) & kMask, sg8);
  a[2] = bmul2(rotr(v, 6) & kMask, sg);
  a[3] = bmul2(((v & kRest) * kSpread) & kMask, sg8);
}

// Exact dequantization to bf16 (csrc/fp4_dequant.cu's dense weight and csrc/fp4_dq_gemm.cu's shared-memory tiles):
// the scale byte -> float32, exactly as qerl.kernels.fp4_triton._scale_val (NVFP4: E4M3; MXFP4: 2^(e-127)) ...
template <int FMT>
__device__ __forceinline__ float scale_val(uint32_t s) {
  if constexpr (FMT == 0) {
    const uint32_t e = (s >> 3) & 15u, m = s & 7u;
    float v = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (s & 128u) ? -v : v;
  } else {
    return __uint_as_float(s << 23);
  }
}

// ... and two masked e2m1 nibbles (bf16 halves of e2m1 * 2^-126, as decode_word masks them) -> bf16x2 of
// (value * sv) each, rounded once from float32 (no fast-math: float32 subnormals are kept).
constexpr uint32_t kOne = 0x7E807E80u;  // bf16x2 (2^126, 2^126)
__device__ __forceinline__ uint32_t scaled_pair(uint32_t masked, float sv) {
  const uint32_t p = bmul2(masked, kOne);  // exact e2m1 values as bf16
  const float lo = __uint_as_float(p << 16) * sv;
  const float hi = __uint_as_float(p & 0xFFFF0000u) * sv;
  __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&r);
}

// A lane's 16-bit scale pair (rows g, g + 8) as the rows' float32 scales; HAS_G: divided by the NVFP4 global scale
// inv as the reference does (div_rn), so that fp4 * scale then rounds once.
template <int FMT, bool HAS_G>
__device__ __forceinline__ void row_scales(uint32_t s16, float inv, float& s0, float& s8) {
  s0 = scale_val<FMT>(s16 & 0xFFu);
  s8 = scale_val<FMT>((s16 >> 8) & 0xFFu);
  if (HAS_G) {
    s0 = __fdiv_rn(s0, inv);
    s8 = __fdiv_rn(s8, inv);
  }
}

// A lane's 16-byte word group of a (strip, chunk) block, dequantized: rows g (a) and g + 8 (b), each 16 columns
// 16 t .. 16 t + 15 of the chunk in order as 8 bf16x2 words (word j of the group holds columns 4 j .. 4 j + 3 of
// both rows); s0 / s8: the rows' float32 scales (the global scale already divided in).
__device__ __forceinline__ void dequant_unit(const uint32_t (&v)[4], float s0, float s8, uint32_t (&a)[8],
                                             uint32_t (&b)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    a[2 * j] = scaled_pair(v[j] & kMask, s0);
    b[2 * j] = scaled_pair(rotr(v[j], 3) & kMask, s8);
    a[2 * j + 1] = scaled_pair(rotr(v[j], 6) & kMask, s0);
    b[2 * j + 1] = scaled_pair(((v[j] & kRest) * kSpread) & kMask, s8);
  }
}

// 16-byte cp.async into shared memory (src-size 0 when !valid: zero-fill, nothing read), its groups.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// The GEMMs' token staging: a group of GT threads copies the TM x 64 bf16 tokens of a chunk into a stage in 16-byte
// units, unit u of token row r at unit u ^ (r & 7) of the row's 128 bytes (conflict-free fragment reads for mma.sync,
// the 128-byte swizzle for wgmma's descriptor). Thread gtid copies unit xu = gtid & 7 of rows xr = gtid >> 3,
// xr + RPP, ... (UPT of them) from one loop-carried source pointer advanced by one chunk per call (ptxas re-derives
// loop-invariant index arithmetic inside a loop, which made a first version issue-bound; a value updated every
// iteration cannot be rematerialized). Rows >= M are zero-filled (src-size 0: nothing is read).
template <int TM, int GT>
struct TokenStager {
  static constexpr int UNITS = TM * 8;                  // 16-byte token units per chunk
  static constexpr int UPT = (UNITS + GT - 1) / GT;      // units per thread and chunk
  static constexpr int RPP = GT / 8;                    // token rows per pass of the group
  const __nv_bfloat16* xb;
  size_t xstride;  // elements between a thread's rows
  int xu, xr, xval;
  bool act;        // false only for threads past the tile (UNITS < GT)
  __device__ __forceinline__ TokenStager(const __nv_bfloat16* x, int ldx, int tok0, int c0, int M, int gtid)
      : xu(gtid & 7), xr(gtid >> 3) {
    act = UNITS % GT == 0 || xr < TM;
    xval = M - tok0 - xr;  // unit j is a real row iff j * RPP < xval
    xb = x + (size_t)(tok0 + xr) * ldx + 8 * xu + 64 * (size_t)c0;
    xstride = (size_t)RPP * ldx;
  }
  // The next chunk's tokens into the stage at shared address dst.
  __device__ __forceinline__ void stage(uint32_t dst) {
    if (act) {
#pragma unroll
      for (int j = 0; j < UPT; ++j) {
        const int row = xr + j * RPP;  // (row & 7) == (xr & 7) unless RPP == 4
        cp_async16(dst + row * 128 + ((xu ^ (row & 7)) << 4), xb + j * xstride, j * RPP < xval);
      }
      xb += 64;
    }
  }
};

// mbarriers (shared addresses; sm_90 code only calls them): the wgmma GEMM's tensor-copy stages and the dq GEMM's
// warp-specialized ring.
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Until the barrier's phase of this parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// Barrier of one split-K group of the GEMMs (ids 1..KS; 0 is __syncthreads).
__device__ __forceinline__ void group_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Split-K across CTAs (the wgmma GEMM's kz, the mma.sync GEMM's QFP4_GEMM_KZ): once every thread of the group (gt
// threads, named barrier 1; rt its index, 0 counting) has stored its part of the CTA's fp32 partial of output tile
// `tile`, whether this CTA is the last of the tile's `splits` to finish (a per-tile counter); the last one may then
// read every partial (fenced on both sides).
__device__ __forceinline__ bool last_of_splits(int* ctr, int tile, int splits, int rt, int gt) {
  __shared__ int last;
  __threadfence();
  group_sync(1, gt);
  if (rt == 0) last = atomicAdd(ctr + tile, 1) == splits - 1;
  group_sync(1, gt);
  if (!last) return false;
  __threadfence();
  return true;
}

// The LoRA members of a product (the GEMV's and the GEMMs' LoRA terms; cuda_fp4.LoraOperand): member i's output rows
// start at 0, bound1, bound2 and use ranks [roff_i, roff_i + rk_i) of t. The member of output row n:
template <class L>
__device__ __forceinline__ int member_of(const L& la, int n) {
  return n < la.bound1 ? 0 : n < la.bound2 ? 1 : 2;
}

// roff / rk of member mb by selects (a dynamic index into the kernel parameter would copy it to local memory)
__device__ __forceinline__ int pick3(const int (&v)[3], int mb) { return mb == 0 ? v[0] : mb == 1 ? v[1] : v[2]; }

// Host: whether a GEMM's LoRA operands fit its epilogue -- t with R >= 8 columns and a row stride ldt >= R that is a
// multiple of t_align / 2 elements, t_align-byte aligned; Bn with rp (a multiple of 16) columns, 4-byte aligned;
// member rows starting at 0 <= bound1 <= bound2 <= N (multiples of 16), ranks [roff_i, roff_i + rk_i) inside t's R
// columns and Bn's rp, multiples of 8 -- and, if so, lo (the kernel's GemmLora / WgLora) filled with them.
template <class L>
inline bool gemm_lora(L& lo, const void* t, const void* bn, int ldt, int rp, int R, int bound1, int bound2,
                      const int* roff, const int* rk, int N, int t_align) {
  if (t == nullptr || bn == nullptr || R < 8 || ldt < R || ldt % (t_align / 2) || rp < 16 || rp % 16 ||
      reinterpret_cast<uintptr_t>(t) % t_align || reinterpret_cast<uintptr_t>(bn) % 4 || roff == nullptr ||
      rk == nullptr || bound1 < 0 || bound1 % 16 || bound2 < bound1 || bound2 % 16 || bound2 > N)
    return false;
  for (int i = 0; i < 3; ++i) {
    if (roff[i] < 0 || roff[i] % 8 || rk[i] < 0 || rk[i] % 8 || rk[i] > rp || roff[i] + rk[i] > R) return false;
    lo.roff[i] = roff[i];
    lo.rk[i] = rk[i];
  }
  lo.t = static_cast<const __nv_bfloat16*>(t);
  lo.bn = static_cast<const __nv_bfloat16*>(bn);
  lo.ldt = ldt;
  lo.rp = rp;
  lo.bound1 = bound1;
  lo.bound2 = bound2;
  return true;
}

// Host: registers and local-memory bytes per thread of a kernel (-1 when it is not compiled or the query fails).
inline int kernel_attributes(const void* fn, int* regs, int* local_bytes) {
  cudaFuncAttributes a;
  if (fn == nullptr || cudaFuncGetAttributes(&a, fn)) return -1;
  *regs = a.numRegs;
  *local_bytes = (int)a.localSizeBytes;
  return 0;
}

// Host: launch fn (args as cudaLaunchKernel takes them), with programmatic stream serialization when pdl (the kernel
// starts while the previous one drains and must griddepcontrol.wait before reading what that one writes).
inline cudaError_t launch_pdl(const void* fn, dim3 grid, dim3 block, size_t smem, cudaStream_t stream, void** args,
                              bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelExC(&cfg, fn, args);
}

}  // namespace qfp4
