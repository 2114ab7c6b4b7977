"""Decode attention (``qerl.kernels.fused.decode_attention``) per layer: Triton's split kernel at each split target
against the CUDA kernel, on a GPU.

    python -m benchmarks.attn_bench [--models 7b,32b] [--batch 2,8,16] [--kv 256,1024,2048]
                                    [--targets 264,528,1056] [--kernels triton,cuda] [--configs 64:4:0,128:4:0]
                                    [--cuda-configs 2,3] [--out results/speed]

For one layer's shapes (heads, KV heads, head dim of the model) and a static KV cache of S_max = 2304 slots, the
attention of one new token per row over the first S keys (Triton: split kernel + combine; CUDA: one launch), timed as one CUDA graph over rotating caches
(>= 160 MB, so the keys come from HBM), median replay per call; effective TB/s counts K and V of the S keys once.
``--kernels`` picks the split kernels: Triton's (``--configs``: keys per tile : warps : pipeline stages, 0 = Triton's
default; ``--targets`` sweeps ``fused.ATTN_TARGET_PROGRAMS``) and the CUDA one of ``qerl.kernels.cuda_attn``
(``--cuda-configs``: ring stages per warp; one CTA per (row, KV head), no split target), called as the decode step
calls them (PDL where on, the cache slot S - 1 as the one the previous launch writes). Writes
``attn_<gpu>.csv`` (gpu = "h100", ...) under ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import math
import os

import torch

from benchmarks import kernel_bench as bench
from qerl.kernels import cuda_attn
from qerl.kernels import fused as fk

S_MAX = 2304


def _settings(kernel: str, target: int, cfg: tuple) -> tuple[dict, dict]:
    """(module attributes to set for one measurement, their CSV columns): the Triton kernel's keys per tile, warps
    and stages, or the CUDA kernel's ring stages and keys-per-split block; the split target either way."""
    if kernel == "triton":
        bs, warps, stages = cfg
        return ({(fk, "ATTN_TARGET_PROGRAMS"): target, (fk, "ATTN_BS"): bs, (fk, "ATTN_WARPS"): warps,
                 (fk, "ATTN_STAGES"): stages, (cuda_attn, "MODE"): "triton"},
                dict(bs=bs, warps=warps, stages=stages))
    (nst,) = cfg
    return ({(cuda_attn, "NST"): nst, (cuda_attn, "MODE"): "cuda"}, dict(bs=16, warps=4, stages=nst))


def run(models, batches, kvs, targets, rep_ms: float, configs=((64, 4, 0),), kernels=("triton",),
        cuda_configs=((2,),)) -> list[dict]:
    rows = []
    for mdl in models:
        _, _, nh, nkv, hd = bench.MODELS[mdl]
        for m in batches:
            per = 2 * m * nkv * S_MAX * hd * 2
            copies = max(1, min(64, math.ceil(bench.ROTATE_BYTES / per)))
            kcs = [torch.randn(m, nkv, S_MAX, hd, device="cuda").bfloat16() for _ in range(copies)]
            vcs = [torch.randn(m, nkv, S_MAX, hd, device="cuda").bfloat16() for _ in range(copies)]
            q = torch.randn(m, nh, hd, device="cuda").bfloat16()
            bias = torch.zeros(m, S_MAX, device="cuda")
            for s in kvs:
                slot = torch.tensor([s - 1], device="cuda")
                for kernel in kernels:
                    for t in (targets if kernel == "triton" else targets[:1]):  # the CUDA kernel never splits
                        for cfg in (configs if kernel == "triton" else cuda_configs):
                            sets, cols = _settings(kernel, t, cfg)
                            orig = {k: getattr(*k) for k in sets}
                            try:
                                for (mod, name), v in sets.items():
                                    setattr(mod, name, v)
                                calls = [functools.partial(fk.decode_attention, q, kc, vc, bias, s, hd ** -0.5, slot)
                                         for kc, vc in zip(kcs, vcs, strict=True)]
                                us = bench._graph_ms(calls, rep_ms)[0] * 1e3
                            finally:
                                for (mod, name), v in orig.items():
                                    setattr(mod, name, v)
                            nsplit = (fk.attention_splits(m * nkv, s, block=cols["bs"], target_programs=t)[0]
                                      if kernel == "triton" else 1)
                            nbytes = 2 * m * nkv * s * hd * 2
                            rows.append(dict(model=mdl, batch=m, kv=s, kernel=kernel, target=t, **cols,
                                             splits=nsplit, us=round(us, 2),
                                             TBps=round(nbytes / (us * 1e-6) / 1e12, 3)))
                            print(f"[attn] {mdl} b{m} S={s:5d} {kernel:6s} target={t:5d} "
                                  f"{cols['bs']}:{cols['warps']}:{cols['stages']} splits={nsplit:3d}: "
                                  f"{us:7.2f} us {rows[-1]['TBps']:.2f} TB/s", flush=True)
            del kcs, vcs
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="7b,32b")
    ap.add_argument("--batch", default="2,8,16")
    ap.add_argument("--kv", default="256,1024,2048")
    ap.add_argument("--targets", default="264,528,1056")
    ap.add_argument("--configs", default="64:4:0", help="Triton: keys per tile:warps:stages, comma-separated")
    ap.add_argument("--kernels", default="triton,cuda", help="split kernels to time: triton, cuda")
    ap.add_argument("--cuda-configs", default="2", help="CUDA: ring stages per warp (2/3/4), comma-separated")
    ap.add_argument("--rep", type=float, default=15.0)
    ap.add_argument("--out", default="results/speed")
    a = ap.parse_args(argv)
    models = [s for s in a.models.split(",") if s]
    if any(s not in bench.MODELS for s in models):
        raise SystemExit(f"unknown --models {models}; choose from {sorted(bench.MODELS)}")
    batches, kvs, targets = ([int(v) for v in x.split(",") if v] for x in (a.batch, a.kv, a.targets))
    if any(not 1 <= s <= S_MAX for s in kvs) or any(t < 1 for t in targets) or any(b < 1 for b in batches):
        raise SystemExit(f"--kv must be in [1, {S_MAX}], --targets and --batch positive; got {kvs} {targets} {batches}")
    try:
        configs = [tuple(int(v) for v in c.split(":")) for c in a.configs.split(",") if c]
        assert configs and all(len(c) == 3 and c[0] in (16, 32, 64, 128, 256) and c[1] in (1, 2, 4, 8) and c[2] >= 0
                               for c in configs)
    except (ValueError, AssertionError):
        raise SystemExit(f"--configs must be bs:warps:stages with bs in 16..256 (powers of 2), warps in 1/2/4/8, "
                         f"stages >= 0; got {a.configs!r}") from None
    kernels = [k for k in a.kernels.split(",") if k]
    if not kernels or any(k not in ("triton", "cuda") for k in kernels):
        raise SystemExit(f"--kernels: triton and/or cuda; got {a.kernels!r}")
    try:
        cuda_configs = [(int(c),) for c in a.cuda_configs.split(",") if c]
        assert cuda_configs and all(c[0] in cuda_attn.NST_CHOICES for c in cuda_configs)
    except (ValueError, AssertionError):
        raise SystemExit(f"--cuda-configs must be ring stages in {cuda_attn.NST_CHOICES}; got {a.cuda_configs!r}"
                         ) from None
    if not torch.cuda.is_available():
        raise SystemExit("attn_bench needs a CUDA GPU")
    rows = run(models, batches, kvs, targets, a.rep, configs, kernels, cuda_configs)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"attn_{bench.gpu_tag()}.csv")
    bench.write_csv(path, rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
