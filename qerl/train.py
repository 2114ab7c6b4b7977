"""The RL loop, top to bottom: ``python -m qerl.train quant=nvfp4 algo=dapo aqn=paper data=gsm8k scale=smoke``.

One step (house rule 1: no trainer class, no callbacks):

    σ      = aqn.sigma_at(step)                                 # stage 0 is noise-free (Alg. 1)
    with aqn.noise(policy, σ): rollout = sampler.generate(...)  # noise in the block RMSNorms, rollout only
    r      = Σ_k w_k · reward_k(completions, answers)           # (B·G,)
    keep   = groups with reward variance (DAPO dynamic sampling) # refill up to max_refills times
    A      = group_advantages(r)                                # (B·G,)
    π_old  = log-probs of the noiseless training policy         # also: training entropy, sampler mismatch
    for each update (ppo_epochs × minibatches):                 # 4 for Table 1 GRPO, 1 for Table 2 DAPO
        loss = policy_loss(logπ, π_old, A, mask, clip 0.2/0.28, agg)  → backward, clip, AdamW(-8bit), lr schedule
    log one metrics line; checkpoint every `save_every` steps

Every random draw of step s is seeded from (seed, s), so a run killed at any moment and resumed from its last
checkpoint recomputes exactly the lines it lost (RunWriter.resume keeps the lines up to the checkpoint, no more).

Under ``torchrun --nproc_per_node=W -m qerl.train ...`` each rank runs this loop on groups i ≡ rank (mod W) of
every step; gradients and metrics are summed over ranks (``qerl.dist``); seeds gain the rank, unless
``rollout.seed_scope=group`` makes them per group (then W does not change what is sampled).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from qerl import algos, aqn, data, dist, rewards
from qerl.config import TrainConfig, load_config
from qerl.devices import autocast_for, resolve_device
from qerl.errors import TrainingDiverged, UserError
from qerl.lora import lora_modules, trainable_parameters
from qerl.model import build_policy, save_adapter, save_full_model
from qerl.results import RunWriter
from qerl.rollout import Rollout, Sampler, seed_for


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, total_updates: int,
                    keep_32bit: list[torch.nn.Parameter] = ()):
    """AdamW (or bitsandbytes' 8-bit AdamW) and its warmup + decay schedule.

    ``keep_32bit``: parameters whose 8-bit AdamW state is kept in float32 instead — the trained embedding tables,
    as Hugging Face's Trainer does for ``adamw_bnb_8bit`` (the paper's optimizer): 8-bit moments of a large, sparsely
    updated embedding are unstable. Only full fine-tuning trains an embedding; LoRA runs are unaffected."""
    o = cfg.optim
    if o.name == "adamw8bit":
        import bitsandbytes as bnb

        keep = {id(p) for p in keep_32bit}

        class AdamW8bit(bnb.optim.AdamW8bit):  # per-parameter 32-bit state without bnb's process-global manager
            def get_config(self, gindex, pindex, group):
                config = super().get_config(gindex, pindex, group)
                if id(self.param_groups[gindex]["params"][pindex]) in keep:
                    config["optim_bits"] = 32
                return config

        opt = AdamW8bit(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    warm = int(round(o.warmup_ratio * total_updates))

    def factor(i: int) -> float:  # HF get_{cosine,linear,constant}_schedule_with_warmup
        if i < warm:
            return (i + 1) / (warm + 1)
        if o.schedule == "constant":
            return 1.0
        frac = (i - warm) / max(1, total_updates - warm)
        return max(0.0, 1.0 - frac) if o.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


# ------------------------------------------------------------------------------------------------- data
class PromptStream:
    """Prompts for step s: an epoch-wise seeded permutation of the training set (position = a pure function of s)."""

    def __init__(self, problems: list[data.Problem], batch: int, seed: int, render):
        if not problems:
            raise ValueError("the training set is empty")
        self.problems, self.batch, self.seed, self.render = problems, batch, seed, render

    def _perm(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(seed_for(self.seed, "epoch", epoch))
        return torch.randperm(len(self.problems), generator=g).tolist()

    def at(self, step: int) -> list[data.Problem]:
        n = len(self.problems)
        start = (step - 1) * self.batch
        out = []
        for i in range(start, start + self.batch):
            out.append(self.problems[self._perm(i // n)[i % n]])
        return out

    def extra(self, step: int, k: int, count: int) -> list[data.Problem]:
        """Refill prompts for DAPO dynamic sampling: a seeded random draw, independent of the main stream."""
        g = torch.Generator().manual_seed(seed_for(self.seed, "refill", step, k))
        return [self.problems[i] for i in torch.randint(len(self.problems), (count,), generator=g).tolist()]


# ------------------------------------------------------------------------------------------------- forward
def completion_logprobs(policy, ro: Rollout, rows: slice | torch.Tensor, temperature: float, with_entropy: bool,
                        chunk_tokens: int = 512) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Teacher-forced log π(o_t | q, o_<t) (and entropy) of completions ``rows`` under the training policy.

    Left-padded prompt + completion go through the HF forward (with gradient checkpointing if enabled); the
    vocabulary projection runs in chunks of ``chunk_tokens`` positions under activation checkpointing, so the
    (rows, T, V) logits never exist at once. Under FSDP (``dist.fsdp``) the same computation runs as the sharded
    root's registered forward method (``qerl.dist.shard_model``), so its parameters are gathered and its gradients
    reduce-scattered as in a root forward.
    """
    if dist.is_sharded(policy):
        return policy.qerl_completion_logprobs(ro, rows, temperature, with_entropy, chunk_tokens)
    return _completion_logprobs(policy, ro, rows, temperature, with_entropy, chunk_tokens)


def _completion_logprobs(policy, ro: Rollout, rows, temperature: float, with_entropy: bool, chunk_tokens: int):
    pi, pm = ro.prompt_ids[rows], ro.prompt_mask[rows]
    ci, cm = ro.completion_ids[rows], ro.completion_mask[rows]
    ids = torch.cat([pi, ci], 1)                                         # (n, Lp+Tc)
    att = torch.cat([pm, cm], 1)
    att[:, pi.shape[1]:] = True  # tokens after EOS are pad: attend anyway (their outputs are masked out)
    pos = (att.long().cumsum(1) - 1).clamp(min=0)
    Lp, Tc = pi.shape[1], ci.shape[1]
    hidden = policy.model(input_ids=ids, attention_mask=att.long(), position_ids=pos,
                          use_cache=False).last_hidden_state[:, Lp - 1:Lp + Tc - 1]  # (n, Tc, D) predicts ci
    head = policy.lm_head

    def piece(h, t):
        return algos.token_logprobs_and_entropy(head(h), t, temperature, with_entropy=with_entropy)

    lps, ents = [], []
    for t0 in range(0, Tc, chunk_tokens):
        h, t = hidden[:, t0:t0 + chunk_tokens], ci[:, t0:t0 + chunk_tokens]
        lp, ent = checkpoint(piece, h, t, use_reentrant=False) if torch.is_grad_enabled() else piece(h, t)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps, 1), (torch.cat(ents, 1) if with_entropy else None)


@contextlib.contextmanager
def adapters_disabled(policy):
    """The reference policy π_ref = the (quantized) base: LoRA switched off — free with LoRA (no second model)."""
    mods = [m for m in lora_modules(policy).values() if m.rank]
    saved = [m.scaling for m in mods]
    try:
        for m in mods:
            m.scaling = 0.0
        yield
    finally:
        for m, s in zip(mods, saved, strict=True):
            m.scaling = s


def rows_in_chunks(n: int, size: int):
    for i in range(0, n, size):
        yield slice(i, min(n, i + size))


# ------------------------------------------------------------------------------------------------- the loop
def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def run(cfg: TrainConfig, on_step=None) -> dict:
    """Train one run end to end (resuming if its directory holds a checkpoint); returns the summary.

    ``on_step(step, metrics)``, if given, is called after each logged step (an Optuna objective reports
    intermediate values there and may raise ``optuna.TrialPruned`` to stop the run).
    Under torchrun (``WORLD_SIZE`` > 1) every rank runs this; rank 0 alone writes the run directory (see qerl.dist).
    """
    D, dev = dist.setup(cfg.device, cfg.dist.backend, cfg.dist.timeout_s, cfg.batch_prompts, cfg.algo.group_size,
                        cfg.train.batch_size)
    with dist.leaving():
        return _run(cfg, on_step, D, dev)


def _open_writer(cfg: TrainConfig, D: dist.Dist, devices: list[str]) -> tuple[RunWriter | None, dict | None]:
    """Rank 0's RunWriter (None elsewhere) and, when the run is already finished, its summary (on every rank)."""
    extra = {"distributed": {"world_size": D.world, "backend": D.backend, "devices": devices,
                             "sharding": "fsdp2" if cfg.dist.fsdp else "none"}}

    def open_main():
        w = RunWriter(cfg.run_dir, cfg.to_yaml(), cfg.train.keep_checkpoints, env_extra=extra)
        if w.is_finished():
            w.close()
            return w, w.read_summary()
        return w, None

    if not D.enabled:
        return open_main()
    box = {}

    def shared():
        box["w"], summary = open_main()
        return summary
    summary = D.on_main(shared)
    return box.get("w"), summary


def _run(cfg: TrainConfig, on_step, D: dist.Dist, device) -> dict:
    fsdp = cfg.dist.fsdp
    if fsdp and not D.enabled:
        raise UserError("dist.fsdp=true shards the training state over torchrun ranks; launch with "
                        "`torchrun --nproc_per_node=N -m qerl.train ...` (N >= 2) or set dist.fsdp=false")
    device = device or resolve_device(cfg.device)
    devices = D.all_gather_object(D.describe_device(device))
    writer, finished = _open_writer(cfg, D, devices)
    if finished is not None:
        if D.main:
            print(f"[qerl] {cfg.run_dir} already finished; skipping")
        return finished
    # The checkpoint to continue from (newest intact one whose steps metrics.jsonl covers; metrics cut back to it),
    # chosen before the model is built so that a run which cannot resume says so at once. Rank 0 chooses (and cuts
    # the metrics back); every rank loads the same checkpoint.
    if D.enabled:
        start, ck = D.on_main(lambda: _resume_point(writer))
        state = load_checkpoint_state(ck, device) if ck is not None else None
    else:
        start, state = writer.resume(map_location=device)
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    policy, tok = build_policy(cfg, device)
    if cfg.train.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = list(trainable_parameters(policy).values())
    D.broadcast_params(params)  # the seeded init is the same on every rank; this makes sure
    if fsdp:  # full fine-tuning, gradients and optimizer state sharded over the ranks (qerl.dist)
        dist.shard_model(policy, forward_methods={"qerl_completion_logprobs": _completion_logprobs})
        params = list(trainable_parameters(policy).values())
    trained_names = set(trainable_parameters(policy))
    n_updates = cfg.train.steps * cfg.algo.updates_per_rollout
    embeddings = [m.weight for m in policy.modules() if isinstance(m, torch.nn.Embedding) and m.weight.requires_grad]
    opt, sched = build_optimizer(params, cfg, n_updates, keep_32bit=embeddings)
    problems = data.load_dataset(cfg.data.train, "train", source=cfg.data.source, seed=cfg.seed,
                                 shuffle=cfg.data.train_size is not None, limit=cfg.data.train_size,
                                 **cfg.data.load_options())
    render = lambda p: data.render_prompt(tok, p.prompt, cfg.data.prompt)  # noqa: E731
    stream = PromptStream(problems, cfg.batch_prompts, cfg.seed, render)
    score = rewards.combined(cfg.data.rewards, cfg.data.reward_weights)
    if "accuracy" in cfg.data.rewards or cfg.eval.sets:
        rewards.get_pool().start(wait=True)  # math-verify workers up before step 1's timer starts
    # per_forward AQN redraws noise in forward pre-hooks, which a CUDA-graph replay would not run: decode eagerly.
    graphs = False if (cfg.aqn.enabled and cfg.aqn.draw == "per_forward") else cfg.rollout.cuda_graphs
    if fsdp:  # decode with the plain step: no CUDA graphs or packed q|k|v views over FSDP-managed parameters
        graphs = False
    sampler = Sampler(policy, tok, cfg.data.max_prompt_tokens, graphs, fused=False if fsdp else "auto")
    noise_targets = aqn.find_noise_targets(policy, cfg.aqn.include_final_norm) if cfg.aqn.enabled else None

    if state is not None and fsdp:
        if not state.get("fsdp"):
            raise UserError(f"{cfg.run_dir}: its checkpoint was written without dist.fsdp; resume it with the "
                            f"setting it was started with")
        dist.load_full_state(policy, state["trainable"], opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        del state
        if D.main:
            print(f"[qerl] resuming {cfg.run_dir} from step {start} on {D.world} ranks (FSDP)")
    elif state is not None:
        if state.get("fsdp"):
            raise UserError(f"{cfg.run_dir}: its checkpoint was written with dist.fsdp=true; resume it with "
                            f"dist.fsdp=true under torchrun")
        with torch.no_grad():
            named = trainable_parameters(policy)
            for k, v in state["trainable"].items():
                named[k].copy_(v)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        del state
        if D.main:
            print(f"[qerl] resuming {cfg.run_dir} from step {start}"
                  + (f" on {D.world} ranks" if D.enabled else ""))

    bar = _progress(cfg, start) if D.main else None
    streak = 0  # consecutive steps whose every update was skipped (non-finite gradient)
    for step in range(start + 1, cfg.train.steps + 1):
        record = [] if cfg.train.log_samples else None
        m = train_step(cfg, step, policy, tok, sampler, stream, score, noise_targets, opt, sched, params, device, D,
                       record)
        if record is not None:
            groups = sorted(sum(D.all_gather_object(record), []), key=lambda g: g["group"])
            if writer is not None:
                writer.log_samples(step, groups)
        if writer is not None:
            writer.log(step, **m)
        streak = streak + 1 if m.get("nonfinite_updates") and not m.get("updates") else 0
        if cfg.train.max_nonfinite_steps and streak >= cfg.train.max_nonfinite_steps:
            raise TrainingDiverged(
                f"{streak} steps in a row had only non-finite (NaN/inf) gradients (steps {step - streak + 1}-{step}); "
                f"their updates were skipped and the weights are those of step {step - streak}. Stopping "
                f"(train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}); metrics.jsonl holds every step so far")
        if on_step is not None:
            on_step(step, m)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(reward=f"{m['reward']:.3f}", tok_s=f"{m['rollout_tokens_per_s']:.0f}",
                            sigma=f"{m['sigma']:.1e}")
        if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.steps:
            if fsdp:  # a collective: every rank gathers, rank 0 receives the full tensors
                full, optim_state = dist.full_state(policy, opt)
                weights = {k: v for k, v in full.items() if k in trained_names}
            elif D.main:
                weights = {k: v.detach().cpu() for k, v in trainable_parameters(policy).items()}
                optim_state = opt.state_dict()
            if D.main:
                writer.save_checkpoint(step, {
                    "step": step, "trainable": weights, "optimizer": optim_state, "scheduler": sched.state_dict(),
                    "data_position": step * stream.batch, "rng": {"torch": torch.get_rng_state()},
                    "world_size": D.world, "fsdp": fsdp})
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
            from qerl.evaluate import evaluate_policy

            sampler.release()  # evaluation builds its own sampler (eval prompts may be longer than training's)
            with dist.unsharded(policy):
                ev = evaluate_policy(policy, tok, cfg)
            if writer is not None:
                writer.log_eval(step, ev)
    if bar is not None:
        bar.close()
    sampler.release()

    from qerl.evaluate import evaluate_policy

    with dist.unsharded(policy):
        ev = evaluate_policy(policy, tok, cfg)
    full = dist.full_state(policy)[0] if fsdp else None  # a collective (every rank); the tensors land on rank 0
    summary = None
    if D.main:
        if cfg.full_finetune:  # every weight was trained: keep them all, so `qerl.evaluate run_dir=...` reloads them
            save_full_model(policy, tok, cfg.run_dir / "checkpoints" / "final_model", state_dict=full)
        else:
            save_adapter(policy, cfg.run_dir / "checkpoints" / "final_adapter", cfg.model.source)
        summary = summarize(cfg, writer, ev, time.perf_counter() - t_start, device, D.world)
        _report_truncation(cfg, writer)
        summary = writer.write_summary(summary)
        writer.close()  # the run directory is free for the next writer (a crash frees it at exit)
    return D.broadcast_object(summary)  # every rank returns the summary; rank 0 has written it


def _resume_point(writer: RunWriter) -> tuple[int, str | None]:
    """(step, checkpoint path) to continue from, chosen (and metrics cut back) by rank 0; the state is not loaded
    here (each rank loads it onto its own device)."""
    start, _ = writer.resume(load=False)
    return start, (str(writer.resumed_from) if writer.resumed_from is not None else None)


def load_checkpoint_state(ck: str, device) -> dict:
    from qerl.results import load_checkpoint

    path = Path(ck)
    if not (path / "state.pt").exists():
        raise UserError(f"checkpoint {path} chosen by rank 0 is not visible on {platform.node()}; a multi-node run "
                        f"needs out_dir on a filesystem every node shares")
    return load_checkpoint(path, device)


def _report_truncation(cfg: TrainConfig, writer: RunWriter) -> None:
    """One line per run when training prompts were cut (the per-step count is the metric `prompts_truncated`)."""
    from qerl.results import read_jsonl

    cut = sum(r.get("prompts_truncated") or 0 for r in read_jsonl(writer.metrics_path))
    if cut:
        print(f"[qerl] {cut} training prompts were longer than data.max_prompt_tokens={cfg.data.max_prompt_tokens} "
              f"and kept only their last {cfg.data.max_prompt_tokens} tokens (metric prompts_truncated, per step)")


def train_step(cfg, step, policy, tok, sampler, stream, score, noise_targets, opt, sched, params, device,
               D: dist.Dist | None = None, record: list | None = None) -> dict:
    """One RL step (rollout, rewards, advantages, updates). Returns the metrics line (the same on every rank).
    ``record``, if a list, receives one dict per group this rank trained on (its position in the step's group
    order, problem id, completions, rewards, advantages): what ``train.log_samples`` writes.

    Under torchrun (``D.enabled``) this rank takes the groups i ≡ rank (mod W) of the step; its metrics are reduced
    from sums and counts over all ranks, and each update sums the ranks' gradients (see qerl.dist)."""
    D = D or dist.Dist()
    a, G = cfg.algo, cfg.algo.group_size
    per_group = cfg.rollout.seed_scope == "group"
    rk = (D.rank,) if D.enabled else ()               # seeds of per-rank streams: a function of (seed, step, rank)
    stream_rk = () if per_group else rk               # group scope: nothing sampled depends on the rank
    torch.manual_seed(seed_for(cfg.seed, "step", step, *rk))  # dropout and anything else global
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sigma = aqn.sigma_at(step, cfg.train.steps, cfg.aqn.sigma_start, cfg.aqn.sigma_end, cfg.aqn.stages,
                         cfg.aqn.schedule, cfg.aqn.mode) if cfg.aqn.enabled else 0.0

    def rollout(problems: list[data.Problem], k: int, gidx: list[int]
                ) -> tuple[Rollout, rewards.RewardOutput, torch.Tensor]:
        gen = torch.Generator(device=device).manual_seed(seed_for(cfg.seed, "aqn", step, k, *stream_rk))
        ctx = aqn.noise(noise_targets, sigma, generator=gen, mode=cfg.aqn.draw) if noise_targets and sigma > 0 \
            else contextlib.nullcontext()
        seed = [seed_for(cfg.seed, "sample", step, k, i) for i in gidx] if per_group \
            else seed_for(cfg.seed, "sample", step, k, *stream_rk)
        with ctx:
            ro = sampler.generate([stream.render(p) for p in problems], G, cfg.data.max_new_tokens,
                                  cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k,
                                  seed=seed, prompt_batch=cfg.rollout.prompt_batch)
        answers = [p.answer for p in problems for _ in range(G)]
        out = score(ro.texts, answers)
        return ro, out, torch.tensor(out.total, dtype=torch.float32, device=device)

    fsdp = dist.is_sharded(policy)
    # FSDP: the full weights stay gathered from the first rollout to the last no-grad log-prob pass (qerl.dist)
    gathered = contextlib.ExitStack()
    gathered.enter_context(dist.unsharded(policy))
    all_problems = stream.at(step)
    B = len(all_problems)
    mine = D.shard(B)                                   # this rank's global group indices (all of them on one)
    mine_t = torch.tensor(mine, dtype=torch.long, device=device)
    probs = [all_problems[i] for i in mine]  # the problems of this rank's groups, in the order of ``pos``
    ro, scored, r = rollout(probs, 0, mine)
    t_roll = time.perf_counter() - t0
    gen_tokens, roll_time = ro.stats["generated_tokens"], ro.stats["rollout_s"]
    # reward, reward_std, rewards/<fn>/mean|std, reward_errors (first sampling round, over every rank's groups)
    stats_all = (_gather_scores(D, scored, G) if D.enabled else scored).metrics()
    groups_total = B
    pos = mine_t   # (b,) each local group's position in the step's global group order (what minibatches slice)
    n_groups = B   # groups in that order, over all ranks
    if a.dynamic_sampling:
        keep = algos.dynamic_sampling_filter(r, G)
        keep_all = D.gather_keep(keep)                                 # (B,) every rank's verdicts, global order
        ros, rs = [ro.select_groups(keep)], [r.view(-1, G)[keep].reshape(-1)]
        probs = [p for p, k in zip(probs, keep.tolist(), strict=True) if k]
        poss = [(keep_all.long().cumsum(0) - 1)[mine_t][keep]]
        kept = int(keep_all.sum())
        for k in range(1, a.max_refills + 1):
            if kept >= B:
                break
            extra = stream.extra(step, k, B)  # the same draw on every rank; each samples its share of it
            ro2, _, r2 = rollout([extra[i] for i in mine], k, mine)
            gen_tokens += ro2.stats["generated_tokens"]
            roll_time += ro2.stats["rollout_s"]
            keep2_all = D.gather_keep(algos.dynamic_sampling_filter(r2, G))
            idx, _ = algos.select_groups(keep2_all, B - kept)       # the first groups that fill the batch, globally
            sel_all = torch.zeros_like(keep2_all)
            sel_all[idx] = True
            sel = sel_all[mine_t]
            ros.append(ro2.select_groups(sel))
            probs += [extra[i] for i, k in zip(mine, sel.tolist(), strict=True) if k]
            rs.append(r2.view(-1, G)[sel].reshape(-1))
            poss.append(kept + (sel_all.long().cumsum(0) - 1)[mine_t][sel])
            kept += int(sel_all.sum())
            groups_total += B
        ro = Rollout.cat(ros, sampler.pad_id)
        r = torch.cat(rs)
        pos = torch.cat(poss)
        n_groups = kept
        stats_all["groups_kept"] = kept
        stats_all["groups_sampled"] = groups_total
    n_rows = r.numel()
    t1 = time.perf_counter()
    metrics = dict(stats_all, sigma=sigma, lr=sched.get_last_lr()[0])
    mask = algos.truncation_mask(ro.completion_mask, ro.truncated, a.mask_truncated)   # (N, Tc)
    lengths = ro.completion_mask.sum(1).float()
    if D.enabled:
        metrics.update(_rollout_metrics(D, ro, lengths, gen_tokens, roll_time, t_roll))
        total_rows, total_tokens = D.all_sum([n_rows, mask.sum().item()])
    else:
        metrics.update(response_length=lengths.mean().item() if n_rows else 0.0,
                       response_length_max=lengths.max().item() if n_rows else 0.0,
                       truncated_frac=ro.truncated.float().mean().item() if n_rows else 0.0,
                       sampling_entropy=algos.entropy_mean(ro.entropy, ro.completion_mask).item() if n_rows else 0.0,
                       rollout_tokens=gen_tokens, rollout_tokens_per_s=gen_tokens / max(roll_time, 1e-9),
                       prompts_truncated=ro.stats.get("prompts_truncated", 0),
                       time_rollout_s=t_roll)
        total_rows, total_tokens = n_rows, mask.sum()
    adv = algos.group_advantages(r, G, a.adv_std_norm, a.adv_eps)                      # (N,)
    if record is not None:
        for j, (p, g) in enumerate(zip(probs, pos.tolist(), strict=True)):
            rows = slice(j * G, (j + 1) * G)
            record.append({"group": g, "id": p.id, "rewards": r[rows].tolist(), "advantages": adv[rows].tolist(),
                           "completions": ro.texts[rows], "truncated": ro.truncated[rows].tolist()})
    if total_rows == 0 or total_tokens == 0:  # nothing to learn from (every group uniform, or all truncated)
        gathered.close()
        metrics.update(skipped_update=1, time_step_s=_max(D, time.perf_counter() - t0),
                       peak_mem_gib=_max(D, peak_memory_gib(device)))
        return metrics
    micro = cfg.train.micro_batch
    temp = cfg.rollout.temperature
    ac = autocast_for(policy, device)

    policy.train()
    with torch.no_grad(), ac:  # π_old, training-policy entropy, reference log-probs
        olds, ents, refs = [], [], []
        for rows in rows_in_chunks(n_rows, micro):
            lp, ent = completion_logprobs(policy, ro, rows, temp, True)
            olds.append(lp)
            ents.append(ent)
            if a.kl_coef > 0:
                with adapters_disabled(policy):
                    refs.append(completion_logprobs(policy, ro, rows, temp, False)[0])
        # a rank may hold no rows of this step (dynamic sampling kept none of its groups)
    gathered.close()  # FSDP: back to shards before the update's forward/backward passes
    with torch.no_grad():
        old_logp = torch.cat(olds) if olds else torch.zeros_like(ro.logp)
        train_ent = torch.cat(ents) if ents else torch.zeros_like(ro.logp)
        ref_logp = torch.cat(refs) if refs else None
    if D.enabled:
        metrics.update(_policy_metrics(D, ro, old_logp, train_ent))
    else:
        metrics["entropy"] = algos.entropy_mean(train_ent, ro.completion_mask).item()
        metrics.update({f"mismatch/{k}": v.item() for k, v in
                        algos.mismatch_stats(ro.logp, old_logp, ro.completion_mask).items()})
    t2 = time.perf_counter()

    loss_stats = []  # (stats, n_tokens, loss weight) per micro-batch: merged by algos.merge_loss_stats
    grad_norms = []
    t_comm = 0.0     # seconds in the gradient all-reduce (part of the update time)
    nonfinite = 0    # updates skipped because the gradient norm was NaN or inf
    per_mb = max(1, n_groups // a.minibatches)
    for _ in range(a.ppo_epochs):
        for g0 in range(0, n_groups, per_mb):
            g1 = min(n_groups, g0 + per_mb)
            if D.enabled:  # this rank's groups of the global minibatch [g0, g1); token and row counts are global
                here = ((pos >= g0) & (pos < g1)).nonzero().squeeze(1)
                mb = algos.group_rows(here, G)
                tok_all, rows_all = D.all_sum([mask[mb].sum().item(), mb.numel()])
                mb_tokens = torch.tensor(int(tok_all), device=device).clamp(min=1)
                mb_rows = int(rows_all)
            else:
                mb = torch.arange(g0 * G, g1 * G, device=device)
                mb_tokens = mask[mb].sum().clamp(min=1)
                mb_rows = mb.numel()
            opt.zero_grad(set_to_none=True)
            n_micro = -(-mb.numel() // micro)
            # FSDP: every rank runs as many forward/backward passes as the busiest one (collectives in every pass)
            passes = int(D.all_max([n_micro])[0]) if fsdp else n_micro
            for j in range(passes):
                if j >= n_micro:
                    _idle_pass(policy, ac, device)
                    continue
                rows = mb[j * micro:(j + 1) * micro]
                with ac:
                    logp, _ = completion_logprobs(policy, ro, rows, temp, False)
                loss, st = algos.policy_loss(
                    logp, old_logp[rows], adv[rows], mask[rows], a.clip_low, a.clip_high, a.loss_agg,
                    ref_logp=None if ref_logp is None else ref_logp[rows], kl_coef=a.kl_coef,
                    behav_logp=ro.logp[rows] if a.tis_cap else None, tis_cap=a.tis_cap,
                    max_len=cfg.data.max_new_tokens)  # Dr. GRPO's constant normaliser, not this step's width
                # the micro-batch's share of the minibatch loss: tokens for the token mean, rows for the others
                n_tok = mask[rows].sum()
                weight = (n_tok / mb_tokens) if a.loss_agg == "token_mean" else rows.numel() / mb_rows
                (loss * weight).backward()
                loss_stats.append((st, n_tok, weight))
            if not fsdp:  # (FSDP reduce-scattered the sums during the backward passes)
                t_comm += D.all_reduce_grads(params)  # Σ over ranks of globally weighted losses: one-process gradient
            gn = torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
            gn = (gn.full_tensor() if hasattr(gn, "full_tensor") else gn).item()  # FSDP: the norm over all shards
            if math.isfinite(gn):
                grad_norms.append(gn)
                opt.step()
            else:  # a NaN/inf gradient would turn every weight it touches into NaN: skip this update (every rank
                nonfinite += 1  # sees the same all-reduced norm, so all skip it together)
                opt.zero_grad(set_to_none=True)
            sched.step()
    policy.eval()
    t3 = time.perf_counter()
    if D.enabled:
        loss_stats = _gather_loss_stats(D, loss_stats)
    metrics.update(algos.merge_loss_stats(loss_stats))
    t_reward, t_logprob, t_update, t_comm, t_step, mem = _max(D, t1 - t0 - t_roll, t2 - t1, t3 - t2, t_comm,
                                                             t3 - t0, peak_memory_gib(device))
    metrics.update(grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
                   updates=len(grad_norms), nonfinite_updates=nonfinite,
                   time_reward_s=t_reward, time_logprob_s=t_logprob, time_update_s=t_update,
                   time_comm_s=t_comm, time_step_s=t_step, peak_mem_gib=mem)
    return metrics


def _idle_pass(policy, ac, device) -> None:
    """A forward/backward pass that adds nothing to any gradient (loss 0 on one token): under FSDP a rank with fewer
    rows than the others runs it so that every rank takes part in the same all-gathers and reduce-scatters."""
    with ac:
        out = policy(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    (out.logits.float().sum() * 0.0).backward()


# ------------------------------------------------------------------------------------------------- rank reductions
def _max(D: dist.Dist, *values: float):
    """The slowest rank's time / the largest rank's memory (one value, or a tuple for several)."""
    out = D.all_max(list(values))
    return out[0] if len(values) == 1 else tuple(out)


def _gather_scores(D: dist.Dist, scored: rewards.RewardOutput, G: int) -> rewards.RewardOutput:
    """Every rank's scores in the step's global group order (so the logged means and stds are the one-process
    ones), counters summed."""
    stats: dict[str, float] = {}
    for part in D.all_gather_object(dict(scored.stats)):
        for k, v in part.items():
            stats[k] = stats.get(k, 0) + v
    return rewards.RewardOutput(D.gather_groups(scored.total, G),
                                {k: D.gather_groups(v, G) for k, v in scored.per_function.items()}, stats)


def _rollout_metrics(D: dist.Dist, ro: Rollout, lengths, gen_tokens, roll_time, t_roll) -> dict:
    """The rollout part of a metrics line from sums and counts over ranks (token means weight every token once)."""
    cm = ro.completion_mask
    n, len_sum, trunc, ent_sum, n_tok, tokens, cut = D.all_sum([
        lengths.numel(), lengths.sum().item(), ro.truncated.sum().item(),
        algos.masked_sum(ro.entropy.float(), cm).item(), cm.sum().item(), gen_tokens,
        ro.stats.get("prompts_truncated", 0)])
    len_max, roll_s, t_roll = D.all_max([lengths.max().item() if lengths.numel() else 0.0, roll_time, t_roll])
    return dict(response_length=len_sum / n if n else 0.0, response_length_max=len_max,
                truncated_frac=trunc / n if n else 0.0, sampling_entropy=ent_sum / max(n_tok, 1.0) if n else 0.0,
                rollout_tokens=int(tokens), rollout_tokens_per_s=tokens / max(roll_s, 1e-9),
                prompts_truncated=int(cut), time_rollout_s=t_roll)


def _policy_metrics(D: dist.Dist, ro: Rollout, old_logp, train_ent) -> dict:
    """Training-policy entropy and sampler/trainer mismatch as token means over every rank's tokens."""
    cm = ro.completion_mask
    sums, count, dmax = algos.mismatch_parts(ro.logp, old_logp, cm)
    names = list(sums)
    tot = D.all_sum([algos.masked_sum(train_ent.float(), cm).item(), count.item(), *(sums[k].item() for k in names)])
    n = max(tot[1], 1.0)
    out = {"entropy": tot[0] / n, "mismatch/abs_diff_max": D.all_max([dmax.item()])[0]}
    out.update({f"mismatch/{k}": v / n for k, v in zip(names, tot[2:], strict=True)})
    return out


def _gather_loss_stats(D: dist.Dist, parts: list) -> list:
    """Every rank's (stats, tokens, loss weight) per micro-batch, for ``algos.merge_loss_stats``."""
    mine = [({k: float(v) for k, v in st.items()}, float(n), float(w)) for st, n, w in parts]
    out = []
    for rank_parts in D.all_gather_object(mine):
        out += [({k: torch.tensor(v) for k, v in st.items()}, n, w) for st, n, w in rank_parts]
    return out


def summarize(cfg: TrainConfig, writer: RunWriter, ev: dict, wall_s: float, device, world_size: int = 1) -> dict:
    from qerl.model import source_provenance
    from qerl.results import read_jsonl

    rows = read_jsonl(writer.metrics_path)
    k = max(1, min(5, len(rows) // 4))
    first = [r["reward"] for r in rows[:k]]
    last = [r["reward"] for r in rows[-k:]]
    return {
        "finished": True, "steps": len(rows), "scale": cfg.scale, "experiment": cfg.experiment,
        "reward_first": sum(first) / len(first) if first else None,
        "reward_last": sum(last) / len(last) if last else None,
        "eval": ev, "wall_time_s": wall_s, "device": str(device), "world_size": world_size,
        "data": data.data_provenance(cfg.data.train, cfg.data.source, **cfg.data.load_options()),
        "model_source": source_provenance(cfg.model.source),  # what the base weights are (a GGUF's: dequantized)
    }


def _progress(cfg: TrainConfig, start: int):
    if not cfg.train.progress or not sys.stderr.isatty() and not os.environ.get("QERL_PROGRESS"):
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=start, desc=str(cfg.run_dir.name), dynamic_ncols=True)


def main(argv: list[str] | None = None) -> None:
    rank = dist.world_from_env()[0]
    try:
        cfg = load_config(sys.argv[1:] if argv is None else argv)
        summary = run(cfg)
    except UserError as e:  # a mistake the user must fix: one line, no traceback (once per job, from rank 0)
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        else:  # every rank finds a launch error at once; the first to exit makes torchrun stop the others, so the
            time.sleep(5)  # other ranks leave rank 0 time to say it (else, under load, the job can end silently)
        sys.exit(2)
    if rank == 0:
        print(f"[qerl] {cfg.run_dir}: reward {summary.get('reward_first')} -> {summary.get('reward_last')}; "
              f"eval {({k: v.get('pass@1') for k, v in (summary.get('eval') or {}).items()})}")


if __name__ == "__main__":
    main()
