"""Where the sm_90a wgmma FP4 GEMM's time goes at mid M (issue 10): bytes and FLOPs per launch configuration
against the time measured, and (under Nsight Compute) the hardware's own account of the same launches.

    python -m benchmarks.wgmma_profile --out DIR [--fmt nvfp4] [--shapes 37888x3584,3584x18944] [--m 64,128,256]
    ncu --clock-control none --kernel-name regex:fp4_wgmma_kernel --section SpeedOfLight ... \\
        python -m benchmarks.wgmma_profile --ncu [--fmt ...] [--shapes ...] [--m ...]

Timing mode: for every (shape, M) every wgmma configuration the tuner would try (``cuda_gemm_bench.configs``) is
timed as the tuner times it (CUDA-graph replays over weight copies larger than L2; the token permutation's launch
included), next to a count of what the launch moves: the weight bytes (packed words and scales, read once per
token tile: from HBM), the token bytes every CTA stages into shared memory (the token tile over its range of K, once
per CTA: mostly L2 hits, x is small), and the FLOPs. The ``l2_tbps`` column is (weights + tokens) per second, the
rate at which the SMs pull operands through L2; the ``tflops`` column the tensor rate. A configuration whose
``l2_tbps`` is near the L2's ceiling while its ``tflops`` is far from the tensor cores' is bound by the token
re-reads, which only more weight rows per CTA (or sharing one staged tile across CTAs) reduce.

``--configs "16,0,2,2 8,0,4,1"`` limits either mode to those configurations; ``--configs tuned`` to the one the
device's tuned table (or heuristic) picks per shape and M (an A/B of two builds: `scripts/gpu_bench.sh desc40`);
``--configs tail`` to that one's grid config and, where it splits no K across CTAs, its tail splits kt =
2..WGMMA_MAX_KZ (a ``QERL_WGMMA_TAIL=1`` build, the default: `scripts/gpu_bench.sh tail`).
``--ncu``: each configuration runs once (no graphs, no timing) so that ``ncu`` profiles exactly these launches
(``--kernel-name regex:fp4_wgmma_kernel``; the permutation kernel is not profiled). Writes
``wgmma_profile_<gpu>.csv`` / ``.md`` under ``--out`` in timing mode.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks import cuda_gemm_bench as cgb
from benchmarks import kernel_bench as bench
from qerl.kernels import cuda_fp4 as cf

DEFAULT_SHAPES = "37888x3584,3584x18944,4608x3584,3584x3584"  # 7B: gate|up, down, q|k|v, o


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``NxK,NxK`` -> [(N, K)]; N a multiple of 16 (strips), K of 64 (chunks)."""
    out = []
    for part in text.split(","):
        try:
            n, k = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--shapes entry {part!r}: expected NxK, e.g. 37888x3584") from None
        if n < 16 or n % 16 or k < 64 or k % 64:
            raise ValueError(f"--shapes entry {part!r}: N must be a multiple of 16 and K of 64")
        out.append((n, k))
    return out


def traffic(fmt: str, n: int, k: int, m: int, config: tuple[int, int, int, int], sk_ctas: int | None = None) -> dict:
    """What one wgmma launch moves and computes: weight bytes (packed words + the scale pairs a stage holds, once
    per token tile), token bytes staged (every CTA stages its token tile's rows that exist, over its range of K),
    the fp32 partials of CTA splits of K or of stream-K's shared tiles (written and read once), and the useful FLOPs.
    A stream-K config (sw = WGMMA_SK) needs ``sk_ctas`` (``cuda_fp4.wgmma_sk_ctas``: the device's CTAs), a tail-split
    one (``cuda_fp4.wgmma_tail_sw``) the CTAs of one wave (``cuda_fp4.wgmma_ctas``)."""
    nt, sw, r, ks = config
    if sw > 0:
        raise ValueError(f"config {config!r} is not a wgmma one (sw <= 0)")
    sk, kt = sw == cf.WGMMA_SK, cf.wgmma_tail_kt(sw)
    if (sk or kt) and not sk_ctas:
        raise ValueError(f"stream-K / tail-split config {config!r}: give sk_ctas (the launch's CTAs on the device, "
                         f"or one wave's)")
    ntok, kz = 8 * nt, 1 if sk or kt else 1 - sw
    s, c = n // 16, k // 64
    sl = 32 if fmt == "nvfp4" else 16  # uint16 scale pairs per (strip, chunk), as the kernel stages them
    tiles_x = -(-m // ntok)
    rows_per_cta = 4 * r * 16
    tiles_y = -(-s // (4 * r))
    w_bytes = tiles_x * s * c * (512 + 2 * sl)
    tok_rows = m  # summed over token tiles: rows past M are zero-filled, not read
    x_bytes = tiles_y * tok_rows * k * 2  # every row block (y) stages all of K (its kz x ks splits together)
    tile_bytes = ntok * rows_per_cta * 4
    if sk:
        segs = cf.streamk_segments(tiles_x * tiles_y, c, sk_ctas * ks)
        ws_bytes = 2 * tile_bytes * sum(1 for seg in segs if seg[4] >= 0)
        ctas = min(sk_ctas, -(-tiles_x * tiles_y * c // ks))
    elif kt:
        split = cf.wgmma_tail_ctas(tiles_x * tiles_y, sk_ctas, kt)
        ws_bytes = 2 * tile_bytes * sum(1 for cta in split if cta[2] > 1)
        ctas = len(split)
    else:
        ws_bytes = 0 if kz == 1 else 2 * kz * tiles_x * tiles_y * tile_bytes
        ctas = tiles_x * tiles_y * kz
    return dict(weight_bytes=w_bytes, token_bytes=x_bytes, splitk_bytes=ws_bytes, flops=2 * m * n * k,
                ctas=ctas, threads=r * ks * 128)


def _ctas_at_once(fmt: str, cfg: tuple[int, int, int, int], lora: bool) -> int | None:
    """What :func:`traffic` needs of the device for ``cfg``: a stream-K launch's CTAs, a tail split's wave; else None."""
    nt, sw, r, ks = cfg
    if sw == cf.WGMMA_SK:
        return cf.wgmma_sk_ctas(fmt, 8 * nt, r, ks)
    return cf.wgmma_ctas(fmt, 8 * nt, r, ks, lora) if cf.wgmma_tail_kt(sw) else None


def _wgmma_configs(s: int, c: int, m: int, fmt: str) -> list[tuple[int, int, int, int]]:
    return [cfg for cfg in cgb.configs(s, c, m, fmt) if cfg[1] <= 0]


TUNED, TAIL = "tuned", "tail"


def parse_configs(text: str) -> list[tuple[int, int, int, int]] | str:
    """``"16,0,2,2 8,0,4,1"`` (or ``;``-separated) -> [(16, 0, 2, 2), (8, 0, 4, 1)]: wgmma configs (sw <= 0);
    ``"tuned"`` -> ``TUNED``: each (shape, M) at the configuration the device's table or heuristic picks; ``"tail"``
    -> ``TAIL``: that one, then its tail splits (:func:`tail_configs`)."""
    if text.strip() in (TUNED, TAIL):
        return text.strip()
    out = []
    for part in text.replace(";", " ").split():
        try:
            cfg = tuple(int(v) for v in part.split(","))
        except ValueError:
            raise ValueError(f"--configs entry {part!r}: expected nt,sw,r,ks, e.g. 16,0,2,2") from None
        if len(cfg) != 4 or cfg[1] > 0:
            raise ValueError(f"--configs entry {part!r}: expected nt,sw,r,ks with sw <= 0 (a wgmma config)")
        out.append(cfg)
    return out


def tail_configs(tuned: tuple[int, int, int, int], c: int) -> list[tuple[int, int, int, int]]:
    """When ``tuned`` is a grid wgmma config without splits of K across CTAs (sw 0) or a tail split of one (the
    dispatcher's pick, ``cuda_fp4.wgmma_tail_pick``): that grid config, then the same variant with its last partial
    wave split kt = 2..WGMMA_MAX_KZ ways (``cuda_fp4.wgmma_tail_sw``; every split >= 4 chunks); else ``[tuned]``."""
    nt, sw, r, ks = tuned
    if sw != 0 and not cf.wgmma_tail_kt(sw):
        return [tuned]
    return [(nt, 0, r, ks)] + [(nt, cf.wgmma_tail_sw(kt), r, ks) for kt in range(2, cf.WGMMA_MAX_KZ + 1)
                               if c // (kt * ks) >= 4]


def _lora_operand(n: int, rank: int, k: int, seed: int):
    """A one-member LoRA operand (N rows, rank ``rank``) of random A (R, K) and B, as the fused step holds them
    (``cuda_fp4.lora_bn``)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(rank, k, generator=g, device="cuda") / k ** 0.5).bfloat16()
    bt = (0.05 * torch.randn(rank, n, generator=g, device="cuda")).bfloat16()
    return cf.LoraOperand(a, cf.lora_bn([bt], [(n, rank)]), [(n, rank)])


def run(fmt: str, shapes, ms, rep_ms: float, ncu: bool, only=None, rank: int = 0) -> list[dict]:
    rows = []
    for i, (n, k) in enumerate(shapes):
        wts = bench._Weights(fmt, n, k, seed=4000 + i)
        cws = wts.cuda()
        lora = None
        if rank:
            lora = _lora_operand(n, rank, k, seed=4500 + i)
        s, c = n // 16, k // 64
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            tuned = tuple(cf._gemm_config(cws[0], m, torch.device("cuda")))
            cfgs = _wgmma_configs(s, c, m, fmt)
            if tuned[1] <= 0 and tuned not in cfgs:
                cfgs.append(tuned)
            if only in (TUNED, TAIL):
                if tuned[1] > 0:
                    print(f"[prof] {fmt} {n}x{k} M={m}: the device's pick {tuned} is not a wgmma config; skipped")
                    continue
                cfgs = [tuned] if only == TUNED else tail_configs(tuned, c)
            elif only:
                cfgs = [cf.check_gemm_config(cfg, s, c) for cfg in only]
            for cfg in cfgs:
                if ncu:
                    cf.gemm(x, cws[0], config=cfg, lora=lora)
                    torch.cuda.synchronize()
                    print(f"[ncu] {fmt} {n}x{k} M={m} config {cfg}", flush=True)
                    continue
                t = cgb._time_gemm(cws, m, rep_ms, cfg, lora) * 1e-3  # s
                tr = traffic(fmt, n, k, m, cfg, _ctas_at_once(fmt, cfg, lora is not None))
                row = dict(fmt=fmt, N=n, K=k, M=m, config=str(cfg), tuned=cfg == tuned, lora_rank=rank,
                           us=round(t * 1e6, 2),
                           tflops=round(tr["flops"] / t / 1e12, 1),
                           l2_tbps=round((tr["weight_bytes"] + tr["token_bytes"]) / t / 1e12, 2),
                           weight_tbps=round(tr["weight_bytes"] / t / 1e12, 2), **tr)
                rows.append(row)
                print(f"[prof] {fmt} {n}x{k} M={m:4d} {cfg!s:18s}{'*' if row['tuned'] else ' '} {row['us']:8.1f} us "
                      f"{row['tflops']:6.1f} TFLOP/s  L2->SM {row['l2_tbps']:5.2f} TB/s (weights "
                      f"{row['weight_bytes'] / 1e6:6.1f} MB, tokens {row['token_bytes'] / 1e6:6.1f} MB)", flush=True)
        del wts, cws
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], header: str) -> str:
    out = [header, "", "| fmt | N×K | M | config (nt, 1-kz, r, ks) | µs | TFLOP/s | L2→SM TB/s | weights MB | tokens MB |"
           " CTAs × threads |", "|---|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: (r["fmt"], -r["N"], r["K"], r["M"], r["us"])):
        mark = " (tuned)" if r["tuned"] else ""
        out.append(f"| {r['fmt']} | {r['N']}×{r['K']} | {r['M']} | {r['config']}{mark} | {r['us']:.1f} | "
                   f"{r['tflops']:.0f} | {r['l2_tbps']:.2f} | {r['weight_bytes'] / 1e6:.1f} | "
                   f"{r['token_bytes'] / 1e6:.1f} | {r['ctas']} × {r['threads']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="nvfp4", choices=list(cf.FORMATS))
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--m", default="64,128,256")
    ap.add_argument("--rep", type=float, default=10.0, help="time spent replaying per measurement (ms)")
    ap.add_argument("--configs", default="", help="only these wgmma configs, e.g. '16,0,2,2 8,0,4,1'; 'tuned': only "
                    "the configuration the device's table or heuristic picks for each shape and M; 'tail': that one "
                    "and its tail splits (a QERL_WGMMA_TAIL=1 build)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK",
                    help="with a LoRA term of this rank in the GEMM's epilogue (its x·Aᵀ launch included); 0: none")
    ap.add_argument("--ncu", action="store_true", help="run each configuration once for ncu; no timing")
    ap.add_argument("--out", default="results/speed")
    a = ap.parse_args(argv)
    shapes = parse_shapes(a.shapes)
    ms = [int(v) for v in a.m.split(",")]
    if any(m < 17 for m in ms):
        raise ValueError(f"--m {a.m}: the wgmma GEMM serves M > 16")
    if a.lora < 0 or a.lora % 8:
        raise ValueError(f"--lora {a.lora}: a rank that is a multiple of 8 (the epilogue's staging), or 0")
    if not (torch.cuda.is_available() and cf.wgmma_supported()):
        sys.exit("needs a CUDA device of compute capability 9.0 (the wgmma GEMM is sm_90a only)")
    rows = run(a.fmt, shapes, ms, a.rep, a.ncu, parse_configs(a.configs), a.lora)
    if a.ncu:
        return
    gpu = bench.gpu_tag()
    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"wgmma_profile_{gpu}")
    bench.write_csv(base + ".csv", rows)
    header = (f"## wgmma GEMM: bytes and FLOPs per configuration against time ({torch.cuda.get_device_name(0)})\n\n"
              f"Command: `python -m benchmarks.wgmma_profile {' '.join(argv if argv is not None else sys.argv[1:])}`"
              f". L2→SM = (weights + tokens staged) / time; weights are read from HBM once per token tile.")
    with open(base + ".md", "w") as f:
        f.write(markdown(rows, header))
    print(f"wrote {base}.csv / .md")


if __name__ == "__main__":
    main()
