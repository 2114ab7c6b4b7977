"""Per-layer benchmark of the decoder linears: each format's ``qmm`` (and ``qmm_t``) against BF16 cuBLAS.

    python -m benchmarks.kernel_bench [--models 7b,14b,32b] [--m 1,2,...,2048] [--out results/speed] [--tune]

For the seven linears of one decoder layer of Qwen2.5-3B/7B/14B/32B (dims hard-coded below), per M: the
median time of each linear, measured as CUDA-graph replays of the product over rotating weight copies
(>= 160 MB, so every weight read comes from HBM, as in a decode step; graphs take host launch overhead
out, as the rollout's CUDA-graph decode does), summed over the layer; and the 7 linears run back to back
over consecutive layer copies in one graph. Effective bytes/s (weights + x + out moved once) is compared
with a device-to-device copy measured in the same run; speed-ups are against BF16 ``F.linear``. Backward
(``qmm_t``, grad_input = g W) is timed at M >= 512. NF4 goes through bitsandbytes if it imports.
``--tune`` first times candidate kernel configurations per (format, layer shape, M) the same way and uses
the fastest (the table is printed for ``configs.TUNED``). ``--layout kernel|both`` times NVFP4/MXFP4 weights held
in the CUDA kernels' layout alone (``quant.layout=kernel``, ``qerl.kernels.relaid``: large M and the backward
rebuild the dense weight with ``dequantize_relaid``) as columns ``<fmt>-kernel``. Writes ``layers_<gpu>.csv`` / ``.md`` (and
``layers_tune_<gpu>.csv``) under ``--out`` and prints the markdown last.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F

MODELS = {  # hidden, intermediate, heads, kv heads, head_dim
    "3b": (2048, 11008, 16, 2, 128),
    "7b": (3584, 18944, 28, 4, 128),
    "14b": (5120, 13824, 40, 8, 128),
    "32b": (5120, 27648, 40, 8, 128),
}
DEFAULT_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048)
ROTATE_BYTES = 160 << 20
MAX_COPIES = 160
KL = "-kernel"  # a column label's suffix: the format's weights held in the CUDA kernels' layout alone


def _base(fmt: str) -> str:
    """The format of a column label (``nvfp4-kernel`` -> ``nvfp4``)."""
    return fmt.removesuffix(KL)


def _fp4(fmt: str) -> bool:
    """True for a format served by the FP4 dispatcher (the fused Triton kernels and their tuning table)."""
    from qerl.kernels import FP4Kernels
    from qerl.quant import get_format

    return isinstance(get_format(_base(fmt)).kernels, FP4Kernels)


def layout_columns(fmts: list[str], layout: str) -> list[str]:
    """The column labels of ``--layout``: compressed (the formats as given), kernel (NVFP4/MXFP4 in the kernels'
    layout instead) or both (each such format twice)."""
    from qerl.quant.base import KERNEL_LAYOUT_FORMATS

    if layout not in ("compressed", "kernel", "both"):
        raise ValueError(f"--layout {layout!r}: valid layouts are compressed, kernel, both")
    out = []
    for f in fmts:
        kl = f in KERNEL_LAYOUT_FORMATS
        if layout != "kernel" or not kl:
            out.append(f)
        if layout != "compressed" and kl:
            out.append(f + KL)
    return out


def fp4_formats() -> list[str]:
    from qerl.quant import FORMATS

    return [f for f in FORMATS if _fp4(f)]
DEVICE = "cuda"  # the benchmark is for GPUs; tests may point it elsewhere


def layer_linears(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of the 7 linears of one decoder layer."""
    h, inter, nh, nkv, hd = MODELS[model]
    return [("q_proj", nh * hd, h), ("k_proj", nkv * hd, h), ("v_proj", nkv * hd, h), ("o_proj", h, nh * hd),
            ("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter)]


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _do_bench(fn, rep_ms: float) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms / 4), rep=rep_ms, return_mode="median"))


def gpu_tag(tag: str = "", device: str = "") -> str:
    """The file tag of a benchmark's outputs: ``tag`` when given, else the model word ("h100") of ``device`` (a
    device name; default this process's GPU)."""
    if tag:
        return tag
    words = (device or torch.cuda.get_device_name()).split()
    return words[1].lower() if len(words) > 1 else "gpu"


def write_csv(path: str, rows: list[dict], keys: list[str] | None = None) -> None:
    """``rows`` as a CSV at ``path`` (columns ``keys``, default the first row's)."""
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=keys or list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)


def run_line(copy_bw: float) -> str:
    """A benchmark header's run line: GPU, torch, python and the copy bandwidth measured in the same run."""
    return (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, python {platform.python_version()}, "
            f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)")


def write_report(out: str, stem: str, rows: list[dict], md: str) -> None:
    """``rows`` as ``<out>/<stem>.csv`` and ``md`` as ``<out>/<stem>.md`` (``out`` created), then ``md`` printed."""
    os.makedirs(out, exist_ok=True)
    write_csv(os.path.join(out, stem + ".csv"), rows)
    with open(os.path.join(out, stem + ".md"), "w") as fh:
        fh.write(md + "\n")
    print(md)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = _do_bench(lambda: dst.copy_(src), 200)
    return 2 * nbytes / (ms * 1e-3)


class _Weights:
    """A quantized random weight and enough copies of it to rotate through more than the L2 cache."""

    def __init__(self, fmt: str, n: int, k: int, seed: int):
        from qerl.kernels import prepare, relaid
        from qerl.quant import FORMATS
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        w = torch.randn(n, k, device=DEVICE, generator=g) * 0.02
        base = _base(fmt)
        q = FORMATS[base].quantize(w.bfloat16() if base == "bf16" else w)
        del w
        if fmt.endswith(KL):  # the kernels' layout alone, as relayout_model leaves a linear
            q = relaid.from_compressed(FORMATS[base], q)
            if q is None:
                raise ValueError(f"{fmt} {(n, k)}: this weight cannot be held exactly in the kernels' layout")
        self.nbytes = sum(t.numel() * t.element_size() for t in q.values())
        reps = max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / self.nbytes)))
        self.qs = [q] + [{kk: v.clone() for kk, v in q.items()} for _ in range(reps - 1)]
        if fmt.endswith(KL):  # every copy's decode exponent known before any capture
            for qq in self.qs:
                relaid.note_bexp(qq["weight_relaid"], int(q["weight_relaid_bexp"][0]))
        elif _fp4(fmt):
            self.pws = [prepare(base, qq) for qq in self.qs]
        self.fmt = fmt

    def cuda(self) -> list:
        """Every copy as the CUDA kernels hold it (``cuda_fp4.prepare``; a BF16 weight: ``cuda_fp4.dense_weight``)."""
        from qerl.kernels import cuda_fp4 as cf
        if self.fmt == "bf16":
            return [cf.dense_weight(q["weight"]) for q in self.qs]
        return [cf.prepare(self.fmt, q["weight_packed"], q["weight_scale"], q.get("weight_global_scale"))
                for q in self.qs]


def _call(fmt: str, wts: _Weights, i: int, x: torch.Tensor, op: str, cfg=None):
    """A closure running one product on copy i of the weight (what a decode step does once per layer)."""
    from qerl import kernels as qk
    q = wts.qs[i]
    if cfg is not None:
        out = torch.empty(x.shape[0], q["weight_packed"].shape[0], device=x.device, dtype=torch.bfloat16)
        if cfg.kernel == "cublas":
            pw = wts.pws[i]
            return lambda: qk._dequant_mm(x, fmt, q, pw, out, cfg.chunk)
        pw = wts.pws[i]
        return lambda: qk._launch(x, pw, cfg, out)
    if fmt == "bf16":
        w = q["weight"]
        return (lambda: torch.matmul(x, w)) if op == "bwd" else (lambda: F.linear(x, w))
    f = qk.qmm_t if op == "bwd" else qk.qmm
    base = _base(fmt)
    if fmt.endswith(KL):
        from qerl.kernels import relaid
        from qerl.quant import FORMATS
        relaid.weight(FORMATS[base], q)  # its one host read, before any capture
    return lambda: f(x, base, q)


def _graph_ms(calls: list, rep_ms: float) -> tuple[float, str]:
    """Per-call time (ms): median over replays of one CUDA graph running ``calls`` in order.

    Graphs take the host's launch overhead out (a decode step runs as a graph); the rotation over weight
    copies larger than L2 keeps every weight read coming from HBM. Falls back to timing the calls eagerly
    (events around the whole list) if capture fails; the second value says which ("graph" / "eager").
    """
    cur = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for c in calls:
            c()
    cur.wait_stream(side)
    torch.cuda.synchronize()
    mode, g = "graph", None
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for c in calls:
                c()
        run = g.replay
    except Exception:  # e.g. a library call that cannot be captured
        mode, g = "eager", None
        torch.cuda.synchronize()

        def run():
            for c in calls:
                c()
    t = replay_median_ms(run, rep_ms)
    del g
    return t / len(calls), mode


def replay_median_ms(run, rep_ms: float) -> float:
    """Median time (ms) of ``run()`` (a graph replay or eager launches) between CUDA events: one untimed run, then
    at least 5 and at most 200 timed ones within ``rep_ms``."""
    run()
    torch.cuda.synchronize()
    times: list[float] = []
    t_end = time.perf_counter() + rep_ms * 1e-3
    while len(times) < 5 or (time.perf_counter() < t_end and len(times) < 200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _time_fn(fmt: str, wts: _Weights, m: int, k: int, n: int, op: str, rep_ms: float, cfg=None) -> float:
    """Per-call time (ms) of one linear, rotating over all copies of its weight inside one graph."""
    x = torch.randn(m, n if op == "bwd" else k, device=DEVICE).bfloat16()
    calls = [_call(fmt, wts, i, x, op, cfg) for i in range(len(wts.qs))]
    if DEVICE != "cuda":
        return _do_bench(lambda: [c() for c in calls], rep_ms) / len(calls)
    return _graph_ms(calls, rep_ms)[0]


# ----------------------------------------------------------------------------------------- tuning

def _candidates(m: int) -> list:
    """Kernel configurations timed by ``--tune`` for one M (all share a small set of constexprs)."""
    from qerl.kernels.configs import KernelConfig as C
    out = []
    if m <= 16:
        md1 = [(64, 256, 4, 3, 0), (128, 256, 8, 3, 0), (64, 128, 4, 4, 0), (32, 512, 4, 3, 0), (32, 256, 4, 4, 0)]
        md2 = [(64, 256, 4, 3, 0), (64, 256, 4, 4, 0), (64, 256, 8, 3, 0), (128, 256, 8, 3, 0), (64, 128, 4, 3, 96),
               (128, 128, 4, 3, 0), (32, 256, 4, 3, 0), (64, 256, 4, 2, 0), (64, 128, 4, 3, 80),
               (64, 128, 4, 4, 96), (128, 128, 8, 3, 96), (128, 128, 4, 3, 128)]
        for mode, base in ((1, md1), (2, md2)):
            out += [C("dot", bm=16, bn=bn, bk=bk, split_k=s, swap=False, warps=w, stages=st, mode=mode, maxnreg=r)
                    for bn, bk, w, st, r in base for s in (1, 2, 4, 8)]
        for s in (1, 4):  # scale-load variants
            out += [C("dot", bm=16, bn=64, bk=256, split_k=s, swap=False, warps=4, stages=3, sc32=True),
                    C("dot", bm=16, bn=64, bk=256, split_k=s, swap=False, warps=4, stages=3, mode=3),
                    C("dot", bm=16, bn=64, bk=256, split_k=s, swap=False, warps=4, stages=3, mode=2, prefetch=False),
                    C("dot", bm=16, bn=64, bk=256, split_k=s, swap=True, warps=4, stages=3)]
        if m <= 2:
            out += [C("gemv", bn=32, bk=256, split_k=s, warps=4, stages=3) for s in (1, 4)]
        return out + [C("cublas")]
    if m >= 512:  # dequantize + cuBLAS, whole or in L2-sized slices; two fused configurations at 512
        out += [C("cublas", chunk=c) for c in (1024, 2048, 4096)]
        if m == 512:
            out += [C("dot", bm=128, bn=128, bk=64, split_k=1, swap=True, warps=8, stages=4),
                    C("dot", bm=128, bn=64, bk=128, split_k=2, swap=True, warps=4, stages=3)]
        return out + [C("cublas")]
    if m <= 64:
        out += [C("dot", bm=16, bn=64, bk=256, split_k=s, swap=False, warps=4, stages=3, mode=2) for s in (1, 2, 4)]
    bms = {32: (32,), 64: (32, 64), 128: (64, 128), 256: (64, 128)}.get(m, (128,))
    base = [(64, 128, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (64, 256, 4, 3)]
    out += [C("dot", bm=bm, bn=bn, bk=bk, split_k=s, swap=sw, warps=w, stages=st)
            for bm in bms for bn, bk, w, st in base for sw in (False, True) for s in (1, 2)]
    return out + [C("cublas")]


def _compile_worker(job) -> str:
    """Compile one (format, configuration, shape) by launching it once on small inputs (fills the cache)."""
    fmt, key, n, k = job
    from qerl import kernels as qk
    from qerl.kernels.configs import KernelConfig
    from qerl.quant import FORMATS
    cfg = KernelConfig.parse(key)
    try:
        q = FORMATS[fmt].quantize(torch.randn(n, k, device=DEVICE) * 0.02)
        pw = qk.prepare(fmt, q)
        x = torch.randn(cfg.bm if cfg.kernel == "dot" else 1, k, device=DEVICE).bfloat16()
        qk._launch(x, pw, cfg, torch.empty(x.shape[0], n, device=DEVICE, dtype=torch.bfloat16))
        _sync()
        return ""
    except Exception as e:  # resource limits: the configuration is dropped from the sweep
        return f"{fmt} {key} {n}x{k}: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def precompile(jobs: list, workers: int) -> list[str]:
    """Compile many configurations in parallel processes (Triton's on-disk cache serves the parent)."""
    import multiprocessing as mp
    if workers <= 1:
        return [r for r in map(_compile_worker, jobs) if r]
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        return [r for r in ex.map(_compile_worker, jobs) if r]


def tune_jobs(models: list[str], fmts: list[str], ms: list[int]) -> list:
    """(fmt, config key, N, K) compile jobs of a tuning sweep (one shape: all tuned shapes specialize alike)."""
    shapes = sorted({(n, k) for mdl in models for _, n, k in layer_linears(mdl)})
    return sorted({(f, c.key(), n, k) for f in fmts for m in ms for c in _candidates(m) if c.kernel != "cublas"
                   for n, k in shapes[:1]})


def _tune_shape(fmt, n, k, ms, cands_for, rep_ms, bad, rows, best) -> dict:
    """Time the candidates of every M for one layer shape; records rows and the best key per M."""
    wts = _Weights(fmt, n, k, seed=n + k)
    ranked = {}
    for m in ms:
        res = []
        for cfg in cands_for(m):
            if (fmt, cfg.key()) in bad:
                continue
            try:
                t = _time_fn(fmt, wts, m, k, n, "fwd", rep_ms, cfg=cfg)
            except Exception as e:  # e.g. out of shared memory for this shape
                print(f"  [tune] {fmt} {n}x{k} M={m} {cfg.key()}: {type(e).__name__}", flush=True)
                continue
            res.append((t, cfg.key()))
            rows.append(dict(fmt=fmt, N=n, K=k, M=m, config=cfg.key(), us=round(t * 1e3, 2)))
        res.sort()
        if not res:
            continue
        ranked[m] = res
        best[(fmt, n, k, m)] = res[0][1]
        second = f"(2nd {res[1][1]} {res[1][0] * 1e3:.1f}us)" if len(res) > 1 else ""
        print(f"[tune] {fmt} {n}x{k} M={m}: best {res[0][1]} {res[0][0] * 1e3:.1f}us {second}", flush=True)
    del wts
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return ranked


def tune(models: list[str], fmts: list[str], ms: list[int], rep_ms: float, out_csv: str, workers: int,
         more_models: list[str] = (), top: int = 6) -> dict:
    """Time every candidate per (format, shape, M) of ``models``; then, for the other shapes of
    ``more_models``, only the ``top`` configurations of each M from the first pass (plus cuBLAS).
    Returns {(fmt, N, K, M): best key} and writes every timing to ``out_csv``."""
    from qerl.kernels.configs import KernelConfig
    shapes = sorted({(n, k) for mdl in models for _, n, k in layer_linears(mdl)})
    more = sorted({(n, k) for mdl in more_models for _, n, k in layer_linears(mdl)} - set(shapes))
    jobs = tune_jobs(models, fmts, ms)
    t0 = time.time()
    failed = precompile(jobs, workers)
    print(f"[tune] compiled {len(jobs)} configurations in {time.time() - t0:.0f}s; failed: {len(failed)}",
          flush=True)
    for f in failed:
        print("  ", f)
    bad = {(f.split()[0], f.split()[1]) for f in failed}
    best, rows = {}, []
    for fmt in fmts:
        shortlist: dict[int, dict[str, float]] = {}
        for n, k in shapes:
            ranked = _tune_shape(fmt, n, k, ms, _candidates, rep_ms, bad, rows, best)
            for m, res in ranked.items():
                for rank, (_, key) in enumerate(res[:top]):
                    shortlist.setdefault(m, {})[key] = shortlist.get(m, {}).get(key, 0) + top - rank
        picks = {m: [KernelConfig.parse(key) for key, _ in sorted(v.items(), key=lambda kv: -kv[1])[:top]]
                 for m, v in shortlist.items()}
        for n, k in more:
            _tune_shape(fmt, n, k, ms, lambda m, p=picks: p.get(m, []) + [KernelConfig(kernel="cublas")],
                        rep_ms, bad, rows, best)
    write_csv(out_csv, rows)
    return best


def install_table(best: dict) -> dict:
    """Map tuned M values to buckets (M=1 -> 1; the M=16 result serves 2..16) and install them in configs."""
    from qerl.kernels import configs
    table = {}
    for (fmt, n, k, m), key in best.items():
        buckets = [m] if m != 16 else [2, 4, 8, 16]
        for b in buckets:
            if (fmt, n, k, b) not in best or b == m:
                table[(fmt, n, k, b)] = key
    configs.set_table(table)
    return table


# ----------------------------------------------------------------------------------------- benchmark

def _layer_graph_ms(fmt: str, lins, wts: dict, m: int, op: str, rep_ms: float) -> float:
    """Per-layer time (ms) of the 7 linears run back to back as one graph, over consecutive layer copies
    (as in a decode step; the copies rotate through more than the L2 cache)."""
    xs = {}
    calls = []
    layers = min(64, max(len(w.qs) for w in wts.values()))
    for r in range(layers):
        for _name, n, k in lins:
            kin = n if op == "bwd" else k
            if (m, kin) not in xs:
                xs[(m, kin)] = torch.randn(m, kin, device=DEVICE).bfloat16()
            w = wts[(n, k)]
            calls.append(_call(fmt, w, r % len(w.qs), xs[(m, kin)], op))
    if DEVICE != "cuda":
        return _do_bench(lambda: [c() for c in calls], rep_ms) / layers
    return _graph_ms(calls, rep_ms)[0] * len(lins)


def run(models, ms, fmts, rep_ms, copy_bw) -> list[dict]:
    from qerl import kernels as qk
    rows = []
    for mdl in models:
        lins = layer_linears(mdl)
        for fmt in fmts:
            wts = {}
            for i, (_name, n, k) in enumerate(lins):
                wts.setdefault((n, k), None)
                if wts[(n, k)] is None:
                    wts[(n, k)] = _Weights(fmt, n, k, seed=1000 + i)
            for m in ms:
                for op in ("fwd", "bwd") if m >= 512 else ("fwd",):
                    total_t, total_b, backends = 0.0, 0, set()
                    for name, n, k in lins:
                        w = wts[(n, k)]
                        t = _time_fn(fmt, w, m, k, n, op, rep_ms)
                        xin = torch.empty(m, n if op == "bwd" else k, device=DEVICE, dtype=torch.bfloat16)
                        if op == "fwd" or not _fp4(fmt):
                            backends.add(qk.backend_for(_base(fmt), xin, w.qs[0]))
                        else:
                            backends.add("dequant_cublas")
                        nbytes = w.nbytes + 2 * m * (n + k)
                        total_t += t
                        total_b += nbytes
                        rows.append(dict(model=mdl, M=m, fmt=fmt, op=op, linear=name, N=n, K=k,
                                         us=round(t * 1e3, 3), bytes=nbytes))
                    t_graph = _layer_graph_ms(fmt, lins, wts, m, op, rep_ms)
                    rows.append(dict(model=mdl, M=m, fmt=fmt, op=op, linear="layer", N=0, K=0,
                                     us=round(total_t * 1e3, 3), bytes=total_b,
                                     backend="+".join(sorted(backends)), layer_graph_us=round(t_graph * 1e3, 3)))
                    print(f"[bench] {mdl} {fmt:6s} {op} M={m:5d}: {total_t * 1e3:8.1f} us/layer "
                          f"{total_b / (total_t * 1e-3) / 1e12:5.2f} TB/s; whole-layer graph "
                          f"{t_graph * 1e3:8.1f} us", flush=True)
            del wts
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    layer = {(r["model"], r["M"], r["fmt"], r["op"]): r for r in rows if r["linear"] == "layer"}
    for r in rows:
        base = layer.get((r["model"], r["M"], "bf16", r["op"]))
        if r["linear"] == "layer" and base is not None:
            r["speedup_vs_bf16"] = round(base["us"] / r["us"], 3)
            r["graph_speedup_vs_bf16"] = round(base["layer_graph_us"] / r["layer_graph_us"], 3)
        r["TBps"] = round(r["bytes"] / (r["us"] * 1e-6) / 1e12, 3)
        r["frac_copy_bw"] = round(r["bytes"] / (r["us"] * 1e-6) / copy_bw, 3)
    return rows


def markdown(rows, header: str) -> str:
    layer = [r for r in rows if r["linear"] == "layer"]
    from qerl.quant import FORMATS

    seen = set(r["fmt"] for r in layer)
    fmts = [c for f in FORMATS for c in (f, f + KL) if c in seen]  # registry order (BF16 first), layouts together
    fmts += sorted(seen - set(fmts))
    out = [header, ""]
    for mdl in dict.fromkeys(r["model"] for r in layer):
        for op in ("fwd", "bwd"):
            sel = [r for r in layer if r["model"] == mdl and r["op"] == op]
            if not sel:
                continue
            out += [f"### Qwen2.5-{mdl.upper()} decoder linears, {'forward qmm' if op == 'fwd' else 'backward qmm_t'}",
                    "", "Cell: sum of the 7 per-linear medians in µs (speed-up vs BF16) effective TB/s · whole-layer "
                    "graph µs (speed-up vs BF16).", ""]
            out.append("| M | " + " | ".join(fmts) + " | FP4 backend |")
            out.append("|---:|" + "---:|" * len(fmts) + "---|")
            for m in sorted({r["M"] for r in sel}):
                cells, be = [], ""
                for f in fmts:
                    r = next((x for x in sel if x["M"] == m and x["fmt"] == f), None)
                    if r is None:
                        cells.append("–")
                        continue
                    sp = "" if f == "bf16" else f" ({r.get('speedup_vs_bf16', float('nan')):.2f}×)"
                    gsp = "" if f == "bf16" else f" ({r.get('graph_speedup_vs_bf16', float('nan')):.2f}×)"
                    cells.append(f"{r['us']:.1f}{sp} {r['TBps']:.2f} · {r['layer_graph_us']:.1f}{gsp}")
                    if _fp4(f) and not be:  # the FP4 path's backend (the first FP4 column's)
                        be = r.get("backend", "")
                out.append(f"| {m} | " + " | ".join(cells) + f" | {be} |")
            out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="3b,7b,14b,32b")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)))
    ap.add_argument("--fmts", default=None, help="comma-separated formats (default: every registered format)")
    ap.add_argument("--out", default="results/speed")
    ap.add_argument("--rep", type=float, default=20.0, help="time spent replaying per measurement (ms)")
    ap.add_argument("--tune", action="store_true", help="time candidate configurations first and use the best")
    ap.add_argument("--tune-models", default="7b")
    ap.add_argument("--tune-m", default="1,16,32,64,128,256,512,2048")
    ap.add_argument("--tune-rep", type=float, default=8.0)
    ap.add_argument("--tune-top", type=int, default=6,
                    help="configurations per M carried from the full sweep to the other models' shapes")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--tag", default="")
    ap.add_argument("--layout", default="compressed", choices=["compressed", "kernel", "both"],
                    help="NVFP4/MXFP4 weights in the compressed-tensors layout, the CUDA kernels' layout alone "
                         "(columns <fmt>-kernel), or both")
    ap.add_argument("--precompile-only", action="store_true",
                    help="only compile the tuning candidates in parallel (fills Triton's cache) and exit")
    a = ap.parse_args(argv)
    if a.precompile_only:
        jobs = tune_jobs(a.tune_models.split(","), fp4_formats(), [int(v) for v in a.tune_m.split(",")])
        t0 = time.time()
        failed = precompile(jobs, a.workers)
        print(f"[precompile] {len(jobs)} jobs in {time.time() - t0:.0f}s, {len(failed)} failed", flush=True)
        for f in failed:
            print("  ", f)
        return
    import triton

    from qerl import kernels as qk
    from qerl.quant import FORMATS

    fmts = layout_columns([f for f in (a.fmts or ",".join(FORMATS)).split(",") if f], a.layout)
    if "nf4" in fmts:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:
            print(f"[bench] bitsandbytes unavailable ({type(e).__name__}); NF4 skipped", flush=True)
            fmts.remove("nf4")
    name = torch.cuda.get_device_name()
    tag = gpu_tag(a.tag)
    os.makedirs(a.out, exist_ok=True)
    bw = copy_bandwidth()
    print(f"[bench] {name}: device-to-device copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    if a.tune:
        best = tune(a.tune_models.split(","), [f for f in fmts if _fp4(f) and not f.endswith(KL)],
                    [int(v) for v in a.tune_m.split(",")], a.tune_rep,
                    os.path.join(a.out, f"layers_tune_{tag}.csv"), a.workers,
                    more_models=a.models.split(","), top=a.tune_top)
        table = install_table(best)
        print("TUNED = {")
        for key in sorted(table):
            print(f"    {key!r}: {table[key]!r},")
        print("}", flush=True)
    rows = run(a.models.split(","), [int(v) for v in a.m.split(",")], fmts, a.rep, bw)
    keys = ["model", "M", "fmt", "op", "linear", "N", "K", "us", "bytes", "TBps", "frac_copy_bw",
            "speedup_vs_bf16", "layer_graph_us", "graph_speedup_vs_bf16", "backend"]
    write_csv(os.path.join(a.out, f"layers_{tag}.csv"), rows, keys)
    try:
        import bitsandbytes
        bnb_v = bitsandbytes.__version__
    except Exception:
        bnb_v = "n/a"
    header = (f"## Per-layer linear benchmark: {name}\n\n"
              f"torch {torch.__version__}, triton {triton.__version__}, bitsandbytes {bnb_v}, "
              f"python {platform.python_version()}; device-to-device copy {bw / 1e12:.2f} TB/s (read+write). "
              f"Per linear: median over CUDA-graph replays of the product over rotating weight copies "
              f"(>= 160 MB); summed over the 7 linears of one decoder layer, and the 7 run back to back as one "
              f"graph over consecutive layer copies. Dispatch table: "
              f"{'tuned in this run' if a.tune else 'qerl/kernels/configs.py'}; "
              f"FP4 dispatch M<= {qk.configs.GEMV_MAX_M} gemv-family, <= {qk.configs.GEMM_MAX_M} fused GEMM, "
              f"else dequant+cuBLAS (table entries may override). Command: `python -m benchmarks.kernel_bench "
              f"{' '.join(sys.argv[1:] if argv is None else argv)}`")
    md = markdown(rows, header)
    with open(os.path.join(a.out, f"layers_{tag}.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
