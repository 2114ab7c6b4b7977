"""``python -m qerl.bench update``: where one GRPO micro-batch's update time goes (the log-prob pass and a forward +
backward, timed, then their CUDA kernels by category)."""

from __future__ import annotations

import os
import time

import torch

from qerl.bench_common import PAPER_NAME, _env, _free, _kernel_times, _policy
from qerl.quant import get_format

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
