"""How fast HBM serves the decode GEMV's weight-read pattern, without the GEMV's arithmetic.

    python -m benchmarks.hbm_pattern_bench [--shapes 7b-gate_up,32b-gate_up] [--loads 2,4,8] [--splits 1,2,4]
                                           [--out results/speed] [--tag NAME]

A read-only kernel streams a packed FP4 weight of the GEMV's shape (N/16 strips x K/64 chunks x 512 bytes, the
``cuda_fp4`` layout without scales) as the GEMV's warps do: each warp one strip's contiguous run of chunks (its
K part of ``splits``), 16-byte loads per lane (``ld.global.nc.L1::no_allocate``), ``loads`` of them in flight,
XOR-folded so nothing is optimized away. Two orders of the same bytes:

* ``strip-major`` (S, C, 512 B): the layout ``cuda_fp4.prepare`` writes — every warp its own contiguous stream,
  thousands of streams far apart in memory at any moment;
* ``chunk-major`` (C, S, 512 B): chunk c of every strip side by side — warps at the same progress read
  neighbouring bytes.

Reported against a device-to-device copy and a torch read (``amax`` over the same bytes) measured in the same
run, each as one CUDA graph over rotating copies larger than L2. Writes ``hbm_pattern_<gpu><tag>.csv`` / ``.md``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks import kernel_bench as bench

_SRC = r"""
#include <cstdint>
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

template <int U>
__global__ void read_streams(const uint4* __restrict__ p, long long S, int C, int splits, int order,
                             unsigned* sink) {
  const int lane = threadIdx.x & 31;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long st = gw / splits;
  const int sp = (int)(gw - st * splits);
  if (st >= S) return;
  const int c0 = sp * C / splits, c1 = (sp + 1) * C / splits;
  const long long cs = order ? S * 32 : 32, ss = order ? 32 : (long long)C * 32;
  const uint4* q = p + st * ss + (long long)c0 * cs + lane;
  uint32_t acc = 0;
  int c = c0;
  for (; c + U <= c1; c += U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_stream(q + u * cs);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    q += U * cs;
  }
  for (; c < c1; ++c) {
    const uint4 v = ld_stream(q);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
    q += cs;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

void run(torch::Tensor buf, int64_t S, int64_t C, int64_t splits, int64_t order, int64_t loads, int64_t threads,
         torch::Tensor sink) {
  const long long warps = S * splits;
  const unsigned blocks = (unsigned)((warps * 32 + threads - 1) / threads);
  auto stream = at::cuda::getCurrentCUDAStream();
  const uint4* p = reinterpret_cast<const uint4*>(buf.data_ptr());
  unsigned* s = reinterpret_cast<unsigned*>(sink.data_ptr());
  if (loads == 2) read_streams<2><<<blocks, threads, 0, stream>>>(p, S, (int)C, (int)splits, (int)order, s);
  else if (loads == 4) read_streams<4><<<blocks, threads, 0, stream>>>(p, S, (int)C, (int)splits, (int)order, s);
  else if (loads == 8) read_streams<8><<<blocks, threads, 0, stream>>>(p, S, (int)C, (int)splits, (int)order, s);
  else TORCH_CHECK(false, "loads must be 2, 4 or 8");
}
"""

SHAPES = {  # name: (N, K) of the fused decode linears
    f"{m}-{lin}": nk for m, (h, inter, nh, nkv, hd) in bench.MODELS.items()
    for lin, nk in (("gate_up", (2 * inter, h)), ("down", (h, inter)), ("qkv", ((nh + 2 * nkv) * hd, h)))
}
ORDERS = ("strip-major", "chunk-major")


def _ext():
    from torch.utils.cpp_extension import load_inline
    cpp = "void run(torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, torch::Tensor);"
    cu = "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>\n" + _SRC
    return load_inline("qerl_hbm_pattern", cpp_sources=cpp, cuda_sources=cu, functions=["run"],
                       extra_cuda_cflags=["-O3"], verbose=False)


def run(shapes, loads, splits, threads: int, rep_ms: float) -> list[dict]:
    ext = _ext()
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        s, c = n // 16, k // 64
        nbytes = s * c * 512
        copies = max(2, -(-bench.ROTATE_BYTES // nbytes))
        bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
                for _ in range(copies)]
        t = bench._graph_ms([lambda b=b: b.amax() for b in bufs], rep_ms)[0]
        rows.append(dict(shape=name, N=n, K=k, MB=round(nbytes / 1e6, 1), kernel="torch amax", order="", loads="",
                         splits="", us=round(t * 1e3, 2), tbps=round(nbytes / t / 1e9, 3)))
        for order in (0, 1):
            for u in loads:
                for sp in splits:
                    calls = [lambda b=b, s=s, c=c, sp=sp, u=u, o=order: ext.run(b, s, c, sp, o, u, threads, sink)
                             for b in bufs]
                    t = bench._graph_ms(calls, rep_ms)[0]
                    rows.append(dict(shape=name, N=n, K=k, MB=round(nbytes / 1e6, 1), kernel="read_streams",
                                     order=ORDERS[order], loads=u, splits=sp, us=round(t * 1e3, 2),
                                     tbps=round(nbytes / t / 1e9, 3)))
                    print(f"[hbm] {name} {ORDERS[order]:11s} loads={u} splits={sp}: {t * 1e3:7.2f} us "
                          f"{nbytes / t / 1e9:5.2f} TB/s", flush=True)
        del bufs
        torch.cuda.empty_cache()
    return rows


def markdown(rows, header: str) -> str:
    out = [header, "", "| shape | MB | kernel | order | loads in flight / warp | splits | µs | TB/s |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['shape']} | {r['MB']} | {r['kernel']} | {r['order']} | {r['loads']} | {r['splits']} | "
                   f"{r['us']:.2f} | {r['tbps']:.2f} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b-gate_up,7b-down,32b-gate_up")
    ap.add_argument("--loads", default="2,4,8")
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--threads", type=int, default=128)
    ap.add_argument("--rep", type=float, default=20.0)
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        raise SystemExit(f"unknown --shapes {bad}; choose from {sorted(SHAPES)}")
    try:
        loads = [int(v) for v in a.loads.split(",") if v]
        splits = [int(v) for v in a.splits.split(",") if v]
    except ValueError:
        raise SystemExit(f"--loads / --splits must be integers, got {a.loads!r} / {a.splits!r}") from None
    if not loads or any(v not in (2, 4, 8) for v in loads):
        raise SystemExit(f"--loads must be among 2, 4, 8, got {a.loads!r}")
    if not splits or any(v < 1 for v in splits):
        raise SystemExit(f"--splits must be positive, got {a.splits!r}")
    if a.threads % 32 or not 32 <= a.threads <= 1024:
        raise SystemExit(f"--threads must be a multiple of 32 in [32, 1024], got {a.threads}")
    if not torch.cuda.is_available():
        raise SystemExit("hbm_pattern_bench needs a CUDA GPU")
    copy_bw = bench.copy_bandwidth()
    rows = run(shapes, loads, splits, a.threads, a.rep)
    header = (f"## HBM read bandwidth of the decode GEMV's access pattern (no arithmetic)\n\n"
              f"{bench.run_line(copy_bw)}, {a.threads} threads per CTA, `{' '.join(sys.argv)}`.")
    bench.write_report(a.out, f"hbm_pattern_{bench.gpu_tag()}{a.tag}", rows, markdown(rows, header))


if __name__ == "__main__":
    main()
