"""One large-M FP4 product and its BF16 cuBLAS twin, launched a few times each for Nsight Compute (issue 10, item 2):
what the in-loop dequantizing GEMM (``qerl.kernels.cuda_dq``, the build's ``QERL_DQ_*`` switches) saturates beside
what cuBLAS does on the same shape (shared-memory and L2 throughput, tensor-pipe use, warp stalls).

    ncu --kernel-name regex:'gemm|nvjet|dq_ws' ... python -m benchmarks.dq_ncu [--shape 18944x3584] [--m 2048]
        [--ops fwd,bwd] [--config 256,1] [--fmt nvfp4] [--launches 2]

Per op: BF16 ``F.linear`` (fwd) / ``g @ W`` (bwd), then the dq kernel at ``--config`` (nb, kz), each ``--launches``
times (the first of each is a warm-up the profile can skip), outside any CUDA graph so every launch is its own
kernel for the profiler. Prints one ``[dq_ncu]`` line a launch group in the order launched.
"""

from __future__ import annotations

import argparse

import torch


def _ints(text: str, sep: str, n: int, what: str, ap) -> tuple[int, ...]:
    try:
        v = tuple(int(t) for t in text.split(sep))
    except ValueError:
        v = ()
    if len(v) != n or min(v) < 0:
        ap.error(f"{what} {text!r}: {n} non-negative integers separated by {sep!r}")
    return v


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dq_ncu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="18944x3584", help="the weight's N x K (7B gate/up)")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--ops", default="fwd,bwd")
    ap.add_argument("--config", default="256,1", help="the dq kernel's (nb, kz)")
    ap.add_argument("--fmt", default="nvfp4")
    ap.add_argument("--launches", type=int, default=2)
    a = ap.parse_args(argv)
    n, k = _ints(a.shape, "x", 2, "--shape", ap)
    nb, kz = _ints(a.config, ",", 2, "--config", ap)
    from qerl.kernels import cuda_dq
    ops = [o for o in a.ops.split(",") if o]
    if not ops or any(o not in cuda_dq.OPS for o in ops):
        ap.error(f"--ops {a.ops!r}: valid: {', '.join(cuda_dq.OPS)}")
    if a.fmt not in ("nvfp4", "mxfp4"):
        ap.error(f"--fmt {a.fmt!r}: valid: nvfp4, mxfp4")
    for op in ops:
        r, c = (n, k) if op == "bwd" else (k, n)
        try:
            cuda_dq.check_config((nb, kz), a.m, r, c)
        except ValueError as e:
            ap.error(f"--config {a.config!r} for {op}: {e}")
    if not (torch.cuda.is_available() and cuda_dq.available()):
        raise SystemExit("[dq_ncu] needs an sm_90 GPU and the dq extension's build")
    from benchmarks import kernel_bench as kb
    from benchmarks.dq_gemm_bench import _dq
    bf = kb._Weights("bf16", n, k, seed=1)
    fp = kb._Weights(a.fmt + kb.KL, n, k, seed=1)
    for op in ops:
        r = n if op == "bwd" else k
        g = torch.randn(a.m, r, device="cuda").bfloat16()
        for name, f in (("bf16", kb._call("bf16", bf, 0, g, op)), ("dq", _dq(fp, 0, g, (nb, kz), op))):
            for _ in range(a.launches):
                f()
            torch.cuda.synchronize()
            print(f"[dq_ncu] {op} {name} M={a.m} {n}x{k} x{a.launches}", flush=True)


if __name__ == "__main__":
    main()
