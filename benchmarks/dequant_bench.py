"""Dense BF16 weight from the kernel layout: the Triton kernel against the CUDA kernel (GPU).

    python -m benchmarks.dequant_bench [--models 7b,32b] [--out results/speed]

Per decoder linear of the Qwen2.5 shapes (NVFP4 and MXFP4, random weights): the median time of
``qerl.kernels.dequantize_relaid(w, out, backend=...)`` over CUDA-graph-free back-to-back launches on rotating
weight copies (>= 160 MB, so L2 holds none), the bytes moved (packed weight + scales read, BF16 written) per second,
and the ratio in the same run. Rows go to ``dequant.csv``; the bits of the two kernels are compared once per shape.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from qerl.bench_common import _env, _write_csv
from qerl.kernels import cuda_fp4, dequantize_relaid
from qerl.model import PRESETS
from qerl.quant import FORMATS

IDENT = ("bench", "model", "fmt", "linear", "n", "k", "backend", "device")


def linears(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's linears of the ``preset:qwen2.5-<model>`` shape."""
    c = PRESETS[f"qwen2.5-{model}"]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    return [("q_proj", h, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, h), ("gate_proj", i, h),
            ("up_proj", i, h), ("down_proj", h, i)]


def weight(fmt: str, n: int, k: int, seed: int):
    """A random (N, K) weight (0.02 N(0, 1), ``seed``) quantized to ``fmt`` and re-laid out for the CUDA kernels."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = FORMATS[fmt].quantize(0.02 * torch.randn(n, k, device="cuda", generator=g))
    return cuda_fp4.prepare(fmt, q["weight_packed"], q["weight_scale"], q.get("weight_global_scale"))


def rotating_copies(w0, min_bytes: int = 160 * 2**20) -> list:
    """``w0`` and as many copies of its tensors as make ``min_bytes`` in all (so L2 holds none of them)."""
    copies = max(1, -(-min_bytes // w0.nbytes))
    return [w0] + [cuda_fp4.weight_from(w0.fmt, w0.qweight.clone(), w0.scales.clone(), w0.global_scale, w0.bexp)
                   for _ in range(copies - 1)]


def _time(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) * 1e3)
    return sorted(ts)[len(ts) // 2]


def _rotating(ws: list, out: torch.Tensor, backend: str):
    """A call that dequantizes the next of the weight copies ``ws`` into ``out`` each time."""
    state = [0]

    def call():
        dequantize_relaid(ws[state[0] % len(ws)], out, backend=backend)
        state[0] += 1
    return call


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="7b")
    p.add_argument("--formats", default="nvfp4,mxfp4")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default="results/speed")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("dequant_bench needs a CUDA GPU")
    env = _env()
    for model in a.models.split(","):
        for fmt in a.formats.split(","):
            for name, n, k in linears(model):
                w0 = weight(fmt, n, k, seed=n + k)
                ws = rotating_copies(w0)
                out = torch.empty((n, k), device="cuda", dtype=torch.bfloat16)
                ref = dequantize_relaid(w0, torch.empty_like(out), backend="triton")
                same = bool(torch.equal(dequantize_relaid(w0, out, backend="cuda"), ref))
                rows = []
                for backend in ("triton", "cuda"):
                    us = _time(_rotating(ws, out, backend), a.iters)
                    moved = w0.nbytes + 2 * n * k
                    rows.append(dict(bench="dequant", model=model, fmt=fmt, linear=name, n=n, k=k, backend=backend,
                                     us=us, tb_s=moved / us / 1e6, bits_equal=same, **env))
                rows[1]["speedup_vs_triton"] = rows[0]["us"] / rows[1]["us"]
                print(f"{model} {fmt} {name:9s} {n:6d}x{k:<6d} triton {rows[0]['us']:8.1f} us "
                      f"({rows[0]['tb_s']:.2f} TB/s)  cuda {rows[1]['us']:8.1f} us ({rows[1]['tb_s']:.2f} TB/s)  "
                      f"x{rows[1]['speedup_vs_triton']:.2f}  bits equal: {same}", flush=True)
                _write_csv(rows, Path(a.out) / "dequant.csv", IDENT)


if __name__ == "__main__":
    main()
