"""What the benchmarks of ``qerl.bench`` share: the paper's method and model names, the run's environment columns,
the CSV rows' identities and their append-merge writer, the layout an FP4 base is held in for this process's runs
(``LAYOUT`` / ``DEVICE``, set by ``qerl.bench``'s ``--layout`` / ``--device``), the bench's policy, and a
profiler run's kernel times."""

from __future__ import annotations

import csv
import gc
import io
from pathlib import Path

import torch

from qerl.lora import LoraSpec
from qerl.model import load_policy, resolve_layout
from qerl.quant import get_format
from qerl.quant.base import KERNEL_LAYOUT_FORMATS
from qerl.results import atomic_write_text, environment

#: The paper's method names of its three formats; any other format is "<label>-LoRA" (MXFP4-LoRA, INT4-LoRA).
PAPER_METHOD = {"bf16": "LoRA", "nf4": "QLoRA", "nvfp4": "QeRL"}


def method_name(fmt: str) -> str:
    """The method a format's rows are reported under (the paper's name where it has one)."""
    return PAPER_METHOD.get(fmt) or f"{get_format(fmt).label}-LoRA"
PAPER_NAME = {"3b": "Qwen2.5-3B-Instruct", "7b": "Qwen2.5-7B-Instruct", "14b": "Qwen2.5-14B-Instruct",
              "32b": "Qwen2.5-32B-Instruct", "0.5b": "Qwen2.5-0.5B-Instruct", "1.5b": "Qwen2.5-1.5B-Instruct"}


def _env() -> dict:
    e = environment()
    hw = e["hardware"]
    return {"device": hw.get("gpu", hw.get("cpu")), "torch": e["packages"].get("torch"),
            "triton": e["packages"].get("triton"), "git_sha": (e["git_sha"] or "")[:10]}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


#: The columns that identify a row of a benchmark CSV (a new row replaces an old one with the same values).
IDENT = ("bench", "model", "weights", "batch_size", "group_size", "micro_batch", "lora_rank", "gc", "prompt_len",
         "new_tokens", "decode", "layout", "pass")
SCALING_IDENT = ("bench", "model", "weights", "world_size", "global_batch", "group_size", "micro_batch", "gc",
                 "new_tokens", "layout")
REUSE_IDENT = ("bench", "model", "weights", "batch_size", "group_size", "new_tokens", "steps", "layout", "reuse",
               "pass", "kind", "step")
UPDATE_IDENT = ("bench", "model", "weights", "micro_batch", "gc", "prompt_len", "new_tokens", "layout", "device",
                "fused_train", "cuda_dequant", "category", "kernel")
#: how NVFP4/MXFP4 bases are held in this process's runs (``--layout``; ``qerl.kernels.relaid``) and on which
#: device (``--device``): rows and training runs record the resolved layout (``auto`` is kernel where the CUDA FP4
#: kernels run); other formats have one layout, "compressed"
LAYOUT, DEVICE = "auto", "cpu"
_FP4_LABELS = ("NVFP4", "MXFP4")


def _layout_for(fmt: str) -> str:
    return resolve_layout(LAYOUT, fmt, DEVICE) if fmt in KERNEL_LAYOUT_FORMATS else "compressed"


def _write_csv(rows: list[dict], path: Path, ident: tuple[str, ...] = IDENT) -> None:
    if not rows:
        return
    for r in rows:  # rows record the layout their base was held in (rows written before it existed: compressed)
        r.setdefault("layout", _layout_for(r["weights"].lower()) if r.get("weights") in _FP4_LABELS else "compressed")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    old = []
    if path.exists():  # append-merge: rows with the same key columns are replaced
        with open(path) as f:
            old = list(csv.DictReader(f))
        keys = list(dict.fromkeys(list(old[0].keys()) + keys)) if old else keys
    for r in old:
        r["layout"] = r.get("layout") or "compressed"
    new_ids = {tuple(str(r.get(k, "")) for k in ident) for r in rows}
    merged = [r for r in old if tuple(str(r.get(k, "")) for k in ident) not in new_ids] + rows
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore")
    w.writeheader()
    w.writerows(merged)
    atomic_write_text(path, buf.getvalue())
    print(f"wrote {path} ({len(rows)} new rows)", flush=True)


def _source(model: str) -> str:
    return "preset:tiny" if model == "tiny" else f"preset:qwen2.5-{model}"


def _policy(model: str, fmt: str, rank: int, device: str):
    """The bench's policy: a LoRA of ``rank`` (alpha = rank) on every target; rank 0: no adapters at all (the frozen
    base alone, ``load_policy(lora=None)``), which bounds what the LoRA term costs a decode step."""
    if rank < 0:
        raise ValueError(f"LoRA rank {rank}: expected >= 1, or 0 for no adapters")
    lora = LoraSpec(rank=rank, alpha=rank) if rank > 0 else None
    return load_policy(_source(model), fmt, lora, device=device, layout=_layout_for(fmt))


def _method(fmt: str, rank: int) -> str:
    """A row's method: :func:`method_name`, or "<format> base" for rank 0 (no adapters: not a LoRA method)."""
    return method_name(fmt) if rank > 0 else f"{get_format(fmt).label} base"



def _kernel_times(prof, cuda: bool) -> dict[str, tuple[float, int]]:
    """{kernel name: (µs, launches)} of a torch.profiler run: device time of the kernels only on CUDA (launch calls
    and copies left out), CPU time of the ops elsewhere."""
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total
        if us > 0 and e.count > 0 and not e.key.startswith(("cudaLaunch", "cuLaunch", "Memcpy", "Memset")):
            out[e.key] = (us, e.count)
    return out


def _layout_tag(fmt: str) -> str:
    return "-kl" if _layout_for(fmt) == "kernel" else ""
