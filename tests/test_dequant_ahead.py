"""qerl.kernels.ahead (the next linear's dense weight rebuilt on a side stream under this one's GEMM): the successor
bookkeeping and the switch on any machine; with ``-m gpu``, the library's large-M forward and backward giving the
same bits with the switch on and off over call orders that the guesses get right, wrong and half right, a
checkpointed autograd pass (the backward on autograd's thread), and no use under CUDA-graph capture."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from qerl.kernels import ahead
from qerl.quant import FORMATS


class _W:  # a stand-in weight object for the bookkeeping (weak-referenceable, identity only)
    pass


def test_successors_learn_per_thread_and_op_and_forget_freed_weights():
    s = ahead.Successors()
    a, b, c = _W(), _W(), _W()
    for w in (a, b, c):
        s.observe(w, "fwd", tid=1)
    assert s.predict(a, "fwd", tid=1) is b and s.predict(b, "fwd", tid=1) is c and s.predict(c, "fwd", tid=1) is None
    assert s.predict(a, "fwd", tid=2) is None  # another thread learned nothing
    # a checkpointed layer: c's forward, then the backward in reverse: the backward's successors are their own
    for w in (c, b, a):
        s.observe(w, "bwd", tid=1)
    assert s.predict(c, "fwd", tid=1) is c  # c's backward follows its forward (the same buffer: a hit)
    assert s.predict(c, "bwd", tid=1) is b and s.predict(b, "bwd", tid=1) is a
    assert s.predict(b, "fwd", tid=1) is c  # the forward's order kept beside it
    s.observe(a, "bwd", tid=1)  # the same product twice in a row teaches nothing
    assert s.predict(a, "bwd", tid=1) is None
    s.observe(c, "fwd", tid=2)
    s.observe(a, "fwd", tid=2)
    assert s.predict(c, "fwd", tid=2) is a and s.predict(c, "fwd", tid=1) is c  # per thread
    s.observe(c, "fwd", tid=1)  # after a's backward on thread 1
    s.observe(b, "fwd", tid=1)
    assert s.predict(c, "fwd", tid=1) is b  # the last order wins
    del b
    gc.collect()
    assert s.predict(c, "fwd", tid=1) is None  # a freed successor is no guess
    d, e = _W(), _W()
    s.observe(d, "fwd", tid=3)
    s.observe(e, "fwd", tid=3)
    assert s.predict(d, "fwd", tid=3) is e
    del e
    gc.collect()
    assert s.predict(d, "fwd", tid=3) is None
    f = _W()  # an entry whose predecessor was freed cannot match a new object at a reused id
    s.observe(f, "fwd", tid=4)
    s.observe(d, "fwd", tid=4)
    key = id(f)
    del f
    gc.collect()
    g = _W()
    if id(g) == key:
        assert s.predict(g, "fwd", tid=4) is None


def test_successors_default_to_the_calling_thread():
    s = ahead.Successors()
    a, b = _W(), _W()
    s.observe(a, "fwd")
    s.observe(b, "fwd")
    assert s.predict(a, "fwd") is b
    got = []
    t = threading.Thread(target=lambda: got.append(s.predict(a, "fwd")))
    t.start()
    t.join()
    assert got == [None]


class _Sim:
    """A simulated CUDA runtime for :class:`ahead.Ahead`: streams with vector clocks, events that capture them, and
    buffers whose every write and read is checked against the others on the same buffer (each pair with a write
    must be ordered by the streams and events; a read must see the weight it was handed)."""

    class Stream:
        def __init__(self, sim, idx):
            self.sim, self.idx, self.clock = sim, idx, {idx: 0}

        def wait_event(self, ev):
            if ev.clock is not None:  # waiting on a never-recorded event is a no-op, as in CUDA
                self.sim.merge(self, ev.clock)

        def wait_stream(self, other):
            self.sim.merge(self, other.clock)

    class Event:
        clock = None

        def record(self, stream):
            self.clock = dict(stream.clock)

    class Buf:
        def __init__(self, ident, numel):
            self.ident, self.n = ident, numel

        def numel(self):
            return self.n

        def __getitem__(self, sl):
            assert sl.stop <= self.n
            return self

        def view(self, *shape):
            return self

    def __init__(self):
        self.streams = [self.Stream(self, 0)]
        self.cur = [self.streams[0]]
        self.ops: dict[int, list] = {}  # buffer -> [(kind, stream idx, clock, weight)]
        self.nbuf = 0
        self.checked = 0

    @staticmethod
    def merge(stream, clock):
        for k, v in clock.items():
            stream.clock[k] = max(stream.clock.get(k, 0), v)

    def new_stream(self):
        self.streams.append(self.Stream(self, len(self.streams)))
        return self.streams[-1]

    def current_stream(self):
        return self.cur[-1]

    def event(self):
        return self.Event()

    def on(self, stream):
        sim = self

        class _Ctx:
            def __enter__(self):
                sim.cur.append(stream)

            def __exit__(self, *exc):
                sim.cur.pop()
        return _Ctx()

    def buffer(self, numel, side):
        self.nbuf += 1
        return self.Buf(self.nbuf, numel)

    def _op(self, kind, buf, w):
        s = self.cur[-1]
        s.clock[s.idx] += 1
        clock = dict(s.clock)
        for k2, idx, c2, w2 in self.ops.get(buf.ident, []):
            if kind == "w" or k2 == "w":  # issued earlier: must happen before this one
                assert c2[idx] <= clock.get(idx, 0), f"{kind} of {w} on buffer {buf.ident} races a {k2} of {w2}"
                self.checked += 1
        if kind == "r":
            writes = [w2 for k2, _, _, w2 in self.ops.get(buf.ident, []) if k2 == "w"]
            assert writes and writes[-1] is w, f"read of {w} on buffer {buf.ident} sees {writes[-1:]}"
        self.ops.setdefault(buf.ident, []).append((kind, s.idx, clock, w))

    def write(self, w, view):
        self._op("w", view, w)

    def read(self, w, view):
        self._op("r", view, w)


class _SW(_W):
    def __init__(self, name, n, k):
        self.name, self.n, self.k = name, n, k

    def __repr__(self):
        return self.name


def test_ahead_orders_every_buffer_write_after_its_reads_whatever_the_call_order():
    """The hand-out and prefetch logic on a simulated runtime: a forward over six weights then the backward in
    reverse on another thread (and stream), a checkpointed segment (recompute then backward), random orders with
    repeats, a weight larger than the buffers (they grow). Every write to a buffer is ordered after every read of
    its previous contents and each read sees its own weight; the regular passes are served by prefetches."""
    import random

    sim = _Sim()
    a = ahead.Ahead(torch.device("cpu"), runtime=sim)
    ws = [_SW(f"w{i}", 16 * (4 + i % 3), 64) for i in range(6)]
    rng = random.Random(0)
    bwd_stream = sim.new_stream()

    def call(w, op, stream=None):
        if stream is not None:
            sim.cur.append(stream)
        try:
            view = a.dense(w, op)
            sim.read(w, view)
            if rng.random() < 0.3:  # a second product with the same weight (q|k|v-like), later on the stream
                sim.read(w, view)
        finally:
            if stream is not None:
                sim.cur.pop()

    def on_thread(fn):
        t = threading.Thread(target=fn)
        t.start()
        t.join()

    for _ in range(4):
        for w in ws:
            call(w, "fwd")
        on_thread(lambda: [call(w, "bwd", bwd_stream) for w in reversed(ws)])
    regular = dict(a.stats)
    assert regular["prefetches"] >= 3 * 10 and regular["hits"] >= 3 * 10, regular

    def segment():  # a checkpointed layer: recompute forward, then its backward, layer by layer from the last
        for lo in (4, 2, 0):
            for w in ws[lo:lo + 2]:
                call(w, "fwd", bwd_stream)
            for w in reversed(ws[lo:lo + 2]):
                call(w, "bwd", bwd_stream)
    for _ in range(3):
        on_thread(segment)
    for _ in range(300):
        w = rng.choice(ws)
        call(w, rng.choice(ahead.OPS), rng.choice([None, bwd_stream]))
    assert sim.nbuf == 6  # two buffers, grown by w1 and w2 (each larger than the one before)
    big = _SW("big", 16 * 40, 64)
    call(big, "fwd")
    call(ws[0], "fwd")
    call(big, "fwd")
    assert sim.nbuf == 8  # grown once more, both buffers
    assert sim.checked > 1000 and a.stats["hits"] + a.stats["misses"] == 4 * 12 + 3 * 12 + 300 + 3


def test_switch_values(monkeypatch):
    monkeypatch.delenv("QERL_DEQUANT_AHEAD", raising=False)
    assert ahead.mode() == "0" and not ahead.usable(torch.zeros(2))
    monkeypatch.setenv("QERL_DEQUANT_AHEAD", "1")
    assert ahead.mode() == "1" and not ahead.usable(torch.zeros(2))  # CPU tensors never
    monkeypatch.setenv("QERL_DEQUANT_AHEAD", "yes")
    with pytest.raises(ValueError, match=r"QERL_DEQUANT_AHEAD='yes'; valid: 0, 1"):
        ahead.mode()
    with pytest.raises(ValueError, match=r"op='up'; valid: 'fwd', 'bwd'"):
        ahead.dense(None, "up")


# ----------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = ((4608, 3584), (3584, 3584), (1024, 3584), (3584, 2048))  # a few 7B-like products, two sizes of K


def _weights(fmt: str, seed: int = 11):
    from qerl.kernels import relaid
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qs = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        q = relaid.from_compressed(FORMATS[fmt], FORMATS[fmt].quantize(w))
        assert q is not None
        relaid.weight(FORMATS[fmt], q)  # the decode exponent read before anything is timed or captured
        qs.append(q)
    return qs


def _run(fmt, qs, order, xs, gs):
    """(forward outputs, backward outputs) of the products in ``order`` (indices; negative: the backward of ~i)."""
    from qerl import kernels as qk
    out = []
    for i in order:
        if i >= 0:
            out.append(qk.qmm(xs[SHAPES[i][1]], fmt, qs[i]))
        else:
            out.append(qk.qmm_t(gs[SHAPES[~i][0]], fmt, qs[~i]))
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ("nvfp4", "mxfp4"))
def test_gpu_ahead_gives_the_same_bits_whatever_the_guesses(fmt, monkeypatch):
    """Forward in order, backward in reverse, repeated (the guesses right after the first pass), then orders that
    break them (a product skipped, two swapped, one weight twice): every output equal bit for bit to the path without
    the switch, and the later passes served from prefetched buffers."""
    monkeypatch.setenv("QERL_CUDA_GEMM", "0")  # every product on the dense weight + cuBLAS path
    qs = _weights(fmt)
    gen = torch.Generator(device="cuda").manual_seed(5)
    m = 2048  # above the CUDA GEMM's range: the dense weight + cuBLAS path
    xs = {k: torch.randn(m, k, device="cuda", generator=gen).bfloat16() for k in {k for _, k in SHAPES}}
    gs = {n: torch.randn(m, n, device="cuda", generator=gen).bfloat16() for n in {n for n, _ in SHAPES}}
    fwd = list(range(len(SHAPES)))
    bwd = [~i for i in reversed(fwd)]
    orders = [fwd + bwd] * 3 + [[0, 2, 1, 3] + bwd, [0, 0, 1, ~1, ~1, 3, ~3], fwd[::-1] + bwd[::-1], fwd + bwd]
    monkeypatch.setenv("QERL_DEQUANT_AHEAD", "0")
    want = [_run(fmt, qs, o, xs, gs) for o in orders]
    monkeypatch.setenv("QERL_DEQUANT_AHEAD", "1")
    ahead.release()
    try:
        got = [_run(fmt, qs, o, xs, gs) for o in orders]
        st = ahead._AHEAD[torch.device("cuda", torch.cuda.current_device())].stats
    finally:
        ahead.release()
    for j, (a, b) in enumerate(zip(want, got, strict=True)):
        for t, (u, v) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(u, v), (fmt, j, t, orders[j][t])
    calls = sum(len(o) for o in orders)
    assert st["hits"] + st["misses"] == calls, st
    # passes 2-3 and the last: 8 calls each, all but a pass's first hit (the guesses learned in pass 1)
    assert st["prefetches"] >= 3 * 7 and st["hits"] >= 3 * 7, st


@pytest.mark.gpu
@gpu
def test_gpu_ahead_checkpointed_autograd_and_capture(monkeypatch):
    """A stack of frozen FP4 products under activation checkpointing (the backward and the recomputed forward on
    autograd's thread): the same loss and input gradient bit for bit with the switch on and off. Inside a CUDA-graph
    capture the switch is ignored (the capture succeeds and replays the same bits)."""
    from torch.utils.checkpoint import checkpoint

    from qerl.lora import _FrozenBaseMatmul
    monkeypatch.setenv("QERL_CUDA_GEMM", "0")
    fmt = FORMATS["nvfp4"]
    qs = _weights("nvfp4", seed=12)
    wide, sq = qs[0], qs[1]  # (4608, 3584) and (3584, 3584)

    def layer(t):  # two products a checkpointed segment, as a decoder layer's are
        h = torch.nn.functional.gelu(_FrozenBaseMatmul.apply(t, fmt, sq, None))
        return _FrozenBaseMatmul.apply(h, fmt, wide, None)[:, :3584] * 0.5

    def net(x):
        h = x
        for _ in range(3):
            h = checkpoint(layer, h, use_reentrant=False)
        return h.float().square().mean()

    x0 = torch.randn(2048, 3584, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)).bfloat16()
    res = {}
    for v in ("0", "1", "1"):
        monkeypatch.setenv("QERL_DEQUANT_AHEAD", v)
        x = x0.clone().requires_grad_(True)
        loss = net(x)
        loss.backward()
        torch.cuda.synchronize()
        res.setdefault(v, []).append((loss.detach(), x.grad))
    try:
        for loss, grad in res["1"]:
            assert torch.equal(loss, res["0"][0][0]) and torch.equal(grad, res["0"][0][1])
        st = ahead._AHEAD[torch.device("cuda", torch.cuda.current_device())].stats
        assert st["prefetches"] > 0 and st["hits"] > 0, st
        # capture: the switch is on, the capture takes the plain path
        from qerl import kernels as qk
        xg = torch.randn(2048, 3584, device="cuda").bfloat16()
        want = qk.qmm(xg, "nvfp4", sq)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            qk.qmm(xg, "nvfp4", sq)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        before = dict(st)
        with torch.cuda.graph(g):
            y = qk.qmm(xg, "nvfp4", sq)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want) and st == before
    finally:
        ahead.release()
