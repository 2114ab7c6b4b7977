// The qerl_attn extension's binding (qerl/kernels/cuda_attn.py compiles it as binding.cpp beside decode_attn.cu):
// torch wrappers that check their tensors and call the extern "C" launchers on the current CUDA stream.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

extern "C" int qattn_decode(const void*, const void*, const void*, const float*, const long long*, void*, void*, int,
                            int, int, int, int, int, float, int, int, void*);

// q (M, H, d) bf16; kc, vc (M, HKV, S_max, d) bf16; bias (M, S_max) fp32; slot (1,) int64 or empty; o (M, H·d)
// bf16; op empty or like o (o in the wgmma GEMM's K permutation too).
void attend(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor bias, torch::Tensor slot,
            torch::Tensor o, torch::Tensor op, int64_t s, double scale, int64_t nst, bool pdl) {
  TORCH_CHECK(op.numel() == 0 || (op.is_cuda() && op.is_contiguous() && op.sizes() == o.sizes() &&
              op.scalar_type() == at::kBFloat16), "op: empty or a contiguous bf16 tensor shaped like o");
  for (const auto* t : {&q, &kc, &vc, &bias, &o})
    TORCH_CHECK(t->is_cuda() && t->is_contiguous(), "decode attention: CUDA tensors, contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kc.scalar_type() == at::kBFloat16 &&
              vc.scalar_type() == at::kBFloat16 && o.scalar_type() == at::kBFloat16, "q, kc, vc, o: bf16");
  TORCH_CHECK(bias.scalar_type() == at::kFloat, "bias: fp32");
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && kc.sizes() == vc.sizes() && bias.dim() == 2, "bad ranks");
  const int64_t m = q.size(0), h = q.size(1), d = q.size(2), hkv = kc.size(1), smax = kc.size(2);
  TORCH_CHECK(kc.size(0) == m && kc.size(3) == d && h % hkv == 0 && bias.size(0) == m && bias.size(1) == smax,
              "shapes: q (M, H, d), kc/vc (M, HKV, S_max, d), bias (M, S_max)");
  TORCH_CHECK(o.numel() == m * h * d, "o: (M, H·d)");
  TORCH_CHECK(slot.numel() == 0 || (slot.is_cuda() && slot.scalar_type() == at::kLong), "slot: int64 CUDA (1,)");
  const c10::cuda::CUDAGuard guard(q.device());
  const long long* sl = slot.numel() ? reinterpret_cast<const long long*>(slot.data_ptr<int64_t>()) : nullptr;
  const int err = qattn_decode(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), bias.data_ptr<float>(), sl, o.data_ptr(),
                               op.numel() ? op.data_ptr() : nullptr, (int)m, (int)hkv, (int)(h / hkv), (int)d, (int)s, (int)smax, (float)scale, (int)nst,
                               pdl ? 1 : 0, (void*)c10::cuda::getCurrentCUDAStream(q.device().index()).stream());
  TORCH_CHECK(err == 0, "qattn_decode: ", err == -1 ? "unsupported arguments" : cudaGetErrorString((cudaError_t)err));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend);
}
