// The qerl_fp4_mma extension's binding (qerl/kernels/cuda_fp4.py compiles it as binding.cpp beside the .cu files):
// torch wrappers that check their tensors and call the extern "C" launchers of fp4_mma_gemv.cu, fp4_mma_gemm.cu,
// fp4_dequant.cu and fp4_wgmma_gemm.cu on the current CUDA stream. QERL_LORA_WS_FLOATS / QERL_LORA_WS_INTS are
// replaced by cuda_fp4.lora_workspace_sizes() before the build.
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

extern "C" int qfp4_gemv(const void*, const void*, const void*, int, void*, int, const float*, float, unsigned,
                         int, int, int, int, int, int, int, int, int, int, void*);
extern "C" int qfp4_gemv_lora(const void*, const void*, const void*, int, void*, int, const float*, float,
                              unsigned, int, int, int, int, int, int, int, int, int, int, void*, const void*,
                              const void*,
                              void*, void*, int, int, int, int, int, const int*, const int*);
extern "C" int qfp4_occupancy(int, int, int, int, int, int, int);
extern "C" int qfp4_attributes(int, int, int, int, int*, int*);
extern "C" int qfp4_gemm(const void*, const void*, const void*, int, void*, int, const float*, float, unsigned, int,
                         int, int, int, int, int, int, int, void*, const void*, int, const void*, int, int, int,
                         int, const int*, const int*, int, int, void*, long long, void*, int);
extern "C" int qfp4_gemm_occupancy(int, int, int, int, int);
extern "C" int qfp4_gemm_attributes(int, int, int, int, int*, int*);
extern "C" int qfp4_dequant(const void*, const void*, const float*, void*, long, int, int, long, int, void*);
extern "C" int qfp4_permute_x(const void*, int, void*, int, int, void*);
extern "C" int qfp4_wgmma_gemm(const void*, const void*, const void*, void*, int, const float*, float,
                               unsigned, int, int, int, int, int, int, int, int, void*, long long, void*, int,
                               const void*, int, const void*, int, int, int, int, const int*, const int*, void*,
                               int);
extern "C" int qfp4_wgmma_attributes(int, int, int, int, int*, int*);
extern "C" int qfp4_wgmma_ctas(int, int, int, int, int, int);

// Strips S = N / 16 and chunks C = K / 64 of the weight: FP4 (S, C, 32, 4) int32 fragments, fmt 2 a BF16 (N, K)
static void weight_dims(const torch::Tensor& qw, int64_t fmt, int& S, int& C) {
  if (fmt == 2) {
    TORCH_CHECK(qw.dim() == 2 && qw.scalar_type() == at::kBFloat16 && qw.size(0) % 16 == 0 && qw.size(1) % 64 == 0,
                "bf16 weight: (N, K) bf16 with N % 16 == 0, K % 64 == 0");
    TORCH_CHECK(qw.stride(1) == 1 && qw.stride(0) == qw.size(1) &&
                reinterpret_cast<uintptr_t>(qw.data_ptr()) % 16 == 0, "bf16 weight: contiguous rows, 16-byte aligned");
    S = (int)(qw.size(0) / 16);
    C = (int)(qw.size(1) / 64);
    return;
  }
  TORCH_CHECK(qw.dim() == 4, "bad ranks");
  S = (int)qw.size(0);
  C = (int)qw.size(1);
}

// act = 1 (silu * up): out holds N / 2 columns; fmt 2: qw a BF16 (N, K) weight, sc unused
static void check_operands(const torch::Tensor& x, const torch::Tensor& qw, const torch::Tensor& sc,
                           const torch::Tensor& out, int64_t act = 0, int64_t fmt = 0) {
  TORCH_CHECK(x.is_cuda() && qw.is_cuda() && sc.is_cuda() && out.is_cuda(), "tensors must be on CUDA");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "x, out must be bf16");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && (fmt == 2 || sc.dim() == 3), "bad ranks");
  int S = 0, C = 0;
  weight_dims(qw, fmt, S, C);
  const int M = (int)x.size(0);
  TORCH_CHECK(x.size(1) == 64 * C && out.size(0) == M && out.size(1) == (act ? 8 : 16) * S, "shape mismatch");
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && out.stride(1) == 1, "x/out layout");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "x must be 16-byte aligned");
  TORCH_CHECK(fmt == 2 || (qw.is_contiguous() && sc.is_contiguous()), "qweight/scales must be contiguous");
}

// A split of K across CTAs (either GEMM): ws its fp32 partial tiles, ctr its int32 tile counters, contiguous on x's device
static void check_split(const torch::Tensor& x, const torch::Tensor& ws, const torch::Tensor& ctr) {
  TORCH_CHECK(ws.is_cuda() && ws.scalar_type() == at::kFloat && ws.is_contiguous() && ws.device() == x.device() &&
              ctr.is_cuda() && ctr.scalar_type() == at::kInt && ctr.is_contiguous() && ctr.device() == x.device(),
              "split-K workspace: a contiguous fp32 ws and int32 ctr on x's device");
}

void gemv(torch::Tensor x, torch::Tensor qw, torch::Tensor sc, torch::Tensor gs, torch::Tensor out, int64_t fmt,
          double out_mult, int64_t bword, int64_t splits, int64_t strips_per_cta, int64_t unroll, int64_t sw,
          bool pdl, int64_t act) {
  check_operands(x, qw, sc, out, act, fmt);
  int S = 0, C = 0;
  weight_dims(qw, fmt, S, C);
  const int M = (int)x.size(0);
  TORCH_CHECK((int64_t)C * splits < (1LL << 31), "too many chunks");
  const c10::cuda::CUDAGuard guard(x.device());
  const float* gp = fmt == 0 ? gs.data_ptr<float>() : nullptr;
  const int err = qfp4_gemv(qw.data_ptr(), sc.data_ptr(), x.data_ptr(), (int)x.stride(0), out.data_ptr(),
                            (int)out.stride(0), gp, (float)out_mult, (unsigned)bword, M, S, C, (int)fmt,
                            (int)splits, (int)strips_per_cta, (int)unroll, (int)sw, pdl ? 1 : 0, (int)act,
                            (void*)c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err == 0, "qfp4_gemv: ", err == -1 ? "unsupported configuration"
                                                  : cudaGetErrorString((cudaError_t)err));
}

void gemv_lora(torch::Tensor x, torch::Tensor qw, torch::Tensor sc, torch::Tensor gs, torch::Tensor out, int64_t fmt,
               double out_mult, int64_t bword, int64_t splits, int64_t strips_per_cta, int64_t unroll, int64_t sw,
               bool pdl, int64_t act, torch::Tensor a, torch::Tensor bn, torch::Tensor part, torch::Tensor ctr,
               int64_t parts,
               int64_t bound1, int64_t bound2, std::vector<int64_t> roff, std::vector<int64_t> rk) {
  check_operands(x, qw, sc, out, act, fmt);
  int S = 0, C = 0;
  weight_dims(qw, fmt, S, C);
  const int M = (int)x.size(0);
  TORCH_CHECK((int64_t)C * splits < (1LL << 31), "too many chunks");
  TORCH_CHECK(a.is_cuda() && bn.is_cuda() && part.is_cuda() && ctr.is_cuda(),
              "LoRA tensors must be on CUDA");
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && bn.scalar_type() == at::kBFloat16, "a, bn must be bf16");
  TORCH_CHECK(part.scalar_type() == at::kFloat && ctr.scalar_type() == at::kInt, "part fp32, ctr int32");
  TORCH_CHECK(a.is_contiguous() && bn.is_contiguous() && a.dim() == 2 && bn.dim() == 2, "a, bn: contiguous 2-D");
  const int R = (int)a.size(0), RP = (int)bn.size(1);
  TORCH_CHECK(a.size(1) == 64 * C && bn.size(0) == 16 * S && RP % 16 == 0, "LoRA shape mismatch");
  TORCH_CHECK(part.numel() >= QERL_LORA_WS_FLOATS && ctr.numel() >= QERL_LORA_WS_INTS, "LoRA workspace too small");
  TORCH_CHECK(roff.size() == 3 && rk.size() == 3, "roff, rk: 3 members");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(a.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(bn.data_ptr()) % 16 == 0,
              "a, bn must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(x.device());
  const float* gp = fmt == 0 ? gs.data_ptr<float>() : nullptr;
  const int ro[3] = {(int)roff[0], (int)roff[1], (int)roff[2]}, rr[3] = {(int)rk[0], (int)rk[1], (int)rk[2]};
  const int err = qfp4_gemv_lora(qw.data_ptr(), sc.data_ptr(), x.data_ptr(), (int)x.stride(0), out.data_ptr(),
                                 (int)out.stride(0), gp, (float)out_mult, (unsigned)bword, M, S, C, (int)fmt,
                                 (int)splits, (int)strips_per_cta, (int)unroll, (int)sw, pdl ? 1 : 0, (int)act,
                                 (void*)c10::cuda::getCurrentCUDAStream(x.device().index()).stream(),
                                 a.data_ptr(), bn.data_ptr(), part.data_ptr(), ctr.data_ptr(), R, RP,
                                 (int)parts,
                                 (int)bound1, (int)bound2, ro, rr);
  TORCH_CHECK(err == 0, "qfp4_gemv_lora: ", err == -1 ? "unsupported configuration"
                                                       : cudaGetErrorString((cudaError_t)err));
}

// The LoRA operands of the GEMMs' epilogues as their C entries take them: t (M, R) bf16 with unit column stride and
// an even row stride, bn (16 S, RP) contiguous bf16, 3 members whose ranks lie inside t's columns.
static void gemm_lora_args(const torch::Tensor& t, const torch::Tensor& bn, int M, int S,
                           const std::vector<int64_t>& roff, const std::vector<int64_t>& rk, int& R, int& ldt, int& RP,
                           int ro[3], int rr[3]) {
  TORCH_CHECK(t.is_cuda() && bn.is_cuda() && t.scalar_type() == at::kBFloat16 && bn.scalar_type() == at::kBFloat16,
              "LoRA t, bn: bf16 CUDA tensors");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == M && t.stride(1) == 1 && t.stride(0) % 2 == 0 && bn.dim() == 2 &&
              bn.is_contiguous() && bn.size(0) == 16 * S,
              "LoRA t (M, R) with unit column stride and an even row stride, bn (N, RP) contiguous");
  TORCH_CHECK(roff.size() == 3 && rk.size() == 3, "roff, rk: 3 members");
  R = (int)t.size(1);
  ldt = (int)t.stride(0);
  RP = (int)bn.size(1);
  for (int i = 0; i < 3; ++i) {
    ro[i] = (int)roff[i];
    rr[i] = (int)rk[i];
    TORCH_CHECK(ro[i] + rr[i] <= R, "LoRA member ", i, ": ranks [", ro[i], ", ", ro[i] + rr[i], ") past t's ", R,
                " columns");
  }
}

// lora: + t Bn^T per member in the epilogue (t = bf16(x A^T) (M, R) with an even row stride, bn (N, RP));
// pdl (with lora): the main loop overlaps the previous kernel, the epilogue waits for it (qfp4_gemm)
void gemm(torch::Tensor x, torch::Tensor qw, torch::Tensor sc, torch::Tensor gs, torch::Tensor out, int64_t fmt,
          double out_mult, int64_t bword, int64_t nt, int64_t sw, int64_t r, int64_t ks, bool lora, torch::Tensor t,
          torch::Tensor bn, int64_t bound1, int64_t bound2, std::vector<int64_t> roff, std::vector<int64_t> rk,
          bool pdl, int64_t kz, torch::Tensor ws, torch::Tensor ctr) {
  check_operands(x, qw, sc, out);
  const int M = (int)x.size(0), S = (int)qw.size(0), C = (int)qw.size(1);
  if (kz > 1) check_split(x, ws, ctr);
  const c10::cuda::CUDAGuard guard(x.device());
  const float* gp = fmt == 0 ? gs.data_ptr<float>() : nullptr;
  int ro[3] = {0, 0, 0}, rr[3] = {0, 0, 0}, ldt = 0, RP = 0, R = 0;
  if (lora) gemm_lora_args(t, bn, M, S, roff, rk, R, ldt, RP, ro, rr);
  const int err = qfp4_gemm(qw.data_ptr(), sc.data_ptr(), x.data_ptr(), (int)x.stride(0), out.data_ptr(),
                            (int)out.stride(0), gp, (float)out_mult, (unsigned)bword, M, S, C, (int)fmt, (int)nt,
                            (int)sw, (int)r, (int)ks,
                            (void*)c10::cuda::getCurrentCUDAStream(x.device().index()).stream(),
                            lora ? t.data_ptr() : nullptr, ldt, lora ? bn.data_ptr() : nullptr, RP, R, (int)bound1,
                            (int)bound2, ro, rr, (int)pdl, (int)kz, kz > 1 ? ws.data_ptr() : nullptr,
                            kz > 1 ? (long long)ws.numel() : 0, kz > 1 ? ctr.data_ptr() : nullptr,
                            kz > 1 ? (int)ctr.numel() : 0);
  TORCH_CHECK(err == 0, "qfp4_gemm: ", err == -1 ? "unsupported configuration"
                                                  : cudaGetErrorString((cudaError_t)err));
}

// The sm_90a wgmma GEMM: x permuted into xp (M, K contiguous; csrc/fp4_wgmma_gemm.cu; permuted: xp already holds
// it), then the GEMM on xp; lora: + t Bn^T per member in its epilogue (t = bf16(x A^T) (M, R), bn (N, RP); see the
// kernel's WgLora); pdl (with lora): the main loop overlaps the previous kernel (qfp4_wgmma_gemm).
void wgmma_gemm(torch::Tensor x, torch::Tensor qw, torch::Tensor sc, torch::Tensor gs, torch::Tensor out,
                torch::Tensor xp, int64_t fmt, double out_mult, int64_t bword, int64_t ntok, int64_t rw, int64_t ks,
                int64_t kz, torch::Tensor ws, torch::Tensor ctr, bool lora, torch::Tensor t, torch::Tensor bn,
                int64_t bound1, int64_t bound2, std::vector<int64_t> roff, std::vector<int64_t> rk, bool permuted,
                bool pdl) {
  check_operands(x, qw, sc, out);
  const int M = (int)x.size(0), S = (int)qw.size(0), C = (int)qw.size(1);
  const c10::cuda::CUDAGuard guard(x.device());
  void* stream = (void*)c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  TORCH_CHECK(xp.is_cuda() && xp.scalar_type() == at::kBFloat16 && xp.is_contiguous() && xp.dim() == 2 &&
              xp.size(0) == M && xp.size(1) == 64 * C, "xp must be a contiguous bf16 (M, K) tensor");
  int err = permuted ? 0 : qfp4_permute_x(x.data_ptr(), (int)x.stride(0), xp.data_ptr(), M, C, stream);
  TORCH_CHECK(err == 0, "qfp4_permute_x: ", err == -1 ? "bad arguments" : cudaGetErrorString((cudaError_t)err));
  const float* gp = fmt == 0 ? gs.data_ptr<float>() : nullptr;
  if (kz != 1) check_split(x, ws, ctr);
  int ro[3] = {0, 0, 0}, rr[3] = {0, 0, 0}, R = 0, ldt = 0, RP = 0;
  if (lora) gemm_lora_args(t, bn, M, S, roff, rk, R, ldt, RP, ro, rr);
  err = qfp4_wgmma_gemm(qw.data_ptr(), sc.data_ptr(), xp.data_ptr(), out.data_ptr(),
                        (int)out.stride(0), gp, (float)out_mult, (unsigned)bword, M, S, C, (int)fmt, (int)ntok,
                        (int)rw, (int)ks, (int)kz, kz != 1 ? ws.data_ptr() : nullptr, (long long)ws.numel(),
                        kz != 1 ? ctr.data_ptr() : nullptr, (int)ctr.numel(), lora ? t.data_ptr() : nullptr, ldt,
                        lora ? bn.data_ptr() : nullptr, RP, R, (int)bound1, (int)bound2, ro, rr, stream,
                        (int)pdl);
  TORCH_CHECK(err == 0, "qfp4_wgmma_gemm: ", err == -1 ? "unsupported device or configuration"
                                                        : cudaGetErrorString((cudaError_t)err));
}

void permute_x(torch::Tensor x, torch::Tensor xp) {
  TORCH_CHECK(x.is_cuda() && xp.is_cuda() && x.scalar_type() == at::kBFloat16 && xp.scalar_type() == at::kBFloat16,
              "x, xp: bf16 CUDA tensors");
  TORCH_CHECK(x.dim() == 2 && xp.sizes() == x.sizes() && xp.is_contiguous() && x.stride(1) == 1 &&
              x.size(1) % 64 == 0, "x (M, K), K % 64 == 0; xp contiguous, same shape");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, "x must be 16-byte aligned");
  const c10::cuda::CUDAGuard guard(x.device());
  const int err = qfp4_permute_x(x.data_ptr(), (int)x.stride(0), xp.data_ptr(), (int)x.size(0),
                                 (int)(x.size(1) / 64),
                                 (void*)c10::cuda::getCurrentCUDAStream(x.device().index()).stream());
  TORCH_CHECK(err == 0, "qfp4_permute_x: ", err == -1 ? "bad arguments" : cudaGetErrorString((cudaError_t)err));
}

int64_t wgmma_ctas(int64_t fmt, int64_t ntok, int64_t rw, int64_t ks, bool lora, bool sk) {
  return qfp4_wgmma_ctas((int)fmt, (int)ntok, (int)rw, (int)ks, (int)lora, (int)sk);
}

std::vector<int64_t> wgmma_attributes(int64_t fmt, int64_t ntok, int64_t rw, int64_t ks) {
  int regs = -1, local = -1;
  qfp4_wgmma_attributes((int)fmt, (int)ntok, (int)rw, (int)ks, &regs, &local);
  return {regs, local};
}

void dequant(torch::Tensor qw, torch::Tensor sc, torch::Tensor gs, torch::Tensor out, int64_t fmt, bool has_g) {
  TORCH_CHECK(qw.is_cuda() && sc.is_cuda() && out.is_cuda() && gs.is_cuda(), "tensors must be on CUDA");
  TORCH_CHECK(qw.dim() == 4 && sc.dim() == 3 && out.dim() == 2, "bad ranks");
  const int S = (int)qw.size(0), C = (int)qw.size(1);
  // whole strips of chunks; a column slice's strips lie qw.stride(0) / 128 chunks apart (the same for the scales)
  const int64_t cs = qw.stride(0) / 128;
  TORCH_CHECK(qw.stride(3) == 1 && qw.stride(2) == 4 && qw.stride(1) == 128 && qw.stride(0) % 128 == 0 && cs >= C
              && sc.stride(2) == 1 && sc.stride(1) == sc.size(2) && sc.stride(0) == cs * sc.size(2),
              "qweight/scales must be a weight's strips, whole or a column slice of them");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.stride(1) == 1, "out must be bf16 with unit column stride");
  TORCH_CHECK(out.size(0) == 16 * S && out.size(1) == 64 * C, "out shape mismatch");
  TORCH_CHECK(!has_g || gs.scalar_type() == at::kFloat, "global scale must be float32");
  const c10::cuda::CUDAGuard guard(out.device());
  const int err = qfp4_dequant(qw.data_ptr(), sc.data_ptr(), has_g ? gs.data_ptr<float>() : nullptr,
                               out.data_ptr(), (long)out.stride(0), S, C, (long)cs, (int)fmt,
                               (void*)c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
  TORCH_CHECK(err == 0, "qfp4_dequant: ", err == -1 ? "unsupported out layout (row stride % 8, 16-byte alignment)"
                                                     : cudaGetErrorString((cudaError_t)err));
}

int64_t gemm_occupancy(int64_t fmt, int64_t nt, int64_t sw, int64_t r, int64_t ks) {
  return qfp4_gemm_occupancy((int)fmt, (int)nt, (int)sw, (int)r, (int)ks);
}

std::vector<int64_t> gemm_attributes(int64_t fmt, int64_t nt, int64_t sw, int64_t r) {
  int regs = -1, local = -1;
  qfp4_gemm_attributes((int)fmt, (int)nt, (int)sw, (int)r, &regs, &local);
  return {regs, local};
}

int64_t occupancy(int64_t fmt, int64_t nt, int64_t unroll, int64_t sw, int64_t warps, int64_t splits,
                  int64_t lora) {
  return qfp4_occupancy((int)fmt, (int)nt, (int)unroll, (int)sw, (int)warps, (int)splits, (int)lora);
}

std::vector<int64_t> attributes(int64_t fmt, int64_t nt, int64_t unroll, int64_t sw) {
  int regs = -1, local = -1;
  qfp4_attributes((int)fmt, (int)nt, (int)unroll, (int)sw, &regs, &local);
  return {regs, local};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv);
  m.def("gemv_lora", &gemv_lora);
  m.def("occupancy", &occupancy);
  m.def("attributes", &attributes);
  m.def("gemm", &gemm);
  m.def("gemm_occupancy", &gemm_occupancy);
  m.def("gemm_attributes", &gemm_attributes);
  m.def("dequant", &dequant);
  m.def("wgmma_gemm", &wgmma_gemm);
  m.def("permute_x", &permute_x);
  m.def("wgmma_attributes", &wgmma_attributes);
  m.def("wgmma_ctas", &wgmma_ctas);
}
