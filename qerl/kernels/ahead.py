"""Dequantize ahead: rebuild the next linear's dense weight on a side stream while cuBLAS multiplies by this one's.

At large M (the update's forward and backward, prefill) an FP4 linear in the kernels' layout rebuilds its dense BF16
weight Ŵ (``dequantize_relaid``: HBM-bound, ~0.6 GB a 7B layer) and then calls cuBLAS (tensor-core bound), one after
the other. With ``QERL_DEQUANT_AHEAD=1`` the rebuild of the weight that comes next runs on a side stream into the
other of two buffers while the current GEMM runs, so the GEMM waits only for its own weight.

Which weight comes next is learned, not declared: per thread (autograd runs the backward, and a checkpointed layer's
recomputed forward, on its own thread), the weight that followed each (weight, forward or backward) last time. A forward over the layers,
the backward in reverse, a checkpointed layer's recompute-then-backward: each repeats its order every micro-batch,
so after the first one every rebuild but a phase's first is ahead. A wrong guess costs one rebuild's bandwidth,
never a wrong result:

- a buffer is written (on the side stream, or on the caller's stream on a miss) only after every product issued
  with its previous contents (an event recorded on the caller's stream when the next weight is asked for: by then
  the previous product has been issued there);
- the caller's stream waits for the side stream's write of the weight it is handed;
- a miss waits for any side write still landing in the buffer it takes.

A handed-out weight is valid until the next :meth:`Ahead.dense` call on that device (as the per-device workspace
of ``dequantize_into`` is). Under CUDA-graph capture nothing here runs (:func:`usable` is False: a side stream left
unjoined would break the capture); the caller's own path does.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch

MODES = ("0", "1")


def mode() -> str:
    """``QERL_DEQUANT_AHEAD`` ("0": off, the default until measured; "1": on)."""
    v = os.environ.get("QERL_DEQUANT_AHEAD", "0")
    if v not in MODES:
        raise ValueError(f"QERL_DEQUANT_AHEAD={v!r}; valid: {', '.join(MODES)}")
    return v


def usable(t: torch.Tensor) -> bool:
    """Whether a product on ``t``'s device may take its dense weight from :func:`dense` now: switched on, a CUDA
    tensor, and no CUDA-graph capture under way."""
    return mode() == "1" and t.is_cuda and not torch.cuda.is_current_stream_capturing()


class Successors:
    """The weight that followed each (weight, op) last time, per thread: ``op`` tells a product's forward from its
    backward, whose successors differ (a checkpointed layer's recompute then backward: after up's forward comes down,
    after its backward comes gate). Weak references: a freed model leaves no entry that could match a new weight at a
    reused address."""

    def __init__(self):
        self._next: dict[tuple[int, int, str], tuple[weakref.ref, weakref.ref]] = {}
        self._prev: dict[int, tuple[weakref.ref, str]] = {}

    def observe(self, w, op: str, tid: int | None = None) -> None:
        """``w``'s product ``op`` is asked for now on thread ``tid`` (default: this thread): ``w`` becomes the
        successor of the (weight, op) asked for before it there."""
        tid = threading.get_ident() if tid is None else tid
        last = self._prev.get(tid)
        prev = None if last is None else last[0]()
        if prev is not None and (prev is not w or last[1] != op):
            self._next[(tid, id(prev), last[1])] = (last[0], weakref.ref(w))
        self._prev[tid] = (weakref.ref(w), op)
        if len(self._next) > 65536:  # entries of freed weights: drop the dead
            self._next = {k: v for k, v in self._next.items() if v[0]() is not None and v[1]() is not None}

    def predict(self, w, op: str, tid: int | None = None):
        """The weight that followed ``w``'s product ``op`` last time on thread ``tid``, or None."""
        tid = threading.get_ident() if tid is None else tid
        hit = self._next.get((tid, id(w), op))
        if hit is None or hit[0]() is not w:
            return None
        return hit[1]()


class _Slot:
    __slots__ = ("buf", "ref", "ready", "used")

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.ref: weakref.ref | None = None  # the weight whose Ŵ the buffer holds or is receiving
        self.ready: torch.cuda.Event | None = None  # recorded after its last write (side stream or a caller's)
        self.used: torch.cuda.Event | None = None  # recorded after the last product issued with its contents

    def holds(self, w) -> bool:
        return self.ref is not None and self.ref() is w


class CudaRuntime:
    """What :class:`Ahead` does with streams, events and buffers, on CUDA (a test drives the same logic through a
    simulated one that checks every buffer's reads and writes are ordered)."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def event(self):
        return torch.cuda.Event()

    def on(self, stream):
        return torch.cuda.stream(stream)

    def buffer(self, numel: int, side) -> torch.Tensor:
        buf = torch.empty(numel, device=self.device, dtype=torch.bfloat16)
        buf.record_stream(side)  # freed later: not reused before the side stream's work on it is done
        return buf

    def write(self, w, view: torch.Tensor) -> None:
        from qerl.kernels import dequantize_relaid
        dequantize_relaid(w, view)


class Ahead:
    """Two dense-weight buffers and a side stream on one device (see the module docstring)."""

    def __init__(self, device: torch.device, runtime=None):
        self.device = device
        self.rt = CudaRuntime(device) if runtime is None else runtime
        self.side = self.rt.new_stream()
        self.slots = (_Slot(), _Slot())
        self.succ = Successors()
        self._last: int | None = None  # the slot handed out last, and the stream it was handed out on
        self._last_stream: torch.cuda.Stream | None = None
        self.stats = {"hits": 0, "misses": 0, "prefetches": 0}

    def _fit(self, numel: int) -> None:
        """Both buffers hold ``numel`` elements (grown together; the side stream drained before the old go)."""
        if self.slots[0].buf is not None and self.slots[0].buf.numel() >= numel:
            return
        self.rt.current_stream().wait_stream(self.side)
        for s in self.slots:
            s.buf = self.rt.buffer(numel, self.side)
            s.ref = s.ready = s.used = None

    def _write_after(self, w, slot: _Slot, stream) -> None:
        """Rebuild ``w`` into ``slot`` on ``stream`` (the current one), after the slot's last write and every product
        issued with its contents; its ready event recorded after."""
        for ev in (slot.ready, slot.used):
            if ev is not None:
                stream.wait_event(ev)
        self.rt.write(w, slot.buf[:w.n * w.k].view(w.n, w.k))
        slot.ref, slot.ready, slot.used = weakref.ref(w), self.rt.event(), None
        slot.ready.record(stream)

    def dense(self, w, op: str) -> torch.Tensor:
        """Ŵ (N, K) bf16 of the re-laid-out weight ``w`` (``cuda_fp4.CudaFP4Weight``) for its product ``op``
        ("fwd" / "bwd") and any others issued on the current stream before the next call; starts the rebuild of the
        weight predicted to come next."""
        cur = self.rt.current_stream()
        if self._last is not None:  # the last hand-out's products are issued by now: its buffer's free point
            ev = self.rt.event()
            ev.record(self._last_stream)
            self.slots[self._last].used = ev
        self._fit(w.n * w.k)
        i = next((j for j, s in enumerate(self.slots) if s.holds(w)), None)
        if i is not None:
            slot = self.slots[i]
            cur.wait_event(slot.ready)  # its write, on the side stream or on another caller's stream
            if slot.used is not None:  # earlier readers on another stream: this stream's free point then covers them
                cur.wait_event(slot.used)
            self.stats["hits"] += 1
        else:
            i = 0 if self._last is None else 1 - self._last
            slot = self.slots[i]
            self._write_after(w, slot, cur)
            self.stats["misses"] += 1
        self.succ.observe(w, op)
        nxt = self.succ.predict(w, op)
        if nxt is not None and nxt is not w and nxt.n * nxt.k <= slot.buf.numel() \
                and not any(s.holds(nxt) for s in self.slots):
            with self.rt.on(self.side):
                self._write_after(nxt, self.slots[1 - i], self.side)
            self.stats["prefetches"] += 1
        self._last, self._last_stream = i, cur
        return slot.buf[:w.n * w.k].view(w.n, w.k)


_AHEAD: dict[torch.device, Ahead] = {}


OPS = ("fwd", "bwd")


def dense(w, op: str) -> torch.Tensor:
    """Ŵ of ``w`` for its product ``op`` ("fwd": x Ŵᵀ, "bwd": g Ŵ) through its device's :class:`Ahead` (made on
    first use)."""
    if op not in OPS:
        raise ValueError(f"ahead.dense: op={op!r}; valid: {', '.join(map(repr, OPS))}")
    dev = w.qweight.device
    a = _AHEAD.get(dev)
    if a is None:
        a = _AHEAD[dev] = Ahead(dev)
    return a.dense(w, op)


def release() -> None:
    """Drop every device's buffers and side stream (after the update; the next call makes them again)."""
    _AHEAD.clear()
