// The qerl_fp4_dq extension's binding (qerl/kernels/cuda_dq.py compiles it as binding.cpp beside fp4_dq_gemm.cu):
// the torch wrapper that checks its tensors and calls the extern "C" launcher on the current CUDA stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

extern "C" int qfp4_dq_gemm(const void*, long, const void*, const void*, const float*, void*, long, void*, int, int,
                            int, long, int, int, int, int, int, unsigned, float, void*);
extern "C" int qfp4_dq_smem(int, int);

// fwd: out (M, N) = g (M, K) @ Wᵀ; else out (M, K) = g (M, N) @ W
void gemm(torch::Tensor g, torch::Tensor qw, torch::Tensor sc, torch::Tensor gs, torch::Tensor out,
          torch::Tensor ws, int64_t fmt, bool has_g, int64_t nb, int64_t kz, int64_t sk, bool fwd, int64_t bword,
          double out_mult) {
  TORCH_CHECK(g.is_cuda() && qw.is_cuda() && sc.is_cuda() && out.is_cuda() && gs.is_cuda() && ws.is_cuda(),
              "tensors must be on CUDA");
  TORCH_CHECK(g.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "g, out must be bf16");
  TORCH_CHECK(g.dim() == 2 && out.dim() == 2 && qw.dim() == 4 && sc.dim() == 3, "bad ranks");
  const int S = (int)qw.size(0), C = (int)qw.size(1);
  const int M = (int)g.size(0), N = 16 * S, K = 64 * C;
  const int R = fwd ? K : N, Cw = fwd ? N : K;
  TORCH_CHECK(g.size(1) == R && out.size(0) == M && out.size(1) == Cw, "shape mismatch");
  const int64_t cs = qw.stride(0) / 128;
  TORCH_CHECK(qw.stride(3) == 1 && qw.stride(2) == 4 && qw.stride(1) == 128 && qw.stride(0) % 128 == 0 && cs >= C
              && sc.stride(2) == 1 && sc.stride(1) == sc.size(2) && sc.stride(0) == cs * sc.size(2),
              "qweight/scales must be a weight's strips");
  TORCH_CHECK(g.stride(1) == 1 && out.stride(1) == 1, "g/out need unit column stride");
  TORCH_CHECK(!has_g || gs.scalar_type() == at::kFloat, "global scale must be float32");
  TORCH_CHECK(kz == 1 || (ws.scalar_type() == at::kFloat && ws.numel() >= kz * (int64_t)M * Cw),
              "workspace too small");
  TORCH_CHECK(sk == 0 || (ws.scalar_type() == at::kFloat && ws.numel() >= 2 * sk * 128 * nb),
              "stream-K workspace too small");
  const c10::cuda::CUDAGuard guard(out.device());
  const int err = qfp4_dq_gemm(g.data_ptr(), (long)g.stride(0), qw.data_ptr(), sc.data_ptr(),
                               has_g ? gs.data_ptr<float>() : nullptr, out.data_ptr(), (long)out.stride(0),
                               kz > 1 || sk > 0 ? ws.data_ptr() : nullptr, M, N, K, (long)cs, (int)fmt, (int)nb,
                               (int)kz, (int)sk, fwd ? 1 : 0, (unsigned)bword, (float)out_mult,
                               (void*)c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
  TORCH_CHECK(err == 0, "qfp4_dq_gemm: ", err == -1 ? "unsupported arguments (shapes, strides, alignment, nb, kz, sk)"
                                                   : cudaGetErrorString((cudaError_t)err));
}

int64_t smem(int64_t fmt, int64_t nb) { return qfp4_dq_smem((int)fmt, (int)nb); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm", &gemm);
  m.def("smem", &smem);
}
