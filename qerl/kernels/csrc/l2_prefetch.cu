// L2 prefetch of weight pieces ahead of the kernel that reads them (issue 11, session 46; qerl/kernels/cuda_prefetch.py).
//
// At decode batch sizes the kernels between a layer's q|k|v GEMV and its gate|up GEMV (RoPE, attention, the o GEMV,
// add + RMSNorm) are bound by latency, not bytes: HBM idles for ~20 us a 7B layer while gate|up (76 MB of NVFP4)
// then streams at the bandwidth limit. This kernel asks L2 for pieces of the next weights in that window, so part of
// gate|up (and o) is read from L2. It reads and writes nothing itself: the results of every kernel are unchanged.
//
// A launch gets up to kMaxSpans spans; span s is `count` rows `stride` bytes apart from `base`, and from each row the
// nseg byte ranges [off[j], off[j] + len[j]) (one per split-K range of the GEMV that reads it: the first chunks each
// of its warps loads). Piece i of the launch (a row's range) goes to thread i (grid-stride), one
// cp.async.bulk.prefetch.L2 each (sm_90: the TMA unit fetches the range; 16-byte aligned, a multiple of 16 bytes);
// before sm_90, prefetch.global.L2 per 128-byte line.
//
// qerl launches it on a side stream (a branch of the captured decode graph that no decode kernel waits for), without
// the programmatic-dependent-launch attribute, so its griddepcontrol instructions are no-ops. They are what made the
// first placement (ad488f2: in the decode chain under PDL) safe: it let its dependent launch at once, issued its
// prefetches and waited for its predecessor before exiting, so the chain's ordering stayed transitive. Session 46
// measured that placement 3-7% slower: the attention waited ~9 us a layer for it.
#include <cuda_runtime.h>
#include <cstdint>

namespace ql2 {

constexpr int kMaxSpans = 4;
constexpr int kMaxSegs = 16;
constexpr int kThreads = 256;
constexpr int kMaxCtas = 32;

struct Span {
  unsigned long long base;
  long long stride;
  int count, nseg;
  int off[kMaxSegs], len[kMaxSegs];
};

struct Args {
  Span s[kMaxSpans];
  int nspan;
  int total;  // sum of count * nseg
};

__global__ void __launch_bounds__(kThreads) l2_prefetch_kernel(const __grid_constant__ Args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.total; i += gridDim.x * kThreads) {
    int j = i, k = 0;
    while (k + 1 < a.nspan && j >= a.s[k].count * a.s[k].nseg) {
      j -= a.s[k].count * a.s[k].nseg;
      ++k;
    }
    const Span& s = a.s[k];
    const int row = j / s.nseg, seg = j - row * s.nseg;
    const char* p = reinterpret_cast<const char*>(s.base) + (long long)row * s.stride + s.off[seg];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(s.len[seg]) : "memory");
#else
    for (int b = 0; b < s.len[seg]; b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(p + b));
#endif
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace ql2

// desc: per span [base, stride, count, nseg, off_0, len_0, ..., off_{nseg-1}, len_{nseg-1}]. Returns 0, -1 for bad
// arguments (too many spans or segments, a misaligned or non-16-multiple range, a negative count), or a CUDA error.
extern "C" int ql2_prefetch(const long long* desc, int ndesc, void* stream) {
  ql2::Args a{};
  int at = 0;
  long long total = 0;
  while (at < ndesc) {
    if (a.nspan == ql2::kMaxSpans || at + 4 > ndesc) return -1;
    ql2::Span& s = a.s[a.nspan++];
    s.base = (unsigned long long)desc[at];
    s.stride = desc[at + 1];
    s.count = (int)desc[at + 2];
    s.nseg = (int)desc[at + 3];
    at += 4;
    if (s.count < 0 || s.nseg < 1 || s.nseg > ql2::kMaxSegs || at + 2 * s.nseg > ndesc || s.stride % 16 ||
        s.base % 16)
      return -1;
    for (int j = 0; j < s.nseg; ++j, at += 2) {
      s.off[j] = (int)desc[at];
      s.len[j] = (int)desc[at + 1];
      if (desc[at] % 16 || desc[at + 1] % 16 || desc[at + 1] <= 0 || desc[at] < 0) return -1;
    }
    total += (long long)s.count * s.nseg;
  }
  if (total == 0) return 0;
  if (total >= (1LL << 31)) return -1;
  a.total = (int)total;
  const int ctas = (int)((total + ql2::kThreads - 1) / ql2::kThreads);
  ql2::l2_prefetch_kernel<<<ctas < ql2::kMaxCtas ? ctas : ql2::kMaxCtas, ql2::kThreads, 0,
                            static_cast<cudaStream_t>(stream)>>>(a);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? 0 : (int)e;
}
