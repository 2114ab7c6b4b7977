"""Throughput of many runs at once on one device: K identical short training rows (seeds 0..K-1) run as worker
processes, at most N at a time, for each N; the wall clock of the whole batch is the measurement.

    python -m experiments.concurrency --scale toy --workers 1,4,8 --rows 8 --steps 20 [key=value ...]

Each batch trains anew in the scratch directory ``<root>/concurrency/<scale>/w<N>/`` (emptied first; every run there
is tagged ``tags.workers=N``). After each batch ``<root>/concurrency/<scale>/concurrency.csv`` and ``concurrency.md``
are rewritten with the batches measured so far: workers, rows, steps, wall_s, runs_per_min, gain_vs_1 (runs per
minute over those of N=1 in the same invocation; empty without N=1), mean_run_s (a run's own wall time: how much
sharing the device slows each run), device and GPU (read from the runs' summary.json and env.json).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import sys
import time
from pathlib import Path

from experiments.common import SCALES, Row, compose, run_jobs
from qerl.errors import UserError
from qerl.results import atomic_write_text

ARTIFACT = "concurrency"
class BatchFailed(RuntimeError):
    """A run of the batch failed: its wall clock measures nothing."""


COLUMNS = ("workers", "rows", "steps", "wall_s", "runs_per_min", "gain_vs_1", "mean_run_s", "device", "gpu", "measured")


def batch(scale: str, workers: int, rows: int, steps: int, root: str, overrides=()) -> dict:
    """Train ``rows`` identical runs (seeds 0..rows-1) with ``workers`` at a time; one line of the CSV."""
    exp = f"{ARTIFACT}/{scale}/w{workers}"
    scratch = Path(root) / exp
    shutil.rmtree(scratch, ignore_errors=True)  # a measurement trains every run; nothing may be skipped or resumed
    row = Row("bench", (), dict(workers=workers))
    # the measured settings come last: they win over the extra overrides (the CSV records them)
    jobs = compose(ARTIFACT, scale, [row], range(rows), [*overrides, f"out_dir={root}", f"experiment={exp}",
                                                          f"train.steps={steps}"])
    t0 = time.perf_counter()
    res = run_jobs(jobs, f"[{exp}]", workers)
    wall = time.perf_counter() - t0
    if res["failed"]:
        raise BatchFailed(f"{len(res['failed'])} of {rows} runs failed with {workers} workers (see their "
                           f"worker.log under {scratch}); no measurement recorded")
    runs = [Path(j.cfg.run_dir) for j in jobs]
    summaries = [json.loads((d / "summary.json").read_text()) for d in runs]
    hw = json.loads((runs[0] / "env.json").read_text()).get("hardware", {})
    return dict(workers=workers, rows=rows, steps=steps, wall_s=round(wall, 2),
                runs_per_min=round(rows / wall * 60, 3),
                mean_run_s=round(sum(s.get("wall_time_s", 0.0) for s in summaries) / rows, 2),
                device=summaries[0].get("device", ""), gpu=hw.get("gpu", ""),
                measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def read_csv(path: Path) -> list[dict]:
    """The batches a CSV holds (numbers parsed; ``measured`` empty where an older CSV lacks it)."""
    if not path.exists():
        return []
    out = []
    for r in csv.DictReader(io.StringIO(path.read_text())):
        out.append(dict(workers=int(r["workers"]), rows=int(r["rows"]), steps=int(r["steps"]),
                        wall_s=float(r["wall_s"]), runs_per_min=float(r["runs_per_min"]),
                        mean_run_s=float(r["mean_run_s"]), device=r.get("device", ""), gpu=r.get("gpu", ""),
                        measured=r.get("measured") or ""))
    return out


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` batches plus the ``old`` ones of other worker counts (same steps and GPU only), by worker count.

    Refuses to mix batches of different run lengths or devices: their runs per minute are not comparable."""
    for o in old:
        n = new[0] if new else o
        if (o["steps"], o["gpu"] or o["device"]) != (n["steps"], n["gpu"] or n["device"]):
            raise UserError(f"--merge: the CSV's {o['workers']}-worker batch ran {o['steps']} steps on "
                            f"{o['gpu'] or o['device']!r}, this one {n['steps']} on {n['gpu'] or n['device']!r}; "
                            f"measure both anew")
    mine = {ln["workers"] for ln in new}
    return sorted([o for o in old if o["workers"] not in mine] + list(new), key=lambda ln: ln["workers"])


def with_gain(lines: list[dict]) -> list[dict]:
    """``gain_vs_1``: runs per minute relative to the one-at-a-time batch (empty when N=1 was not measured)."""
    one = next((ln["runs_per_min"] for ln in lines if ln["workers"] == 1), None)
    return [dict(ln, gain_vs_1=round(ln["runs_per_min"] / one, 3) if one else "") for ln in lines]


def write(lines: list[dict], out_dir: Path, scale: str, overrides, earlier: int = 0) -> list[Path]:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(lines)
    atomic_write_text(out_dir / "concurrency.csv", buf.getvalue())
    first = lines[0]
    md = [f"# Runs at once on one device ({scale} scale)", "",
          f"Identical runs of {first['steps']} steps (seeds 0..rows-1) on "
          f"{first['gpu'] or first['device']}; overrides: `{' '.join(overrides) or 'none'}`. "
          "Wall = the whole batch, process start-up included; run time = a run's own wall time." +
          (f" {earlier} batch(es) kept from an earlier invocation (`--merge`; the CSV's `measured` column says "
           f"when each ran): the gain compares machines of the same kind, not the same machine." if earlier else ""),
          "",
          "| workers | runs | wall (s) | runs/min | gain vs 1 | run time, mean (s) |", "|---:|---:|---:|---:|---:|---:|"]
    for ln in lines:
        gain = f"{ln['gain_vs_1']:.2f}x" if ln["gain_vs_1"] != "" else "-"
        md.append(f"| {ln['workers']} | {ln['rows']} | {ln['wall_s']:.1f} | {ln['runs_per_min']:.2f} | {gain} | "
                  f"{ln['mean_run_s']:.1f} |")
    atomic_write_text(out_dir / "concurrency.md", "\n".join(md) + "\n")
    return [out_dir / "concurrency.csv", out_dir / "concurrency.md"]


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give worker counts >= 1, e.g. 1,4,8")
    return list(dict.fromkeys(counts))  # each count once, in the order given


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default="smoke", choices=SCALES)
    p.add_argument("--workers", type=_counts, default=[1, 2, 4], help="comma-separated worker counts (default 1,2,4)")
    p.add_argument("--rows", type=int, default=8, help="runs per batch (default 8; 0: max(2, N) for N workers, so "
                                                        "one-at-a-time costs two runs, not N)")
    p.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    p.add_argument("--root", default="results")
    p.add_argument("--merge", action="store_true", help="keep the CSV's batches of other worker counts (same steps "
                                                        "and device; e.g. a one-at-a-time batch measured earlier)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides of every run")
    a = p.parse_args(argv)
    if a.rows < 0 or a.steps < 1:
        p.error(f"--rows {a.rows} / --steps {a.steps}: rows must be >= 0 (0: max(2, N)), steps >= 1")
    from qerl.config import ConfigError

    out_dir, lines = Path(a.root) / ARTIFACT / a.scale, []
    old = read_csv(out_dir / "concurrency.csv") if a.merge else []
    try:
        for n in a.workers:
            lines.append(batch(a.scale, n, a.rows or max(2, n), a.steps, a.root, a.overrides))
            ln = lines[-1]
            print(f"[{ARTIFACT}] {n} workers: {ln['rows']} runs in {ln['wall_s']:.1f} s = {ln['runs_per_min']:.2f} "
                  f"runs/min", flush=True)
            both = merge(old, lines)
            written = write(with_gain(both), out_dir, a.scale, a.overrides, earlier=len(both) - len(lines))  # after each batch: a crash keeps it
    except (UserError, ConfigError, BatchFailed) as e:
        print(f"{ARTIFACT}: {e}", file=sys.stderr)
        sys.exit(1 if isinstance(e, BatchFailed) else 2)
    except KeyboardInterrupt:
        print(f"{ARTIFACT}: interrupted", file=sys.stderr)
        sys.exit(130)
    print((out_dir / "concurrency.md").read_text())
    print("wrote", ", ".join(map(str, written)))


if __name__ == "__main__":
    main()
