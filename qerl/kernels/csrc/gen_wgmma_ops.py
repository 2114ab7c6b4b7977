"""Writes fp4_wgmma_ops.cuh: the inline-PTX wrappers of sm_90a ``wgmma.mma_async`` (m64nNk16, bf16 in, f32
accumulators, A from registers, B from a shared-memory descriptor: ``wgmma_rs``) for the token-tile widths the FP4
wgmma GEMM is compiled for, and the same with A from a shared-memory descriptor too (``wgmma_ss``: only the
timing-only ablation build ``QFP4_WGMMA_ABLATE & 16`` calls it). One wrapper per N because each lists its N/2
accumulator registers as asm operands. The descriptor comes as its two 32-bit halves, joined inside the asm: given one
64-bit value, ptxas added 2 j to it with a carry and re-copied both halves for every MMA of a chunk (session 40's
SASS: 6-7 instructions per MMA, a fifth of the main loop); as halves, the high one is a constant and each MMA costs
one add of the low one.

    python qerl/kernels/csrc/gen_wgmma_ops.py   (from the repository root; the output is committed)
"""
from pathlib import Path

WIDTHS = (32, 64, 128, 256)
TB_WIDTHS = (128, 256)  # wgmma_ss_tb: the backward GEMM's weight-column tiles


def _asm(name: str, n: int, params: str, lines: list[str], inputs: str) -> str:
    """One specialization of ``name<n>``: an asm block of the PTX ``lines`` (each a C string literal's contents; the
    token ``MMA`` stands for ``wgmma.mma_async.sync.aligned.m64n<n>k16.f32.bf16.bf16 {the n/2 accumulators}``),
    the accumulators its in-out operands %0 .. %(n/2 - 1), then ``inputs``."""
    acc = n // 2
    mma = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{', '.join(f'%{i}' for i in range(acc))}}}"
    body = "\n".join(f'      "{line.replace("MMA", mma)}"' for line in lines)
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(acc))
    return (f"template <>\n__device__ __forceinline__ void {name}<{n}>(float (&d)[{acc}], {params}) {{\n"
            f"  asm volatile(\n{body}\n      : {outs}\n      : {inputs});\n}}\n")


def wrapper(n: int) -> str:
    """``wgmma_rs<n>``: A from four registers, B from the descriptor's halves (dlo, dhi)."""
    a = n // 2
    return _asm("wgmma_rs", n, "uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t dlo, uint32_t dhi",
                [f"{{\\n.reg .pred p;\\n.reg .b64 dsc;\\nsetp.ne.b32 p, %{a + 6}, 0;\\n"
                 f"mov.b64 dsc, {{%{a + 4}, %{a + 5}}};\\n",  # one C string line (the committed header's layout)
                 "MMA, ", f"{{%{a}, %{a + 1}, %{a + 2}, %{a + 3}}}, dsc, p, 1, 1, 0;\\n}}\\n"],
                '"r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(dlo), "r"(dhi), "r"(1)')


def wrapper_ss(n: int, tnsp_b: bool = False) -> str:
    """``wgmma_ss<n>``: A and B from descriptors, each as its two halves (alo, ahi; dlo, dhi). ``tnsp_b``:
    ``wgmma_ss_tb<n>``, the same with B MN-major (the instruction's transpose-B immediate 1: B's N dimension
    contiguous in shared memory, as the backward's dequantized weight tile of fp4_dq_gemm.cu lies)."""
    a = n // 2
    return _asm("wgmma_ss_tb" if tnsp_b else "wgmma_ss", n, "uint32_t alo, uint32_t ahi, uint32_t dlo, uint32_t dhi",
                [f"{{\\n.reg .pred p;\\n.reg .b64 asc, dsc;\\nsetp.ne.b32 p, %{a + 4}, 0;\\n",
                 f"mov.b64 asc, {{%{a}, %{a + 1}}};\\nmov.b64 dsc, {{%{a + 2}, %{a + 3}}};\\n",
                 f"MMA, asc, dsc, p, 1, 1, 0, {int(tnsp_b)};\\n}}\\n"],
                '"r"(alo), "r"(ahi), "r"(dlo), "r"(dhi), "r"(1)')


HELPERS = r"""__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes this thread's generic-proxy shared-memory writes (st.shared, landed cp.async) visible to the MMAs' reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accesses of an accumulator across the (asynchronous) MMAs.
__device__ __forceinline__ void fence_reg(float& r) { asm volatile("" : "+f"(r)::"memory"); }
// Keeps a chunk's A registers allocated and unmodified up to this point (see the main loop).
__device__ __forceinline__ void keep_regs(const uint32_t (&a)[4][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j)
    asm volatile("" ::"r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]) : "memory");
}

// Matrix descriptor of a K-major bf16 operand in the 128-byte swizzle, as its two 32-bit halves: low = start
// address >> 4 (bits 0-13) | leading byte offset, unused for this swizzle (1, bits 16-29); high = stride byte offset
// of the 8-row atoms (1024 B >> 4, bits 32-45) | the swizzle mode (128 B: bit 62). The k16 step j of a 64-k chunk
// starts 32 j bytes into the row (low + 2 j: shared addresses are below 256 KB, so the address field never carries);
// the hardware applies the swizzle to the computed addresses.
constexpr uint32_t kDescHi = (1024u >> 4) | (1u << 30);
__device__ __forceinline__ uint32_t desc_lo(uint32_t saddr) { return ((saddr & 0x3FFFFu) >> 4) | (1u << 16); }
"""  # the fences, waits and descriptor every wgmma kernel here uses


def text() -> str:
    """The header's full text."""
    head = ("// GENERATED by gen_wgmma_ops.py -- do not edit. sm_90a wgmma.mma_async m64nNk16 (bf16 x bf16 -> f32),\n"
            "// A (64 x 16) from four registers per thread (the mma.sync m16n8k16 A fragment of the thread's warp,\n"
            "// rows 16 * (warp % 4) ...), B (16 x N, K-major) from a shared-memory matrix descriptor (its low and high\n"
            "// 32 bits); d += A B. wgmma_ss: A (64 x 16, K-major) from a descriptor too (timing-only ablation builds);\n"
            "// wgmma_ss_tb: the same with B MN-major (csrc/fp4_dq_gemm.cu, the backward g @ W).\n"
            "// Also the fences, waits, register keep-alives and matrix descriptor the wgmma kernels share\n"
            "// (csrc/fp4_wgmma_gemm.cu, benchmarks/wgmma_peak.py).\n"
            "#pragma once\n#include <cstdint>\n\nnamespace qfp4 {\n\n"
            "template <int N>\n__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], uint32_t a0, uint32_t a1, "
            "uint32_t a2, uint32_t a3, uint32_t dlo, uint32_t dhi);\n"
            "template <int N>\n__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint32_t alo, uint32_t ahi, "
            "uint32_t dlo, uint32_t dhi);\n"
            "template <int N>\n__device__ __forceinline__ void wgmma_ss_tb(float (&d)[N / 2], uint32_t alo, "
            "uint32_t ahi, uint32_t dlo, uint32_t dhi);\n\n")
    body = "\n".join([*(wrapper(n) for n in WIDTHS), *(wrapper_ss(n) for n in WIDTHS),
                       *(wrapper_ss(n, tnsp_b=True) for n in TB_WIDTHS)])
    return head + HELPERS + "\n" + body + "\n}  // namespace qfp4\n"


OUT = Path(__file__).with_name("fp4_wgmma_ops.cuh")


def main() -> None:
    OUT.write_text(text())
    print("wrote", OUT)


if __name__ == "__main__":
    main()
