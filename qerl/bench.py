"""Speed and memory benchmarks behind the paper's Tables 3, 5-9 and Figures 1/11 (GPU).

    python -m qerl.bench memory  --models 7b --formats bf16,nf4,mxfp4,nvfp4
    python -m qerl.bench rollout --models 7b,14b --formats bf16,nf4,nvfp4 --batch 2,8 --prompt 256 --new 2048 \
                                 --ranks 32 [--rank-sweep 16,32,64]
    python -m qerl.bench step    --models 7b --formats bf16,nf4,nvfp4 --batch 8 --gc both --steps 3
    python -m qerl.bench layers  ...   (per-layer kernels: benchmarks.kernel_bench)
    python -m qerl.bench scaling --models 7b --formats nvfp4,bf16 --nproc 1,2,4 --batch 128 --group 8 --new 1024 \
                                 --micro 8 --gc on --steps 3      (data-parallel GRPO steps under torchrun)
    python -m qerl.bench update  --models 7b --formats nvfp4,bf16 --micro 16 --prompt 64 --new 1024 --gc on
                                 (one micro-batch of the update: timed, then its kernels by category)
    python -m qerl.bench reuse   --models 7b --formats nvfp4 --batch 16 --group 8 --new 512 --steps 8 --passes 0,1,1,0
                                 (GSM8K prompts step after step: the sampler's buffers and graphs rebuilt whenever
                                 the prompt length changes, or only when it grows)

Models are the ``preset:qwen2.5-*`` shape presets (random weights, exact Qwen2.5-*-Instruct shapes): speed does
not depend on the values, and nothing is downloaded. Methods are named as in the paper: LoRA = BF16 base +
LoRA, QLoRA = NF4 (bitsandbytes) + LoRA, QeRL = NVFP4 + LoRA; MXFP4 + LoRA is reported too. ``--ranks 0`` (rollout,
profile) loads no adapters: rows "<format> base", the base alone, whose difference to a rank's rows is what the LoRA
term costs (not a method of the paper). Rollouts use qerl's
own sampler (static KV cache, CUDA graphs, unmerged LoRA) with ``ignore_eos`` so every sequence runs to
``--new`` tokens, like the paper's vLLM measurement; throughput = generated tokens / wall time of the rollout.
Each result row records device, torch/triton versions and the wall time; CSVs go to ``results/speed/``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import io
import json
import os
import time
from pathlib import Path

import torch

from qerl.lora import LoraSpec, lora_inference_cache, resident_weight_bytes
from qerl.model import load_policy, resolve_layout
from qerl.quant import FORMATS, get_format
from qerl.quant.base import KERNEL_LAYOUT_FORMATS, LAYOUTS
from qerl.results import atomic_write_text, environment
from qerl.rollout import Sampler

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


def bench_memory(models, formats, device, sink=None) -> list[dict]:
    """Resident weight memory of each format (Table 3's 'model size'), after loading and again after a short
    decode: ``decode_copy_gb`` is what the decode kernels added (their re-laid-out copy of a compressed-tensors
    base; none in ``quant.layout=kernel``)."""
    from qerl.kernels import prepared_bytes

    rows = []
    for m in models:
        for f in formats:
            _free()
            policy, tok = _policy(m, f, 32, device)
            b = resident_weight_bytes(policy)
            alloc = torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else None
            before = prepared_bytes()
            Sampler(policy, tok, max_prompt_tokens=16, cuda_graphs=False).generate(["1 + 1 ="], 1, max_new_tokens=2)
            copy = prepared_bytes() - before
            rows.append(dict(bench="memory", model=PAPER_NAME.get(m, m), method=method_name(f), weights=get_format(f).label,
                             quantized_linears_gb=b["quantized_base"] / 1e9, other_frozen_gb=b["other_frozen"] / 1e9,
                             lora_gb=b["trainable"] / 1e9, model_size_gb=(b["quantized_base"] + b["other_frozen"]) / 1e9,
                             decode_copy_gb=copy / 1e9, resident_after_decode_gb=(b["quantized_base"] + copy) / 1e9,
                             cuda_allocated_gb=alloc, **_env()))
            print(rows[-1])
            if sink:
                sink(rows[-1])
            del policy
    return rows


DECODES = ("fused", "fused-split-lora", "fused-torch-sample", "fused-split-silu", "fused-heuristic-gemv",
           "fused-triton-attn", "fused-cublas-bf16", "fused-bf16-pdl", "fused-bf16-no-pdl", "fused-lora-a-64",
           "fused-gemm-lora", "fused-gemm-lora-a-64", "fused-gemm-lora-pdl", "fused-cublas-lora", "fused-lora-a-256",
           "fused-wgmma-lora-pdl", "fused-wgmma-lora-pdl-a-256", "fused-s36", "fused-s37", "fused-s38",
           "fused-lora-a-pdl", "fused-vec-perm", "fused-s38-next", "fused-tma", "fused-no-tma", "fused-tail",
           "fused-no-tail", "fused-bf16-sector",
           "fused-bf16-pair", "fused-pdl", "fused-no-pdl", "fused-torch-ends", "fused-rope-split", "fused-rope-in-split",
           "unfused")
# environment each decode mode sets while it runs (restored after): the fused step's switches
_DECODE_ENV = {"fused-split-lora": {"QERL_CUDA_LORA": "0", "QERL_LORA_ROWS": "0"}, "fused-torch-sample": {"QERL_FUSED_SAMPLE": "0"},
               "fused-split-silu": {"QERL_FUSED_SILU": "0"}, "fused-heuristic-gemv": {"QERL_GEMV_TABLE": "0"},
               "fused-triton-attn": {"QERL_ATTN": "triton"}, "fused-cublas-bf16": {"QERL_BF16_GEMV": "0"},
               "fused-bf16-pdl": {"QERL_BF16_GEMV": "pdl"}, "fused-bf16-no-pdl": {"QERL_BF16_GEMV": "1"},
               "fused-lora-a-64": {"QERL_LORA_A_MAX_M": "64", "QERL_GEMM_LORA": "0"},
               "fused-gemm-lora": {"QERL_GEMM_LORA": "1", "QERL_LORA_A_MAX_M": "16"},
               "fused-gemm-lora-a-64": {"QERL_GEMM_LORA": "1", "QERL_LORA_A_MAX_M": "64"},
               "fused-gemm-lora-pdl": {"QERL_GEMM_LORA": "pdl", "QERL_LORA_A_MAX_M": "64"},
               "fused-cublas-lora": {"QERL_GEMM_LORA": "0", "QERL_LORA_A_MAX_M": "16"},
               "fused-lora-a-256": {"QERL_LORA_A_MAX_M": "256", "QERL_WGMMA_LORA": "1"},
               "fused-wgmma-lora-pdl": {"QERL_WGMMA_LORA": "pdl", "QERL_LORA_A_MAX_M": "64"},
               "fused-s36": {"QERL_WGMMA_LORA": "1", "QERL_LORA_A_MAX_M": "64"},
               "fused-s37": {"QERL_FUSED_PERMUTE": "0"},
               "fused-lora-a-pdl": {"QERL_LORA_A_PDL": "1"},
               "fused-s38": {"QERL_LORA_A_PDL": "0"},
               "fused-vec-perm": {"QERL_PERMUTE_STORE": "vector"},
               "fused-s38-next": {"QERL_LORA_A_PDL": "1", "QERL_PERMUTE_STORE": "vector"},
               "fused-tma": {"QERL_WGMMA_TMA": "1"}, "fused-no-tma": {"QERL_WGMMA_TMA": "0"},
               "fused-tail": {"QERL_WGMMA_TAIL": "1"}, "fused-no-tail": {"QERL_WGMMA_TAIL": "0"},
               "fused-bf16-sector": {"QERL_BF16_LOADS": "sector"}, "fused-bf16-pair": {"QERL_BF16_LOADS": "pair"},
               "fused-wgmma-lora-pdl-a-256": {"QERL_WGMMA_LORA": "pdl", "QERL_LORA_A_MAX_M": "256"},
               "fused-pdl": {"QERL_PDL": "1"},
               "fused-no-pdl": {"QERL_PDL": "0"}, "fused-torch-ends": {"QERL_FUSED_STEP_ENDS": "0"},
               "fused-rope-split": {"QERL_FUSED_ROPE_ATTN": "0"}, "fused-rope-in-split": {"QERL_FUSED_ROPE_ATTN": "1"}}


def check_decodes(decodes) -> None:
    for d in decodes:
        if d not in DECODES:
            raise ValueError(f"unknown decode mode {d!r}; valid: {list(DECODES)}")


@contextlib.contextmanager
def decode_mode(sampler, dec: str):
    """Set the sampler's decode step for ``dec``: "fused" (``qerl.kernels.fused``; NVFP4/MXFP4 at decode size run
    base and LoRA in one CUDA launch; the token drawn by ``qerl.kernels.fused.sample_race``), "fused-split-lora"
    (LoRA as its own launches, ``QERL_CUDA_LORA=0``; for BF16 also x·Aᵀ as its own launch, ``QERL_LORA_ROWS=0``), "fused-torch-sample" (the token drawn by torch ops,
    ``QERL_FUSED_SAMPLE=0``), "fused-split-silu" (silu(gate) · up as its own launch after the gate|up GEMV,
    ``QERL_FUSED_SILU=0``), "fused-heuristic-gemv" (the FP4 GEMV's launch configurations by rule, not the device's
    tuned table, ``QERL_GEMV_TABLE=0``), "fused-triton-attn" (the Triton split kernel for decode attention, not
    ``qerl.kernels.cuda_attn``'s, ``QERL_ATTN=triton``), "fused-cublas-bf16" (BF16 weights by cuBLAS, not the CUDA
    GEMV, ``QERL_BF16_GEMV=0``), "fused-bf16-pdl" / "fused-bf16-no-pdl" (the BF16 GEMV always / never under PDL,
    ``QERL_BF16_GEMV=pdl|1``; "fused": under PDL at M <= 4), the LoRA term at 17-64 tokens: "fused-cublas-lora"
    (x·Aᵀ by cuBLAS, an addmm after the GEMM: ``QERL_GEMM_LORA=0 QERL_LORA_A_MAX_M=16``, session 35's default),
    "fused-lora-a-64" (x·Aᵀ by the Triton kernel, the addmm), "fused-gemm-lora" (x·Aᵀ by cuBLAS, the term in the
    mma.sync GEMM's epilogue), "fused-gemm-lora-a-64" (both, ``QERL_GEMM_LORA=1``: 84d081f's default),
    "fused-gemm-lora-pdl" (both, the GEMM under PDL overlapping the x·Aᵀ kernel: the default's settings spelled
    out), at 64-256 tokens "fused-s36" (x·Aᵀ by the Triton kernel up to 64 tokens, the wgmma GEMM's epilogue without
    PDL: ``QERL_WGMMA_LORA=1 QERL_LORA_A_MAX_M=64``, session 36's default; for BF16, x·Aᵀ by cuBLAS above 64 tokens),
    "fused-lora-a-256" (the same with x·Aᵀ by the Triton kernel up to 256 tokens), "fused-wgmma-lora-pdl" (the wgmma
    GEMM under PDL overlapping the x·Aᵀ kernel up to 64 tokens: ``QERL_WGMMA_LORA=pdl``, a build of its own),
    "fused-wgmma-lora-pdl-a-256" (both: the default's settings spelled out), "fused-s37" (the wgmma GEMM's tokens
    permuted by a launch of their own, not written so by the norm / SwiGLU launch before it: ``QERL_FUSED_PERMUTE=0``,
    session 37's default), "fused-lora-a-pdl" (x·Aᵀ before a GEMM under PDL launched under PDL itself:
    ``QERL_LORA_A_PDL=1``, the default spelled out), "fused-s38" (x·Aᵀ launched plainly: ``QERL_LORA_A_PDL=0``,
    session 38's default), "fused-vec-perm" (the producers' permuted copy permuted in registers and stored
    contiguously: ``QERL_PERMUTE_STORE=vector``), "fused-s38-next" (both of the last two), "fused-tma" (the wgmma
    grid variants' chunks staged by tensor copies on mbarriers: ``QERL_WGMMA_TMA=1``, the default spelled out),
    "fused-no-tma" (by cp.async: ``QERL_WGMMA_TMA=0``, session 40's kernel, a build of its own), "fused-tail" (the
    wgmma grid launches' last partial wave split along K: ``QERL_WGMMA_TAIL=1``, the default spelled out;
    ``cuda_fp4.wgmma_tail_pick``), "fused-no-tail" (no split: ``QERL_WGMMA_TAIL=0``, session 49's kernel, a build of
    its own), "fused-bf16-sector" (the BF16 GEMV's load instructions each covering whole 32-byte sectors:
    ``QERL_BF16_LOADS=sector``, the default spelled out), "fused-bf16-pair" (each covering every other 16 bytes:
    ``QERL_BF16_LOADS=pair``, session 34's loads, a build of its own) — all but "fused" for same-run comparisons —,
    "fused-pdl" / "fused-no-pdl" (programmatic dependent launch across the step on / off, ``QERL_PDL``; "fused" = the
    default, on where the GPU has it), "fused-torch-ends" (the step's opening and close as session 57's ~30 torch
    launches instead of one launch each: ``QERL_FUSED_STEP_ENDS=0``), "fused-rope-split" (bias + RoPE + cache write a
    launch of their own before the Triton attention split kernel: ``QERL_FUSED_ROPE_ATTN=0``, the default spelled
    out), "fused-rope-in-split" (them inside that kernel, session 59's opt-in: ``QERL_FUSED_ROPE_ATTN=1``) or
    "unfused"."""
    check_decodes([dec])
    sampler.fused = dec != "unfused"
    with _environ(_DECODE_ENV.get(dec, {})):
        yield


@contextlib.contextmanager
def _environ(env: dict):
    """``env`` set in os.environ while the block runs, the previous values (or their absence) restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_rollout(models, formats, batches, ranks, prompt_len, new_tokens, device, repeats: int = 1,
                  sink=None, decodes=("fused",)) -> list[dict]:
    """Rollout throughput (Tables 5-9): B sequences x `new_tokens` tokens after a `prompt_len`-token prompt.
    ``decodes``: the sampler's decode step (:func:`decode_mode`), same policy; a step named again (``a,b,a,b``: an A/B
    alternating in one process) is run again, and its row records ``pass`` = 2, 3, ... (the first pass none), so the
    CSV keeps every pass."""
    check_decodes(decodes)
    rows = []
    for m in models:
        for f in formats:
            for r in ranks:
                _free()
                try:
                    policy, tok = _policy(m, f, r, device)
                except torch.OutOfMemoryError as e:
                    rows.append(dict(bench="rollout", model=PAPER_NAME.get(m, m), method=_method(f, r), weights=get_format(f).label,
                                     lora_rank=r, status=f"OOM at load: {e}"[:200], **_env()))
                    if sink:
                        sink(rows[-1])
                    continue
                size = resident_weight_bytes(policy)
                sampler = Sampler(policy, tok, max_prompt_tokens=prompt_len, cuda_graphs="auto")
                seen: dict[tuple[int, str], int] = {}
                for b, dec in [(b, d) for b in batches for d in decodes]:
                    seen[b, dec] = n_pass = seen.get((b, dec), 0) + 1
                    g = torch.Generator().manual_seed(b)
                    vocab = min(policy.config.vocab_size, 150_000)
                    prompts = [torch.randint(vocab // 10, vocab, (prompt_len,), generator=g).tolist() for _ in range(b)]
                    with decode_mode(sampler, dec):
                        try:
                            t0 = time.perf_counter()
                            n_graphs = sampler.precapture(b, prompt_len, 1, new_tokens, ignore_eos=True)
                            capture_s = time.perf_counter() - t0
                            best = None
                            for rep in range(repeats):
                                ro = sampler.generate(prompts, 1, new_tokens, 1.0, seed=rep, ignore_eos=True)
                                st = ro.stats
                                tps = st["generated_tokens"] / st["rollout_s"]
                                if best is None or tps > best[0]:
                                    best = (tps, st)
                            tps, st = best
                            rows.append(dict(
                                bench="rollout", model=PAPER_NAME.get(m, m), method=_method(f, r), weights=get_format(f).label, lora_rank=r,
                                batch_size=b, decode=dec if st.get("fused_decode") else "unfused", prompt_len=prompt_len, new_tokens=new_tokens, tokens_per_s=tps,
                                decode_tokens_per_s=b * (st["decode_steps"] - 1) / max(st["decode_s"], 1e-9),
                                prefill_s=st["prefill_s"], rollout_s=st["rollout_s"], generated_tokens=st["generated_tokens"],
                                cuda_graphs=sampler.use_graphs, graphs=n_graphs, capture_s=capture_s,
                                model_size_gb=(size["quantized_base"] + size["other_frozen"]) / 1e9,
                                peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
                                status="ok", **_env()))
                        except torch.OutOfMemoryError as e:
                            rows.append(dict(bench="rollout", model=PAPER_NAME.get(m, m), method=_method(f, r), weights=get_format(f).label,
                                             lora_rank=r, batch_size=b, decode=dec, status=f"OOM: {e}"[:200], **_env()))
                    if n_pass > 1:
                        rows[-1]["pass"] = n_pass
                    print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in rows[-1].items()
                           if k in ("model", "method", "lora_rank", "batch_size", "decode", "pass", "tokens_per_s",
                                    "status", "capture_s", "peak_mem_gb")}, flush=True)
                    if sink:
                        sink(rows[-1])
                    sampler.release()
                    _free()
                del policy, sampler
    return rows


def bench_step(models, formats, batches, gcs, steps, prompt_len, new_tokens, device, out_root: Path,
               sink=None, group: int | None = None, micro: int | None = None) -> list[dict]:
    """End-to-end GRPO steps (rollout + log-probs + update) through qerl.train on a shape preset (Table 3).
    ``batch`` completions per step in groups of ``group`` (default: one group of ``batch``, as Table 3), ``micro``
    completions per forward/backward (default: the whole batch). The first step (CUDA-graph capture, autotuning)
    is left out of the means when there are more."""
    from qerl.config import load_config
    from qerl.results import read_jsonl
    from qerl.train import run

    rows = []
    for m in models:
        for f in formats:
            for b in batches:
                g_, mb = group or b, micro or b
                if b % g_:
                    raise ValueError(f"step: batch {b} is not a whole number of groups of {g_}")
                for use_gc in gcs:
                    _free()
                    name = f"{m}-{f}-b{b}" + (f"-g{g_}-mb{mb}" if (g_, mb) != (b, b) else "") + \
                        f"-{'gc' if use_gc else 'nogc'}"
                    over = ["model=tiny" if m == "tiny" else f"model=preset-{m}", f"quant={f}", "lora=r32", "algo=grpo", "algo.ppo_epochs=1", "algo.mask_truncated=false",
                            f"algo.group_size={g_}", f"train.batch_size={b}", f"train.micro_batch={mb}",
                            f"train.steps={steps}", "train.save_every=0", "train.progress=false",
                            f"train.gradient_checkpointing={str(use_gc).lower()}", "data=toy",
                            f"data.max_new_tokens={new_tokens}", f"data.max_prompt_tokens={prompt_len}",
                            "eval.sets=[]", "aqn=off", "scale=smoke", f"out_dir={out_root}", "experiment=step",
                            f"quant.layout={_layout_for(f)}", f"run_name={name}{_layout_tag(f)}"]
                    cfg = load_config(over)
                    status = "ok"
                    t0 = time.perf_counter()
                    try:
                        run(cfg)
                    except torch.OutOfMemoryError as e:
                        status = f"OOM: {str(e)[:160]}"
                    metrics = read_jsonl(cfg.run_dir / "metrics.jsonl")
                    keep = metrics[1:] if len(metrics) > 1 else metrics  # step 1 includes graph capture
                    def mean(k, keep=keep):
                        return sum(r.get(k, 0.0) for r in keep) / len(keep) if keep else None
                    rows.append(dict(bench="step", model=PAPER_NAME.get(m, m), method=method_name(f), weights=get_format(f).label,
                                     batch_size=b, group_size=g_, micro_batch=mb, gc=use_gc,
                                     prompt_len="toy task (~60 tokens)", new_tokens=new_tokens,
                                     steps=len(metrics), step_s=mean("time_step_s"), rollout_s=mean("time_rollout_s"),
                                     logprob_s=mean("time_logprob_s"), update_s=mean("time_update_s"),
                                     rollout_tokens_per_s=mean("rollout_tokens_per_s"),
                                     rollout_tokens=mean("rollout_tokens"),
                                     peak_mem_gb=max((r.get("peak_mem_gib", 0) for r in metrics), default=None),
                                     wall_s=time.perf_counter() - t0, status=status, **_env()))
                    print(rows[-1], flush=True)
                    if sink:
                        sink(rows[-1])
    return rows


def _layout_tag(fmt: str) -> str:
    return "-kl" if _layout_for(fmt) == "kernel" else ""


def scaling_overrides(model: str, fmt: str, world: int, batch: int, group: int, micro: int, use_gc: bool,
                      steps: int, prompt_len: int, new_tokens: int, device: str, out_root: Path) -> list[str]:
    """The ``qerl.train`` overrides of one scaling run: GRPO on the shape preset, ``batch`` completions per step in
    groups of ``group`` (whole groups per rank), ``micro`` completions per forward/backward, no evaluation."""
    gc_ = "gc" if use_gc else "nogc"
    return ["model=tiny" if model == "tiny" else f"model=preset-{model}", f"quant={fmt}", "lora=r32", "algo=grpo",
            "algo.ppo_epochs=1", "algo.minibatches=1", "algo.mask_truncated=false", f"algo.group_size={group}",
            f"train.batch_size={batch}", f"train.micro_batch={micro}", f"train.steps={steps}", "train.save_every=0",
            "train.progress=false", f"train.gradient_checkpointing={str(use_gc).lower()}", "data=toy",
            f"data.max_new_tokens={new_tokens}", f"data.max_prompt_tokens={prompt_len}", "eval.sets=[]", "aqn=off",
            "scale=smoke", f"device={device}", "dist.timeout_s=900", f"out_dir={out_root}", "experiment=scaling",
            f"quant.layout={_layout_for(fmt)}", f"run_name={model}-{fmt}-b{batch}-g{group}-w{world}-{gc_}{_layout_tag(fmt)}"]


def scaling_command(world: int, overrides: list[str]) -> list[str]:
    """``python -m qerl.train`` for one process, ``torchrun --standalone --nproc_per_node W`` for several."""
    import sys

    train = ["-m", "qerl.train", *overrides]
    if world == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), *train]


def scaling_measures(metrics: list[dict]) -> dict:
    """The measured columns of a scaling row from a run's metrics lines. The first step (CUDA-graph capture,
    autotuning) is left out when there are more; times are the slowest rank's, memory the largest rank's (qerl.train
    logs them so)."""
    keep = metrics[1:] if len(metrics) > 1 else metrics

    def mean(k):
        vals = [r[k] for r in keep if r.get(k) is not None]
        return sum(vals) / len(vals) if vals else None
    step_s, tokens = mean("time_step_s"), mean("rollout_tokens")
    return dict(steps=len(metrics), timed_steps=len(keep), step_s=step_s, rollout_s=mean("time_rollout_s"),
                reward_s=mean("time_reward_s"), logprob_s=mean("time_logprob_s"), update_s=mean("time_update_s"),
                comm_s=mean("time_comm_s"), rollout_tokens=tokens,
                tokens_per_s=(tokens / step_s) if tokens and step_s else None,
                rollout_tokens_per_s=mean("rollout_tokens_per_s"),
                peak_mem_gb=max((r.get("peak_mem_gib", 0) for r in metrics), default=None))


def bench_scaling(models, formats, nprocs, batch: int, group: int, micro: int, use_gc: bool, steps: int,
                  prompt_len: int, new_tokens: int, device: str, out_root: Path, sink=None) -> list[dict]:
    """Data-parallel GRPO steps on 1, 2, 4 ... ranks with the same global batch (issue 13): each configuration is
    a ``qerl.train`` job (``torchrun`` for several ranks) whose metrics give time per step split into rollout /
    reward / log-probs / update, the gradient all-reduce inside the update (``comm_s``), generated tokens per
    second of step, and peak memory per GPU. A world size that needs more GPUs than are visible, or that does not
    divide the step's groups, is recorded with its reason and skipped."""
    import os
    import subprocess

    from qerl.results import read_jsonl

    rows = []
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    env = dict(os.environ)
    # NVLink multicast stays off (a program that uses it can take a shared host's GPUs down)
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for m in models:
        for f in formats:
            for w in nprocs:
                over = scaling_overrides(m, f, w, batch, group, micro, use_gc, steps, prompt_len, new_tokens, device,
                                         out_root)
                run_dir = out_root / "scaling" / over[-1].split("=", 1)[1]
                base = dict(bench="scaling", model=PAPER_NAME.get(m, m), method=method_name(f),
                            weights=get_format(f).label, world_size=w, global_batch=batch, group_size=group,
                            per_gpu_batch=batch // w, micro_batch=micro, gc=use_gc,
                            prompt_len="toy task (~60 tokens)", new_tokens=new_tokens, host_gpus=visible)
                why = None
                if device.startswith("cuda") and w > visible:
                    why = f"skipped: needs {w} GPUs, {visible} visible"
                elif (batch // group) % w or batch % group:
                    why = f"skipped: {batch // group} groups of {group} do not split over {w} ranks"
                if why:
                    rows.append(dict(base, status=why, **_env()))
                else:
                    if run_dir.exists():  # a fresh measurement, never a resumed one
                        import shutil

                        shutil.rmtree(run_dir)
                    run_dir.parent.mkdir(parents=True, exist_ok=True)
                    log = run_dir.parent / f"{run_dir.name}.log"
                    t0 = time.perf_counter()
                    with open(log, "w") as fh:
                        rc = subprocess.run(scaling_command(w, over), env=env, stdout=fh, stderr=subprocess.STDOUT
                                            ).returncode
                    wall = time.perf_counter() - t0
                    text = log.read_text(errors="replace")
                    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
                    if rc == 0 and metrics:
                        status = "ok"
                    elif "OutOfMemoryError" in text or "out of memory" in text:
                        status = "OOM"
                    else:
                        last = [ln for ln in text.splitlines() if ln.strip()][-1:] or [""]
                        status = f"failed (exit {rc}): {last[0][:160]}"
                    rows.append(dict(base, **(scaling_measures(metrics) if metrics else {}), status=status,
                                     wall_s=wall, **_env()))
                print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()
                       if k in ("model", "weights", "world_size", "step_s", "rollout_s", "logprob_s", "update_s",
                                "comm_s", "tokens_per_s", "peak_mem_gb", "status")}, flush=True)
                if sink:
                    sink(rows[-1])
    return rows


def _kernel_times(prof, cuda: bool) -> dict[str, tuple[float, int]]:
    """{kernel name: (µs, launches)} of a torch.profiler run: device time of the kernels only on CUDA (launch calls
    and copies left out), CPU time of the ops elsewhere."""
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) if cuda else e.self_cpu_time_total
        if us > 0 and e.count > 0 and not e.key.startswith(("cudaLaunch", "cuLaunch", "Memcpy", "Memset")):
            out[e.key] = (us, e.count)
    return out


def bench_reuse(models, formats, steps: int, prompts_per_step: int, group: int, new_tokens: int, device: str,
                passes=("0", "1", "1", "0"), sink=None, max_prompt_tokens: int = 256) -> list[dict]:
    """Prompt lengths as a GRPO run meets them: ``steps`` rollouts of ``prompts_per_step`` GSM8K train prompts (Table 1's
    template, data.max_prompt_tokens 256, a seeded draw per step, the same draws in every pass) x ``group``
    completions of ``new_tokens`` tokens (ignore_eos, so every pass decodes the same number of steps), by a fresh
    sampler per pass. ``passes``: ``QERL_SAMPLER_REUSE`` of each pass — 0, session 57's rule (new cache and graphs
    whenever the padded prompt length changes), 1, the default (only when it grows). One row per step (wall
    seconds, padded prompt length, whether the buffers were built, graphs held) and one per pass (totals)."""
    import random as _random

    from qerl.data import load_gsm8k, render_prompt
    from qerl.rollout import state_reuse

    for v in passes:
        if v not in ("0", "1"):
            raise ValueError(f"reuse pass {v!r}: valid QERL_SAMPLER_REUSE values are ['0', '1']")
    problems = load_gsm8k("train", "local")
    rng = _random.Random(0)
    draws = [rng.sample(range(len(problems)), prompts_per_step) for _ in range(steps)]
    rows = []
    for m in models:
        for f in formats:
            _free()
            policy, tok = _policy(m, f, 32, device)
            texts = [[render_prompt(tok, problems[i].prompt, "think_answer_suffix") for i in d] for d in draws]
            for n_pass, v in enumerate(passes, 1):
                with _environ({"QERL_SAMPLER_REUSE": v}):
                    assert state_reuse() == (v == "1")
                    sampler = Sampler(policy, tok, max_prompt_tokens=max_prompt_tokens, cuda_graphs="auto")
                    total, built, per = 0.0, 0, []
                    for step, prompts in enumerate(texts):
                        if device.startswith("cuda"):
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        ro = sampler.generate(prompts, group, new_tokens, 1.0, seed=step, ignore_eos=True)
                        if device.startswith("cuda"):
                            torch.cuda.synchronize()
                        wall = time.perf_counter() - t0
                        total += wall
                        built += bool(ro.stats.get("state_built"))
                        per.append(dict(step=step, prompt_len=int(ro.prompt_ids.shape[1]), wall_s=wall,
                                        state_built=bool(ro.stats.get("state_built")), graphs=ro.stats.get("graphs"),
                                        rollout_s=ro.stats["rollout_s"]))
                    base = dict(bench="reuse", model=PAPER_NAME.get(m, m), method=_method(f, 32),
                                weights=get_format(f).label, reuse=v, batch_size=prompts_per_step * group,
                                group_size=group, new_tokens=new_tokens, steps=steps, cuda_graphs=sampler.use_graphs,
                                **{"pass": n_pass})
                    for r in per:
                        rows.append(dict(base, kind="step", **r, status="ok", **_env()))
                    rows.append(dict(base, kind="pass", wall_s=total, builds=built,
                                     prompt_lens=" ".join(str(r["prompt_len"]) for r in per),
                                     graphs=per[-1]["graphs"], status="ok", **_env()))
                    print({k: (round(x, 2) if isinstance(x, float) else x) for k, x in rows[-1].items()
                           if k in ("model", "weights", "reuse", "pass", "wall_s", "builds", "prompt_lens", "graphs")},
                          flush=True)
                    if sink:
                        sink(rows[-len(per) - 1:])
                    sampler.release()
                    del sampler
                    _free()
            del policy
    return rows


def bench_profile(models, formats, batches, prompt_len, device, decodes=("fused", "unfused"), steps: int = 8,
                  kv: int = 1024, sink=None, ranks=(32,)) -> list[dict]:
    """Where a decode step's GPU time goes: the CUDA kernels of ``steps`` eager decode steps (torch.profiler,
    kernel durations only — launch gaps are what CUDA graphs remove), grouped by kernel, next to the
    graph-replayed step time at the same KV length ``kv``. One row per (model, format, LoRA rank, batch, decode,
    kernel); rank 0: no adapters (the base alone: with a rank's rows, what the LoRA term costs the step)."""
    from torch.profiler import ProfilerActivity, profile

    check_decodes(decodes)
    if steps + 24 > 64:  # 3 + 20 graph steps, then 1 + steps eager ones, within the 64 slots past kv
        raise ValueError(f"steps must be <= 40, got {steps}")
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for m, f, r in [(m, f, r) for m in models for f in formats for r in ranks]:
        _free()
        policy, tok = _policy(m, f, r, device)
        sampler = Sampler(policy, tok, max_prompt_tokens=prompt_len, cuda_graphs="auto")
        for b, dec in [(b, d) for b in batches for d in decodes]:
            with decode_mode(sampler, dec):
                new = kv - prompt_len + 64
                g = torch.Generator().manual_seed(b)
                prompts = [torch.randint(100, 700, (prompt_len,), generator=g).tolist() for _ in range(b)]
                sampler.generate(prompts, 1, new, ignore_eos=True)  # state, graphs, warm kernels
                s = sampler._static
                S = sampler._bucket(kv, prompt_len + new)
                t_kv = kv - prompt_len  # every phase starts at the token whose cache slot is kv
                s["t"].fill_(t_kv)
                for _ in range(3):  # graph replay time of one step at this KV length
                    sampler._run_step(s, S)
                s["t"].fill_(t_kv)
                sync()
                t0 = time.perf_counter()
                for _ in range(20):
                    sampler._run_step(s, S)
                sync()
                graph_us = (time.perf_counter() - t0) / 20 * 1e6
                s["t"].fill_(t_kv)
                with lora_inference_cache(policy, sampler._act_dtype()), torch.no_grad():
                    sampler._decode_step(s, S)  # warm (eager)
                    sync()
                    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                        for _ in range(steps):
                            sampler._decode_step(s, S)
                        sync()
                per = {k: (us / steps, n / steps) for k, (us, n) in _kernel_times(prof, cuda).items()}
                total = sum(v[0] for v in per.values())
                launches = sum(v[1] for v in per.values())
                ranked = sorted(per.items(), key=lambda kv_: -kv_[1][0])
                for k, (us, n) in ranked:
                    rows.append(dict(bench="profile", model=PAPER_NAME.get(m, m), weights=get_format(f).label, lora_rank=r,
                                     batch_size=b, decode=dec, kv=kv, graph_step_us=graph_us, kernels_us=total, launches=launches,
                                     kernel=k[:120], kernel_us=us, calls=n, **_env()))
                if sink:  # written before the print: a run cut off while printing keeps them
                    sink(rows[-len(per):])
                print(f"{m} {f} r{r} b{b} {dec}: graph step {graph_us:.0f} us, kernels {total:.0f} us in {launches:.0f} "
                      f"launches ({launches / max(policy.config.num_hidden_layers, 1):.1f}/layer)", flush=True)
                for k, (us, n) in ranked:
                    if us > 0.01 * total:
                        print(f"   {us:8.1f} us {n:6.1f}x  {k[:100]}")
                sampler.release()
        del policy, sampler
    return rows


#: Kernel-name fragments -> the phase table's categories (first match wins; lower-case names).
UPDATE_CATEGORIES = (("dequant", "dequantize"), ("_rms", "norm"), ("_silu", "activation"), ("_rope", "rope"), ("fp4", "fp4_gemm"), ("flash", "attention"), ("fmha", "attention"),
                     ("attn", "attention"), ("nvjet", "cublas_gemm"), ("gemm", "cublas_gemm"),
                     ("xmma", "cublas_gemm"), ("cutlass", "cublas_gemm"), ("softmax", "logprob"),
                     ("reduce", "reduce"), ("elementwise", "elementwise"), ("copy", "copy_cast"))


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel name in ``bench_update``'s table (``UPDATE_CATEGORIES``; else "other")."""
    low = name.lower()
    return next((c for frag, c in UPDATE_CATEGORIES if frag in low), "other")


def _update_passes(policy, ro, ac):
    """The log-prob pass (no grad) and one forward + backward of all of ``ro``'s rows, as closures."""
    from qerl.train import completion_logprobs

    rows = slice(0, ro.prompt_ids.shape[0])

    def logprob_pass():
        with torch.no_grad(), ac:
            completion_logprobs(policy, ro, rows, 1.0, False)

    def update_pass():
        with ac:
            lp, _ = completion_logprobs(policy, ro, rows, 1.0, False)
        lp.float().mean().backward()
        policy.zero_grad(set_to_none=True)

    return logprob_pass, update_pass


def bench_update(models, formats, micro: int, prompt_len: int, new_tokens: int, use_gc: bool, device: str,
                 repeats: int = 2, sink=None) -> list[dict]:
    """Where the GRPO update's GPU time goes: one micro-batch of ``micro`` completions (``prompt_len`` prompt +
    ``new_tokens`` completion tokens, random ids) through ``qerl.train.completion_logprobs`` — the log-prob pass
    (no grad) and the update's forward + backward (GC as ``use_gc``), each timed over ``repeats`` runs after a warm
    one, then one forward + backward under torch.profiler with its CUDA kernels grouped by ``kernel_category``.
    One row per (model, format, category) plus the ten longest kernels (``kernel`` set)."""
    from torch.profiler import ProfilerActivity, profile

    from qerl.devices import autocast_for
    from qerl.kernels.train_fused import fused_train_enabled
    from qerl.rollout import Rollout

    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for m in models:
        for f in formats:
            _free()
            policy, _tok = _policy(m, f, 32, device)
            if use_gc:
                policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            policy.train()
            g = torch.Generator().manual_seed(0)
            vocab = policy.config.vocab_size
            pi = torch.randint(100, vocab, (micro, prompt_len), generator=g).to(device)
            ci = torch.randint(100, vocab, (micro, new_tokens), generator=g).to(device)
            ones = lambda t: torch.ones_like(t, dtype=torch.bool)  # noqa: E731
            z = torch.zeros(micro, new_tokens, device=device)
            ro = Rollout(pi, ones(pi), ci, ones(ci), z, z, torch.zeros(micro, dtype=torch.bool, device=device),
                         [""] * micro, micro)
            logprob_pass, update_pass = _update_passes(policy, ro, autocast_for(policy, torch.device(device)))
            times = {}
            for name, fn in (("logprob", logprob_pass), ("update", update_pass)):
                fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                sync()
                times[name] = (time.perf_counter() - t0) / repeats
            with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                update_pass()
                sync()
            per = _kernel_times(prof, cuda)
            total = sum(v[0] for v in per.values())
            cats: dict[str, list[float]] = {}
            for k, (us, n) in per.items():
                c = cats.setdefault(kernel_category(k), [0.0, 0])
                c[0] += us
                c[1] += n
            base = dict(bench="update", model=PAPER_NAME.get(m, m), weights=get_format(f).label, micro_batch=micro,
                        fused_train=fused_train_enabled(), cuda_dequant=os.environ.get("QERL_CUDA_DEQUANT", "1") != "0",
                        prompt_len=prompt_len, new_tokens=new_tokens, gc=use_gc, tokens=micro * (prompt_len + new_tokens),
                        logprob_ms=times["logprob"] * 1e3, update_ms=times["update"] * 1e3, kernels_ms=total / 1e3,
                        **_env())
            print(f"{m} {f} micro {micro} x ({prompt_len} + {new_tokens}) gc={use_gc}: log-prob pass "
                  f"{times['logprob'] * 1e3:.1f} ms, forward + backward {times['update'] * 1e3:.1f} ms "
                  f"(profiled kernels {total / 1e3:.1f} ms)", flush=True)
            out = []
            for c, (us, n) in sorted(cats.items(), key=lambda kv: -kv[1][0]):
                out.append(dict(base, category=c, kernel="", kernel_ms=us / 1e3, calls=n))
                print(f"   {c:12s} {us / 1e3:9.2f} ms {n:6d} launches")
            for k, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:10]:
                out.append(dict(base, category=kernel_category(k), kernel=k[:120], kernel_ms=us / 1e3, calls=n))
                print(f"      {us / 1e3:9.2f} ms {n:6d}x  {k[:100]}")
            rows += out
            if sink:
                sink(out)
            del policy
    return rows


def _replace_arg(args: list[str], flag: str, value: str) -> list[str]:
    out, skip = [], False
    for x in args:
        if skip:
            skip = False
            continue
        if x == flag:
            skip = True
            continue
        if x.startswith(flag + "="):
            continue
        out.append(x)
    return out + [flag, value]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["memory", "rollout", "step", "layers", "profile", "scaling", "update", "reuse"])
    p.add_argument("--models", default="7b")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--batch", default="2,8")
    p.add_argument("--ranks", default="32", help="rollout, profile: LoRA ranks (comma-separated); 0 = no adapters, "
                                                 "the base alone (what the LoRA term costs)")
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new", type=int, default=2048)
    p.add_argument("--gc", default="both", choices=["on", "off", "both"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--passes", default="0,1,1,0", help="reuse: QERL_SAMPLER_REUSE of each pass (comma-separated)")
    p.add_argument("--nproc", default="1,2", help="scaling: world sizes (GPUs, or CPU ranks with --device cpu)")
    p.add_argument("--group", type=int, default=None,
                   help="scaling/step: completions per prompt (GRPO group size; scaling default 8, step: the batch)")
    p.add_argument("--micro", type=int, default=None,
                   help="scaling/step: completions per forward/backward (scaling default 8, step: the batch)")
    p.add_argument("--decode", default="fused", help="rollout, profile: fused, fused-split-lora, unfused (comma-separated; the sampler's decode step, see decode_mode)")
    p.add_argument("--layout", default="auto", choices=LAYOUTS,
                   help="memory, rollout, step, scaling, profile: hold NVFP4/MXFP4 bases in the compressed-tensors "
                        "layout (plus the CUDA kernels' copy), only in the kernels' layout, or auto (kernel where the "
                        "CUDA FP4 kernels run; quant.layout)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="results/speed")
    p.add_argument("--isolate", default="auto", choices=["auto", "yes", "no"],
                   help="one process per (model, format): a 32B BF16 policy after a 32B NVFP4 one in the same process "
                        "OOMed at load on 80 GB (memory the first left cached); auto = yes on CUDA")
    a, rest = p.parse_known_args(argv)
    global LAYOUT, DEVICE
    LAYOUT, DEVICE = a.layout, a.device
    if a.what == "layers":
        from benchmarks import kernel_bench as kb

        return kb.main(rest)
    models, fmts = a.models.split(","), a.formats.split(",")
    isolate = a.isolate == "yes" or (a.isolate == "auto" and torch.cuda.is_available())
    if isolate and a.what in ("rollout", "memory", "step", "profile", "update", "reuse") and len(models) * len(fmts) > 1:
        import subprocess
        import sys

        base = [x for x in (argv if argv is not None else sys.argv[1:])]
        for m in models:
            for f in fmts:
                args = _replace_arg(_replace_arg(base, "--models", m), "--formats", f) + ["--isolate", "no"]
                subprocess.run([sys.executable, "-m", "qerl.bench", *args], check=False)
        return
    batches, ranks = [int(x) for x in a.batch.split(",")], [int(x) for x in a.ranks.split(",")]
    out = Path(a.out)
    sink = lambda name: (lambda row: _write_csv([row], out / name))  # noqa: E731  (each row lands at once)
    if a.what == "memory":
        bench_memory(models, fmts, a.device, sink("memory.csv"))
    elif a.what == "profile":
        bench_profile(models, fmts, batches, a.prompt, a.device, tuple(a.decode.split(",")),
                      sink=lambda rows: _write_csv(rows, out / "profile.csv"), ranks=tuple(ranks))
    elif a.what == "update":
        if a.gc == "both":
            p.error("update: choose --gc on or --gc off")
        bench_update(models, fmts, a.micro or 16, a.prompt, a.new, a.gc == "on", a.device, max(a.repeats, 1),
                     sink=lambda rows: _write_csv(rows, out / "update.csv", UPDATE_IDENT))
    elif a.what == "reuse":
        bench_reuse(models, fmts, a.steps, batches[0], a.group or 8, a.new, a.device, tuple(a.passes.split(",")),
                    sink=lambda rows: _write_csv(rows, out / "reuse.csv", REUSE_IDENT), max_prompt_tokens=a.prompt)
    elif a.what == "rollout":
        bench_rollout(models, fmts, batches, ranks, a.prompt, a.new, a.device, a.repeats, sink("rollout.csv"),
                      tuple(a.decode.split(",")))
    elif a.what == "scaling":
        if a.gc == "both":
            p.error("scaling: choose --gc on or --gc off")
        nprocs = [int(x) for x in a.nproc.split(",")]
        if len(batches) != 1 or any(n < 1 for n in nprocs):
            p.error(f"scaling: one --batch (the global batch) and world sizes >= 1; got --batch {a.batch} "
                    f"--nproc {a.nproc}")
        bench_scaling(models, fmts, nprocs, batches[0], a.group or 8, a.micro or 8, a.gc == "on", a.steps, a.prompt, a.new,
                      a.device, out / "runs", lambda row: _write_csv([row], out / "scaling.csv", SCALING_IDENT))
    else:
        gcs = {"on": [True], "off": [False], "both": [False, True]}[a.gc]
        bench_step(models, fmts, batches, gcs, a.steps, a.prompt, a.new, a.device, out / "runs", sink("step.csv"),
                   group=a.group, micro=a.micro)
    (out / "env.json").write_text(json.dumps(environment(), indent=1, default=str))


if __name__ == "__main__":
    main()
