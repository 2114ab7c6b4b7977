"""Optuna sweep of Adaptive Quantization Noise: ``python -m sweeps.aqn --study NAME --trials 16 --workers 2 [k=v ...]``.

Search space (base ``aqn=paper``; the extra ``key=value`` overrides reach every trial, e.g. ``quant=nvfp4 algo=dapo``):

    sigma_start  log-uniform [1e-3, 1e-1]
    sigma_ratio  log-uniform [1e-3, 0.5]   sigma_end = sigma_start · sigma_ratio: always below sigma_start with no
                                           rejected samples (σ_end is a user attribute and a column of trials.csv)
    stages       int [2 (paper mode) or 3 (official), min(12, train.steps)]   paper mode needs steps >= stages
    schedule     exponential | linear | cosine | logarithmic

The first trial of a new study is the paper's setting (σ 1e-2 → 5e-4, K = 10 capped by the steps, exponential).
Trial n trains ``<out_dir>/sweeps/<study>/trial_<n>/`` (experiment ``sweeps/<study>``, ``tags.sweep``/``tags.trial``)
through ``qerl.train.run``; results/ stays the one source of truth.

Objective (maximized): ``val_acc`` = final eval pass@1, mean over ``eval.sets`` (default), or ``reward_area`` = mean
accuracy reward over all training steps. After every step a trial reports its running mean accuracy reward; the
pruner (``median``: after 3 finished trials, with a warm-up of a third of the steps — AQN's stage 0 is noise-free and
identical in every trial) stops trials below the median of the others at the same step.

Storage: ``sqlite:///<out_dir>/sweeps/<study>.db`` (busy timeout, WAL journal) unless ``--storage URL``; with an RDB
URL (``postgresql://…``) the same command on several machines works on one study (give each its own ``--seed``).
GPUs: ``--devices 0,1,2,3`` gives worker i its own GPU ``i mod 4`` (CUDA_VISIBLE_DEVICES; ``--workers`` defaults to
one per device). A trial itself runs on one process (multi-GPU trials are not wired).
Every trial sends a heartbeat; a trial whose heartbeat is older than 3 × ``--heartbeat`` seconds (its worker was
killed) is failed and re-enqueued with the same parameters, and the retry resumes its run directory from the last
checkpoint. Ctrl-C / SIGTERM does the same at once.

Budget: ``--trials N`` is the number of finished trials the *study* should hold (over all invocations and workers):
COMPLETE + PRUNED + FAIL, where a FAIL counts when the trial failed by itself (an exception in training, recorded in
the user attribute ``error``; the study goes on) but not when it was superseded by a retry (its worker died) nor
when it was void: "surplus" (opened the instant another worker took the last slot) or a duplicate retry (two
workers noticed the same dead trial at once). Workers run trials while slots are
free, then wait for the running ones (taking over their retries if their workers die), so every invocation ends
with N finished trials, and interrupting and rerunning the same command continues the same study.

Each invocation ends by writing ``trials.csv``, ``trials.md`` and plots into ``<out_dir>/sweeps/<study>/``;
``--report-only`` writes only those.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from qerl.errors import UserError, cli_main
from sweeps.report import accuracy_reward, census, run_values, void_reason, write_report
from sweeps.storage import default_storage, make_storage, retry_callback, storage_errors

OBJECTIVES = ("val_acc", "reward_area")
PRUNERS = ("median", "none")
SPACE = {"sigma_start": [1e-3, 1e-1], "sigma_ratio": [1e-3, 0.5], "max_stages": 12}
PAPER = {"sigma_start": 1e-2, "sigma_ratio": 0.05, "stages": 10, "schedule": "exponential"}
# Keys the sweep sets itself; overriding them on the command line would break the trial <-> run mapping.
OWNED = ("aqn.enabled", "aqn.sigma_start", "aqn.sigma_end", "aqn.stages", "aqn.schedule", "experiment", "run_name")


class VoidTrial(RuntimeError):
    """A trial that must not run: the budget was taken by other workers, or it duplicates another retry."""


class _NoVoidTraceback(logging.Filter):
    """Optuna logs a failed trial with its traceback; for a void trial the one-line reason is the whole story."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], VoidTrial):
            record.exc_info = None
        return True


@dataclass(frozen=True)
class Sweep:
    """A study's fixed settings, stored in its user attributes so every worker and every rerun uses the same."""

    study: str
    overrides: tuple[str, ...] = ()
    scale: str = "smoke"
    objective: str = "val_acc"
    out_dir: str = "results"
    steps: int = 16
    space: dict = field(default_factory=dict)
    base: dict = field(default_factory=dict)  # the resolved config every trial shares (flattened, JSON values)

    @property
    def dir(self) -> Path:
        return Path(self.out_dir) / "sweeps" / self.study

    def stored(self) -> dict:
        d = asdict(self)
        d["overrides"] = list(self.overrides)
        return d


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def trial_overrides(sweep: Sweep, params: dict, run_number: int) -> list[str]:
    """The overrides of one trial: base ``aqn=paper`` (unless the user chose another aqn preset), the scale, the
    user's overrides, then the sampled AQN values (``repr`` floats round-trip exactly) and the run location."""
    base = [] if any(_key(o) == "aqn" for o in sweep.overrides) else ["aqn=paper"]
    return [*base, f"scale={sweep.scale}", *sweep.overrides,
            f"experiment=sweeps/{sweep.study}", f"run_name=trial_{run_number}",
            f"aqn.sigma_start={float(params['sigma_start'])!r}", f"aqn.sigma_end={float(params['sigma_end'])!r}",
            f"aqn.stages={int(params['stages'])}", f"aqn.schedule={params['schedule']}",
            f"++tags.sweep={sweep.study}", f"++tags.trial={run_number}"]


def build_sweep(study: str, overrides=(), scale: str = "smoke", objective: str = "val_acc") -> Sweep:
    """Validate the settings by composing the paper-point trial, and derive the search space from the config."""
    from qerl.aqn import SCHEDULES
    from qerl.config import compose, load_config

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", study or ""):
        raise ValueError(f"study name {study!r} must be letters, digits, '_', '.', '-'")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not valid; choose one of {list(OBJECTIVES)}")
    owned = [o for o in overrides if _key(o) in OWNED]
    if owned:
        raise ValueError(f"the sweep sets {list(OWNED)} itself; remove {owned} from the overrides")
    if any(_key(o) == "scale" for o in overrides):
        raise ValueError("give the scale with --scale, not as an override")
    probe = Sweep(study, tuple(overrides), scale, objective)
    raw = compose(trial_overrides(probe, {**PAPER, "sigma_end": 5e-4}, 0))  # not validated yet: K may not fit
    if not raw.aqn.enabled:
        raise ValueError("the sweep needs AQN enabled (drop aqn=off / aqn.enabled=false)")
    steps, lo = int(raw.train.steps), 2 if raw.aqn.mode == "paper" else 3
    hi = min(SPACE["max_stages"], steps)
    if hi < lo:
        raise ValueError(f"train.steps={steps} leaves no room for >= {lo} AQN stages")
    cfg = load_config(trial_overrides(probe, {**PAPER, "sigma_end": 5e-4, "stages": lo}, 0))  # validates the rest
    if objective == "val_acc" and not cfg.eval.sets:
        raise ValueError("objective val_acc needs at least one eval set (eval.sets)")
    space = {"sigma_start": list(SPACE["sigma_start"]), "sigma_ratio": list(SPACE["sigma_ratio"]),
             "stages": [lo, hi], "schedule": list(SCHEDULES)}
    return Sweep(study, tuple(overrides), scale, objective, cfg.out_dir, steps, space, base_config(cfg))


# What a trial sets itself; everything else of its resolved config must equal the study's base.
_PER_TRIAL = ("aqn.sigma_start", "aqn.sigma_end", "aqn.stages", "aqn.schedule", "run_name", "tags.trial")


def base_config(cfg) -> dict:
    """The resolved config of a trial without what the trial sets itself: equal for all trials of a study. A change
    (someone edited a YAML default or a preset between two trials) would make the trials incomparable."""
    import json

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k not in ("choices",):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    return {k: v for k, v in json.loads(json.dumps(dict(flat(cfg.to_dict())), default=list)).items()
            if k not in _PER_TRIAL}


def config_drift(stored: dict, now: dict) -> dict:
    """{key: (stored, now)} for every key whose value differs."""
    return {k: (stored.get(k), now.get(k)) for k in sorted(set(stored) | set(now)) if stored.get(k) != now.get(k)}


def suggest(trial, space: dict) -> dict:
    """Sample one AQN setting (σ_end = σ_start · ratio, so σ_end < σ_start by construction)."""
    s = trial.suggest_float("sigma_start", *space["sigma_start"], log=True)
    r = trial.suggest_float("sigma_ratio", *space["sigma_ratio"], log=True)
    k = trial.suggest_int("stages", *space["stages"])
    sched = trial.suggest_categorical("schedule", space["schedule"])
    return {"sigma_start": s, "sigma_end": s * r, "sigma_ratio": r, "stages": k, "schedule": sched}


# ------------------------------------------------------------------------------------------------- storage and study
def make_pruner(name: str, steps: int):
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=max(1, steps // 3))
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ValueError(f"pruner {name!r} is not valid; choose one of {list(PRUNERS)}")


def stored_settings(storage, study: str) -> dict | None:
    """The settings a study was created with (None when there is no such study)."""
    import optuna

    if study not in optuna.study.get_all_study_names(storage):
        return None
    return optuna.load_study(study_name=study, storage=storage).user_attrs.get("sweep") or {}


def open_study(sweep: Sweep, storage, pruner=None, n_trials: int | None = None, baseline: bool = True):
    """Create or load the study; a new one records ``sweep`` and gets the paper's setting as its first trial."""
    import optuna

    study = optuna.create_study(storage=storage, study_name=sweep.study, direction="maximize", pruner=pruner,
                                load_if_exists=True)
    if study.direction != optuna.study.StudyDirection.MAXIMIZE:
        raise ValueError(f"study {sweep.study!r} exists with direction {study.direction.name}; the sweep maximizes")
    old = study.user_attrs.get("sweep")
    if old is None:
        study.set_user_attr("sweep", sweep.stored())
        if baseline:
            p = dict(PAPER, stages=min(max(PAPER["stages"], sweep.space["stages"][0]), sweep.space["stages"][1]))
            study.enqueue_trial(p, user_attrs={"baseline": "paper"}, skip_if_exists=True)
    else:
        diff = {k: (old.get(k), v) for k, v in sweep.stored().items() if old.get(k) != v and k != "base"}
        drift = config_drift(old.get("base") or {}, sweep.base)
        if drift:
            diff["base config"] = drift
        if diff:
            raise ValueError(f"study {sweep.study!r} was created with other settings {diff} (stored, given); "
                             f"rerun with the same ones (or none) or pick another --study")
    if n_trials is not None:
        study.set_user_attr("n_trials", int(n_trials))
    return study


# ------------------------------------------------------------------------------------------------- a worker
def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


class Worker:
    """Runs trials of one study until it holds ``n_trials`` counted trials (see the module docstring)."""

    def __init__(self, sweep: Sweep, study, n_trials: int, seed: int = 0, tag: str = "0", poll_s: float = 5.0,
                 startup_trials: int = 5):
        self.sweep, self.study, self.n_trials = sweep, study, n_trials
        self.seed, self.tag, self.poll_s, self.startup_trials = seed, tag, poll_s, startup_trials
        self.current: int | None = None  # number of the trial running in this process
        self.drift: str | None = None

    # -------------------------------------------------------------------- the objective
    def objective(self, trial) -> float:
        """One trial = one ``qerl.train.run``; returns the objective, raises ``TrialPruned`` when pruned."""
        import optuna

        from qerl.config import load_config
        from qerl.train import run

        self.current = trial.number
        run_number = int(trial.user_attrs.get("run_number", trial.number))  # a retry resumes its original run
        trial.set_user_attr("run_number", run_number)
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}:{self.tag}")
        params = suggest(trial, self.sweep.space)
        trial.set_user_attr("sigma_end", params["sigma_end"])
        frozen = self.study.get_trials(deepcopy=False)
        me = next(t for t in frozen if t.number == trial.number)
        void = void_reason(me, frozen, self.n_trials)
        if void:
            trial.set_user_attr("void", void)
            raise VoidTrial(void)
        try:
            cfg = load_config(trial_overrides(self.sweep, params, run_number))
            drift = config_drift(self.sweep.base, base_config(cfg))
            if drift:  # not this trial's fault: void it and stop this worker (see Worker.run)
                self.drift = f"the base configuration changed since the study was created: {drift}"
                trial.set_user_attr("void", self.drift[:2000])
                raise VoidTrial(self.drift)
            trial.set_user_attr("run_dir", str(cfg.run_dir))
            run(cfg, on_step=self._reporter(trial, cfg.run_dir))
            values = run_values(cfg.run_dir)
            for k in ("val_acc", "reward_area"):
                trial.set_user_attr(k, values[k])
            if values[self.sweep.objective] is None:
                raise RuntimeError(f"{cfg.run_dir} finished without a {self.sweep.objective} value")
            return float(values[self.sweep.objective])
        except (optuna.TrialPruned, VoidTrial):
            raise
        except KeyboardInterrupt:
            trial.set_user_attr("interrupted", True)
            raise
        except Exception as e:
            trial.set_user_attr("error", f"{type(e).__name__}: {e}"[:2000])
            raise

    @staticmethod
    def _reporter(trial, run_dir: Path):
        """``on_step`` for ``train.run``: report the running mean accuracy reward, prune when the pruner says so."""
        import optuna

        from qerl.results import read_jsonl

        accs: list[float] = []

        def on_step(step: int, metrics: dict) -> None:
            if not accs and step > 1:  # a resumed run: the steps before its checkpoint are in metrics.jsonl
                for r in read_jsonl(Path(run_dir) / "metrics.jsonl"):
                    a = accuracy_reward(r)
                    if r["step"] < step and a is not None:
                        accs.append(a)
                        trial.report(sum(accs) / len(accs), r["step"])
            a = accuracy_reward(metrics)
            accs.append(0.0 if a is None else a)
            value = sum(accs) / len(accs)
            trial.report(value, step)
            if trial.should_prune():
                raise optuna.TrialPruned(f"pruned at step {step}: running accuracy reward {value:.4f}")

        return on_step

    # -------------------------------------------------------------------- the loop
    def _sampler(self, n_existing: int):
        """A TPE sampler seeded by (seed, trials so far, worker): reruns and parallel workers never replay the
        random draws of an earlier process, and a one-worker sweep is reproducible."""
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return optuna.samplers.TPESampler(seed=_seed(self.seed, n_existing, self.tag), multivariate=True,
                                              constant_liar=True, n_startup_trials=self.startup_trials)

    def _fail_stale(self) -> None:
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optuna.storages.fail_stale_trials(self.study)

    def _retry_current(self) -> None:
        """After Ctrl-C/SIGTERM: re-enqueue the interrupted trial (its retry resumes the run directory)."""
        if self.current is None:
            return
        t = next((t for t in self.study.get_trials(deepcopy=False) if t.number == self.current), None)
        if t is not None and t.state.name == "FAIL" and not t.user_attrs.get("void") \
                and not t.user_attrs.get("error"):
            retry_callback()(self.study, t)

    def run(self) -> int:
        """Work until the study is done; returns the number of trials this worker ran."""
        ran, said = 0, False
        while True:
            self._fail_stale()
            trials = self.study.get_trials(deepcopy=False)
            counted, pending, _ = census(trials)
            if len(counted) >= self.n_trials:
                return ran
            waiting = [t for t in pending if t.state.name == "WAITING"]
            if not waiting and len(counted) + len(pending) >= self.n_trials:
                if not said:
                    print(f"[sweep] worker {self.tag}: waiting for running trials "
                          f"{[t.number for t in pending]}", flush=True)
                    said = True
                time.sleep(self.poll_s)
                continue
            said = False
            self.study.sampler = self._sampler(len(trials))
            self.current = None
            try:
                self.study.optimize(self.objective, n_trials=1, catch=(Exception,), gc_after_trial=True)
            except KeyboardInterrupt:
                self._retry_current()
                raise
            if self.drift:
                raise SystemExit(f"sweeps.aqn: {self.drift}; start a new --study")
            ran += 1
            if self.current is not None:
                print(f"[sweep] worker {self.tag}: trial {self.current} done", flush=True)


# ------------------------------------------------------------------------------------------------- processes
#: modules whose code runs inside a study-storage transaction (SQLAlchemy, Optuna's storages, the DB-API driver)
_STORAGE_MODULES = ("sqlalchemy.", "optuna.storages.", "sqlite3", "psycopg", "pymysql")
_INTERRUPT_RETRY_S = 0.02


def _in_storage(frame) -> bool:
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_STORAGE_MODULES):
            return True
        frame = frame.f_back
    return False


def _sigterm_to_interrupt(signum, frame):
    """SIGTERM (and Ctrl-C) -> KeyboardInterrupt (running trials are re-enqueued), but never inside a storage call:
    raised there, between SQLAlchemy's BEGIN IMMEDIATE and its COMMIT or rollback, it leaves the connection in its
    transaction, holding SQLite's write lock, and the next write (marking the trial failed) waits out the busy timeout
    and fails with "database is locked" (seen once in a clean-clone `make test`, session 37). There the signal is sent
    again 20 ms later, until it lands outside (a storage call ends within its busy timeout)."""
    if _in_storage(frame):
        threading.Timer(_INTERRUPT_RETRY_S, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt(f"signal {signum}")


def _die_with_parent() -> None:  # Linux: a worker is SIGKILLed when the invoking process dies (even by SIGKILL)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def parse_devices(text: str | None) -> list[str]:
    """``--devices 0,1,3`` -> ['0', '1', '3'], checked against the GPUs this process sees."""
    if text is None:
        return []
    devs = [d.strip() for d in text.split(",")]
    if not all(devs):
        raise UserError(f"--devices {text!r}: give comma-separated GPU indices, e.g. --devices 0,1,2,3")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    valid = [str(i) for i in range(count)]
    bad = [d for d in devs if d.isdigit() and d not in valid]
    if count == 0 or bad:
        raise UserError(f"--devices {text!r}: " + (f"no GPU {bad} here; valid: {valid}" if count else
                                                  "no CUDA GPU is visible here (CUDA_VISIBLE_DEVICES="
                                                  f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})"))
    return devs


def worker_envs(n: int, devices=(), environ=None) -> list[dict[str, str]]:
    """The environments of ``n`` sweep workers: a share of the CPU cores each, and with ``devices`` worker i sees
    only GPU ``devices[i % len(devices)]``."""
    threads = max(1, (os.cpu_count() or 1) // n)
    env = dict(os.environ if environ is None else environ, PYTHONUNBUFFERED="1")
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(k, str(threads))
    return [dict(env, CUDA_VISIBLE_DEVICES=devices[i % len(devices)]) if devices else dict(env) for i in range(n)]


def spawn_workers(args, n: int, storage_url: str, devices: list[str] = ()) -> int:
    """Start ``n`` worker processes on the study (each one is ``python -m sweeps.aqn --worker-tag i``); returns the
    first nonzero exit status. Their output is prefixed with ``[w<i>]``. With ``devices``, worker i sees only GPU
    ``devices[i % len(devices)]`` (CUDA_VISIBLE_DEVICES)."""
    procs = []
    for i, wenv in enumerate(worker_envs(n, devices)):
        cmd = [sys.executable, "-m", "sweeps.aqn", "--study", args.study, "--storage", storage_url,
               "--trials", str(args.trials), "--seed", str(args.seed), "--pruner", args.pruner,
               "--heartbeat", str(args.heartbeat), "--startup-trials", str(args.startup_trials),
               "--worker-tag", f"{args.worker_tag}.{i}" if args.worker_tag else str(i), "--no-report"]
        procs.append(subprocess.Popen(cmd, env=wenv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      preexec_fn=_die_with_parent if sys.platform == "linux" else None))

    def pump(i, p):
        for line in p.stdout:
            sys.stdout.write(f"[w{i}] {line}")
            sys.stdout.flush()

    pumps = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        codes = [p.wait() for p in procs]
    for t in pumps:
        t.join(timeout=5)
    return next((c for c in codes if c), 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sweeps.aqn", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--study", required=True, help="study name (also the folder results/sweeps/<study>/)")
    p.add_argument("--trials", type=int, default=None, help="finished trials the study should hold (default: the "
                   "stored value, else 16)")
    p.add_argument("--workers", type=int, default=None, help="worker processes on this machine (default: one per "
                   "--devices entry, else 1)")
    p.add_argument("--devices", default=None, help="comma-separated GPU indices: worker i runs on GPU i mod their "
                   "number (CUDA_VISIBLE_DEVICES), e.g. --devices 0,1,2,3")
    p.add_argument("--storage", default=None, help="RDB URL (default sqlite:///<out_dir>/sweeps/<study>.db)")
    p.add_argument("--scale", choices=("smoke", "toy", "paper"), default=None, help="default: stored, else smoke")
    p.add_argument("--objective", choices=OBJECTIVES, default=None, help="default: stored, else val_acc")
    p.add_argument("--pruner", choices=PRUNERS, default="median")
    p.add_argument("--seed", type=int, default=0, help="sampler seed (give each machine its own)")
    p.add_argument("--heartbeat", type=int, default=10, help="heartbeat interval in s (stale after 3x)")
    p.add_argument("--startup-trials", type=int, default=5, help="random trials before TPE takes over")
    p.add_argument("--worker-tag", default="", help="this worker's name (mixed into its sampler seed)")
    p.add_argument("--no-baseline", action="store_true", help="do not enqueue the paper's setting as trial 0")
    p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    p.add_argument("--report-only", action="store_true", help="only (re)write trials.csv, trials.md and the plots")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the training config for every trial")
    a = p.parse_args(argv)
    if a.workers is None:
        a.workers = len(a.devices.split(",")) if a.devices else 1
    if a.workers < 1 or (a.trials is not None and a.trials < 1):
        p.error("--workers and --trials must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    import optuna

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    for h in logging.getLogger("optuna").handlers:  # records of optuna's child loggers reach these handlers
        h.addFilter(_NoVoidTraceback())
    args = parse_args(argv)
    devices = parse_devices(args.devices)  # before anything is opened: a bad GPU list is the user's to fix
    out_dir = next((o.split("=", 1)[1] for o in args.overrides if _key(o) == "out_dir"), "results")
    url = args.storage or default_storage(out_dir, args.study)
    storage = make_storage(url, args.heartbeat)
    with storage_errors(url):  # a damaged SQLite file may open and fail only at the first query
        stored = stored_settings(storage, args.study)
    if args.report_only:
        if stored is None:
            raise UserError(f"no study {args.study!r} in {url}")
        study = optuna.load_study(study_name=args.study, storage=storage)
        for f in write_report(study, Path(stored.get("out_dir", out_dir)) / "sweeps" / args.study):
            print(f"[sweep] wrote {f}")
        return 0
    try:
        sweep = build_sweep(args.study, tuple(args.overrides) or tuple((stored or {}).get("overrides", ())),
                            args.scale or (stored or {}).get("scale", "smoke"),
                            args.objective or (stored or {}).get("objective", "val_acc"))
        if args.trials is None:
            args.trials = 16 if stored is None else optuna.load_study(study_name=args.study, storage=storage) \
                .user_attrs.get("n_trials", 16)
        study = open_study(sweep, storage, make_pruner(args.pruner, sweep.steps), args.trials, not args.no_baseline)
    except UserError:
        raise
    except ValueError as e:  # bad settings (ConfigError included): one clear line, no traceback
        raise UserError(str(e)) from None
    print(f"[sweep] study {args.study} ({url}): {args.trials} trials, objective {sweep.objective}, scale "
          f"{sweep.scale}, overrides {list(sweep.overrides)}", flush=True)
    t0, code = time.perf_counter(), 0
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):  # running trials are re-enqueued (see _sigterm_to_interrupt)
            signal.signal(sig, _sigterm_to_interrupt)
        if args.workers > 1:
            code = spawn_workers(args, args.workers, url, devices)
        else:
            if devices:  # this process is the one worker (CUDA is not initialised yet)
                os.environ["CUDA_VISIBLE_DEVICES"] = devices[0]
            Worker(sweep, study, args.trials, args.seed, args.worker_tag or "0",
                   poll_s=min(5.0, args.heartbeat), startup_trials=args.startup_trials).run()
    except KeyboardInterrupt:
        code = 130
    finally:
        if not args.no_report:
            counted, pending, _ = census(study.get_trials(deepcopy=False))
            print(f"[sweep] {len(counted)}/{args.trials} trials finished, {len(pending)} pending, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            for f in write_report(study, sweep.dir):
                print(f"[sweep] wrote {f}", flush=True)
    return code


if __name__ == "__main__":
    cli_main(main)
