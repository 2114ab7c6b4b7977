"""pass@1 evaluation: ``python -m qerl.evaluate [run_dir=PATH] [overrides ...]``.

The paper's protocol (QERL.md §5): temperature 0.6, top-p 0.95, up to 4096 new tokens, pass@1 = the accuracy of
one sample averaged over ``n_samples`` samples per problem ("evaluated multiple times"). Scoring is the
math-verify ``accuracy`` reward (answers in ``<answer>`` tags, ``\\boxed{}`` or ``#### N``).

* ``run_dir=results/<exp>/<run>``: evaluates a trained run (its config, its final LoRA adapter) and merges the
  results into its ``summary.json``;
* otherwise: evaluates the base model named by the overrides (``model=… quant=…``) with no adapter — the untrained
  rows of Tables 1 and 2 — in its own run directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

import torch

from qerl import data, dist, rewards
from qerl.config import TrainConfig, from_dict, load_config
from qerl.errors import UserError
from qerl.results import RunWriter, atomic_write_text
from qerl.results import load_config as read_run_config
from qerl.rollout import Sampler, seed_for


def evaluate_policy(policy, tok, cfg: TrainConfig, sampler: Sampler | None = None, sets=None,
                    out_dir: Path | None = None) -> dict:
    """pass@1 over ``cfg.eval.n_samples`` samples per problem on each eval set. Returns {set: stats}."""
    e = cfg.eval
    D = dist.current()  # under torchrun: batch j of a set runs on rank j % W (its seed is the batch's, not the rank's)
    sampler = sampler or Sampler(policy, tok, max(cfg.data.max_prompt_tokens, 1024), cfg.rollout.cuda_graphs)
    accuracy = rewards.get_reward("accuracy")
    out = {}
    for name in sets or e.sets:
        t0 = time.perf_counter()
        split, source = "test", "local" if name == "toy" else cfg.data.source  # recorded below as loaded here
        # the training set's own test split is drawn like the training set (e.g. the same toy levels)
        levels = {"levels": tuple(cfg.data.levels)} if name == cfg.data.train and cfg.data.levels else {}
        problems = data.load_dataset(name, split, source=source, limit=e.limit, seed=cfg.seed, **levels)
        correct, lengths, truncated, rows, cut = [], [], [], [], 0
        per_batch = []  # this rank's (correct, lengths, truncated, rows) per batch, gathered to every rank below
        for j, i in enumerate(range(0, len(problems), e.batch_prompts)):
            if j % D.world != D.rank:
                continue
            correct, lengths, truncated, rows = [], [], [], []
            per_batch.append((j, correct, lengths, truncated, rows))
            batch = problems[i:i + e.batch_prompts]
            ro = sampler.generate([data.render_prompt(tok, p.prompt, cfg.data.prompt) for p in batch], e.n_samples,
                                  e.max_new_tokens, e.temperature, e.top_p, 0, seed=seed_for(cfg.seed, "eval", name, i),
                                  prompt_batch=0)
            answers = [p.answer for p in batch for _ in range(e.n_samples)]
            cut += ro.stats.get("prompts_truncated", 0)
            sc = accuracy(ro.texts, answers)
            correct += sc
            lengths += ro.lengths.tolist()
            truncated += ro.truncated.tolist()
            for q, (text, s) in enumerate(zip(ro.texts, sc, strict=True)):
                rows.append({"id": batch[q // e.n_samples].id, "sample": q % e.n_samples, "correct": s,
                             "length": int(ro.lengths[q]), "completion": text[:2000]})
        sampler.release()
        correct, lengths, truncated, rows = [], [], [], []
        for _, c, ln, tr, rw in sorted(sum(D.all_gather_object(per_batch), []), key=lambda b: b[0]):
            correct += c  # the batches in order, from every rank
            lengths += ln
            truncated += tr
            rows += rw
        cut = int(sum(D.all_sum([cut])))
        if cut and D.main:  # once per set: the sampler keeps a long prompt's last tokens
            print(f"[qerl] eval {name}: {cut} of {len(problems)} prompts were longer than {sampler.max_prompt_tokens} "
                  f"tokens and kept only their last {sampler.max_prompt_tokens}")
        n = len(problems)
        per_run = torch.tensor(correct, dtype=torch.float64).view(n, e.n_samples).mean(0) if n else torch.zeros(1)
        out[name] = {
            "pass@1": float(sum(correct) / max(1, len(correct))),
            "pass@1_std_over_samples": float(per_run.std()) if e.n_samples > 1 else 0.0,
            "n_problems": n, "n_samples": e.n_samples, "temperature": e.temperature, "top_p": e.top_p,
            "max_new_tokens": e.max_new_tokens, "mean_length": float(sum(lengths) / max(1, len(lengths))),
            "truncated_frac": float(sum(truncated) / max(1, len(truncated))), "time_s": time.perf_counter() - t0,
            "data": data.data_provenance(name, source, split, **levels),
        }
        if out_dir is not None and D.main:
            atomic_write_text(Path(out_dir) / "eval" / f"{_file_name(name)}.jsonl",
                              "".join(json.dumps(r) + "\n" for r in rows))
    return out


def _file_name(set_name: str) -> str:
    """A file name for an eval set's per-sample records ('jsonl:/data/my set.jsonl' -> 'jsonl_data_my_set.jsonl')."""
    return re.sub(r"[^\w.-]+", "_", set_name).strip("_")


def run_base(cfg: TrainConfig) -> dict:
    """Evaluate the untrained (quantized) base model; one run directory with config, env and summary.
    Under torchrun the eval batches are shared by the ranks and rank 0 writes the directory."""
    from qerl.devices import resolve_device
    from qerl.model import build_policy, source_provenance

    D, device = dist.setup(cfg.device, cfg.dist.backend, cfg.dist.timeout_s)  # no training batch to split
    with dist.leaving():
        device = device or resolve_device(cfg.device)
        devices = D.all_gather_object(D.describe_device(device))
        box = {}

        def open_main():
            box["w"] = RunWriter(cfg.run_dir, cfg.to_yaml(), env_extra={"distributed": {
                "world_size": D.world, "backend": D.backend, "devices": devices}})
            return json.loads((cfg.run_dir / "summary.json").read_text()) if box["w"].is_finished() else None

        done = D.on_main(open_main)
        if done is not None:
            return done
        t0 = time.perf_counter()
        policy, tok = build_policy(cfg, device, base_only=True)
        ev = evaluate_policy(policy, tok, cfg, out_dir=cfg.run_dir)
        summary = None
        if D.main:
            summary = box["w"].write_summary({
                "finished": True, "trained": False, "steps": 0, "scale": cfg.scale, "experiment": cfg.experiment,
                "eval": ev, "wall_time_s": time.perf_counter() - t0, "device": str(device), "world_size": D.world,
                "model_source": source_provenance(cfg.model.source)})
        return D.broadcast_object(summary)


def _readable_file(path: Path, what: str, hint: str) -> None:
    if not path.is_file():
        raise UserError(f"{what} {path} not found: {hint}")
    if not os.access(path, os.R_OK):
        raise UserError(f"{what} {path} is not readable (permissions)")


def _trained_weights(run_dir: Path, cfg: TrainConfig) -> Path:
    """The run's final weights (LoRA adapter, or the whole model for full fine-tuning), checked before any model is
    built: the directory, the files, and that the safetensors header reads."""
    from safetensors import safe_open

    kind = "final_model" if cfg.full_finetune else "final_adapter"
    weights = run_dir / "checkpoints" / kind
    file = weights / ("model.safetensors" if cfg.full_finetune else "adapter_model.safetensors")
    hint = "the run has not finished (train it again to resume it)" + \
        (" or was trained before full fine-tuning runs saved their weights" if cfg.full_finetune else "")
    _readable_file(file, "trained weights", hint)
    try:
        with safe_open(str(file), framework="pt"):
            pass
    except Exception as e:  # a truncated or foreign file: say which
        raise UserError(f"trained weights {file} are not a readable safetensors file ({e})") from None
    return weights


def evaluate_run(run_dir: str | Path, overrides: list[str] = ()) -> dict:
    """Re-evaluate a trained run from its config and final weights (LoRA adapter, or the full model of a full
    fine-tuning run); merge into its summary. Everything the run needs is checked before a model is built."""
    import yaml

    from qerl.devices import resolve_device
    from qerl.model import build_policy, load_adapter

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    _readable_file(run_dir / "config.yaml", "run config", f"{run_dir} is not a qerl run directory")
    raw = read_run_config(run_dir)
    for o in overrides:  # eval.* overrides only, e.g. eval.n_samples=8
        key, sep, val = o.partition("=")
        if not key.startswith("eval.") or not sep:
            raise UserError(f"only eval.* overrides (eval.key=value) apply to an existing run, got {o!r}")
        raw["eval"][key[5:]] = yaml.safe_load(val)
    cfg = from_dict(raw)
    for s in cfg.eval.sets:  # a user eval file may have moved since training
        if data.dataset_name(s) == "jsonl":
            data.check_dataset(s, "test")
    weights = _trained_weights(run_dir, cfg)
    if cfg.full_finetune:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, source=str(weights)))
    D, device = dist.setup(cfg.device, cfg.dist.backend, cfg.dist.timeout_s)  # torchrun: eval batches shared out
    with dist.leaving():  # on success the ranks meet before returning: rank 0 has written the summary
        policy, tok = build_policy(cfg, device or resolve_device(cfg.device))
        if not cfg.full_finetune:
            load_adapter(policy, weights)
        ev = evaluate_policy(policy, tok, cfg, out_dir=run_dir)
        if D.main:
            RunWriter(run_dir).write_summary({"eval": ev})
        return ev


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dirs = [a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")]
    rest = [a for a in argv if not a.startswith("run_dir=")]
    try:
        if run_dirs:
            ev = evaluate_run(run_dirs[0], rest)
        else:
            cfg = load_config(rest + ([] if any(a.startswith("run_name=") for a in rest) else
                                      ["run_name=base-" + next((a.split("=", 1)[1] for a in rest
                                                                if a.startswith("quant=")), "bf16")]))
            ev = run_base(cfg)["eval"]
    except UserError as e:  # a mistake the user must fix: one line, no traceback (from rank 0 under torchrun)
        if dist.world_from_env()[0] == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if dist.world_from_env()[0] != 0:
        return
    for name, s in ev.items():
        print(f"{name}: pass@1 = {100 * s['pass@1']:.1f}% ({s['n_problems']} problems x {s['n_samples']} samples)")


if __name__ == "__main__":
    main()
