"""``python -m paper_figures [--root results] [--only fig4,table2] [--scale smoke] [--smooth N]``

Regenerates every table and figure it can from ``results/`` alone and prints what it wrote and what it skipped.
Without ``--scale`` it renders every scale that some run records; Fig. 15 and the speed figures have no scale.
A run whose summary.json or config.yaml cannot be read, and a corrupt metrics line, are skipped with a one-line
warning naming the file (and line); the rest is still drawn.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from paper_figures import evidence as E
from paper_figures import figures as F
from paper_figures import findings as FD
from paper_figures import runs as R
from paper_figures import speed as S
from paper_figures import tables as T
from qerl.errors import UserError, cli_main
from qerl.results import ResultsWarning


def _table(name: str):
    return lambda root, scale, smooth: T.render_table(name, root, scale)[1].attrs["written"]


def _curve(fn):
    return lambda root, scale, smooth: fn(root, scale=scale, smooth=smooth)


# name -> (per_scale, maker(root, scale, smooth) -> written paths)
ARTIFACTS = {
    "table1": (True, _table("table1")),
    "table2": (True, _table("table2")),
    "fig4": (True, _curve(F.fig4)),
    "fig5": (True, _curve(F.fig5)),
    "fig7": (True, _curve(F.fig7)),
    "fig8": (True, _curve(F.fig8)),
    "fig9": (True, _curve(F.fig9)),
    "fig10": (True, _curve(F.fig10)),
    "fig14": (True, _curve(F.fig14)),
    "fig16": (True, _curve(F.fig16)),
    "fig17": (True, _curve(F.fig17)),
    "fig15": (False, lambda root, scale, smooth: F.fig15(root)),
    "fig1": (False, lambda root, scale, smooth: S.speed_rollout(root)),
    "fig11": (False, lambda root, scale, smooth: S.speed_rank(root)),
    "speed_layers": (False, lambda root, scale, smooth: S.speed_layers(root)),
    "evidence": (True, lambda root, scale, smooth: E.all_figures(root, scale, smooth=smooth)),
    "findings": (True, lambda root, scale, smooth: FD.write_findings(root, scale)),
}


def _show(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    """A skipped run or line as one line on stderr (the message names the file); other warnings as usual."""
    if issubclass(category, ResultsWarning):
        print(f"[paper_figures] warning: {message}", file=sys.stderr, flush=True)
    else:
        _default(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> int:
    with warnings.catch_warnings():  # restores the usual warning display afterwards (main is called by tests)
        warnings.showwarning = _show
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m paper_figures", description=__doc__.split("\n\n")[1])
    ap.add_argument("--root", default="results", help="results tree (default: results)")
    ap.add_argument("--only", default="", help=f"comma-separated subset of {','.join(ARTIFACTS)}")
    ap.add_argument("--scale", default="", help="smoke|toy|paper, comma-separated (default: every scale found)")
    ap.add_argument("--smooth", type=int, default=1, help="rolling-mean window over steps for curves (default 1)")
    a = ap.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = [s for s in only if s not in ARTIFACTS]
    if bad:
        ap.error(f"unknown artifact(s) {bad}; valid: {list(ARTIFACTS)}")
    if not Path(a.root).is_dir():
        raise UserError(f"--root {a.root}: no such directory (the results tree to draw from)")
    if a.smooth < 1:
        raise UserError(f"--smooth {a.smooth}: the rolling-mean window must be >= 1 step")
    scales = [s.strip() for s in a.scale.split(",") if s.strip()] or R.scales(a.root)
    if not scales:
        print(f"[paper_figures] no runs under {a.root}; only scale-free figures can be made")
    wrote, skipped = [], []
    for name, (per_scale, make) in ARTIFACTS.items():
        if only and name not in only:
            continue
        for scale in scales if per_scale else [None]:
            label = f"{name}[{scale}]" if scale else name
            paths = make(a.root, scale, a.smooth)
            (wrote if paths else skipped).append((label, paths))
    print("\n[paper_figures] summary")
    for label, paths in wrote:
        print(f"  wrote   {label}: " + ", ".join(str(p) for p in paths))
    for label, _ in skipped:
        print(f"  skipped {label}")
    return 0


if __name__ == "__main__":
    cli_main(main)
