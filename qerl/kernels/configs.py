"""Launch configurations of the FP4 kernels: a measured table per layer shape and M bucket, and a fallback rule.

A configuration is a handful of constexprs from a small set, so each one compiles once and a new shape or a
new M inside a bucket never recompiles. ``TUNED`` is filled from ``python -m benchmarks.kernel_bench --tune``
on the device named in ``TUNED_DEVICE`` (see benchmarks/NOTES.md); other devices and untuned shapes use ``heuristic``.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

# TUNED_DEVICE: device name substring the table was measured on (``torch.cuda.get_device_name``);
# TUNED: (fmt, N, K, M bucket) -> configuration key (``KernelConfig.key``), written by ``bench --tune``.
from qerl.kernels.tuned_h100 import TUNED, TUNED_DEVICE

__all__ = ["KernelConfig", "heuristic", "lookup", "m_bucket", "replace", "set_table", "TUNED", "TUNED_DEVICE",
           "dequant_slice", "device_slug", "install_slice_table", "load_slice_table", "slice_ops",
           "SliceTable", "SLICE_OPS"]

#: Largest M sent to the split-K GEMV family (decode), and to the fused Triton GEMM; above it the
#: weight is dequantized into a reusable BF16 buffer and cuBLAS does the product.
GEMV_MAX_M = 16
GEMM_MAX_M = 256


@dataclass(frozen=True)
class KernelConfig:
    """One launch of ``_qmm_dot_kernel`` ("dot") or ``_qgemv_kernel`` ("gemv"), or "cublas" (dequant + cuBLAS)."""

    kernel: str = "dot"
    bm: int = 16
    bn: int = 64
    bk: int = 256
    split_k: int = 1
    swap: bool = True
    join: bool = False
    warps: int = 4
    stages: int = 3
    mode: int = 1  # packed-tile load: 1 = 3-D (BN, BK/G, G/2), 2 = 2-D (BN, BK/2) then reshape
    sc32: bool = False  # load the group scales four at a time (int32, pipelined by cp.async) where possible
    prefetch: bool = True  # load the group scale bytes one K tile ahead (register double buffer)
    maxnreg: int = 0  # register cap per thread (0: the compiler's choice), to fit more CTAs per SM
    chunk: int = 0  # "cublas" only: dequantize and multiply this many weight rows at a time (L2-sized)

    def key(self) -> str:
        if self.kernel == "cublas":
            return f"cublas_ch{self.chunk}" if self.chunk else "cublas"
        tail = (f"_w{self.warps}_st{self.stages}" + ("" if self.mode == 1 else f"_md{self.mode}")
                + ("_sc32" if self.sc32 else "") + ("" if self.prefetch else "_np")
                + (f"_r{self.maxnreg}" if self.maxnreg else ""))
        if self.kernel == "gemv":
            return f"gemv_n{self.bn}_k{self.bk}_s{self.split_k}" + tail
        return (f"dot_m{self.bm}_n{self.bn}_k{self.bk}_s{self.split_k}_{'swap' if self.swap else 'nt'}"
                f"{'_join' if self.join else ''}" + tail)

    @staticmethod
    def parse(key: str) -> KernelConfig:
        """Inverse of :meth:`key`."""
        if key == "cublas" or key.startswith("cublas_ch"):
            return KernelConfig(kernel="cublas", chunk=int(key[9:]) if key != "cublas" else 0)
        parts = key.split("_")
        kind, vals = parts[0], {}
        flags = set()
        for p in parts[1:]:
            if p in ("swap", "nt", "join", "sc32", "np"):
                flags.add(p)
            else:
                name = p.rstrip("0123456789")
                vals[name] = int(p[len(name):])
        cfg = KernelConfig(kernel=kind, bn=vals["n"], bk=vals["k"], split_k=vals["s"], warps=vals["w"],
                           stages=vals["st"], mode=vals.get("md", 1), sc32="sc32" in flags,
                           prefetch="np" not in flags, maxnreg=vals.get("r", 0))
        if kind == "dot":
            cfg = replace(cfg, bm=vals["m"], swap="swap" in flags, join="join" in flags)
        return cfg


def m_bucket(m: int) -> int:
    """Smallest power of two >= m (1, 2, 4, ...): configurations are chosen per bucket."""
    return 1 << max(0, (int(m) - 1).bit_length())


def _split_for(tiles: int, k: int, bk: int, sms: int) -> int:
    """Split K until the grid covers about two waves of SMs (at least one full K tile per split)."""
    split = 1
    while tiles * split < 2 * sms and split < 16 and k // (bk * split * 2) >= 1:
        split *= 2
    return split


def heuristic(n: int, k: int, m: int, sms: int = 132) -> KernelConfig:
    """Rule-of-thumb configuration for shapes missing from the tuned table."""
    if m > GEMM_MAX_M:
        return KernelConfig(kernel="cublas")
    if m <= GEMV_MAX_M:
        bn, bk = 64, 256
        tiles = -(-n // bn)
        return KernelConfig(kernel="dot", bm=16, bn=bn, bk=bk, split_k=_split_for(tiles, k, bk, sms),
                            swap=True, warps=4, stages=3)
    bm = 32 if m <= 32 else 64 if m <= 64 else 128
    bn, bk = 128, 128
    tiles = -(-n // bn) * -(-m // bm)
    return KernelConfig(kernel="dot", bm=bm, bn=bn, bk=bk, split_k=_split_for(tiles, k, bk, sms),
                        swap=False, warps=4 if bm <= 64 else 8, stages=3)




def lookup(fmt: str, n: int, k: int, m: int, device_name: str = "", sms: int = 132) -> KernelConfig:
    """The tuned configuration for this layer shape and M (same device family), else :func:`heuristic`."""
    return _lookup(fmt, n, k, m_bucket(m), device_name, sms)


@functools.lru_cache(maxsize=4096)
def _lookup(fam: str, n: int, k: int, bucket: int, device_name: str, sms: int) -> KernelConfig:
    if TUNED_DEVICE in device_name:
        key = TUNED.get((fam, n, k, bucket))
        if key is None:  # an untuned shape: the tuned shape of this bucket closest in (log N, log K)
            near = [(abs(math.log(n / tn)) + abs(math.log(k / tk)), tkey)
                    for (tf, tn, tk, tb), tkey in TUNED.items() if tf == fam and tb == bucket]
            if near and min(near)[0] < 2.0:
                key = min(near)[1]
        if key is None and bucket > GEMM_MAX_M:  # beyond the tuned Ms: the largest tuned M's cuBLAS variant
            tuned = [b for (tf, tn, tk, b) in TUNED if (tf, tn, tk) == (fam, n, k) and b < bucket]
            if tuned:
                key = _lookup(fam, n, k, max(tuned), device_name, sms).key()
                key = key if key.startswith("cublas") else None
        if key is not None:
            return KernelConfig.parse(key)
    return heuristic(n, k, bucket, sms)


def set_table(table: dict) -> None:
    """Replace the tuned table (e.g. from a fresh ``bench --tune`` run) and forget cached lookups."""
    TUNED.clear()
    TUNED.update(table)
    _lookup.cache_clear()


# ----------------------------------------------------------------------------------------- large-M slices

#: The products of the large-M path (dequantize + cuBLAS) a slice table covers: the forward x Ŵᵀ, sliced by rows of
#: Ŵ (columns of the output), and the backward g Ŵ, sliced by columns of Ŵ (columns of grad_input).
SLICE_OPS = ("fwd", "bwd")
_SLICE_DIR = Path(__file__).resolve().parent / "tuned"


class SliceTable(dict):
    """A device's measured slice table: {(op, N, K): [(M, slice), ...]} sorted by M, and ``ops``, the products it
    was measured and chosen for (a table may cover the backward alone; the other op then keeps the caller's rule)."""

    ops: tuple[str, ...] = ()


_SLICE_TABLES: dict[str, SliceTable] = {}


def slice_ops(ops) -> tuple[str, ...]:
    """``ops`` (an iterable of names) as a tuple of :data:`SLICE_OPS` members; a ValueError naming the bad value and
    the valid ones otherwise (a table file's ``ops``, the bench's ``--ops``)."""
    ops = tuple(ops)
    if not ops or any(op not in SLICE_OPS for op in ops):
        raise ValueError(f"ops={list(ops)}; give one or more of {SLICE_OPS}")
    return ops


def device_slug(device_name: str) -> str:
    """A device name as the tuned tables' file names spell it ("NVIDIA H200" -> "nvidia_h200")."""
    return "".join(ch if ch.isalnum() else "_" for ch in device_name.lower()).strip("_")


def _slice_path(device_name: str) -> Path:
    return _SLICE_DIR / f"dequant_slices_{device_slug(device_name)}.json"


def load_slice_table(device_name: str) -> SliceTable:
    """The device's measured slice table (``qerl/kernels/tuned/dequant_slices_<device>.json``, written by ``python -m
    benchmarks.dequant_slices_bench --write-table``); empty, covering no op, when the device has none. Each slice is
    a whole number of the layout's units (16 rows / 64 columns) or 0 (the whole weight at once). The file's ``ops``
    (default: both) names the products it covers; every entry must be one of them."""
    if device_name in _SLICE_TABLES:
        return _SLICE_TABLES[device_name]
    path = _slice_path(device_name)
    table = SliceTable()  # covers no op
    if path.exists():
        doc = json.loads(path.read_text())
        try:
            table.ops = ops = slice_ops(doc.get("ops", SLICE_OPS))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        for e in doc["entries"]:
            op, size = e["op"], int(e["slice"])
            unit = 16 if op == "fwd" else 64
            if op not in ops or size < 0 or size % unit:
                raise ValueError(f"{path}: entry {e}: op must be one of {ops} and slice a non-negative "
                                 f"multiple of {unit}")
            table.setdefault((op, int(e["N"]), int(e["K"])), []).append((int(e["M"]), size))
        for v in table.values():
            v.sort()
    _SLICE_TABLES[device_name] = table
    return table


def install_slice_table(device_name: str, text: str) -> Path:
    """Write a slice table (the JSON ``benchmarks.dequant_slices_bench --write-table`` makes) as the device's table
    and forget this process's cached one."""
    path = _slice_path(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    _SLICE_TABLES.pop(device_name, None)
    return path


def dequant_slice(op: str, n: int, k: int, m: int, device_name: str) -> int | None:
    """Rows (``op`` "fwd") or columns ("bwd") of Ŵ per dequantize + cuBLAS slice at M tokens, measured on this
    device: the entry of the measured M nearest to m in ratio (a tie: the larger), 0 (the whole weight at once)
    above the largest measured M (each slice re-reads x or g, and no slice was timed there) or for a shape it lacks;
    None when the device has no table, its table does not cover ``op``, or ``QERL_DEQUANT_SLICES=0``: the caller
    keeps its own rule. (Until session 56 the smallest measured M >= m: the GRPO update at micro-batch 2, M = 2176,
    then ran the M = 4096 picks, which the same sweep had timed slower than the whole weight at M = 2048;
    ``results/speed/raw/h100_s56_upslice``.)"""
    if op not in SLICE_OPS:
        raise ValueError(f"dequant_slice: op={op!r}; valid: {SLICE_OPS}")
    if os.environ.get("QERL_DEQUANT_SLICES", "1") == "0":
        return None
    table = load_slice_table(device_name)
    if op not in table.ops:
        return None
    hit = nearest_measured(table.get((op, n, k), ()), m)
    return 0 if hit is None else hit


def nearest_measured(entries, m: int):
    """The value of the (M, value) entry (sorted by M) whose M is nearest to m in ratio, a tie going to the larger M;
    None when there are no entries or m is above the largest measured M. The measured tables' one lookup rule
    (``dequant_slice``, ``cuda_dq.tuned_config``)."""
    if not entries or m > entries[-1][0]:
        return None
    m = max(m, 1)  # an empty input: the smallest M's entry
    # ratio distance max(mm, m) / min(mm, m); entries are sorted by M, so on a tie the later (larger) one wins
    return min(reversed(entries), key=lambda e: max(e[0], m) / min(e[0], m))[1]
