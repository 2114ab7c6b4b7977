"""Shared machinery of the experiment scripts: a row is a list of overrides of the training core.

An experiment script declares its rows for a scale and calls ``main``; nothing about training is re-implemented
here. Every run lands in ``results/<artifact>/<scale>/<row>-s<seed>/``; a finished run is skipped and an
interrupted one resumes from its checkpoint (``qerl.train.run`` does both), so re-running a matrix is cheap.

A row names what it runs (``Row.runner``, a key of ``RUNNERS``). ``--workers N`` (default 1) runs each row x seed
as its own process (``experiments.worker``), at most N at a time on the same device; ``--workers 0`` runs them one
after the other inside this process (for a debugger or a profiler). ``--nproc P`` (``NPROC=`` in the Makefile,
default 1) runs each row data-parallel on P GPUs: its worker is launched by ``torchrun --standalone
--nproc_per_node P`` (runners that train or evaluate; others run as one process).

Scales (``SCALE=`` in the Makefile):
* ``smoke``: CPU, minutes. The committed toy smoke model stands in for every paper model and trains on the toy
  arithmetic task; numbers prove the plumbing and are not comparable with the paper.
* ``toy``: one GPU. The larger toy model, several seeds: meaningful relative comparisons between formats.
* ``paper``: Qwen2.5-*-Instruct from the hub, the paper's data, hyper-parameters and lengths.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from qerl.errors import UserError
from qerl.quant import FORMATS

SCALES = ("smoke", "toy", "small", "paper")

#: Learning rates per scale. Paper (Table 4): 1e-5 for quantized LoRA (QeRL, QLoRA), 5e-6 for BF16 LoRA (it
#: "collapses" above); the Full baseline's rate is not stated — 1e-6, a common full-parameter RL rate. The tiny toy
#: models need far larger rates to move in a few dozen steps; the 2:1 quantized:BF16 ratio is kept.
LR = {
    "smoke": {"quantized": 1e-3, "bf16_lora": 5e-4, "full": 1e-4},
    "toy": {"quantized": 5e-4, "bf16_lora": 2.5e-4, "full": 2e-5},
    "small": {"quantized": 2e-4, "bf16_lora": 2e-4, "full": 3e-5},
    "paper": {"quantized": 1e-5, "bf16_lora": 5e-6, "full": 1e-6},
}
#: Seeds per scale (the paper reports single runs; toy-scale comparisons need several).
SEEDS = {"smoke": (0,), "toy": (0, 1, 2), "small": (0, 1, 2), "paper": (0,)}
PAPER_MODELS = {"3b": "Qwen2.5-3B-Instruct", "7b": "Qwen2.5-7B-Instruct", "14b": "Qwen2.5-14B-Instruct",
                "32b": "Qwen2.5-32B-Instruct"}
WEIGHTS = {name: f.label for name, f in FORMATS.items()}  # format -> the label tables and figures show

#: What a row runs: name -> "module:function", a function of the row's TrainConfig. Import paths, not functions,
#: so nothing heavy is imported until a row runs, and a worker process can import the function by itself.
#: Another module registers its own: ``RUNNERS["entropy"] = "experiments.evidence:run_entropy"``.
RUNNERS = {"train": "qerl.train:run", "base": "qerl.evaluate:run_base"}
#: Runners that run data-parallel under torchrun (every rank calls them; rank 0 writes): ``--nproc`` applies to these.
DISTRIBUTED_RUNNERS = {"qerl.train:run", "qerl.evaluate:run_base"}


def runner_path(name: str, where: str = "") -> str:
    """The import path of the runner ``name`` (``where`` says which row asked, for the error)."""
    if name not in RUNNERS:
        raise UserError(f"{where}unknown runner {name!r}; valid runners: {sorted(RUNNERS)}")
    return RUNNERS[name]


def load_runner(path: str):
    """Import ``"package.module:function"`` and return the function."""
    module, sep, attr = path.partition(":")
    if not (module and sep and attr):
        raise UserError(f"runner path {path!r} must look like 'package.module:function'")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise UserError(f"runner path {path!r}: module {module!r} has no function {attr!r}")
    return fn


@dataclass(frozen=True)
class Row:
    """One cell-producing run: ``overrides`` of the training config plus the paper-row tags it fills, and the name
    of what runs it (a key of ``RUNNERS``: ``train`` trains, ``base`` evaluates the untrained base model)."""

    key: str
    overrides: tuple[str, ...]
    tags: dict = field(default_factory=dict)
    runner: str = "train"

    def all_overrides(self, artifact: str, scale: str, seed: int, extra=()) -> list[str]:
        tags = [f"+tags.{k}={v}" for k, v in {"table": artifact, **self.tags}.items()]
        return [f"scale={scale}", f"experiment={artifact}/{scale}", f"run_name={self.key}-s{seed}",
                f"seed={seed}", *self.overrides, *tags, *extra]


def method_rows(model_key: str, scale: str, formats: tuple[str, ...] = tuple(FORMATS), full: bool = True,
                aqn: bool = True, base: tuple[str, ...] = tuple(FORMATS)) -> list[Row]:
    """The rows of Tables 1/2 for one model: untrained bases, Full, LoRA per format, NVFP4 + AQN. By default every
    registered format (the paper's four and any added since, e.g. INT4) gets a base row and a LoRA row."""
    lr = LR[scale]
    paper = PAPER_MODELS[model_key]
    rows = [Row(f"{model_key}-{f}-base", (f"quant={f}",),
                dict(paper_model=paper, weights=WEIGHTS[f], training="none", aqn="no"), runner="base") for f in base]
    if full:
        rows.append(Row(f"{model_key}-bf16-full", ("quant=bf16", "lora=none", f"optim.lr={lr['full']}"),
                        dict(paper_model=paper, weights="BF16", training="full", aqn="no")))
    for f in formats:
        rate = lr["bf16_lora"] if f == "bf16" else lr["quantized"]
        rows.append(Row(f"{model_key}-{f}-lora", (f"quant={f}", "lora=r32", f"optim.lr={rate}"),
                        dict(paper_model=paper, weights=WEIGHTS[f], training="lora", aqn="no")))
    if aqn:
        rows.append(Row(f"{model_key}-nvfp4-lora-aqn", ("quant=nvfp4", "lora=r32", "aqn=paper",
                                                         f"optim.lr={lr['quantized']}"),
                        dict(paper_model=paper, weights="NVFP4", training="lora", aqn="yes")))
    return rows


@dataclass(frozen=True)
class Job:
    """One row x seed of a matrix: its 1-based position, the row, the seed, its overrides and composed config."""

    index: int
    row: Row
    seed: int
    overrides: tuple[str, ...]
    cfg: object  # qerl.config.TrainConfig

    @property
    def runner(self) -> str:
        return RUNNERS[self.row.runner]


def compose(artifact: str, scale: str, rows: list[Row], seeds, extra=()) -> list[Job]:
    """Every row x seed with its validated config; a bad runner name or two jobs sharing a run directory (they
    would write over each other, at the same time with workers) is an error before anything runs."""
    from qerl.config import load_config

    for row in rows:
        runner_path(row.runner, f"row {row.key!r}: ")
    jobs, owner = [], {}
    for row in rows:
        for seed in seeds:
            ov = tuple(row.all_overrides(artifact, scale, seed, extra))
            cfg = load_config(ov)
            if cfg.run_dir in owner:
                raise UserError(f"rows {owner[cfg.run_dir]!r} and {row.key!r} (seed {seed}) both write {cfg.run_dir}; "
                                "give them distinct keys")
            owner[cfg.run_dir] = row.key
            jobs.append(Job(len(jobs) + 1, row, seed, ov, cfg))
    return jobs


def run_rows(artifact: str, scale: str, rows: list[Row], seeds=None, extra=(), dry_run: bool = False,
             workers: int = 1, nproc: int = 1) -> dict:
    """Run (or skip, or resume) every row x seed (see ``run_jobs``); returns ``{"configs", "done", "skipped",
    "failed"}``."""
    jobs = compose(artifact, scale, rows, SEEDS[scale] if seeds is None else seeds, extra)
    return run_jobs(jobs, f"[{artifact}/{scale}]", workers, dry_run, nproc)


def run_jobs(jobs: list[Job], label: str, workers: int = 1, dry_run: bool = False, nproc: int = 1) -> dict:
    """Run (or skip, or resume) composed jobs; ``done`` includes the skipped, already finished runs.

    ``workers >= 1``: each job runs in its own process (``python -m experiments.worker``), at most ``workers`` at a
    time, all on this machine's device; its output goes to ``<run_dir>/worker.log``. ``workers = 0``: one after the
    other inside this process. Either way a finished run is skipped without starting anything, and a failed one is
    reported without stopping the others; it resumes from its checkpoint the next time the matrix runs.
    ``nproc > 1``: each training or evaluation job runs on ``nproc`` ranks (``torchrun``; needs ``workers >= 1``).
    """
    if workers < 0:
        raise UserError(f"workers={workers} is not valid; use 0 (in this process) or N >= 1 processes at a time")
    if nproc < 1 or (nproc > 1 and workers == 0):
        raise UserError(f"nproc={nproc} is not valid with workers={workers}; use nproc >= 1, and workers >= 1 when "
                        f"nproc > 1 (each row is then a torchrun job)")
    log = _Log(label, len(jobs))
    res = {"configs": [(j.row, j.cfg) for j in jobs], "done": [], "skipped": [], "failed": []}
    todo = []
    for j in jobs:
        if dry_run:
            log(j, "plan", f" ({j.row.runner}; dry run)")
        elif _finished(j.cfg.run_dir):
            log(j, "skip", " (finished)")
            res["skipped"].append(str(j.cfg.run_dir))
            res["done"].append(str(j.cfg.run_dir))
        else:
            todo.append(j)
    if workers == 0:
        _run_in_process(todo, log, res)
    else:
        _run_in_workers(todo, workers, log, res, nproc=nproc)
    return res


class _Log:
    """The runner's one line per event: ``[fig4/smoke] done 3/12 results/fig4/smoke/... in 42 s``."""

    def __init__(self, label: str, n: int):
        self.label, self.n = label, n

    def __call__(self, job: Job, event: str, detail: str = "", file=None) -> None:
        print(f"{self.label} {event} {job.index}/{self.n} {job.cfg.run_dir}{detail}", file=file or sys.stdout,
              flush=True)


def _finished(run_dir: Path) -> bool:
    from qerl.results import RunWriter

    return Path(run_dir).is_dir() and RunWriter(run_dir).is_finished()


def _run_in_process(jobs: list[Job], log: _Log, res: dict) -> None:
    for j in jobs:
        log(j, "start", f" ({j.row.runner})")
        t0 = time.perf_counter()
        try:
            load_runner(j.runner)(j.cfg)
        except Exception as e:  # keep going: the matrix resumes the failed row next time
            traceback.print_exc()
            log(j, "FAILED", f" after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {e}", sys.stderr)
            res["failed"].append((str(j.cfg.run_dir), f"{type(e).__name__}: {e}"))
        else:
            log(j, "done", f" in {time.perf_counter() - t0:.0f} s")
            res["done"].append(str(j.cfg.run_dir))


# ------------------------------------------------------------------------------------- rows as processes
WORKER_LOG = "worker.log"
_ROOT = Path(__file__).resolve().parents[1]  # the checkout holding experiments/ (and qerl/)


def worker_env(workers: int, environ=None, nproc: int = 1) -> dict[str, str]:
    """The environment of each of ``workers`` row processes sharing this machine: this process's (so
    CUDA_VISIBLE_DEVICES and everything else pass through) plus a fair share of the CPU cores for torch's threads
    (OMP_NUM_THREADS) and for the math-verify pool (QERL_REWARD_WORKERS; its own default, min(4, cores), times N
    workers would oversubscribe the cores); ``nproc`` ranks per row share their row's share. A value the caller
    already set wins."""
    env = dict(os.environ if environ is None else environ)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // (workers * nproc))
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(k, str(share))
    env.setdefault("QERL_REWARD_WORKERS", str(min(4, share)))
    env["PYTHONUNBUFFERED"] = "1"  # the log shows where a row is, even when it is killed
    # the worker imports this checkout's experiments/ and qerl/, whatever its working directory's sys.path says
    paths = [str(_ROOT), *(q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q and q != str(_ROOT))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def job_nproc(job: Job, nproc: int) -> int:
    """How many ranks ``job`` runs on: ``nproc`` for a runner that runs data-parallel, else 1."""
    return nproc if job.runner in DISTRIBUTED_RUNNERS else 1


def worker_command(job: Job, workers: int, nproc: int = 1) -> list[str]:
    """``python -m experiments.worker``: the row's runner and overrides; ``--workers`` lands in env.json's argv.
    With ``nproc > 1`` (and a data-parallel runner) the worker is launched on that many ranks by torchrun
    (``--standalone``: a rendezvous on a free local port, so several rows can run at once)."""
    cmd = ["-m", "experiments.worker", "--runner", job.runner, "--workers", str(workers),
           "--parent-pid", str(os.getpid()), "--", *job.overrides]
    n = job_nproc(job, nproc)
    if n > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n), *cmd]
    return [sys.executable, *cmd]


@dataclass(eq=False)
class _Proc:
    job: Job
    proc: subprocess.Popen
    log: object  # the open worker.log
    t0: float


def _term_with_parent() -> None:  # in the torchrun child before exec: SIGTERM when the runner dies, however it dies
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(job: Job, workers: int, env: dict, nproc: int = 1) -> _Proc:
    run_dir = Path(job.cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = worker_command(job, workers, nproc)
    f = open(run_dir / WORKER_LOG, "a")  # appended: a resumed row keeps the story of its earlier attempts
    f.write(f"\n=== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {shlex.join(cmd)}\n")
    f.flush()
    # torchrun (nproc > 1) stops its ranks on SIGTERM; the ranks die with torchrun (experiments.worker)
    pre = _term_with_parent if job_nproc(job, nproc) > 1 and sys.platform.startswith("linux") else None
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=pre)
    return _Proc(job, p, f, time.perf_counter())


def _exit_reason(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def _log_tail(path: Path, lines: int = 15) -> str:
    """The last lines of the newest attempt in a worker.log."""
    with contextlib.suppress(OSError):
        text = path.read_text(errors="replace").rsplit("\n=== ", 1)[-1]
        return "\n".join("    " + line for line in text.splitlines()[1:][-lines:])
    return ""


def _run_in_workers(jobs: list[Job], workers: int, log: _Log, res: dict, poll_s: float = 0.2, nproc: int = 1) -> None:
    env = worker_env(workers, nproc=nproc)
    pending, running = list(reversed(jobs)), []
    try:
        with _sigterm_as_interrupt():
            while pending or running:
                while pending and len(running) < workers:
                    w = _spawn(pending.pop(), workers, env, nproc)
                    running.append(w)
                    log(w.job, "start", f" ({w.job.row.runner}, pid {w.proc.pid}, log "
                                        f"{Path(w.job.cfg.run_dir) / WORKER_LOG})")
                time.sleep(poll_s)
                for w in [w for w in running if w.proc.poll() is not None]:
                    running.remove(w)
                    _collect(w, log, res)
    finally:  # Ctrl-C, SIGTERM or a bug here: no row process outlives the runner
        _stop(running, log)


def _collect(w: _Proc, log: _Log, res: dict) -> None:
    w.log.close()
    dt, run_dir = time.perf_counter() - w.t0, str(w.job.cfg.run_dir)
    code = w.proc.returncode
    if code == 0:
        log(w.job, "done", f" in {dt:.0f} s")
        res["done"].append(run_dir)
        return
    why = _exit_reason(code)
    log(w.job, "FAILED", f" after {dt:.0f} s: {why}; last lines of its {WORKER_LOG}:\n"
        f"{_log_tail(Path(run_dir) / WORKER_LOG)}", sys.stderr)
    res["failed"].append((run_dir, why))


def _stop(running: list[_Proc], log: _Log, grace_s: float = 10.0) -> None:
    """Terminate the row processes, then kill what is left after ``grace_s``; their runs resume next time."""
    for w in running:
        with contextlib.suppress(ProcessLookupError):
            w.proc.terminate()
    deadline = time.monotonic() + grace_s
    for w in running:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()
        w.log.close()
        log(w.job, "stopped", " (interrupted; it resumes from its checkpoint next time)", sys.stderr)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM unwinds like Ctrl-C, so the ``finally`` that stops the row processes runs (main thread only: Python
    delivers signals there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--scale", default="smoke", choices=SCALES)
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: per scale)")
    p.add_argument("--dry-run", action="store_true", help="compose and validate every row, run nothing")
    p.add_argument("--root", default="results")
    p.add_argument("--workers", type=_workers_arg, default=1, metavar="N",
                   help="run N rows at a time, each in its own process on the same device (default 1; 0: one after "
                        "the other inside this process). Each gets max(1, cores // N) torch threads and a "
                        "math-verify pool of min(4, cores // N) unless OMP_NUM_THREADS / QERL_REWARD_WORKERS are set")
    p.add_argument("--nproc", type=_nproc_arg, default=1, metavar="P",
                   help="run each row data-parallel on P ranks (torchrun --standalone --nproc_per_node P; one GPU "
                        "per rank on CUDA, see CUDA_VISIBLE_DEVICES). Default 1: one process per row")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides applied to every row")
    return p


def _nproc_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; use P >= 1 ranks per row")
    return n


def _workers_arg(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; use 0 (in this process) or N >= 1 processes")
    return n


def finish(result: dict, render=None) -> None:
    """Render the artifact (when given) and exit non-zero if any row failed."""
    if render is not None and result["done"]:
        render()
    for run_dir, err in result["failed"]:
        print(f"FAILED {run_dir}: {err}", file=sys.stderr)
    if result["failed"]:
        sys.exit(1)


def seeds_arg(args) -> tuple[int, ...] | None:
    return tuple(int(s) for s in args.seeds.split(",")) if args.seeds else None


def scale_model(scale: str, paper_key: str) -> tuple[str, ...]:
    """Model and data overrides for a figure run: the paper's model on GSM8K, or the toy model on the toy task."""
    if scale == "paper":
        return (f"model=qwen2.5-{paper_key}", "data=gsm8k", "eval.sets=[gsm8k]")
    return ("data=toy", "eval.sets=[toy]")


#: At the one-GPU evidence scales an artifact is a view of the one evidence matrix (``experiments.evidence``), so a
#: run that serves Table 1 and Fig. 4 is trained once: artifact -> the evidence stages it needs.
EVIDENCE_STAGES = {"table1": "all", "fig4": "calibrate,entropy,base,grid,main", "fig8": "all", "fig9": "all",
                   "fig16": "calibrate,grid", "fig17": "calibrate,grid"}


def _evidence_view(artifact: str, args) -> None:
    from experiments import evidence

    if artifact not in EVIDENCE_STAGES:
        raise UserError(f"{artifact} at --scale {args.scale}: this artifact is not part of the evidence matrix "
                        f"(which serves {sorted(EVIDENCE_STAGES)} at scales {sorted(evidence.SCALES)}); use "
                        f"--scale smoke or paper")
    argv = ["--scale", args.scale, "--stage", EVIDENCE_STAGES[artifact], "--root", args.root,
            "--workers", str(args.workers), "--nproc", str(args.nproc),
            *(["--seeds", args.seeds] if args.seeds else []),
            *(["--dry-run"] if args.dry_run else []), *args.overrides]
    evidence.main(argv)


def artifact_main(artifact: str, rows_fn, doc: str, render, argv=None) -> None:
    """CLI of an experiment: run (or skip, or resume) its rows, then ``render(root, scale)`` from results/.
    At the evidence scales (toy, small) the artifact runs its stages of ``experiments.evidence`` instead."""
    from qerl.config import ConfigError

    args = parser(doc).parse_args(argv)
    if args.scale in ("toy", "small"):
        try:
            return _evidence_view(artifact, args)
        except (UserError, ConfigError) as e:
            print(f"{artifact}: {e}", file=sys.stderr)
            sys.exit(2)
    try:
        res = run_rows(artifact, args.scale, rows_fn(args.scale), seeds_arg(args),
                       [f"out_dir={args.root}", *args.overrides], args.dry_run, args.workers, args.nproc)
    except (UserError, ConfigError) as e:  # the user's to fix: one line, no traceback
        print(f"{artifact}: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{artifact}: interrupted; run the same command again to resume", file=sys.stderr)
        sys.exit(130)
    finish(res, lambda: render(args.root, args.scale))


def figure_main(artifact: str, rows_fn, figures: tuple[str, ...], doc: str, argv=None) -> None:
    """CLI of a figure experiment: run its rows, then draw its figures from results/."""

    def render(root, scale):
        from paper_figures import figures as figs

        for name in figures:
            written = getattr(figs, name)(root=root, scale=scale)
            print(f"{name}: {written or 'skipped'}")

    artifact_main(artifact, rows_fn, doc, render, argv)


def table_main(artifact: str, rows_fn, doc: str, argv=None) -> None:
    """CLI of a table experiment: run its rows, then render the table (ours beside the paper's)."""

    def render(root, scale):
        from paper_figures import tables

        md, _ = getattr(tables, f"render_{artifact}")(root, scale)
        print(md)

    artifact_main(artifact, rows_fn, doc, render, argv)
