"""Move an evidence matrix between this checkout and an offline GPU host whose upload is small (see
``scripts/evidence_gpu.sh``).

    python -m experiments.evidence_carry slim --scale toy --out results.slim   # what the host needs to resume
    python -m experiments.evidence_carry merge UNPACKED_DIR --tag h100-s18     # bring its new runs back

``slim`` keeps, of ``results/evidence/<scale>/``, only what the matrix reads on the host: ``protocol.json`` (the
calibrated temperature, the chosen rates), each finished run's ``summary.json`` (so the run is skipped there) and,
for the seed-0 grid runs, their per-step training reward (what ``best_rates`` scores). A small-scale matrix shrinks
from ~15 MB to ~0.5 MB, which leaves room in one upload for the model's wheel part.

``merge`` copies back every *finished* run directory the local results do not have yet (a slimmed copy that went up
never comes back over the full local one; unfinished runs stay out: the findings count finished runs only),
merges ``protocol.json`` (the host's keys win, ``best_lr`` is merged arm by arm) and files the host's logs under
``logs/`` with the tag.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from qerl.errors import UserError


def _finished(run: Path) -> bool:
    try:
        return bool(json.loads((run / "summary.json").read_text()).get("finished"))
    except (OSError, ValueError):
        return False


def slim(src: Path, scale: str, out: Path) -> list[Path]:
    """Write the slim copy of ``src/evidence/<scale>`` under ``out/evidence/<scale>``; returns the runs kept."""
    here = src / "evidence" / scale
    if not (here / "protocol.json").exists():
        raise UserError(f"{here}/protocol.json does not exist: nothing of scale {scale!r} to carry")
    dst = out / "evidence" / scale
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(here / "protocol.json", dst / "protocol.json")
    kept = []
    for run in sorted(p for p in here.iterdir() if p.is_dir() and _finished(p)):
        (dst / run.name).mkdir(exist_ok=True)
        shutil.copy2(run / "summary.json", dst / run.name / "summary.json")
        if "-lr" in run.name and run.name.endswith("-s0") and (run / "metrics.jsonl").exists():
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
            (dst / run.name / "metrics.jsonl").write_text(
                "".join(json.dumps({"step": r["step"], "reward": r["reward"]}) + "\n" for r in rows))
        kept.append(dst / run.name)
    return kept


def merge(unpacked: Path, dst: Path, tag: str) -> dict[str, list[str]]:
    """Bring the finished runs, protocol and logs of a host's unpacked results (``$RES`` as packed) into ``dst``."""
    if not (unpacked / "evidence").is_dir():
        raise UserError(f"{unpacked} has no evidence/ folder: give the directory the host's pack was unpacked into")
    added: dict[str, list[str]] = {}
    for scale_dir in sorted(p for p in (unpacked / "evidence").iterdir() if p.is_dir()):
        scale, local = scale_dir.name, dst / "evidence" / scale_dir.name
        local.mkdir(parents=True, exist_ok=True)
        for run in sorted(p for p in scale_dir.iterdir() if p.is_dir() and _finished(p)):
            if not (local / run.name).exists():
                shutil.copytree(run, local / run.name, ignore=shutil.ignore_patterns("checkpoints", "*.lock"))
                added.setdefault(scale, []).append(run.name)
        theirs = scale_dir / "protocol.json"
        if theirs.exists():
            mine = json.loads((local / "protocol.json").read_text()) if (local / "protocol.json").exists() else {}
            doc = json.loads(theirs.read_text())
            best = {**mine.get("best_lr", {}), **doc.get("best_lr", {})}
            mine.update(doc)
            if best:
                mine["best_lr"] = best
            (local / "protocol.json").write_text(json.dumps(mine, indent=2) + "\n")
        logs = sorted(unpacked.glob(f"evidence-{scale}*.log"))
        if logs:
            (local / "logs").mkdir(exist_ok=True)
            for log in logs:
                shutil.copy2(log, local / "logs" / f"{log.stem}-{tag}.log")
    return added


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.evidence_carry", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("slim", help="the part of an evidence matrix a GPU host needs to resume it")
    s.add_argument("--scale", required=True)
    s.add_argument("--src", default="results")
    s.add_argument("--out", required=True)
    m = sub.add_parser("merge", help="bring a host's finished runs back")
    m.add_argument("unpacked")
    m.add_argument("--dst", default="results")
    m.add_argument("--tag", required=True, help="names the host's logs, e.g. h100-2026-11-24")
    args = ap.parse_args(argv)
    if args.cmd == "slim":
        kept = slim(Path(args.src), args.scale, Path(args.out))
        print(f"{len(kept)} finished runs slimmed into {Path(args.out) / 'evidence' / args.scale}")
    else:
        for scale, runs in merge(Path(args.unpacked), Path(args.dst), args.tag).items():
            print(f"{scale}: {len(runs)} new finished runs: {', '.join(runs)}")


if __name__ == "__main__":
    from qerl.errors import cli_main

    cli_main(main)
