"""The memory floor of a decode step (issue 11): the bytes one step must read, and the tokens/s they allow.

    python -m benchmarks.decode_floor [--root results/speed] [--gpu H100]

A decode step emits one token per sequence and reads, at least once each:

* the decoder linears in the weight format's storage (``fmt.bits_per_weight``: scales included; the kernel layout
  holds the same bytes),
* the LoRA A and B of the seven projections (BF16, rank r),
* the q|k|v biases and the RMSNorm weights (BF16),
* the BF16 lm_head (untied in 7B-32B; the 3B's tied embedding is the same matrix, read once),
* every sequence's KV cache at the rollout's mean length (prompt + new / 2, BF16).

The embedding rows, the activations and every write are left out (< 0.1 % at these shapes). So at a memory
bandwidth B, tokens/s <= batch x B / bytes -- a ceiling that no kernel can pass, whatever it fuses. The other way
round, a tokens/s target asks ``bytes x target / batch`` of the GPU's memory ("required TB/s"), which this compares
with the device-to-device copy bandwidth measured on that GPU model (``benchmarks.hbm_pattern_bench``: read + write
over the copy time, found in ``results/speed/raw/*/hbm_pattern_*.md``) and with the spec sheet's peak.

Our tokens/s (``qerl.bench rollout``) is generated tokens over the whole rollout, prefill included, so the ceiling
holds for it a fortiori.

At GRPO batch sizes (issue 10) the tensor cores bind too, so two more tables take, per part, the longer of its bytes
at the copy bandwidth and its FLOPs at the dense BF16 peak (a roofline per part, summed): ``roofline_table``, the 7B
decode step at 64-256 sequences for NVFP4 and BF16-LoRA (the ratio the floors allow beside the last same-run
measurement), and ``layer_roofline_table``, the 7B decoder linears at M = 17-512 beside the last per-layer GEMM table
(``benchmarks.cuda_gemm_bench``) of that GPU model. Writes ``decode_floor.md`` under ``--out`` when given; prints the
three tables.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pandas as pd

from qerl.model import PRESETS
from qerl.quant import get_format

ROOT = Path(__file__).resolve().parents[1] / "results" / "speed"
# spec-sheet HBM bandwidth (TB/s) and dense BF16 tensor-core peak (TFLOPS) of the GPU models the project measures on
# (SXM parts; the H200 is the H100's chip with more and faster memory)
SPEC_TBPS = {"H100": 3.35, "H200": 4.8}
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}
# issue 10's rollout target: NVFP4 tokens/s >= 1.3 x BF16-LoRA's at these sequences (7B, 256 + 512, one H100)
ROLLOUT_TARGETS = {64: 1.3, 128: 1.3}
# issue 10's layer targets: the 7B decoder linears' forward, NVFP4 / MXFP4 over BF16 cuBLAS, at these M (one H100)
LAYER_TARGETS = {32: 2.3, 64: 1.6, 128: 1.15, 256: 0.95, 512: 0.95}
# issue 11's targets: (preset, weights, batch) -> tokens/s at 256 + 2048 tokens, LoRA rank 32, one H100
TARGETS = {("qwen2.5-7b", "nvfp4", 8): 2600, ("qwen2.5-7b", "mxfp4", 8): 2600, ("qwen2.5-7b", "bf16", 8): 1650,
           ("qwen2.5-7b", "nvfp4", 2): 700, ("qwen2.5-14b", "nvfp4", 8): 1300, ("qwen2.5-32b", "nvfp4", 8): 800}
MODEL_NAMES = {"qwen2.5-3b": "Qwen2.5-3B-Instruct", "qwen2.5-7b": "Qwen2.5-7B-Instruct",
               "qwen2.5-14b": "Qwen2.5-14B-Instruct", "qwen2.5-32b": "Qwen2.5-32B-Instruct"}


def _shapes(preset: str, batch: int, kv_len: float, rank: int) -> tuple[dict, list[tuple[int, int]], int]:
    """(preset config, (out, in) of q, k, v, o, gate, up, down, KV width) after checking the arguments."""
    key = preset.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid: {sorted(PRESETS)}")
    if batch < 1 or kv_len < 0 or rank < 0:
        raise ValueError(f"batch {batch}, kv_len {kv_len}, rank {rank}: expected batch >= 1, kv_len >= 0, rank >= 0")
    c = PRESETS[key]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    return c, [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)], kv


def _weight_bytes(fmt, n: int, k: int) -> float:
    """Bytes of an (n, k) weight in ``fmt``'s storage, scales included."""
    return n * k * fmt.bits_per_weight(n, k) / 8


def step_bytes(preset: str, weights: str, batch: int, kv_len: float, rank: int = 32) -> dict[str, float]:
    """Bytes one decode step reads at least, by part (see the module docstring) and in all ("total")."""
    c, shapes, kv = _shapes(preset, batch, kv_len, rank)
    fmt = get_format(weights)  # raises on an unknown format, naming the valid ones
    h, L = c["hidden_size"], c["num_hidden_layers"]
    linears = L * sum(_weight_bytes(fmt, n, k) for n, k in shapes)
    lora = L * sum(rank * (n + k) * 2 for n, k in shapes)
    small = L * ((h + 2 * kv) + 2 * h) * 2 + h * 2  # q|k|v biases, two norms a layer, the final norm
    lm_head = c["vocab_size"] * h * 2
    cache = L * 2 * kv * 2 * batch * kv_len
    parts = {"linears": linears, "lora": lora, "small": small, "lm_head": lm_head, "kv_cache": cache}
    parts["total"] = sum(parts.values())
    return parts


def step_flops(preset: str, batch: int, kv_len: float, rank: int = 32) -> dict[str, float]:
    """Multiply-adds x 2 of one decode step by the parts of :func:`step_bytes` (an FP4 weight is multiplied in BF16
    after its decode: the same count): the linears, the LoRA terms, the lm_head, and attention over the KV cache
    (q·kᵀ and p·v, every head)."""
    c, shapes, _ = _shapes(preset, batch, kv_len, rank)
    h, L = c["hidden_size"], c["num_hidden_layers"]
    parts = {"linears": 2.0 * L * sum(n * k for n, k in shapes) * batch,
             "lora": 2.0 * L * sum(rank * (n + k) for n, k in shapes) * batch,
             "lm_head": 2.0 * c["vocab_size"] * h * batch,
             "kv_cache": 2.0 * 2 * L * h * kv_len * batch}
    parts["total"] = sum(parts.values())
    return parts


def step_floor_s(preset: str, weights: str, batch: int, kv_len: float, tbps: float, tflops: float,
                 rank: int = 32) -> dict[str, float]:
    """Seconds one decode step takes at least, by part: each part's bytes at ``tbps`` or its FLOPs at ``tflops``,
    whichever is longer (a roofline per part; the parts run one after another), and their sum ("total")."""
    b, f = step_bytes(preset, weights, batch, kv_len, rank), step_flops(preset, batch, kv_len, rank)
    parts = {k: max(b[k] / (tbps * 1e12), f.get(k, 0.0) / (tflops * 1e12)) for k in b if k != "total"}
    parts["total"] = sum(parts.values())
    return parts


def ceiling_tokens_per_s(total_bytes: float, batch: int, tbps: float) -> float:
    """Tokens/s a step of ``total_bytes`` allows at ``tbps`` (one token per sequence a step)."""
    return batch * tbps * 1e12 / total_bytes


def required_tbps(total_bytes: float, batch: int, tokens_per_s: float) -> float:
    """The memory bandwidth (TB/s) a step of ``total_bytes`` needs to reach ``tokens_per_s``."""
    return total_bytes * tokens_per_s / batch / 1e12


def copy_bandwidths(root: Path = ROOT) -> dict[str, tuple[float, str]]:
    """{GPU model ("H100", "H200"): (copy TB/s, run folder)} from the HBM pattern benchmarks under ``root/raw``; the
    last run (by folder name) per model."""
    out: dict[str, tuple[float, str]] = {}
    pat = re.compile(r"NVIDIA (H100|H200)\b[^\n]*?copy bandwidth ([0-9.]+) TB/s")
    for md in sorted((root / "raw").glob("*/hbm_pattern_*.md")):
        m = pat.search(md.read_text())
        if m:
            out[m.group(1)] = (float(m.group(2)), md.parent.name)
    return out


def _gpu_model(device: str) -> str | None:
    m = re.search(r"\b(H100|H200)\b", str(device))
    return m.group(1) if m else None


def _check_gpu(gpu: str) -> None:
    if gpu not in SPEC_TBPS:
        raise ValueError(f"unknown GPU model {gpu!r}; valid: {sorted(SPEC_TBPS)}")


def _read_rollouts(root: Path) -> pd.DataFrame | None:
    path = root / "rollout.csv"
    return pd.read_csv(path) if path.exists() else None


def _finished_rows(rollouts: pd.DataFrame, preset: str, batch: int, gpu: str, prompt: int, new: int,
                   rank: int = 32) -> pd.DataFrame:
    """The finished rollout rows of that model, batch, lengths and LoRA rank on that GPU model."""
    d = rollouts
    return d[(d["model"] == MODEL_NAMES.get(preset, preset)) & (d["batch_size"] == batch) & (d["prompt_len"] == prompt)
             & (d["new_tokens"] == new) & (d["lora_rank"] == rank) & (d["status"] == "ok")
             & (d["device"].map(_gpu_model) == gpu)]


def _bound(bytes_only_s: float, floor_s: float) -> str:
    """What bounds a floor: its bytes when the bytes alone (at infinite compute) take as long."""
    return "bytes" if bytes_only_s >= floor_s * (1 - 1e-9) else "FLOPs"


def best_measured(rollouts: pd.DataFrame, preset: str, weights: str, batch: int, gpu: str,
                  prompt: int = 256, new: int = 2048, rank: int = 32) -> tuple[float, str] | None:
    """(tokens/s, run) of the fastest finished rollout row of that model, format, batch, lengths and rank on that GPU
    model (any decode mode, any build), or None."""
    d = _finished_rows(rollouts, preset, batch, gpu, prompt, new, rank)
    d = d[d["weights"].str.lower() == weights]
    if d.empty:
        return None
    r = d.loc[d["tokens_per_s"].idxmax()]
    return float(r["tokens_per_s"]), str(r.get("run", ""))


def floor_table(root: Path = ROOT, gpu: str = "H100", prompt: int = 256, new: int = 2048) -> str:
    """Markdown: issue 11's rows with their bytes a step, the bandwidth their target asks, the ceilings at the
    measured copy bandwidth and at the spec peak, and the best measured tokens/s on ``gpu``."""
    _check_gpu(gpu)
    copy = copy_bandwidths(root).get(gpu)
    rollouts = _read_rollouts(root)
    kv_len = prompt + new / 2
    spec = SPEC_TBPS[gpu]
    head = (f"Per decode step at {prompt} + {new} tokens (mean KV length {kv_len:g}), LoRA rank 32; "
            f"{gpu}: copy bandwidth " + (f"{copy[0]:.2f} TB/s (`raw/{copy[1]}`)" if copy else "not measured")
            + f", spec peak {spec} TB/s. Targets: issue 11 (one H100).\n")
    cols = ["model", "weights", "batch", "GB a step (linears / LoRA / lm_head / KV)", "target tok/s",
            "target needs TB/s", "ceiling at copy BW", "ceiling at spec peak", f"best measured ({gpu})",
            "measured / copy ceiling"]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for (preset, weights, batch), target in TARGETS.items():
        b = step_bytes(preset, weights, batch, kv_len)
        need = required_tbps(b["total"], batch, target)
        ceil_copy = ceiling_tokens_per_s(b["total"], batch, copy[0]) if copy else None
        ceil_spec = ceiling_tokens_per_s(b["total"], batch, spec)
        best = best_measured(rollouts, preset, weights, batch, gpu, prompt, new) if rollouts is not None else None
        parts = " / ".join(f"{b[k] / 1e9:.2f}" for k in ("linears", "lora", "lm_head", "kv_cache"))
        need_s = f"{need:.2f}" + (f" ({100 * need / copy[0]:.0f} % of copy)" if copy else "")
        lines.append("| " + " | ".join([
            MODEL_NAMES[preset], weights.upper(), str(batch), f"{b['total'] / 1e9:.2f} ({parts})", str(target),
            need_s, f"{ceil_copy:.0f}" if ceil_copy else "—", f"{ceil_spec:.0f}",
            f"{best[0]:.0f} ({best[1]})" if best else "—",
            f"{best[0] / ceil_copy:.2f}" if best and ceil_copy else "—"]) + " |")
    return "\n".join(lines) + "\n"


def _same_run_pair(rollouts: pd.DataFrame, batch: int, gpu: str, prompt: int, new: int):
    """(NVFP4 row, BF16 row) of 7B rank-32 `fused` rollouts at ``batch`` from the last run (by row order) on ``gpu``
    that has both, or None."""
    d = _finished_rows(rollouts, "qwen2.5-7b", batch, gpu, prompt, new)
    if "decode" in d:
        d = d[d["decode"].fillna("fused") == "fused"]
    for run in reversed(list(dict.fromkeys(d["run"]))):
        r = d[d["run"] == run]
        nv, bf = r[r["weights"] == "NVFP4"], r[r["weights"] == "BF16"]
        if len(nv) and len(bf):
            return nv.iloc[-1], bf.iloc[-1]
    return None


def roofline_table(root: Path = ROOT, gpu: str = "H100", batches=(64, 128, 256), prompt: int = 256,
                   new: int = 512) -> str:
    """Markdown: issue 10's rollout rows (7B, NVFP4 vs BF16-LoRA, rank 32) against the per-part roofline of a decode
    step (:func:`step_floor_s` at the measured copy bandwidth and the dense BF16 peak): each format's floor and what
    bounds its linears, the ratio the floors allow, and the last same-run measurement (its decode rate against the
    ceiling, its tokens/s ratio against the target)."""
    _check_gpu(gpu)
    copy = copy_bandwidths(root).get(gpu)
    if copy is None:
        return f"_no copy bandwidth measured on an {gpu} (`benchmarks.hbm_pattern_bench`)_\n"
    rollouts = _read_rollouts(root)
    kv_len, peak = prompt + new / 2, PEAK_TFLOPS[gpu]
    head = (f"7B, LoRA rank 32, {prompt} + {new} tokens (mean KV length {kv_len:g}); {gpu}: copy bandwidth "
            f"{copy[0]:.2f} TB/s (`raw/{copy[1]}`), dense BF16 peak {peak} TFLOPS. Floor = per part (linears, LoRA, "
            "lm_head, attention over the KV cache) the longer of its bytes and its FLOPs, summed; ceiling = sequences / "
            "floor. Measured: the last run with both formats (decode rate = tokens / decode time; the ratio on "
            "tokens/s, as issue 10 sets it).\n")
    cols = ["sequences", "NVFP4 floor ms (linears bound by)", "BF16 floor ms (linears bound by)",
            "ratio the floors allow", "issue-10 target (H100)", f"measured ratio ({gpu})", "NVFP4 decode / ceiling",
            "BF16 decode / ceiling", "run"]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for batch in batches:
        cells = [str(batch)]
        floors = {}
        for w in ("nvfp4", "bf16"):
            f = step_floor_s("qwen2.5-7b", w, batch, kv_len, copy[0], peak)
            fb = step_floor_s("qwen2.5-7b", w, batch, kv_len, copy[0], float("inf"))  # the bytes' alone
            floors[w] = f["total"]
            cells.append(f"{1e3 * f['total']:.2f} ({_bound(fb['linears'], f['linears'])})")
        cells.append(f"{floors['bf16'] / floors['nvfp4']:.2f}×")
        cells.append(f"≥ {ROLLOUT_TARGETS[batch]}×" if batch in ROLLOUT_TARGETS else "—")
        pair = _same_run_pair(rollouts, batch, gpu, prompt, new) if rollouts is not None else None
        if pair is None:
            cells += ["—", "—", "—", "—"]
        else:
            nv, bf = pair
            cells += [f"{nv['tokens_per_s'] / bf['tokens_per_s']:.2f}×",
                      f"{nv['decode_tokens_per_s'] * floors['nvfp4'] / batch:.2f}",
                      f"{bf['decode_tokens_per_s'] * floors['bf16'] / batch:.2f}", str(nv["run"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def layer_floor_s(preset: str, weights: str, m: int, tbps: float, tflops: float) -> float:
    """Seconds one layer's seven decoder linears take at least for M tokens, each linear at the longer of its weight
    bytes at ``tbps`` and its FLOPs at ``tflops`` (activations left out)."""
    c, shapes, _ = _shapes(preset, m, 0, 0)
    fmt = get_format(weights)
    return sum(max(_weight_bytes(fmt, n, k) / (tbps * 1e12), 2.0 * n * k * m / (tflops * 1e12)) for n, k in shapes)


def _layer_csv(root: Path, gpu: str) -> tuple[pd.DataFrame, str] | None:
    """The last per-layer GEMM table (``benchmarks.cuda_gemm_bench``) of that GPU model: results/speed's own, else the
    last raw run's (by folder name)."""
    tag = gpu.lower()
    top = root / f"cuda_gemm_{tag}.csv"
    if top.exists():
        return pd.read_csv(top), top.name
    raws = sorted((root / "raw").glob(f"*/cuda_gemm_{tag}.csv"))
    return (pd.read_csv(raws[-1]), f"raw/{raws[-1].parent.name}") if raws else None


def layer_roofline_table(root: Path = ROOT, gpu: str = "H100", weights: str = "nvfp4") -> str:
    """Markdown: issue 10's layer targets (7B decoder linears, forward, against BF16 cuBLAS) beside each format's floor
    (:func:`layer_floor_s` at the measured copy bandwidth and the dense BF16 peak) and the last measured table."""
    _check_gpu(gpu)
    copy, table = copy_bandwidths(root).get(gpu), _layer_csv(root, gpu)
    if copy is None or table is None:
        return f"_no copy bandwidth or layer table measured on an {gpu}_\n"
    d, src = table
    d = d[d["model"] == "7b"]
    peak = PEAK_TFLOPS[gpu]
    head = (f"7B decoder linears (seven a layer), forward, {weights.upper()} (the dispatcher: `qmm`) against BF16 cuBLAS; "
            f"{gpu}: copy bandwidth {copy[0]:.2f} TB/s (`raw/{copy[1]}`), dense BF16 peak {peak} TFLOPS; measured: "
            f"`{src}`. Floor = per linear the longer of its weight bytes and its FLOPs, summed.\n")
    cols = ["M", f"{weights.upper()} floor µs (bound by)", "BF16 floor µs (bound by)", "ratio the floors allow",
            "issue-10 target (H100)", "measured ratio", f"{weights.upper()} floor / measured", "BF16 floor / measured"]
    lines = [head, "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for m in sorted(d["M"].unique()):
        bf = d[(d["M"] == m) & (d["fmt"] == "bf16") & (d["path"] == "bf16")]
        fp = d[(d["M"] == m) & (d["fmt"] == weights) & (d["path"] == "qmm")]
        if bf.empty or fp.empty:
            continue
        cells, floors = [str(m)], {}
        for w in (weights, "bf16"):
            f = layer_floor_s("qwen2.5-7b", w, int(m), copy[0], peak)
            fb = layer_floor_s("qwen2.5-7b", w, int(m), copy[0], float("inf"))  # the bytes' alone
            floors[w] = f
            cells.append(f"{1e6 * f:.1f} ({_bound(fb, f)})")
        b_us, f_us = float(bf["us"].iloc[-1]), float(fp["us"].iloc[-1])
        cells += [f"{floors['bf16'] / floors[weights]:.2f}×",
                  f"≥ {LAYER_TARGETS[m]}×" if m in LAYER_TARGETS else "", f"{b_us / f_us:.2f}×",
                  f"{1e6 * floors[weights] / f_us:.2f}", f"{1e6 * floors['bf16'] / b_us:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(ROOT), help="results/speed (rollout.csv and raw/*/hbm_pattern_*.md)")
    ap.add_argument("--gpu", default="H100", help=f"GPU model: {', '.join(sorted(SPEC_TBPS))}")
    ap.add_argument("--out", default=None, help="folder for decode_floor.md")
    a = ap.parse_args(argv)
    md = "\n".join([floor_table(Path(a.root), a.gpu), roofline_table(Path(a.root), a.gpu),
                    layer_roofline_table(Path(a.root), a.gpu)])
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "decode_floor.md").write_text(md)
    sys.stdout.write(md)


if __name__ == "__main__":
    main()
