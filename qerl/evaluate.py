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

import json
import sys
import time
from pathlib import Path

import torch

from qerl import data, rewards
from qerl.config import TrainConfig, from_dict, load_config
from qerl.results import RunWriter, atomic_write_text
from qerl.results import load_config as read_run_config
from qerl.rollout import Sampler, seed_for


def evaluate_policy(policy, tok, cfg: TrainConfig, sampler: Sampler | None = None, sets=None,
                    out_dir: Path | None = None) -> dict:
    """pass@1 over ``cfg.eval.n_samples`` samples per problem on each eval set. Returns {set: stats}."""
    e = cfg.eval
    sampler = sampler or Sampler(policy, tok, max(cfg.data.max_prompt_tokens, 1024), cfg.rollout.cuda_graphs)
    accuracy = rewards.get_reward("accuracy")
    out = {}
    for name in sets or e.sets:
        t0 = time.perf_counter()
        split, source = "test", "local" if name == "toy" else cfg.data.source  # recorded below as loaded here
        problems = data.load_dataset(name, split, source=source, limit=e.limit, seed=cfg.seed)
        correct, lengths, truncated, rows = [], [], [], []
        for i in range(0, len(problems), e.batch_prompts):
            batch = problems[i:i + e.batch_prompts]
            ro = sampler.generate([data.render_prompt(tok, p.prompt, cfg.data.prompt) for p in batch], e.n_samples,
                                  e.max_new_tokens, e.temperature, e.top_p, 0, seed=seed_for(cfg.seed, "eval", name, i),
                                  prompt_batch=0)
            answers = [p.answer for p in batch for _ in range(e.n_samples)]
            sc = accuracy(ro.texts, answers)
            correct += sc
            lengths += ro.lengths.tolist()
            truncated += ro.truncated.tolist()
            for j, (text, s) in enumerate(zip(ro.texts, sc, strict=True)):
                rows.append({"id": batch[j // e.n_samples].id, "sample": j % e.n_samples, "correct": s,
                             "length": int(ro.lengths[j]), "completion": text[:2000]})
        sampler.release()
        n = len(problems)
        per_run = torch.tensor(correct, dtype=torch.float64).view(n, e.n_samples).mean(0) if n else torch.zeros(1)
        out[name] = {
            "pass@1": float(sum(correct) / max(1, len(correct))),
            "pass@1_std_over_samples": float(per_run.std()) if e.n_samples > 1 else 0.0,
            "n_problems": n, "n_samples": e.n_samples, "temperature": e.temperature, "top_p": e.top_p,
            "max_new_tokens": e.max_new_tokens, "mean_length": float(sum(lengths) / max(1, len(lengths))),
            "truncated_frac": float(sum(truncated) / max(1, len(truncated))), "time_s": time.perf_counter() - t0,
            "data": data.data_provenance(name, source, split),
        }
        if out_dir is not None:
            atomic_write_text(Path(out_dir) / "eval" / f"{name}.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return out


def run_base(cfg: TrainConfig) -> dict:
    """Evaluate the untrained (quantized) base model; one run directory with config, env and summary."""
    from qerl.train import build_policy, resolve_device

    writer = RunWriter(cfg.run_dir, cfg.to_yaml())
    if writer.is_finished():
        return json.loads((cfg.run_dir / "summary.json").read_text())
    device = resolve_device(cfg.device)
    t0 = time.perf_counter()
    policy, tok = build_policy(cfg, device, base_only=True)
    ev = evaluate_policy(policy, tok, cfg, out_dir=cfg.run_dir)
    return writer.write_summary({"finished": True, "trained": False, "steps": 0, "scale": cfg.scale,
                                 "experiment": cfg.experiment, "eval": ev, "wall_time_s": time.perf_counter() - t0,
                                 "device": str(device)})


def evaluate_run(run_dir: str | Path, overrides: list[str] = ()) -> dict:
    """Re-evaluate a trained run from its config and final adapter; merge into its summary."""
    from qerl.model import load_adapter
    from qerl.train import build_policy, resolve_device

    run_dir = Path(run_dir)
    raw = read_run_config(run_dir)
    for o in overrides:  # eval.* overrides only, e.g. eval.n_samples=8
        key, _, val = o.partition("=")
        if not key.startswith("eval."):
            raise ValueError(f"only eval.* overrides apply to an existing run, got {o!r}")
        import yaml

        raw["eval"][key[5:]] = yaml.safe_load(val)
    cfg = from_dict(raw)
    policy, tok = build_policy(cfg, resolve_device(cfg.device))
    adapter = run_dir / "checkpoints" / "final_adapter"
    if not adapter.exists():
        raise FileNotFoundError(f"{adapter} not found: the run has not finished (or was full fine-tuning)")
    load_adapter(policy, adapter)
    ev = evaluate_policy(policy, tok, cfg, out_dir=run_dir)
    RunWriter(run_dir).write_summary({"eval": ev})
    return ev


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    run_dirs = [a.split("=", 1)[1] for a in argv if a.startswith("run_dir=")]
    rest = [a for a in argv if not a.startswith("run_dir=")]
    if run_dirs:
        ev = evaluate_run(run_dirs[0], rest)
    else:
        cfg = load_config(rest + ([] if any(a.startswith("run_name=") for a in rest) else
                                  ["run_name=base-" + next((a.split("=", 1)[1] for a in rest
                                                            if a.startswith("quant=")), "bf16")]))
        ev = run_base(cfg)["eval"]
    for name, s in ev.items():
        print(f"{name}: pass@1 = {100 * s['pass@1']:.1f}% ({s['n_problems']} problems x {s['n_samples']} samples)")


if __name__ == "__main__":
    main()
