"""How fast HBM serves the decode GEMV's weight-read pattern, without the GEMV's arithmetic.

    python -m benchmarks.hbm_pattern_bench [--shapes 7b-gate_up,32b-gate_up] [--loads 2,4,8] [--splits 1,2,4]
                                           [--patterns fp4,bf16-pair,bf16-sector] [--out results/speed] [--tag NAME]

A read-only kernel streams a packed FP4 weight of the GEMV's shape (N/16 strips x K/64 chunks x 512 bytes, the
``cuda_fp4`` layout without scales) as the GEMV's warps do: each warp one strip's contiguous run of chunks (its
K part of ``splits``), 16-byte loads per lane (``ld.global.nc.L1::no_allocate``), ``loads`` of them in flight,
XOR-folded so nothing is optimized away. Two orders of the same bytes:

* ``strip-major`` (S, C, 512 B): the layout ``cuda_fp4.prepare`` writes — every warp its own contiguous stream,
  thousands of streams far apart in memory at any moment;
* ``chunk-major`` (C, S, 512 B): chunk c of every strip side by side — warps at the same progress read
  neighbouring bytes.

``--patterns bf16-pair,bf16-sector`` (session 43) stream a dense BF16 weight of the shape, row-major as stored, the
way the BF16 decode GEMV reads it: a warp = one 16-row strip's run of 64-k chunks (its K part), lane (g, t) rows g
and g + 8, four 16-byte loads a lane and chunk -- ``pair``: at bytes 32 t and 32 t + 16 of the row's 128 (each
instruction covers every other 16 bytes, ``QERL_BF16_LOADS=pair``); ``sector``: at 16 t and 64 + 16 t (each covers
whole sectors, the default) -- ``loads`` chunks in flight (4 x loads loads a lane). So the GEMV's bandwidth can be
read against what its access pattern alone gets.

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

// A dense BF16 weight (N rows of 8 C uint4) read as the BF16 GEMV reads it (see the module docstring): warp = strip
// st (16 rows) x K part sp, lane (g, t) rows g and g + 8, per chunk two 16-byte pieces of each row (SECTOR: at 16 t
// and 64 + 16 t; else at 32 t and 32 t + 16), U chunks in flight.
template <int U, bool SECTOR>
__global__ void read_rows(const uint4* __restrict__ p, long long S, int C, int splits, unsigned* sink) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const long long gw = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const long long st = gw / splits;
  const int sp = (int)(gw - st * splits);
  if (st >= S) return;
  const int c0 = sp * C / splits, c1 = (sp + 1) * C / splits;
  const long long row = (long long)C * 8;  // uint4 per row
  constexpr int O2 = SECTOR ? 4 : 1;       // uint4 from a lane's first piece of a row chunk to its second
  const uint4* q = p + (st * 16 + g) * row + (long long)c0 * 8 + (SECTOR ? t : 2 * t);
  uint32_t acc = 0;
  int c = c0;
  for (; c + U <= c1; c += U) {
    uint4 v[U][4];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      v[u][0] = ld_stream(q + u * 8);
      v[u][1] = ld_stream(q + u * 8 + O2);
      v[u][2] = ld_stream(q + 8 * row + u * 8);
      v[u][3] = ld_stream(q + 8 * row + u * 8 + O2);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc ^= v[u][j].x ^ v[u][j].y ^ v[u][j].z ^ v[u][j].w;
    q += U * 8;
  }
  for (; c < c1; ++c) {
    const uint4 a = ld_stream(q), b = ld_stream(q + O2), e = ld_stream(q + 8 * row), f = ld_stream(q + 8 * row + O2);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ e.x ^ e.y ^ e.z ^ e.w ^ f.x ^ f.y ^ f.z ^ f.w;
    q += 8;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}

template <bool SECTOR>
void launch_rows(const uint4* p, long long S, int C, int splits, int loads, unsigned blocks, int threads,
                 cudaStream_t stream, unsigned* s) {
  if (loads == 2) read_rows<2, SECTOR><<<blocks, threads, 0, stream>>>(p, S, C, splits, s);
  else if (loads == 4) read_rows<4, SECTOR><<<blocks, threads, 0, stream>>>(p, S, C, splits, s);
  else if (loads == 8) read_rows<8, SECTOR><<<blocks, threads, 0, stream>>>(p, S, C, splits, s);
  else TORCH_CHECK(false, "loads must be 2, 4 or 8");
}

// order: 0 strip-major, 1 chunk-major (FP4 layout); 2 BF16 rows, pair loads; 3 BF16 rows, sector loads
void run(torch::Tensor buf, int64_t S, int64_t C, int64_t splits, int64_t order, int64_t loads, int64_t threads,
         torch::Tensor sink) {
  const long long warps = S * splits;
  const unsigned blocks = (unsigned)((warps * 32 + threads - 1) / threads);
  auto stream = at::cuda::getCurrentCUDAStream();
  const uint4* p = reinterpret_cast<const uint4*>(buf.data_ptr());
  unsigned* s = reinterpret_cast<unsigned*>(sink.data_ptr());
  if (order >= 2) {
    if (order == 3) launch_rows<true>(p, S, (int)C, (int)splits, (int)loads, blocks, (int)threads, stream, s);
    else launch_rows<false>(p, S, (int)C, (int)splits, (int)loads, blocks, (int)threads, stream, s);
    return;
  }
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
ORDERS = ("strip-major", "chunk-major", "bf16 rows, pair", "bf16 rows, sector")
PATTERNS = {"fp4": (0, 1), "bf16-pair": (2,), "bf16-sector": (3,)}  # --patterns: the kernel's order codes


def _ext():
    from torch.utils.cpp_extension import load_inline
    cpp = "void run(torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, torch::Tensor);"
    cu = "#include <torch/extension.h>\n#include <ATen/cuda/CUDAContext.h>\n" + _SRC
    return load_inline("qerl_hbm_pattern", cpp_sources=cpp, cuda_sources=cu, functions=["run"],
                       extra_cuda_cflags=["-O3"], verbose=False)


def run(shapes, loads, splits, threads: int, rep_ms: float, patterns=("fp4",)) -> list[dict]:
    ext = _ext()
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        for dense in dict.fromkeys(p != "fp4" for p in patterns):  # the FP4 bytes and / or the BF16 weight's
            orders = [o for p in patterns if (p != "fp4") == dense for o in PATTERNS[p]]
            rows += _run_bytes(ext, sink, name, n, k, dense, orders, loads, splits, threads, rep_ms)
    return rows


def _run_bytes(ext, sink, name, n, k, dense, orders, loads, splits, threads, rep_ms) -> list[dict]:
    """The rows of one byte image of shape (n, k): packed FP4 (N/16 x K/64 x 512 bytes) or a dense BF16 weight, read
    by torch's amax and then by the kernel in each of ``orders``."""
    s, c = n // 16, k // 64
    nbytes = n * k * 2 if dense else s * c * 512
    copies = max(2, -(-bench.ROTATE_BYTES // nbytes))
    bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (nbytes // 4,), dtype=torch.int32, device="cuda")
            for _ in range(copies)]
    row = dict(shape=name, N=n, K=k, MB=round(nbytes / 1e6, 1))
    t = bench._graph_ms([lambda b=b: b.amax() for b in bufs], rep_ms)[0]
    rows = [dict(row, kernel="torch amax", order="", loads="", splits="", us=round(t * 1e3, 2),
                 tbps=round(nbytes / t / 1e9, 3))]
    for order in orders:
        for u in loads:
            for sp in splits:
                calls = [lambda b=b, sp=sp, u=u, o=order: ext.run(b, s, c, sp, o, u, threads, sink) for b in bufs]
                t = bench._graph_ms(calls, rep_ms)[0]
                rows.append(dict(row, kernel="read_streams" if order < 2 else "read_rows", order=ORDERS[order],
                                 loads=u, splits=sp, us=round(t * 1e3, 2), tbps=round(nbytes / t / 1e9, 3)))
                print(f"[hbm] {name} {ORDERS[order]:17s} loads={u} splits={sp}: {t * 1e3:7.2f} us "
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
    ap.add_argument("--patterns", default="fp4", help=f"comma-separated: {', '.join(PATTERNS)}")
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
    patterns = [p for p in a.patterns.split(",") if p]
    if not patterns or any(p not in PATTERNS for p in patterns):
        raise SystemExit(f"unknown --patterns {a.patterns!r}; choose from {', '.join(PATTERNS)}")
    if a.threads % 32 or not 32 <= a.threads <= 1024:
        raise SystemExit(f"--threads must be a multiple of 32 in [32, 1024], got {a.threads}")
    if not torch.cuda.is_available():
        raise SystemExit("hbm_pattern_bench needs a CUDA GPU")
    copy_bw = bench.copy_bandwidth()
    rows = run(shapes, loads, splits, a.threads, a.rep, patterns)
    header = (f"## HBM read bandwidth of the decode GEMV's access pattern (no arithmetic)\n\n"
              f"{bench.run_line(copy_bw)}, {a.threads} threads per CTA, `{' '.join(sys.argv)}`.")
    bench.write_report(a.out, f"hbm_pattern_{bench.gpu_tag()}{a.tag}", rows, markdown(rows, header))


if __name__ == "__main__":
    main()
