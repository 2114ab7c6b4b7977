"""``python -m qerl.bench scaling``: data-parallel GRPO steps on 1, 2, 4 ... ranks with the same global batch (issue
13), each configuration one ``qerl.train`` job (``torchrun`` for several ranks), its metrics turned into a row."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from qerl.bench_common import PAPER_NAME, _env, _layout_for, _layout_tag, method_name
from qerl.quant import get_format


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
