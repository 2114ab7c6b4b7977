// Stream-K's division of the in-loop dequantizing GEMM's iterations (fp4_dq_gemm.cu): T iterations (tile, chunk),
// tile-major, cut into G contiguous ranges, one a CTA. Used by the kernel, by its reduction launch and, compiled as
// plain C++, by tests/test_cuda_dq.py (which walks every CTA's segments and checks the reduction's view of them).
#pragma once

#ifdef __CUDACC__
#define QFP4_HD __host__ __device__ __forceinline__
#else
#define QFP4_HD inline
#endif

namespace qfp4 {
namespace dq {

// CTA b's iterations are [sk_begin(T, G, b), sk_begin(T, G, b + 1)); every range is non-empty when G <= T.
QFP4_HD long sk_begin(long T, int G, int b) { return T * b / G; }

// The CTA whose range holds iteration j (the largest b with sk_begin(T, G, b) <= j).
QFP4_HD int sk_owner(long T, int G, long j) { return (int)(((j + 1) * G - 1) / T); }

// The segment of a range [i, i1) that starts at iteration i: its tile and chunks [s, e) of the tile's nc.
QFP4_HD void sk_segment(int nc, long i, long i1, int& tile, int& s, int& e) {
  tile = (int)(i / nc);
  s = (int)(i % nc);
  const long left = i1 - i;
  e = left < (long)(nc - s) ? s + (int)left : nc;
}

// Where a CTA's partial segment goes: slot 0 for its range's first segment, 1 for its last (a partial segment is
// always one of the two). Seen from the tile whose first iteration is j0: 0 when b's range starts inside it.
QFP4_HD int sk_slot(long T, int G, int b, long j0) { return sk_begin(T, G, b) >= j0 ? 0 : 1; }

}  // namespace dq
}  // namespace qfp4
