"""LoRA down-projection x·Aᵀ at decode: ``qerl.kernels.fused.lora_a`` against cuBLAS and a grid of launch parameters
of its Triton split-K kernel (GPU).

    python -m benchmarks.lora_a_bench [--models 7b] [--m 64,128,256] [--rank 32] [--out results/speed] [--quick]
                                      [--max-split 32] [--launches 20] [--replays 10]

For the four LoRA x·Aᵀ products of a decoder layer of the ``preset:qwen2.5-<model>`` shape as the fused decode step
runs them (q|k|v: R = 3·rank, o: R = rank, gate|up: R = 2·rank, all K = hidden; down: R = rank, K = intermediate),
each at M token rows (random x (M, K) bf16 and A (R, K) bf16 · 0.02, fresh per shape and M), candidates:

* ``default``: ``lora_a(x, a)`` as the sampler calls it (its own tile/split choice; F.linear above
  ``QERL_LORA_A_MAX_M`` rows: column ``default_path``);
* ``cublas``: ``F.linear(x, a)``;
* ``grid``: ``_lora_a_kernel`` launched directly as ``lora_a`` launches it, over BM (token rows per CTA, tiles of BM
  along grid axis 2), BR (rank rows per CTA), BK, the K split (``lora_a_splits``' rule for several CTA targets, plus
  no split; at most ``--max-split``) and num_warps (:func:`candidates`; ``--quick`` trims it).

Timed as the decode step runs (CUDA graphs): after two eager calls, one graph of ``--launches`` back-to-back
launches is captured and replayed ``--replays`` times; µs = median replay / launches (inputs stay in L2, as the
decode step's x does; A is small). Each candidate's output (of the graph's last launch, after the replays) is
checked against x.float() @ a.float().T (|out − ref| <= 1e-2·|ref| + 1e-2·max|ref|), the split-K counters must be
back at zero, and ``bit_identical`` says whether it equals the default's output bit for bit. A candidate that raises
(compile, launch, capture) or fails the check is a row with ``ok`` False and the error; the run goes on. Rows go
to ``lora_a.csv`` under ``--out``; per (shape, M) the default, cuBLAS and the best three grid configurations are
printed, and per M the layer's sum of the four.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.nn.functional as F

from qerl.bench_common import _env, _write_csv
from qerl.kernels.base import _COUNTER_SLOTS, _counters, _interpret
from qerl.kernels.fused import lora_a_config
from qerl.kernels.fused import lora_a_splits as splits  # (K splits, K per split); cap: most splits
from qerl.model import PRESETS

IDENT = ("bench", "model", "shape", "m", "r", "k", "candidate", "bm", "br", "bk", "split", "per", "warps", "device")
BMS, BRS, BKS, WARPS = (32, 64, 128), (16, 32, 64), (64, 128), (4, 8)
TARGETS = (16, 32, 64, 96, 132, 192, 264)  # CTAs the split aims at (132: the H100's SMs)
QUICK_BKS, QUICK_WARPS, QUICK_TARGETS = (128,), (4,), (32, 96, 264)
MAX_SPLIT = 32  # lora_a_splits caps at 16; the grid may go further where few CTAs cover R and M


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def shapes(model: str, rank: int) -> list[tuple[str, int, int]]:
    """(name, R, K) of the four LoRA x·Aᵀ products of one decoder layer in the fused decode step."""
    c = PRESETS[f"qwen2.5-{model}"]
    h, i = c["hidden_size"], c["intermediate_size"]
    return [("qkv", 3 * rank, h), ("o", rank, c["num_attention_heads"] * (h // c["num_attention_heads"])),
            ("gate_up", 2 * rank, h), ("down", rank, i)]


def geometry(m: int, r: int, cfg: dict) -> tuple[int, int]:
    """(rank blocks, M tiles) of a configuration: the grid is (rank blocks, split, M tiles)."""
    return -(-r // cfg["br"]), -(-m // cfg["bm"])


def candidates(m: int, r: int, k: int, quick: bool = False, max_split: int = MAX_SPLIT) -> list[dict]:
    """Distinct launch configurations {bm, br, bk, split, per, warps} of ``_lora_a_kernel`` for x (m, k) · Aᵀ (r, k):
    BM up to max(32, next_pow2(m)), BR up to next_pow2(r) (at least 16, tl.dot's minimum), every split's ``per``
    a multiple of BK with split·per >= K > (split−1)·per (no empty split), each target's split counting all M tiles
    (target / M tiles CTAs per tile row, as ``lora_a`` does), plus split 1."""
    bks, warps, targets = (QUICK_BKS, QUICK_WARPS, QUICK_TARGETS) if quick else (BKS, WARPS, TARGETS)
    bms = [b for b in BMS if b <= max(32, next_pow2(m))]
    brs = [b for b in BRS if b <= max(16, next_pow2(r))]
    out, seen = [], set()
    for bm, br, bk in itertools.product(bms, brs, bks):
        mtiles = -(-m // bm)
        pairs = [(1, -(-k // bk) * bk)] + [splits(r, k, br, bk, max(1, -(-t // mtiles)), max_split) for t in targets]
        for (split, per), w in itertools.product(sorted(set(pairs)), warps):
            key = (bm, br, bk, split, per, w)
            if key not in seen:
                seen.add(key)
                out.append(dict(bm=bm, br=br, bk=bk, split=split, per=per, warps=w))
    return out


def default_config(m: int, r: int, k: int) -> dict:
    """What ``lora_a`` launches for x (m, k) · Aᵀ (r, k) where it takes the Triton path (its own rule)."""
    bm, split, per = lora_a_config(m, r, k)
    return dict(bm=bm, br=16, bk=128, split=split, per=per, warps=4)


def validate(m: int, r: int, k: int, cfg: dict) -> None:
    """Raise ValueError where the kernel's preconditions do not hold for cfg."""
    bm, br, bk, split, per = cfg["bm"], cfg["br"], cfg["bk"], cfg["split"], cfg["per"]
    for name, v in (("bm", bm), ("br", br), ("bk", bk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v}: tl.dot needs a power of two >= 16")
    if per <= 0 or per % bk or split < 1 or split * per < k or (split - 1) * per >= k:
        raise ValueError(f"split {split} × per {per} does not tile K={k} in whole BK={bk} tiles")
    nrb, mtiles = geometry(m, r, cfg)
    if split > 1 and nrb * mtiles > _COUNTER_SLOTS:
        raise ValueError(f"{nrb * mtiles} split-K tiles exceed the {_COUNTER_SLOTS} counters")


def launch(x: torch.Tensor, a: torch.Tensor, cfg: dict, check: bool = True) -> torch.Tensor:
    """out (M, R) = x · Aᵀ by one ``_lora_a_kernel`` launch with cfg, with ``lora_a``'s argument conventions
    (workspace (split, M, R) float32 and the per-stream tile counters when split > 1, the fence on CUDA, fp32 dots
    under the interpreter). ``check``: validate cfg first (``validate``)."""
    from qerl.kernels.fused import _lora_a_kernel
    m, k = x.shape
    r = a.shape[0]
    if x.stride(1) != 1 or not a.is_contiguous() or a.shape[1] != k:
        raise ValueError("x needs unit stride along K and A (R, K) contiguous")
    if check:
        validate(m, r, k, cfg)
    split = cfg["split"]
    nrb, mtiles = geometry(m, r, cfg)
    out = torch.empty((m, r), dtype=x.dtype, device=x.device)
    ws = torch.empty((split, m, r), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = _counters(x.device) if split > 1 else out
    interp = _interpret()
    _lora_a_kernel[(nrb, split, mtiles)](x, a, out, ws, cnt, m, r, k, x.stride(0), cfg["per"], BM=cfg["bm"],
                                         BR=cfg["br"], BK=cfg["bk"], SPLIT=split, FENCE=x.is_cuda and not interp,
                                         DOT_F32=interp, TRIGGER=False, MTILES=mtiles > 1, num_warps=cfg["warps"])
    return out


def check(out: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-2, atol: float = 1e-2) -> tuple[bool, float]:
    """(within |out − ref| <= rtol·|ref| + atol·max|ref|, max |out − ref| / max |ref|); ref float32."""
    if out.shape != ref.shape:
        return False, float("inf")
    o = out.float()
    d = (o - ref).abs()
    scale = ref.abs().max().clamp_min(1e-30)
    ok = bool(torch.isfinite(o).all()) and bool((d <= rtol * ref.abs() + atol * scale).all())
    return ok, float(d.max() / scale) if d.numel() else 0.0


def time_graph(fn, launches: int, replays: int, stream) -> tuple[float, torch.Tensor]:
    """(median µs per launch, output of the graph's last launch after the replays): two eager calls, one graph of
    ``launches`` calls of fn, replayed ``replays`` times (after one untimed replay), all on ``stream`` (so the split-K
    counters of that stream exist before the capture)."""
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    stream.synchronize()
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=stream):
            for _ in range(launches):
                out = fn()
    except Exception:
        del g
        torch.cuda.synchronize()
        raise
    times = []
    with torch.cuda.stream(stream):
        g.replay()
        for _ in range(replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / launches)
    stream.synchronize()
    out = out.clone()
    del g
    return sorted(times)[len(times) // 2], out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset(counters: list[torch.Tensor]) -> int:
    """Non-zero split-K counters left behind (each kernel must leave them zero), zeroed again for the next one."""
    left = sum(int(torch.count_nonzero(c)) for c in counters)
    if left:
        for c in counters:
            c.zero_()
            _sync(c.device)
    return left


def bench_shape(model: str, shape: str, m: int, r: int, k: int, quick: bool, max_split: int, env: dict, timer,
                counters: list[torch.Tensor], device: str | torch.device = "cuda") -> list[dict]:
    """Rows of every candidate for one (shape, M). ``timer(fn)`` -> (µs per launch, an output of fn) (on CUDA
    :func:`time_graph`); ``counters``: every split-K counter tensor the launches may use (checked and re-zeroed
    after each candidate)."""
    from qerl.kernels.fused import lora_a, lora_a_max_m
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(1000 * m + r + k)
    x = torch.randn(m, k, device=dev, generator=gen).bfloat16()
    a = (0.02 * torch.randn(r, k, device=dev, generator=gen)).bfloat16()
    ref = x.float() @ a.float().t()
    nbytes = 2 * (m * k + r * k + m * r)
    default_path = "triton" if m <= 16 or m <= lora_a_max_m() else "F.linear"
    base = dict(bench="lora_a", model=model, shape=shape, m=m, r=r, k=k)
    _sync(dev)
    todo = [("default", default_config(m, r, k) if default_path == "triton" else {}, lambda: lora_a(x, a)),
            ("cublas", {}, lambda: F.linear(x, a))]
    todo += [("grid", c, (lambda c=c: launch(x, a, c))) for c in candidates(m, r, k, quick, max_split)]
    rows, first = [], None
    for name, cfg, fn in todo:
        row = dict(base, candidate=name, bm="", br="", bk="", split="", per="", warps="", mtiles="", ctas="",
                   k_iters="", default_path=default_path if name == "default" else "")
        row.update(cfg)
        if cfg:
            nrb, mtiles = geometry(m, r, cfg)
            row.update(mtiles=mtiles, ctas=nrb * cfg["split"] * mtiles, k_iters=cfg["per"] // cfg["bk"])
        try:
            if name == "grid":
                validate(m, r, k, cfg)
            us, out = timer(fn)
            ok, err = check(out, ref)
            left = _reset(counters)
            if name == "default":
                first = out
            row.update(us=round(us, 3), gb_s=round(nbytes / us / 1e3, 1) if us > 0 else "", max_rel_err=f"{err:.2e}",
                       bit_identical=bool(first is not None and torch.equal(out, first)),
                       ok=ok and not left, error="" if ok and not left else
                       ("split-K counters left non-zero; " if left else "") + ("" if ok else "wrong result"))
        except Exception as e:  # compile / launch / capture failure: a failed candidate, the run goes on
            try:
                _sync(dev)
                _reset(counters)
            except Exception:  # e.g. a dead context after a fault: the later candidates will say so
                pass
            row.update(us="", gb_s="", max_rel_err="", bit_identical="", ok=False,
                       error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
        rows.append(dict(row, **env))
    return rows


def _params(r: dict) -> str:
    return f"BM{r['bm']} BR{r['br']} BK{r['bk']} split{r['split']} w{r['warps']} ({r['ctas']} CTAs)"


def report(rows: list[dict], per_shape: bool = True, per_layer: bool = True) -> None:
    """Per (shape, M): default, cuBLAS and the best three grid rows (``per_shape``); then per (model, M) the layer's four
    products summed (``per_layer``)."""
    keys = list(dict.fromkeys((r["model"], r["shape"], r["m"]) for r in rows))
    layer: dict = {}
    for key in keys:
        sel = [r for r in rows if (r["model"], r["shape"], r["m"]) == key]
        d = next(r for r in sel if r["candidate"] == "default")
        c = next(r for r in sel if r["candidate"] == "cublas")
        grid = sorted((r for r in sel if r["candidate"] == "grid" and r["ok"]), key=lambda r: r["us"])
        nfail = sum(1 for r in sel if r["candidate"] == "grid" and not r["ok"])

        def us(r):
            return f"{r['us']:.2f} us" if r["ok"] else f"FAILED ({r['error']})"
        if per_shape:
            print(f"[lora_a] {key[0]} {key[1]:8s} M={key[2]:<4d} R={d['r']:<3d} K={d['k']:<6d} default {us(d)} "
                  f"({d['default_path']}{', ' + _params(d) if d['bm'] != '' else ''})  cublas {us(c)}  "
                  f"grid {len(grid)} ok / {nfail} failed", flush=True)
            for r in grid[:3]:
                print(f"    {r['us']:7.2f} us  {_params(r)}  bit-identical to default: {r['bit_identical']}",
                      flush=True)
        lay = layer.setdefault((key[0], key[2]), [0.0, 0.0, 0.0])
        for i, r in enumerate((d, c, grid[0] if grid else None)):
            lay[i] += r["us"] if r is not None and r["ok"] else float("nan")
    for (model, m), (d, c, g) in layer.items() if per_layer else ():
        print(f"[lora_a] {model} M={m}: layer (4 products) default {d:.2f} us, cublas {c:.2f} us, "
              f"best grid per product {g:.2f} us", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="7b")
    p.add_argument("--m", default="64,128,256")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--out", default="results/speed")
    p.add_argument("--quick", action="store_true", help="trimmed grid: BK 128, 4 warps, three CTA targets")
    p.add_argument("--max-split", type=int, default=MAX_SPLIT, help="most K splits of a grid candidate")
    p.add_argument("--launches", type=int, default=20, help="launches per CUDA graph")
    p.add_argument("--replays", type=int, default=10, help="timed replays per candidate")
    a = p.parse_args(argv)
    models = [s for s in a.models.split(",") if s]
    bad = [s for s in models if f"qwen2.5-{s}" not in PRESETS]
    if bad:
        raise SystemExit(f"unknown --models {bad}; choose from "
                         f"{sorted(n.removeprefix('qwen2.5-') for n in PRESETS if n.startswith('qwen2.5-'))}")
    try:
        ms = [int(s) for s in a.m.split(",") if s]
    except ValueError:
        raise SystemExit(f"--m must be comma-separated positive integers, got {a.m!r}") from None
    if not ms or any(m < 1 for m in ms):
        raise SystemExit(f"--m must be comma-separated positive integers, got {a.m!r}")
    if a.rank < 1 or a.max_split < 1 or a.launches < 1 or a.replays < 1:
        raise SystemExit("--rank, --max-split, --launches and --replays must be positive")
    if not torch.cuda.is_available():
        raise SystemExit("lora_a_bench needs a CUDA GPU (torch.cuda is not available): it times Triton and cuBLAS "
                         "launches in CUDA graphs")
    env = _env()
    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(dev)
    with torch.cuda.stream(stream):  # the capture stream's counters, created (zeroed) outside any capture
        counters = [_counters(dev)]
    counters.append(_counters(dev))  # the default stream's
    torch.cuda.synchronize(dev)

    def timer(fn):
        return time_graph(fn, a.launches, a.replays, stream)
    rows = []
    for model in models:
        for m in ms:
            for shape, r, k in shapes(model, a.rank):
                new = bench_shape(model, shape, m, r, k, a.quick, a.max_split, env, timer, counters, dev)
                report(new, per_layer=False)
                _write_csv(new, Path(a.out) / "lora_a.csv", IDENT)  # per shape: a cut-short run keeps what it has
                rows += new
                torch.cuda.empty_cache()
    report(rows, per_shape=False)


if __name__ == "__main__":
    main()
