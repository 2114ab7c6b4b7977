"""Figure 15: σ per AQN stage for the four schedules (and both σ modes), written to results/fig15/schedules.csv
and drawn by paper_figures. Pure computation (qerl.aqn.sigma_at), seconds on any machine.

    python -m experiments.fig15 [--root results] [--sigma-start 5e-2] [--sigma-end 5e-4] [--stages 10] [--steps 600]
"""

from __future__ import annotations

import argparse
import csv
import io
from pathlib import Path

from qerl import aqn
from qerl.results import atomic_write_text


def schedule_rows(sigma_start: float, sigma_end: float, stages: int, steps: int) -> list[dict]:
    rows = []
    for mode in aqn.SIGMA_MODES:
        for sched in aqn.SCHEDULES:
            seen = set()
            for step in range(1, steps + 1):
                k = aqn.stage_at(step, steps, stages, mode)
                if k in seen:
                    continue
                seen.add(k)
                rows.append(dict(schedule=sched, mode=mode, stage=k, step=step,
                                 sigma=aqn.sigma_at(step, steps, sigma_start, sigma_end, stages, sched, mode)))
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", default="results")
    p.add_argument("--sigma-start", type=float, default=5e-2)  # Fig. 15's y-axis implies 5e-2
    p.add_argument("--sigma-end", type=float, default=5e-4)
    p.add_argument("--stages", type=int, default=10)
    p.add_argument("--steps", type=int, default=600)
    a = p.parse_args(argv)
    rows = schedule_rows(a.sigma_start, a.sigma_end, a.stages, a.steps)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["schedule", "mode", "stage", "step", "sigma"])
    w.writeheader()
    w.writerows(rows)
    out = Path(a.root) / "fig15" / "schedules.csv"
    atomic_write_text(out, buf.getvalue())
    print(f"wrote {out} ({len(rows)} rows)")
    from paper_figures import figures

    print("fig15:", figures.fig15(root=a.root) or "skipped")


if __name__ == "__main__":
    main()
