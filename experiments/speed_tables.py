"""The tables of ``results/speed/speed.md`` (rendered by :func:`experiments.speed.render`): each reads the committed
CSVs under ``results/speed`` (or a raw run's) and returns markdown, ours beside the paper's where the paper has the
number; ratios are ours against our own BF16-LoRA in the same run (same git SHA and device), never the paper's."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from experiments.speed_targets import _last_pass, _layer_us, _read
from qerl.bench_common import _FP4_LABELS
from qerl.bench_common import IDENT as BENCH_IDENT

PAPER_DIR = Path(__file__).resolve().parents[1] / "paper_figures" / "paper"
SIZES = {"Qwen2.5-7B-Instruct": {"BF16": 15.2, "NF4": 5.7, "NVFP4": 5.9},
         "Qwen2.5-14B-Instruct": {"BF16": 29.6, "NF4": 10.2, "NVFP4": 10.6}}


def _fmt(x, nd=1):
    return "—" if x is None or (isinstance(x, float) and x != x) else f"{x:.{nd}f}"




KL = " (kernel layout)"


def _kernel_layout(d: pd.DataFrame) -> pd.Series:
    """Rows whose FP4 base was held only in the CUDA kernels' layout (``quant.layout=kernel``, or ``auto`` where
    the kernels run); rows from before the option held the compressed-tensors layout."""
    return (d["layout"].fillna("compressed") == "kernel") if "layout" in d else pd.Series(False, index=d.index)


def memory_table(root: Path) -> str:
    d = _read(root, "memory.csv")
    if d is None:
        return "_no memory.csv_\n"
    lines = ["| model | method | weights | ours: model size (GB) | + decode kernels' copy (GB) | paper (Table 3) |",
             "|---|---|---|---|---|---|"]
    kl = _kernel_layout(d)
    for i, r in d.iterrows():
        paper = SIZES.get(r["model"], {}).get(r["weights"])
        lines.append(f"| {r['model']} | {r['method']}{KL if kl[i] else ''} | {r['weights']} | "
                     f"{r['model_size_gb']:.2f} | {_fmt(r.get('decode_copy_gb'), 2)} | {_fmt(paper)} |")
    return "\n".join(lines) + "\n"


def _size(model: str) -> float:
    import re
    m = re.search(r"(\d+(?:\.\d+)?)B", str(model))
    return float(m.group(1)) if m else 0.0


def _reference(ref: pd.DataFrame, r) -> tuple[pd.Series | None, str]:
    """The row of ``ref`` to compare ``r`` with, and "†" unless it comes from r's run: r's own run first, else a
    row of the same GPU model; none (no ratio) when only other GPUs have one — an H200's row against an H100's
    would mix two memory systems. Rows without a device compare with any."""
    if not len(ref):
        return None, ""
    if "run" in ref:
        same = ref[ref["run"] == r.get("run")]
        if len(same):
            return same.iloc[0], ""
    dev = r.get("device")
    if "device" in ref and isinstance(dev, str) and dev:
        ref = ref[ref["device"].isna() | (ref["device"] == dev)]
        if not len(ref):
            return None, ""
    return ref.iloc[0], "†"


#: The paper's rollout figures (Tables 5-8): vLLM 0.10.1 on one H100, 256-token prompts, 2048 new tokens.
PAPER_GPU, PAPER_TOKENS = "H100", "256 + 2048"


def _gpu(dev) -> str:
    """A device name as the tables show it ("H100", "H200", "H200 x2 (NV18)"); "" when the row has none."""
    if not isinstance(dev, str) or not dev:
        return ""
    return dev.replace("NVIDIA ", "").replace(" 80GB HBM3", "")


def _beside_paper(r) -> bool:
    """Whether the paper's figure may sit beside this row: the paper's GPU model (or none recorded) and lengths."""
    g = _gpu(r.get("device"))
    return (not g or g.startswith(PAPER_GPU)) and _tokens(r) == PAPER_TOKENS


def rollout_table(root: Path, name: str = "rollout.csv", decode: str | None = None, rank: int | None = 32) -> str:
    """Ours beside the paper's (Tables 5-8), grouped by model, batch, LoRA rank and decode step; ×LoRA and
    ×QLoRA against our own rows of the same group (marked † where that row came from another run). The paper's
    columns only beside rows of its GPU model and lengths (:func:`_beside_paper`; else ‡); the run cell names the
    GPU."""
    d = _read(root, name)
    if d is None:
        return f"_no {name}_\n"
    d = d[d["tokens_per_s"].notna()]
    d["decode"] = d["decode"].fillna("unfused") if "decode" in d else "unfused"
    d["_step"] = d["decode"]  # the decode step the rows are grouped (and compared with BF16-LoRA) by
    kl = _kernel_layout(d)  # a base held only in the kernels' layout: the same decode step, marked
    d.loc[kl, "decode"] = d.loc[kl, "decode"] + KL
    if "pass" in d:  # an A/B's later passes in one process (raw runs; the top level keeps one pass)
        again = d["pass"].notna()
        d.loc[again, "decode"] = d.loc[again, "decode"] + d.loc[again, "pass"].map(lambda p: f", pass {int(p)}")
    if "lora_rank" not in d:
        d["lora_rank"] = 32
    if decode is not None:
        d = d[d["_step"] == decode]
    if rank is not None:
        d = d[d["lora_rank"] == rank]
    if d.empty:
        return "_no rows_\n"
    d = d.assign(_size=d["model"].map(_size)).sort_values(["_size", "batch_size"], ascending=[True, False])
    paper = pd.read_csv(PAPER_DIR / "rollout_speed.csv")
    paper = paper[paper.metric == "rollout_throughput"]
    lines = ["| model | batch | rank | decode | method | weights | ours tok/s | ours ×LoRA | ours ×QLoRA | "
             "paper tok/s (vLLM) | paper ×LoRA | run (sha) | tokens (prompt + new) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    other = False  # a row beside which the paper's figure is withheld (‡)
    for (model, batch, rk, _), g in d.groupby(["model", "batch_size", "lora_rank", "_step"], sort=False):
        base = g[g.method == "LoRA"]
        qlora = g[g.method == "QLoRA"]
        pg = paper[(paper.model == model) & (paper.batch_size == batch)] if rk == 32 else paper.iloc[:0]
        p_lora = pg[pg.method == "LoRA"]["value"]

        def ratio(r, ref):
            ref, mark = _reference(ref, r)
            return "—" if ref is None else _fmt(r["tokens_per_s"] / ref["tokens_per_s"], 2) + mark

        for _, r in g.sort_values("tokens_per_s", ascending=False).iterrows():
            pv = pg[pg.method == r["method"]]["value"]
            pv = float(pv.iloc[0]) if len(pv) else None
            if _beside_paper(r):
                paper_cells = f"{_fmt(pv)} | {_fmt(pv / float(p_lora.iloc[0]), 2) if pv and len(p_lora) else '—'}"
            else:
                paper_cells = "—‡ | —‡" if pv else "— | —"
                other = other or bool(pv)
            gpu = _gpu(r.get("device"))
            lines.append(
                f"| {model} | {int(batch)} | {int(rk)} | {r['decode']} | {r['method']} | {r['weights']} | "
                f"{r['tokens_per_s']:.0f} | {ratio(r, base)} | {ratio(r, qlora)} | {paper_cells} | "
                f"{r.get('run', '')} ({r.get('git_sha', '')}){', ' + gpu if gpu else ''} | {_tokens(r)} |")
    if other:
        lines.append(f"\n‡ The paper's figure is not shown beside the rows marked ‡: it was measured on one {PAPER_GPU} "
                     f"at {PAPER_TOKENS} tokens, and they ran on another GPU or at other lengths.")
    return "\n".join(lines) + "\n"


def _tokens(r) -> str:
    """"256 + 2048": a rollout row's prompt and generated lengths (the paper's shapes are 256 + 2048)."""
    p, n = r.get("prompt_len"), r.get("new_tokens")
    return "—" if pd.isna(p) or pd.isna(n) else f"{int(p)} + {int(n)}"


def rank_table(root: Path) -> str:
    """Table 9: ours per LoRA rank (the batch of our sweep) beside the paper's (vLLM, batch 1); † = a ratio against
    the BF16 row of another run; each row's run (a rank re-measured later replaces that rank's row only)."""
    d = _read(root, "rollout.csv")
    if d is None:
        return "_no rollout.csv_\n"
    d = d[d["tokens_per_s"].notna() & (d.get("decode", "fused") == "fused")]
    if "device" not in d:
        d = d.assign(device="")
    d = d.assign(device=d["device"].fillna(""))
    swept = d.groupby(["model", "batch_size", "device"])["lora_rank"].nunique()  # a sweep is one GPU's rows
    swept = swept[swept > 1]
    if swept.empty:
        return "_no rank sweep_\n"
    t9 = pd.read_csv(PAPER_DIR / "table9.csv")
    lines = ["| model | batch (ours) | weights | rank | ours tok/s | ours ×LoRA | paper tok/s (vLLM, batch 1) | "
             "paper ×LoRA | run |", "|---|---|---|---|---|---|---|---|---|"]
    for (model, batch, device) in swept.index:
        g = d[(d.model == model) & (d.batch_size == batch) & (d.device == device)].sort_values(["lora_rank", "weights"])
        for _, r in g.iterrows():
            ref, mark = _reference(g[(g.lora_rank == r.lora_rank) & (g.weights == "BF16")], r)
            pv = t9[(t9.model == model) & (t9.weights == r.weights) & (t9.lora_rank == r.lora_rank)]
            pb = t9[(t9.model == model) & (t9.weights == "BF16") & (t9.lora_rank == r.lora_rank)]
            pvv = float(pv.rollout_throughput_tokens_per_s.iloc[0]) if len(pv) else None
            pbv = float(pb.rollout_throughput_tokens_per_s.iloc[0]) if len(pb) else None
            lines.append(f"| {model} | {int(batch)} | {r.weights} | {int(r.lora_rank)} | {r.tokens_per_s:.0f} | "
                         f"{_fmt(r.tokens_per_s / ref.tokens_per_s, 2) + mark if ref is not None else '—'} | "
                         f"{_fmt(pvv)} | "
                         f"{_fmt(pvv / pbv, 2) if pvv and pbv else '—'} | {r.get('run', '')} |")
    return "\n".join(lines) + "\n"


def step_table(root: Path) -> str:
    """End-to-end GRPO steps (Table 3 beside ours): one row per (model, completions, groups, micro-batch, GC)
    configuration and method, each method's speed-up against LoRA (BF16) of the same configuration (:func:`_reference`:
    the same run's, else († ) the same GPU model's; none against another GPU's)."""
    d = _read(root, "step.csv")
    if d is None:
        return "_no step.csv_\n"
    t3 = pd.read_csv(PAPER_DIR / "table3.csv")
    for col in ("group_size", "micro_batch"):  # rows from before these columns: one group, whole-batch micro-batches
        d[col] = d[col].fillna(d["batch_size"]) if col in d else d["batch_size"]
    if "new_tokens" not in d:
        d["new_tokens"] = float("nan")
    lines = ["| model | completions (prompts × G) | micro | new tokens | GC | method | status | ours s/step | rollout s | "
             "log-prob s | update s | peak GB | ours ×LoRA | paper ×LoRA (Table 3) | run (sha) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = ["model", "batch_size", "group_size", "micro_batch", "new_tokens", "gc"]
    d["_label"] = d["method"] + _kernel_layout(d).map({True: KL, False: ""})
    for (model, batch, group, micro, new, gc), g in d.groupby(keys, sort=False, dropna=False):
        base_rows = g[(g.method == "LoRA") & (g.status == "ok")]
        one_group = group == batch
        for _, r in g.iterrows():
            ref, mark = _reference(base_rows, r)
            # Table 3 is one prompt per step (batch = G): compare only that configuration
            pp = t3[(t3.model == model) & (t3.batch_size == batch) & (t3.method == r["method"])] if one_group else t3[:0]
            pv = pp["e2e_speedup_vs_bf16_lora"].iloc[0] if len(pp) else None
            ok = r["status"] == "ok"
            st = "ok" if ok else str(r["status"]).split(".")[0][:40]
            lines.append(
                f"| {model} | {int(batch)} ({int(batch // group)} × {int(group)}) | {int(micro)} | "
                f"{int(new) if new == new else '—'} | {'on' if gc else 'off'} | {r['_label']} | {st} | "
                f"{_fmt(r['step_s']) if ok else '—'} | {_fmt(r['rollout_s']) if ok else '—'} | "
                f"{_fmt(r['logprob_s'], 2) if ok else '—'} | {_fmt(r['update_s'], 2) if ok else '—'} | "
                f"{_fmt(r['peak_mem_gb']) if ok else '—'} | "
                f"{_fmt(ref['step_s'] / r['step_s'], 2) + mark if ok and ref is not None else '—'} | "
                f"{_fmt(pv) if pv == pv else '—'} | "
                f"{r.get('run', '')} ({r.get('git_sha', '') if r.get('git_sha', '') == r.get('git_sha', '') else ''}) |")
    return "\n".join(lines) + "\n"


def layout_table(root: Path, sessions: tuple[str, ...] = ("h100_s27_layout",)) -> str:
    """Issue 10's one resident layout: each kernel-layout row of ``rollout.csv`` / ``step.csv`` (the top-level rows
    and those kept under ``raw/<session>/*/`` for ``sessions``, so a later run of the same configuration does not
    unpair them) beside the compressed-layout row of the same configuration from the same session (``run``'s first
    path component), with the speed ratio (> 1: the kernel layout is faster) and both peaks."""
    lines = ["| bench | model | configuration | compressed | kernel layout | kernel speed ÷ compressed | "
             "update s (c → k) | peak GB (c → k) | run (sha) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, value, unit, faster in (("rollout.csv", "tokens_per_s", "tok/s", "higher"),
                                      ("step.csv", "step_s", "s/step", "lower")):
        d = _read(root, name)
        if d is None or "layout" not in d or "run" not in d:
            continue
        ident = [c for c in (*BENCH_IDENT, "device") if c in d.columns]
        for s_ in sessions:  # a session's rows that a later run of the same configuration replaced at the top level
            mine = set(_ident(d[d["run"].astype(str).str.split("/").str[0] == s_], ident))
            for f in sorted((root / "raw" / s_).glob(f"*/{name}")):
                r = pd.read_csv(f)
                if "run" in r and all(c in r.columns for c in ident):
                    d = pd.concat([d, r[[i not in mine for i in _ident(r, ident)]]], ignore_index=True)
                    mine |= set(_ident(r, ident))
        d = d[d["status"].fillna("ok") == "ok"] if "status" in d else d
        d = d.assign(_session=d["run"].astype(str).str.split("/").str[0])
        keys = [k for k in BENCH_IDENT if k in d.columns and k != "layout"] + ["_session"]
        kl = _kernel_layout(d)
        kern, comp = d[kl], d[~kl]
        for _, k in kern.iterrows():
            m = comp
            for c in keys:
                m = m[(m[c] == k[c]) | (m[c].isna() & pd.isna(k[c]))]
            if m.empty:
                continue
            c = m.iloc[-1]
            ratio = k[value] / c[value] if faster == "higher" else c[value] / k[value]
            if name == "rollout.csv":
                conf = f"{int(k['batch_size'])} sequences, {int(k['new_tokens'])} new tokens"
                upd = "—"
            else:
                g = k.get("group_size", k["batch_size"])
                g = k["batch_size"] if g != g else g
                mb = k.get("micro_batch", k["batch_size"])
                mb = k["batch_size"] if mb != mb else mb
                conf = (f"{int(k['batch_size'])} completions ({int(k['batch_size'] // g)} × {int(g)}), micro "
                        f"{int(mb)}, {int(k['new_tokens'])} new, GC {'on' if k['gc'] else 'off'}")
                upd = f"{_fmt(c['update_s'], 2)} → {_fmt(k['update_s'], 2)}"
            lines.append(f"| {k['bench']} | {k['model']} | {conf} | {_fmt(c[value])} {unit} | "
                         f"{_fmt(k[value])} {unit} | {ratio:.3f} | {upd} | "
                         f"{_fmt(c['peak_mem_gb'])} → {_fmt(k['peak_mem_gb'])} | {k['run']} ({k.get('git_sha', '')}) |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else "_no kernel-layout rows with a same-session pair_\n"


SCALE_KEYS = ["model", "weights", "global_batch", "group_size", "micro_batch", "gc", "new_tokens"]


def scaling_rows(d: pd.DataFrame) -> list[dict]:
    """Each scaling row with its efficiency against the one-GPU row of the same configuration (model, format,
    global batch, group, micro-batch, GC, lengths), measured in the same session: per-GPU throughput
    (generated tokens per second of step / GPUs) over the one-GPU throughput, and each phase's speed-up."""
    out = []
    ok = d[d.status == "ok"]
    for _, r in d.iterrows():
        row = r.to_dict()
        same = ok
        for k in SCALE_KEYS:
            same = same[same[k].astype(str) == str(r[k])]
        one = same[same.world_size == 1]
        for k in ("run", "device"):  # the 1-GPU row of the same session, else of the same hardware, else any
            if k in one and len(mine := one[one[k].astype(str) == str(r.get(k))]):
                one = mine
                break
        w = int(r["world_size"])
        if r["status"] == "ok" and len(one):
            o = one.iloc[0]
            row["efficiency"] = r["tokens_per_s"] / w / o["tokens_per_s"]
            row["cross_run"] = str(o.get("run", "")) != str(r.get("run", ""))
            for ph in ("rollout", "logprob", "update"):
                row[f"{ph}_speedup"] = o[f"{ph}_s"] / r[f"{ph}_s"] if r[f"{ph}_s"] else None
        row["comm_share"] = (r["comm_s"] / r["step_s"]) if r["status"] == "ok" and r["step_s"] else None
        out.append(row)
    return out


def scaling_table(root: Path) -> str:
    d = _read(root, "scaling.csv")
    if d is None:
        return "_no scaling.csv (python -m experiments.speed --run scaling on a multi-GPU host)_\n"
    hosts: dict[str, tuple[str, int]] = {}  # run -> (device, the most GPUs a row of it saw: host_gpus, later runs)
    for _, r in d.iterrows():
        if isinstance(r.get("device"), str):
            n = r.get("host_gpus")
            n = int(n) if n is not None and n == n else 1
            dev, m = hosts.get(r.get("run", ""), (r["device"], 1))
            hosts[r.get("run", "")] = (dev, max(m, n))
    devs = sorted(f"{run}: {dev}" + (f" x{n}" if n > 1 else "") for run, (dev, n) in hosts.items())
    head = f"Devices: {'; '.join(devs)}.\n\n" if devs else ""
    lines = ["| model | method | GPUs | completions/GPU | status | s/step | rollout s | log-prob s | update s | "
             "all-reduce s (% of step) | tokens/s | tokens/s/GPU | efficiency | rollout × | log-prob × | update × | "
             "peak GB/GPU | run (sha) |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in scaling_rows(d):
        ok = r["status"] == "ok"
        w = int(r["world_size"])
        eff = r.get("efficiency")
        cell = (lambda k, nd=1, r=r, ok=ok: _fmt(r.get(k), nd) if ok else "—")
        sha = r.get("git_sha", "")
        share = r.get("comm_share")
        comm = f"{_fmt(r['comm_s'], 3)} ({100 * share:.1f}%)" if ok and share is not None else "—"
        lines.append(
            f"| {r['model']} | {r['method']} | {w} | {_fmt(r.get('per_gpu_batch'), 0) if ok else '—'} | "
            f"{'ok' if ok else str(r['status'])[:60]} | {cell('step_s')} | {cell('rollout_s')} | "
            f"{cell('logprob_s', 2)} | {cell('update_s', 2)} | "
            f"{comm} | "
            f"{cell('tokens_per_s', 0)} | {_fmt(r['tokens_per_s'] / w, 0) if ok else '—'} | "
            f"{(f'{100 * eff:.0f}%' + ('†' if r.get('cross_run') else '')) if eff is not None else '—'} | "
            f"{_fmt(r.get('rollout_speedup'), 2)} | {_fmt(r.get('logprob_speedup'), 2)} | "
            f"{_fmt(r.get('update_speedup'), 2)} | {cell('peak_mem_gb')} | "
            f"{r.get('run', '')} ({sha if sha == sha else ''}) |")
    return head + "\n".join(lines) + "\n"


def curves_table(root: Path) -> str:
    """The 1-GPU vs N-GPU reward-curve comparisons (``scaling_curves.csv``, written by
    ``python -m paper_figures.scaling_curves``): per scale and arm, each metric's N-GPU − 1-GPU effect and verdict."""
    d = _read(root, "scaling_curves.csv")
    if d is None:
        return ("_no scaling_curves.csv (python -m paper_figures.scaling_curves --one ROOT1 --two ROOT2 --scale "
                "SCALE)_\n")
    lines = ["| scale | arm | lr | GPUs | seeds | steps | metric | 1 GPU mean (sd) | N GPUs mean (sd) | "
             "effect [95% CI] | verdict | overall |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in d.iterrows():
        lines.append(f"| {r['scale']} | {r['arm']} | {r['lr']:g} | {int(r['world_size'])} | {r['seeds']} | "
                     f"{int(r['steps'])} | {r['metric']} | {_fmt(r['mean_one'], 3)} ({_fmt(r['sd_one'], 3)}) | "
                     f"{_fmt(r['mean_many'], 3)} ({_fmt(r['sd_many'], 3)}) | {_fmt(r['effect'], 3)} "
                     f"[{_fmt(r['ci_lo'], 3)}, {_fmt(r['ci_hi'], 3)}] | {r['verdict']} | {r['overall']} |")
    return "\n".join(lines) + "\n"


def batch_rollout_table(root: Path, run: str = "h100_s19_rollout") -> str:
    """Rollouts at GRPO batch sizes (32-256 sequences) from ``raw/<run>/``. Two layouts: a session that ran the
    sampler with the CUDA FP4 GEMM on (``QERL_CUDA_GEMM`` unset) and off (``=0``) as ``rollout_gemm_{auto,0}.csv``
    (the BF16-LoRA baseline is the ``0`` process's: the ``auto`` process measured BF16 first, with warm-up in its
    first row), or one ``rollout.csv`` with the dispatcher as committed, one process per format, whose smallest
    batch (16) is the warm-up and is left out. Where a run measured several decode modes, the ``fused`` rows
    (the default) are shown; where it measured a mode more than once (``pass``), the last pass."""
    on, off = _read(root / "raw" / run, "rollout_gemm_auto.csv"), _read(root / "raw" / run, "rollout_gemm_0.csv")
    if on is None or off is None:
        one = _read(root / "raw" / run, "rollout.csv")
        if one is None:
            return "_not measured_\n"
        rows = ["| model | sequences | BF16-LoRA tok/s | NVFP4 tok/s | × BF16-LoRA | MXFP4 tok/s | × BF16-LoRA |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        if "decode" in one and (one.decode == "fused").any():
            one = one[one.decode == "fused"]
        one = _last_pass(one, ["model", "batch_size", "weights"])
        for (model, batch), g in one[one.batch_size >= 32].groupby(["model", "batch_size"], sort=True):
            base = g[g.weights == "BF16"].tokens_per_s
            if base.empty:
                continue
            b = float(base.iloc[0])
            cells = []
            for w in ("NVFP4", "MXFP4"):
                q = g[g.weights == w].tokens_per_s
                cells += [f"{float(q.iloc[0]):.0f}", f"{float(q.iloc[0]) / b:.2f}"] if len(q) else ["—", "—"]
            rows.append(f"| {model} | {batch} | {b:.0f} | " + " | ".join(cells) + " |")
        return "\n".join(rows) + "\n"
    rows = ["| model | sequences | BF16-LoRA tok/s | NVFP4, CUDA GEMM on | × BF16-LoRA | NVFP4, GEMM off (before) | "
            "× BF16-LoRA |", "|---|---:|---:|---:|---:|---:|---:|"]
    for (model, batch), g in off.groupby(["model", "batch_size"], sort=True):
        base = g[g.weights == "BF16"].tokens_per_s
        q_off = g[g.weights == "NVFP4"].tokens_per_s
        q_on = on[(on.model == model) & (on.batch_size == batch) & (on.weights == "NVFP4")].tokens_per_s
        if base.empty or q_off.empty or q_on.empty:
            continue
        b, a, o = float(base.iloc[0]), float(q_on.iloc[0]), float(q_off.iloc[0])
        rows.append(f"| {model} | {batch} | {b:.0f} | {a:.0f} | {a / b:.2f} | {o:.0f} | {o / b:.2f} |")
    return "\n".join(rows) + "\n"


#: update.csv's kernel categories in the order the table shows them (others are summed into "other")
UPDATE_COLUMNS = ("cublas_gemm", "elementwise", "norm", "activation", "rope", "dequantize", "attention")


def update_table(root: Path) -> str:
    """Where a GRPO micro-batch's GPU time goes (``qerl.bench update``): per raw run, device and variant (fused
    training kernels, CUDA dequantization), each format's log-prob pass and forward + backward, NVFP4/MXFP4 against
    BF16-LoRA of the same run and variant, and the profiled kernel time by category."""
    d = _read(root, "update.csv")
    if d is None or not len(d):
        return "_no update.csv (python -m qerl.bench update)_\n"
    d = d[d["kernel"].isna() | (d["kernel"].astype(str) == "")]
    for c in ("fused_train", "cuda_dequant"):
        d[c] = d[c].astype(str).str.lower() == "true" if c in d else False
    d["run"] = d["run"] if "run" in d else ""
    keys = ["run", "device", "model", "micro_batch", "prompt_len", "new_tokens", "gc", "fused_train"]
    lines = ["| run | device | fused training kernels | dequantize | weights | tokens | log-prob pass ms | fwd + bwd ms | "
             "vs BF16 | " + " | ".join(UPDATE_COLUMNS) + " | other |", "|---" * (10 + len(UPDATE_COLUMNS)) + "|"]
    for key, g in d.groupby(keys, sort=False, dropna=False):
        cats = g.pivot_table(index="weights", columns="category", values="kernel_ms", aggfunc="sum")
        first = g.drop_duplicates("weights").set_index("weights")
        ref = first.loc["BF16"] if "BF16" in first.index else None
        for w, r in first.iterrows():
            ratio = "—" if ref is None or w == "BF16" else f"{float(r['update_ms']) / float(ref['update_ms']):.3f}×"
            row = cats.loc[w] if w in cats.index else pd.Series(dtype=float)
            shown = [row.get(c, float("nan")) for c in UPDATE_COLUMNS]
            other = float(row.drop([c for c in UPDATE_COLUMNS if c in row.index]).sum())
            dq = ("CUDA" if r["cuda_dequant"] else "Triton") if w in _FP4_LABELS else "—"
            lines.append(f"| {key[0]} | {key[1]} | {'yes' if key[7] else 'no'} | {dq} | {w} | {int(r['tokens'])} | "
                         f"{_fmt(r['logprob_ms'], 0)} | {_fmt(r['update_ms'], 0)} | {ratio} | "
                         + " | ".join(_fmt(x, 0) if x == x else "—" for x in shown) + f" | {_fmt(other, 0)} |")
    return "\n".join(lines) + "\n"


def dequant_table(root: Path) -> str:
    """The dense BF16 weight rebuilt from the kernel layout (``benchmarks.dequant_bench``): Triton vs CUDA per linear."""
    d = _read(root, "dequant.csv")
    if d is None or not len(d):
        return "_no dequant.csv (python -m benchmarks.dequant_bench)_\n"
    lines = ["| device | model | format | linear | N × K | Triton µs (TB/s) | CUDA µs (TB/s) | CUDA vs Triton | same bits |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, g in d.groupby(["device", "model", "fmt", "linear", "n", "k"], sort=False):
        b = g.set_index("backend")
        if not {"triton", "cuda"} <= set(b.index):
            continue
        t, c = b.loc["triton"], b.loc["cuda"]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} × {key[5]} | {_fmt(t['us'])} "
                     f"({_fmt(t['tb_s'], 2)}) | {_fmt(c['us'])} ({_fmt(c['tb_s'], 2)}) | {float(t['us']) / float(c['us']):.2f}× | "
                     f"{'yes' if str(c['bits_equal']).lower() == 'true' else 'NO'} |")
    return "\n".join(lines) + "\n"


def slices_ab_table(root: Path, run: str) -> str:
    """The large-M path with the device's slice table and without (``QERL_DEQUANT_SLICES`` = 1 / 0), from
    ``raw/<run>/layers_s<on>_<pass>/layers_*.csv`` (``benchmarks.kernel_bench``, one process each, in the order
    1, 0, 0, 1): per format, direction and M the FP4 layer µs of each pass, the gain, and each against BF16's µs of the
    same process."""
    runs = {}
    for p in sorted((root / "raw" / run).glob("layers_s*_*/layers_*.csv")):
        on, pas = p.parent.name.split("_")[1:]
        runs[(on[1:], pas)] = _layer_us(p)
    if not runs:
        return f"_no slice A/B in raw/{run}_\n"
    first = next(iter(runs.values()))
    lines = ["| FP4 | op | M | with the table µs (pass 1 / 2) | without µs (1 / 2) | gain (1 / 2) | "
             "vs BF16 with | vs BF16 without |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for fmt, op, m in first.index:
        if fmt == "bf16":
            continue
        on = [runs[("1", p)][(fmt, op, m)] for p in ("1", "2")]
        off = [runs[("0", p)][(fmt, op, m)] for p in ("1", "2")]
        bf_on = [runs[("1", p)][("bf16", op, m)] for p in ("1", "2")]
        bf_off = [runs[("0", p)][("bf16", op, m)] for p in ("1", "2")]
        gain = " / ".join(f"{(b / a - 1) * 100:+.1f}%" for a, b in zip(on, off, strict=True))
        vs = [" / ".join(f"{b / a:.2f}×" for a, b in zip(f, bf, strict=True)) for f, bf in ((on, bf_on), (off, bf_off))]
        lines.append(f"| {fmt.replace('-kernel', '')} | {op} | {m} | {on[0]:.0f} / {on[1]:.0f} | {off[0]:.0f} / "
                     f"{off[1]:.0f} | {gain} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines) + "\n"


def step_ab_table(root: Path, new: str, old: str, what: str) -> str:
    """Two raw step runs of the same configuration on one machine (``raw/<new>/step.csv`` against
    ``raw/<old>/step.csv``): each phase's seconds and the change, per format."""
    a, b = _read(root / "raw" / new, "step.csv"), _read(root / "raw" / old, "step.csv")
    if a is None or b is None:
        return "_not measured_\n"
    lines = [f"| weights | s/step ({what} / before) | rollout s | log-prob s | update s | peak GB |", "|---|---|---|---|---|---|"]
    for _, r in a.iterrows():
        o = b[b["weights"] == r["weights"]]
        if not len(o):
            continue
        o = o.iloc[0]
        cells = [f"{_fmt(r[c], 2)} / {_fmt(o[c], 2)} ({(float(r[c]) / float(o[c]) - 1) * 100:+.1f}%)"
                 for c in ("step_s", "rollout_s", "logprob_s", "update_s")]
        lines.append(f"| {r['weights']} | " + " | ".join(cells) + f" | {_fmt(r['peak_mem_gb'])} / {_fmt(o['peak_mem_gb'])} |")
    return "\n".join(lines) + "\n"


def _devices(root: Path) -> str:
    """The GPUs behind the top-level tables' rows, the most frequent first, each with its rows' count; empty when no
    row names one. Every row's run (its ``raw/`` folder) names its machine too."""
    counts: dict[str, int] = {}
    for name in ("rollout.csv", "step.csv", "memory.csv", "scaling.csv"):
        d = _read(root, name)
        if d is not None and "device" in d:
            for dev, n in d["device"].dropna().astype(str).value_counts().items():
                counts[dev] = counts.get(dev, 0) + int(n)
    if not counts:
        return ""
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{dev} ({n} row{'s' if n != 1 else ''})" for dev, n in ranked)
    return text + ("; a ratio never pairs rows of two GPU models" if len(ranked) > 1 else "")


def _floor(root: Path, gpu: str, table: str = "floor_table") -> str:
    """One of ``benchmarks.decode_floor``'s tables (``floor_table``, ``roofline_table``, ``layer_roofline_table``)
    for a GPU model, rendered here."""
    from benchmarks import decode_floor

    return getattr(decode_floor, table)(root, gpu)



def _raw_md(root: Path, run: str, name: str) -> str:
    """A raw run's markdown table file without its first heading line (its own title)."""
    p = root / "raw" / run / name
    return p.read_text().split("\n", 1)[1] if p.exists() else f"_no raw/{run}/{name}_\n"


def reuse_table(root: Path, *names: str) -> str:
    """``qerl.bench reuse`` runs (raw/<name>/reuse.csv): per pass, the rule (``QERL_SAMPLER_REUSE``), the seconds of
    all its rollouts, how often the sampler built new buffers (and captured its graphs anew), the padded prompt length
    of each step, and the seconds against the mean of the same run's default-rule passes after the first pass."""
    out = []
    for n in names:
        f = root / "raw" / n / "reuse.csv"
        if not f.exists():
            continue
        d = pd.read_csv(f)
        d = d[d["kind"] == "pass"].sort_values("pass")
        later = d[(d["reuse"] == 1) & (d["pass"] > d["pass"].min())]
        ref = float(later["wall_s"].mean()) if len(later) else float("nan")
        r0 = d.iloc[0]
        out.append(f"`raw/{n}`: {r0['model']} {r0['weights']}-LoRA, {int(r0['batch_size']) // int(r0['group_size'])} "
                   f"prompts x G {int(r0['group_size'])}, {int(r0['new_tokens'])} new tokens, {int(r0['steps'])} steps "
                   f"a pass, {r0.get('device', '')}\n")
        out.append("| pass | rule | s (all steps) | vs the default's later passes | builds | padded prompt lengths |")
        out.append("|---:|---|---:|---:|---:|---|")
        for _, r in d.iterrows():
            rule = "grow only (default)" if int(r["reuse"]) == 1 else "every new length (s57)"
            out.append(f"| {int(r['pass'])} | {rule} | {r['wall_s']:.2f} | {r['wall_s'] / ref:.3f}x | "
                       f"{int(r['builds'])} | {r['prompt_lens']} |")
        out.append("")
    return "\n".join(out) if out else "_not measured_\n"


def _raw_rollouts(root: Path, *names: str) -> str:
    """The rollout table of each of these raw runs (decode modes side by side), one after the other."""
    out = [rollout_table(root / "raw" / n, decode=None) for n in names if (root / "raw" / n).exists()]
    return "\n".join(out) if out else "_not measured_\n"


def _ident(df: pd.DataFrame, keys: list[str]) -> list[tuple]:
    """Row identities with numbers normalised (8, 8.0 and "8" are the same batch)."""
    def norm(v):
        try:
            f = float(v)
            return str(int(f)) if f == int(f) else str(f)
        except (TypeError, ValueError):
            return str(v)
    return [tuple(norm(v) for v in row) for row in df[keys].values.tolist()]
