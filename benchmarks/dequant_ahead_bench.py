"""Dequantize the next linear's weight while cuBLAS runs this one: does the rebuild of Ŵ hide under the GEMM?

    python -m benchmarks.dequant_ahead_bench [--models 7b] [--fmts nvfp4,mxfp4] [--m 512,1024,2048]
                                             [--ops fwd,bwd] [--rounds 2] [--rep-ms 300] [--out DIR]

At M above the CUDA GEMM's range the FP4 linears rebuild the dense BF16 weight from the kernels' layout and call
cuBLAS (``dequantize_relaid`` + ``torch.mm``), one after the other on one stream. The GEMM is bound by the tensor
cores (7B at M 512: ~680 TFLOP/s) and the rebuild by HBM (a 7B layer's weights: ~0.47 GB written and read back), so
the two could overlap: while cuBLAS multiplies by linear i's Ŵ, a second stream rebuilds linear i+1's into the other
of two buffers. Session 65's in-loop dequantizing GEMM (``cuda_dq``) reached only ~0.5x BF16; this measures the
cheaper idea before anything in the library depends on it.

Per (format, M, op) this times a decoder layer's 7 linears as one chain (the forward in the layer's order q, k, v,
o, gate, up, down; the backward ``g Ŵ`` in the reverse order), over consecutive layer copies that rotate through more
than the L2 cache, each variant captured as one CUDA graph (median replay / layers), or timed eagerly:

- ``bf16``: cuBLAS on BF16 weights (``F.linear`` / ``g @ W``), the baseline;
- ``lib``: the library's own path (``qmm`` / ``qmm_t`` on weights in the kernels' layout: the wgmma GEMM where the
  device's table picks it, the slice tables, dequantize + cuBLAS else);
- ``seq``: dequantize the whole weight, then cuBLAS, one stream, one buffer;
- ``ahead``: the same work with linear i+1's rebuild on a side stream into the other of two buffers (it waits
  until the GEMM two steps back has read that buffer), the GEMM waiting only for its own weight;
- ``ahead_prio``: ``ahead`` with the GEMMs on a high-priority stream and the rebuilds on a low-priority one;
- ``ahead_eager``: ``ahead`` launched eagerly (as autograd runs it; events around the whole chain);
- ``bf16_carve`` / ``ahead_carve``: ``bf16`` / ``ahead`` with the GEMMs through cuBLASLt told to leave ``--carveout``
  SMs free (``torch._C._set_sm_carveout_experimental``), so the rebuild has SMs of its own while a GEMM holds the
  rest (a GEMM whose CTAs fill every SM leaves the side stream nothing until its last wave). Skipped, with a line
  saying so, where this torch lacks the switch;
- ``lib_eager``: the library's path launched eagerly (as autograd runs it).

Measured on one H100 (session 66, ``results/speed/raw/h100_s66_ahead``): the side stream's rebuild did not hide
under cuBLAS (``ahead`` 0.65x BF16 at M 512 forward, the same as ``seq``; at most +3% over ``seq`` elsewhere), nor
with 16 SMs carved out of the GEMMs. A library form of it (``QERL_DEQUANT_AHEAD``, successors learned from the call
order; variant ``lib_ahead``) was measured in the same run and removed; its code is at commit 9d2955c.

The variants run in turn, ``--rounds`` times, so the spread between rounds is printed beside each figure. Rows go
to ``dequant_ahead_<gpu>.csv`` as they finish and a markdown summary (per-layer µs, and each variant's speed
relative to ``bf16`` of the same round) to ``dequant_ahead_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

import torch
import torch.nn.functional as F

from benchmarks import kernel_bench as kb

VARIANTS = ("bf16", "lib", "seq", "ahead", "ahead_prio", "ahead_eager", "bf16_carve", "ahead_carve", "lib_eager")
EAGER = ("ahead_eager", "lib_eager")
#: SMs left free of cuBLAS's GEMMs in the ``*_carve`` variants (``--carveout``)
CARVEOUT = 16


def _dense(fmt: str, q) -> object:
    """The ``CudaFP4Weight`` of a kernels'-layout weight (its one host read happens here, before any capture)."""
    from qerl.kernels import relaid
    from qerl.quant import FORMATS
    return relaid.weight(FORMATS[kb._base(fmt)], q)


class _Chain:
    """One variant's work: the layer's linears over ``layers`` layer copies, in the op's order."""

    def __init__(self, variant: str, fmt: str, steps: list, op: str, bufs: list, outs: dict):
        self.variant, self.fmt, self.steps, self.op, self.bufs, self.outs = variant, fmt, steps, op, bufs, outs
        self.side = self.main = None
        variant = variant.removesuffix("_carve")
        self.variant = variant
        if variant.startswith("ahead"):
            pr = torch.cuda.Stream.priority_range()  # lower numbers run first: e.g. (0, -5)
            lo, hi = max(pr), min(pr)
            prio = variant == "ahead_prio"
            self.side = torch.cuda.Stream(priority=lo if prio else 0)
            self.main = torch.cuda.Stream(priority=hi if prio else 0)

    def _mm(self, x: torch.Tensor, wd: torch.Tensor, n_out: int) -> None:
        out = self.outs[(x.shape[0], n_out)]
        if self.op == "bwd":
            torch.mm(x, wd, out=out)
        else:
            torch.mm(x, wd.t(), out=out)

    def _dq(self, w, j: int) -> torch.Tensor:
        from qerl.kernels import dequantize_relaid
        buf = self.bufs[j % len(self.bufs)][:w.n * w.k].view(w.n, w.k)
        dequantize_relaid(w, buf)
        return buf

    def issue(self) -> None:
        """Launch the chain on the current stream (``ahead*``: on its main stream, joined back at the end)."""
        if self.variant == "bf16":
            for q, x, _w, _n in self.steps:
                torch.matmul(x, q["weight"]) if self.op == "bwd" else F.linear(x, q["weight"])
            return
        if self.variant.startswith("lib"):
            from qerl import kernels as qk
            f = qk.qmm_t if self.op == "bwd" else qk.qmm
            for q, x, _w, _n in self.steps:
                f(x, kb._base(self.fmt), q)
            return
        if self.variant == "seq":
            for _q, x, w, n_out in self.steps:
                self._mm(x, self._dq(w, 0), n_out)
            return
        cur, side, main = torch.cuda.current_stream(), self.side, self.main
        main.wait_stream(cur)
        side.wait_stream(cur)
        ready = [torch.cuda.Event() for _ in self.steps]
        free = [torch.cuda.Event() for _ in self.steps]
        wds: list = [None] * len(self.steps)
        with torch.cuda.stream(side):
            wds[0] = self._dq(self.steps[0][2], 0)
            ready[0].record(side)
        for j, (_q, x, _w, n_out) in enumerate(self.steps):
            if j + 1 < len(self.steps):
                with torch.cuda.stream(side):
                    if j >= 1:
                        side.wait_event(free[j - 1])  # the buffer j+1 writes was read by GEMM j-1
                    wds[j + 1] = self._dq(self.steps[j + 1][2], j + 1)
                    ready[j + 1].record(side)
            with torch.cuda.stream(main):
                main.wait_event(ready[j])
                self._mm(x, wds[j], n_out)
                free[j].record(main)
        cur.wait_stream(main)
        cur.wait_stream(side)


@contextlib.contextmanager
def _carveout(sms: int | None):
    """cuBLAS GEMMs launched inside leave ``sms`` SMs free (cuBLASLt's SM-count target; None: no change)."""
    if sms is None:
        yield
        return
    prev = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)
        torch.backends.cuda.preferred_blas_library(prev)


def carveout_supported() -> bool:
    return hasattr(torch._C, "_set_sm_carveout_experimental")


def _time_chain(chain: _Chain, layers: int, rep_ms: float, carve: int | None = None) -> tuple[float, str]:
    """Per-layer time (ms) of the chain: median over CUDA-graph replays (eagerly for ``ahead_eager``); with ``carve``,
    its GEMMs captured (or launched) leaving that many SMs free."""
    with _carveout(carve):
        return _time_chain_now(chain, layers, rep_ms)


def _time_chain_now(chain: _Chain, layers: int, rep_ms: float) -> tuple[float, str]:
    eager = chain.variant in EAGER
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (cuBLAS handles, workspaces) off the capture
        chain.issue()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = None
    if not eager:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain.issue()
        run = g.replay
    else:
        run = chain.issue
    t = kb.replay_median_ms(run, rep_ms)
    del g
    return t / layers, "eager" if eager else "graph"


def measure(models, fmts, ms, ops, variants, rounds: int, rep_ms: float, csv_path: str,
            carveout: int = CARVEOUT) -> list[dict]:
    rows: list[dict] = []
    dev = torch.cuda.get_device_name()
    for mdl in models:
        lins = kb.layer_linears(mdl)
        shapes = list(dict.fromkeys((n, k) for _, n, k in lins))
        wbf = {s: kb._Weights("bf16", s[0], s[1], seed=1000 + j) for j, s in enumerate(shapes)}
        for fmt in fmts:
            kfmt = fmt + kb.KL
            wq = {s: kb._Weights(kfmt, s[0], s[1], seed=1000 + j) for j, s in enumerate(shapes)}
            layers = min(64, max(len(w.qs) for w in wq.values()))
            dense = {s: [_dense(kfmt, q) for q in w.qs] for s, w in wq.items()}
            big = max(n * k for n, k in shapes)
            bufs = [torch.empty(big, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
            for m in ms:
                for op in ops:
                    order = lins if op == "fwd" else lins[::-1]
                    xs: dict = {}
                    outs: dict = {}
                    steps_q, steps_b = [], []
                    for r in range(layers):
                        for _name, n, k in order:
                            kin, n_out = (n, k) if op == "bwd" else (k, n)
                            if (m, kin) not in xs:
                                xs[(m, kin)] = torch.randn(m, kin, device="cuda").bfloat16()
                            outs.setdefault((m, n_out), torch.empty(m, n_out, device="cuda", dtype=torch.bfloat16))
                            i_q = r % len(wq[(n, k)].qs)
                            steps_q.append((wq[(n, k)].qs[i_q], xs[(m, kin)], dense[(n, k)][i_q], n_out))
                            i_b = r % len(wbf[(n, k)].qs)
                            steps_b.append((wbf[(n, k)].qs[i_b], xs[(m, kin)], None, n_out))
                    for rd in range(rounds):
                        base = None
                        for v in variants:
                            chain = _Chain(v, kfmt, steps_b if v.startswith("bf16") else steps_q, op, bufs, outs)
                            carve = carveout if v.endswith("_carve") else None
                            t, mode = _time_chain(chain, layers, rep_ms, carve)
                            if v == "bf16":
                                base = t
                            row = dict(model=mdl, fmt=fmt, op=op, M=m, round=rd, variant=v, us=round(t * 1e3, 1),
                                       vs_bf16=round(base / t, 3) if base else "", mode=mode, layers=layers,
                                       carveout=carve or 0, device=dev)
                            rows.append(row)
                            kb.write_csv(csv_path, rows)
                            print(f"[ahead] {mdl} {fmt} {op} M={m} round {rd} {v}: {t * 1e3:.1f} us/layer"
                                  + (f" ({base / t:.3f}x bf16)" if base else ""), flush=True)
                            del chain
                    del steps_q, steps_b, xs, outs
            del wq, dense, bufs
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict], header: str) -> str:
    """Per (model, format, op, M): each variant's per-layer µs (median over rounds, the rounds' range) and its
    speed relative to bf16 (the same round's; median and range)."""
    lines = [header, "", "| model | fmt | op | M | variant | µs / layer (rounds) | vs bf16 (rounds) |",
             "|---|---|---|---:|---|---:|---:|"]
    keys = list(dict.fromkeys((r["model"], r["fmt"], r["op"], r["M"], r["variant"]) for r in rows))
    for key in keys:
        rs = [r for r in rows if (r["model"], r["fmt"], r["op"], r["M"], r["variant"]) == key]
        us = [r["us"] for r in rs]
        vs = [r["vs_bf16"] for r in rs if r["vs_bf16"] != ""]
        u = f"{statistics.median(us):.1f} ({min(us):.1f}-{max(us):.1f})"
        x = f"{statistics.median(vs):.3f}× ({min(vs):.3f}-{max(vs):.3f})" if vs else ""
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {u} | {x} |")
    return "\n".join(lines) + "\n"


def _csv_ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="7b")
    p.add_argument("--fmts", default="nvfp4,mxfp4")
    p.add_argument("--m", default="512,1024,2048")
    p.add_argument("--ops", default="fwd,bwd")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep-ms", type=float, default=300.0)
    p.add_argument("--carveout", type=int, default=CARVEOUT, help="SMs the *_carve variants' GEMMs leave free")
    p.add_argument("--out", default="results/speed")
    a = p.parse_args(argv)
    models = [v for v in a.models.split(",") if v]
    for mdl in models:
        if mdl not in kb.MODELS:
            p.error(f"--models: {mdl!r} is not one of {', '.join(kb.MODELS)}")
    fmts = [v for v in a.fmts.split(",") if v]
    for f in fmts:
        if f not in ("nvfp4", "mxfp4"):
            p.error(f"--fmts: {f!r} is not one of nvfp4, mxfp4 (the formats held in the kernels' layout)")
    ops = [v for v in a.ops.split(",") if v]
    for o in ops:
        if o not in ("fwd", "bwd"):
            p.error(f"--ops: {o!r} is not one of fwd, bwd")
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if variants[0] != "bf16":
        p.error("--variants: the first must be bf16 (every ratio is against its round's bf16)")
    if a.carveout < 1:
        p.error(f"--carveout: {a.carveout} must be at least 1 SM")
    if a.rounds < 1:
        p.error(f"--rounds: {a.rounds} must be at least 1")
    try:
        ms = _csv_ints(a.m)
    except ValueError:
        p.error(f"--m: {a.m!r} is not a comma-separated list of integers")
    if not torch.cuda.is_available():
        p.error("this benchmark times CUDA streams: it needs a GPU")
    if not carveout_supported() and any(v.endswith("_carve") for v in variants):
        print("[ahead] this torch has no torch._C._set_sm_carveout_experimental: the *_carve variants are skipped")
        variants = [v for v in variants if not v.endswith("_carve")]
    os.makedirs(a.out, exist_ok=True)
    stem = "dequant_ahead_" + kb.gpu_tag()
    csv_path = os.path.join(a.out, stem + ".csv")
    rows = measure(models, fmts, ms, ops, variants, a.rounds, a.rep_ms, csv_path, a.carveout)
    md = markdown(rows, f"# Dequantize-ahead at large M ({torch.cuda.get_device_name()})")
    with open(os.path.join(a.out, stem + ".md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
