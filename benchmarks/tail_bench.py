"""The wgmma GEMM's tail launch (``QERL_WGMMA_LORA=pdl-tail``, ``cuda_fp4.gemm(tail=True)``) against one launch,
per decoder product of a model at mid M, as the decode step launches them (GPU, sm_90).

    python -m benchmarks.tail_bench [--models 7b] [--fmt nvfp4] [--m 64,128,256] [--rank 32] [--rep 20]
                                    [--out results/speed]

For the four fused products of a decoder layer (q|k|v, o, gate|up, down; LoRA of ``--rank`` on every member) at
each M: the device's configuration (tuned table or heuristic, ``cuda_fp4._gemm_config``); where it is a wgmma one
with K not split across CTAs, the split :func:`qerl.kernels.cuda_fp4.wgmma_tail_split` makes on this GPU (one wave
= ``cuda_fp4.wgmma_ctas`` CTAs). Each timed call is the decode step's pair: t = x·Aᵀ by ``fused.lora_a(trigger=True)``
(it waits for the previous call, then lets the GEMM start), then the GEMM under PDL with the permuted tokens, once as
one launch (``one``) and once split (``tail``); both in the pdl-tail build (the script sets ``QERL_WGMMA_LORA``
before the extension loads), so the split is the only difference. Timed by ``kernel_bench._graph_ms`` (one CUDA graph
over weight copies larger than L2, median of replays), ``one`` and ``tail`` alternating twice (columns ``us_one`` /
``us_tail``: the mean; ``*_passes``: both). The tail's output is checked against one launch's: the main launch's rows
bit for bit, the tail's within ``rel_err`` (its fp32 sums add in another order). Rows go to ``tail_bench.csv``
under ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

IDENT = ("bench", "model", "product", "M", "fmt", "device")


def products(model: str, rank: int) -> list[tuple[str, int, int, list[tuple[int, int]]]]:
    """(name, N, K, LoRA members [(rows, rank)]) of a decoder layer's products as the fused decode step runs them
    (q|k|v and gate|up as one matmul each), for the Qwen2.5 shape ``model`` (``kernel_bench.MODELS``)."""
    from benchmarks import kernel_bench as kb
    if model not in kb.MODELS:
        raise ValueError(f"unknown model {model!r}; valid: {', '.join(kb.MODELS)}")
    h, inter, nh, nkv, hd = kb.MODELS[model]
    return [("qkv", (nh + 2 * nkv) * hd, h, [(nh * hd, rank), (nkv * hd, rank), (nkv * hd, rank)]),
            ("o", h, nh * hd, [(h, rank)]),
            ("gate_up", 2 * inter, h, [(inter, rank), (inter, rank)]),
            ("down", h, inter, [(h, rank)])]


def lora_operand(members, k: int, seed: int):
    """A LoRA operand of random A (R, K) and per-member B as the fused step holds them (``cuda_fp4.lora_bn``)."""
    from qerl.kernels import cuda_fp4 as cf
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = sum(rk for _, rk in members)
    a = (torch.randn(r, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    bts = [(0.05 * torch.randn(rk, n, generator=g, device="cuda")).bfloat16() for n, rk in members]
    return cf.LoraOperand(a, cf.lora_bn(bts, members), members)


def bench_product(model, name, n, k, members, fmt, m, rep_ms, seed) -> dict:
    from benchmarks import kernel_bench as kb
    from qerl.kernels import cuda_fp4 as cf
    from qerl.kernels import fused as fk
    wts = kb._Weights(fmt, n, k, seed=seed)
    cws = wts.cuda()
    op = lora_operand(members, k, seed + 1)
    dev = torch.device("cuda")
    cfg = tuple(cf._gemm_config(cws[0], m, dev))
    row = dict(bench="tail", model=model, product=name, N=n, K=k, M=m, fmt=fmt, config=str(cfg),
               device=torch.cuda.get_device_name(0))
    nt, sw, r, ks = cfg
    if sw > 0:
        return dict(row, split="mma.sync config: no tail launch")
    wave = cf.wgmma_ctas(fmt, 8 * nt, r, ks, lora=True)
    ctas = cf.wgmma_tiles(m, n // 16, nt, r) * (1 if sw == cf.WGMMA_SK else 1 - sw)  # stream-K: per wave, not all
    split = cf.wgmma_tail_split(m, n // 16, k // 64, cfg, wave)
    row.update(wave=wave, ctas=ctas, waves=round(ctas / wave, 2))
    if split is None:
        return dict(row, split="none")
    x = torch.randn(m, k, device="cuda").bfloat16()
    xp = cf.permute_tokens(x)
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in cws]

    def calls(tail: bool):
        return [lambda w=w, o=o: cf.gemm(x, w, out=o, config=cfg, lora=op, t=fk.lora_a(x, op.a, trigger=True),
                                         pdl=True, xp=xp, tail=tail) for w, o in zip(cws, outs, strict=True)]
    times = {False: [], True: []}
    for tail in (False, True, True, False):
        times[tail].append(kb._graph_ms(calls(tail), rep_ms)[0] * 1e3)
    ref = cf.gemm(x, cws[0], config=cfg, lora=op, t=fk.lora_a(x, op.a), pdl=True, xp=xp)
    got = cf.gemm(x, cws[0], config=cfg, lora=op, t=fk.lora_a(x, op.a), pdl=True, xp=xp, tail=True)
    n0 = 16 * split[0]
    err = float((got[:, n0:].float() - ref[:, n0:].float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    one, tl = (sum(times[v]) / 2 for v in (False, True))
    return dict(row, split=f"{n0} rows + {n - n0} rows x {split[1]} splits of K", main_rows=n0, tail_kz=split[1],
                us_one=round(one, 2), us_tail=round(tl, 2), speedup=round(one / tl, 3),
                us_one_passes=" / ".join(f"{v:.2f}" for v in times[False]),
                us_tail_passes=" / ".join(f"{v:.2f}" for v in times[True]),
                main_rows_equal=bool(torch.equal(got[:, :n0], ref[:, :n0])), rel_err=err)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b")
    ap.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "mxfp4"))
    ap.add_argument("--m", default="64,128,256")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--rep", type=float, default=20.0, help="time spent replaying per measurement (ms)")
    ap.add_argument("--out", default="results/speed")
    a = ap.parse_args(argv)
    ms = [int(v) for v in a.m.split(",")]
    if any(m < 17 for m in ms):
        raise ValueError(f"--m {a.m}: the wgmma GEMM serves M > 16")
    if a.rank < 8 or a.rank % 8:
        raise ValueError(f"--rank {a.rank}: the GEMM's LoRA epilogue needs a multiple of 8")
    models = a.models.split(",")
    for mdl in models:
        products(mdl, a.rank)  # unknown names refused before any GPU work
    from qerl.kernels import cuda_fp4 as cf
    if not (torch.cuda.is_available() and cf.wgmma_supported()):
        sys.exit("needs a CUDA device of compute capability 9.0 (the wgmma GEMM is sm_90a only)")
    os.environ["QERL_WGMMA_LORA"] = "pdl-tail"  # the build whose LoRA variants trigger (before the extension loads)
    from qerl.bench import _write_csv
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for mdl in models:
        for i, (name, n, k, members) in enumerate(products(mdl, a.rank)):
            for m in ms:
                row = bench_product(mdl, name, n, k, members, a.fmt, m, a.rep, seed=5000 + 10 * i)
                _write_csv([row], out / "tail_bench.csv", IDENT)  # each row as it is measured
                print({kk: v for kk, v in row.items() if kk not in ("bench", "device")}, flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
