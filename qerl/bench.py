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
import json
import os
import time
from pathlib import Path

import torch

from qerl import bench_common
from qerl.bench_common import (
    PAPER_NAME,
    REUSE_IDENT,
    SCALING_IDENT,
    UPDATE_IDENT,
    _env,
    _free,
    _kernel_times,
    _layout_for,
    _layout_tag,
    _method,
    _policy,
    _write_csv,
    method_name,
)
from qerl.bench_scaling import bench_scaling
from qerl.bench_update import bench_update
from qerl.lora import lora_inference_cache, resident_weight_bytes
from qerl.quant import FORMATS, get_format
from qerl.quant.base import LAYOUTS
from qerl.results import environment
from qerl.rollout import Sampler


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
    bench_common.LAYOUT, bench_common.DEVICE = a.layout, a.device  # read by _layout_for
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
