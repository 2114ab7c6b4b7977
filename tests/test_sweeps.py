"""AQN sweeps: sampled parameters reach the run, pruning stops a run, failures are recorded, the trial budget is
counted right, SIGKILLed workers are retried on rerun, two workers share one SQLite study, the report is written."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from qerl.results import read_jsonl
from sweeps.aqn import (
    Worker,
    build_sweep,
    default_storage,
    make_storage,
    open_study,
    suggest,
    trial_overrides,
)
from sweeps.report import census, run_values, trials_frame, void_reason, write_report

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
optuna.logging.set_verbosity(optuna.logging.WARNING)

# Small but real training runs of the committed toy smoke model (scale=smoke): a few seconds a trial.
FAST = ["train.steps=3", "train.batch_size=8", "algo.group_size=4", "train.micro_batch=8",
        "data.max_new_tokens=16", "eval.limit=4", "eval.n_samples=1", "eval.max_new_tokens=16", "algo.ppo_epochs=1",
        "train.save_every=1", "train.progress=false"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: the 2 shared cores run other jobs too, and 2-thread OpenMP regions stall badly when a core is
    taken (a 0.1 s step was seen taking 12 s)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _setup(tmp_path, name, extra=(), pruner=None, n=1, objective="val_acc"):
    sweep = build_sweep(name, (*FAST, f"out_dir={tmp_path}", *extra), "smoke", objective)
    storage = make_storage(default_storage(tmp_path, name), heartbeat=1)
    study = open_study(sweep, storage, pruner or optuna.pruners.NopPruner(), n, baseline=False)
    return sweep, study


def _acc(row):
    return row.get("rewards/accuracy/mean", row["reward"])


def test_sampled_parameters_become_the_run_config_and_drive_sigma(tmp_path):
    sweep, study = _setup(tmp_path, "wire")
    p = {"sigma_start": 0.0123, "sigma_ratio": 0.037, "stages": 3, "schedule": "cosine"}
    study.enqueue_trial(p)
    assert Worker(sweep, study, n_trials=1).run() == 1
    (t,) = study.get_trials()
    assert t.state == TrialState.COMPLETE
    run = tmp_path / "sweeps" / "wire" / "trial_0"
    assert Path(t.user_attrs["run_dir"]) == run
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    s_end = 0.0123 * 0.037
    assert cfg["aqn"]["enabled"] and cfg["aqn"]["mode"] == "paper"
    assert (cfg["aqn"]["sigma_start"], cfg["aqn"]["sigma_end"]) == (0.0123, s_end)  # exact: repr round-trips
    assert (cfg["aqn"]["stages"], cfg["aqn"]["schedule"]) == (3, "cosine")
    assert cfg["experiment"] == "sweeps/wire" and cfg["run_name"] == "trial_0"
    assert cfg["tags"] == {"sweep": "wire", "trial": 0}
    assert (cfg["train"]["steps"], cfg["algo"]["group_size"], cfg["scale"]) == (3, 4, "smoke")  # overrides reach it
    # σ per step, by hand (paper mode, 3 steps / 3 stages): stage 0 noise-free, stage 1 σ_start (u = 0),
    # stage 2 cosine at u = 1/2: σ_end + (σ_start − σ_end)(1 + cos(π/2))/2 = (σ_start + σ_end)/2.
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["sigma"] for r in rows] == pytest.approx([0.0, 0.0123, (0.0123 + s_end) / 2], rel=1e-12)
    # the objective is the summary's pass@1 (mean over eval sets); reward_area the mean accuracy reward
    summary = json.loads((run / "summary.json").read_text())
    passes = [v["pass@1"] for v in summary["eval"].values()]
    assert t.value == pytest.approx(sum(passes) / len(passes))
    accs = [_acc(r) for r in rows]
    assert t.user_attrs["reward_area"] == pytest.approx(sum(accs) / 3)
    assert t.intermediate_values == pytest.approx({s: sum(accs[:s]) / s for s in (1, 2, 3)})
    # a FixedTrial samples the same mapping: σ_end = σ_start · ratio
    got = suggest(optuna.trial.FixedTrial(p), sweep.space)
    assert got == {**p, "sigma_end": s_end}
    assert f"aqn.sigma_end={s_end!r}" in trial_overrides(sweep, got, 7)


def test_sigterm_mid_trial_reenqueues_it_and_the_retry_resumes_its_run(tmp_path):
    from sweeps.aqn import _sigterm_to_interrupt

    sweep, study = _setup(tmp_path, "term")
    study.enqueue_trial({"sigma_start": 0.03, "sigma_ratio": 0.01, "stages": 3, "schedule": "linear"})
    run = tmp_path / "sweeps" / "term" / "trial_0"

    def shoot():  # SIGTERM this process once step 2 is logged (a checkpoint exists from step 1)
        while len(read_jsonl(run / "metrics.jsonl")) < 2:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
        threading.Thread(target=shoot, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            Worker(sweep, study, n_trials=1).run()
    finally:
        signal.signal(signal.SIGTERM, old)
    dead, retry = study.get_trials()
    assert dead.state == TrialState.FAIL and retry.state == TrialState.WAITING and retry.params == dead.params
    assert not (run / "summary.json").exists()
    Worker(sweep, study, n_trials=1).run()
    retry = study.get_trials()[1]
    assert retry.state == TrialState.COMPLETE and retry.user_attrs["run_dir"] == str(run)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert retry.intermediate_values.keys() == {1, 2, 3}  # steps before the checkpoint reported from metrics.jsonl
    assert len(census(study.get_trials())[0]) == 1


def test_sigterm_inside_a_storage_transaction_lands_after_it(tmp_path):
    """A SIGTERM that arrives while the main thread is inside a storage transaction (here: from SQLAlchemy's commit hook
    of trial.report's write, after BEGIN IMMEDIATE) is held until the call has returned: the write commits, the
    interrupt follows, and the next writes (the trial marked failed, as Worker does) find no transaction left open.
    Raised inside, it used to leave the connection in its transaction: the next write failed ("cannot start a
    transaction within a transaction" here; "database is locked" from another connection after the busy timeout, as
    test_sigterm_mid_trial_... did once)."""
    from sqlalchemy import event

    from sweeps.aqn import _sigterm_to_interrupt

    _, study = _setup(tmp_path, "held")
    storage = study._storage
    engine = getattr(storage, "engine", None) or storage._backend.engine  # RDBStorage, or wrapped in a cache
    trial = study.ask()
    fired = []

    def _term_in_commit(conn):
        if not fired:
            fired.append(time.perf_counter())
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here, between this hook's bytecodes
            time.sleep(0.05)

    event.listen(engine, "commit", _term_in_commit)
    old = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt, match="signal 15"):
            trial.report(0.5, 1)
            time.sleep(5)  # the interrupt arrives here, once the write has returned
    finally:
        signal.signal(signal.SIGTERM, old)
        event.remove(engine, "commit", _term_in_commit)
    assert fired and time.perf_counter() - fired[0] < 4
    assert study.get_trials()[0].intermediate_values == {1: 0.5}  # the write committed
    study.tell(trial, state=TrialState.FAIL)
    trial2 = study.ask()
    trial2.report(0.25, 1)
    assert [t.state for t in study.get_trials()] == [TrialState.FAIL, TrialState.RUNNING]


def test_build_sweep_space_and_refusals(tmp_path):
    sw = build_sweep("s", (*FAST, "train.steps=5"), "smoke")
    assert sw.space["stages"] == [2, 5] and sw.steps == 5  # paper mode needs steps >= stages
    assert build_sweep("s", (*FAST, "train.steps=40", "aqn.mode=official"), "smoke").space["stages"] == [3, 12]
    assert set(sw.space["schedule"]) == {"exponential", "linear", "cosine", "logarithmic"}
    for bad, needle in [(["aqn.sigma_start=0.1"], "aqn.sigma_start"), (["run_name=x"], "run_name"),
                        (["aqn=off"], "AQN enabled"), (["scale=toy"], "--scale"), (["train.steps=1"], "stages")]:
        with pytest.raises(ValueError, match=needle.replace(".", r"\.").replace("-", r"\-")):
            build_sweep("s", (*FAST, *bad), "smoke")
    with pytest.raises(ValueError, match="reward_area"):
        build_sweep("s", FAST, "smoke", "accuracy")
    # a rerun with other settings is refused; the stored ones are kept
    sweep, study = _setup(tmp_path, "same")
    other = build_sweep("same", (*FAST, f"out_dir={tmp_path}", "quant=nf4"), "smoke")
    with pytest.raises(ValueError, match="other settings"):
        open_study(other, make_storage(default_storage(tmp_path, "same")))
    assert study.user_attrs["sweep"]["overrides"] == list(sweep.overrides)
    # the resolved base config is stored: if a YAML default changes later, the study refuses to mix the two
    assert study.user_attrs["sweep"]["base"]["train.steps"] == 3 and "aqn.sigma_start" not in sweep.base
    drifted = dataclasses.replace(sweep, base={**sweep.base, "optim.lr": 0.5})
    with pytest.raises(ValueError, match="base config.*optim.lr"):
        open_study(drifted, make_storage(default_storage(tmp_path, "same")))
    # ... and a worker that finds the drift mid-study voids the trial (not counted) and stops
    with pytest.raises(SystemExit, match="optim.lr"):
        Worker(drifted, study, n_trials=1).run()
    (t,) = study.get_trials()
    assert t.state == TrialState.FAIL and "optim.lr" in t.user_attrs["void"] and not census([t])[0]
    assert not (tmp_path / "sweeps" / "same" / "trial_0").exists()  # nothing was trained


def test_a_pruned_trial_stops_its_run(tmp_path):
    # a real Optuna pruner that prunes any running reward below 2 (rewards are <= 1): at step 1, once
    sweep, study = _setup(tmp_path, "prune", pruner=optuna.pruners.ThresholdPruner(lower=2.0))
    Worker(sweep, study, n_trials=1).run()
    (t,) = study.get_trials()
    assert t.state == TrialState.PRUNED
    run = Path(t.user_attrs["run_dir"])
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]  # stopped after the first of 3 steps
    assert not (run / "summary.json").exists()
    assert t.intermediate_values == pytest.approx({1: _acc(rows[0])})


def test_a_failed_trial_is_recorded_and_the_study_goes_on(tmp_path):
    sweep, study = _setup(tmp_path, "fail", n=2)
    study.enqueue_trial({"sigma_start": 0.01, "sigma_ratio": 0.1, "stages": 1, "schedule": "linear"})  # K=1: invalid
    study.enqueue_trial({"sigma_start": 0.02, "sigma_ratio": 0.1, "stages": 2, "schedule": "linear"})
    assert Worker(sweep, study, n_trials=2).run() == 2
    bad, good = study.get_trials()
    assert bad.state == TrialState.FAIL and "stages" in bad.user_attrs["error"]
    assert good.state == TrialState.COMPLETE
    counted, pending, _ = census(study.get_trials())
    assert len(counted) == 2 and not pending  # a FAIL of its own counts toward the budget


def _synthetic_study(tmp_path):
    """Every state the budget has to tell apart, and run directories with hand-made metrics."""
    dists = {"sigma_start": FloatDistribution(1e-3, 1e-1, log=True), "sigma_ratio": FloatDistribution(1e-3, 0.5, log=True),
             "stages": IntDistribution(2, 12), "schedule": CategoricalDistribution(["exponential", "linear"])}

    def run_dir(n, accs, passes=None):
        d = tmp_path / f"trial_{n}"
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "rewards/accuracy/mean": a}) + "\n"
                                                 for i, a in enumerate(accs)))
        if passes is not None:
            (d / "summary.json").write_text(json.dumps({"finished": True, "eval": {
                s: {"pass@1": v} for s, v in passes.items()}}))
        return str(d)

    study = optuna.create_study(direction="maximize")
    P = lambda s, r, k: {"sigma_start": s, "sigma_ratio": r, "stages": k, "schedule": "linear"}
    add = lambda **kw: study.add_trial(create_trial(distributions=dists, **kw))
    add(state=TrialState.COMPLETE, value=0.4, params=P(0.01, 0.05, 10),
        user_attrs={"run_dir": run_dir(0, [0.25, 0.75], {"toy": 0.5, "gsm8k": 0.3})})
    add(state=TrialState.PRUNED, params=P(0.05, 0.5, 3), intermediate_values={1: 0.125},
        user_attrs={"run_dir": run_dir(1, [0.125])})
    add(state=TrialState.FAIL, params=P(0.002, 0.01, 4), user_attrs={"error": "ValueError: bad K"})
    add(state=TrialState.FAIL, params=P(0.003, 0.02, 5))                              # worker died ...
    add(state=TrialState.WAITING, params=P(0.003, 0.02, 5), system_attrs={"failed_trial": 3, "retry_history": [3]})
    add(state=TrialState.FAIL, params=P(0.004, 0.02, 6), user_attrs={"void": "surplus: the study already holds 4 trials"})
    add(state=TrialState.RUNNING, params=P(0.005, 0.03, 7))
    add(state=TrialState.COMPLETE, value=0.9, params=P(0.02, 0.2, 8))
    return study


def test_budget_census_and_run_values(tmp_path):
    study = _synthetic_study(tmp_path)
    counted, pending, retried_as = census(study.get_trials())
    assert sorted(t.number for t in counted) == [0, 1, 2, 7]  # COMPLETE, PRUNED, FAIL of its own
    assert sorted(t.number for t in pending) == [4, 6]
    assert retried_as == {3: 4}
    # a trial just opened by a worker: surplus when counted + pending opened before it fill the budget
    study.add_trial(create_trial(state=TrialState.RUNNING))
    study.add_trial(create_trial(state=TrialState.RUNNING, system_attrs={"failed_trial": 3, "retry_history": [3]}))
    trials = study.get_trials()
    assert void_reason(trials[8], trials, 7) is None
    assert void_reason(trials[8], trials, 6).startswith("surplus")  # 4 counted + trials 4 and 6 pending
    # two workers retried the same dead trial 3: the later copy (9) must not train trial 3's run directory too
    assert void_reason(trials[9], trials, 100) == "duplicate retry of trial 3 (trial 4 retries it)"
    assert void_reason(trials[4], trials, 100) is None
    # the retry (4) of dead trial 3 takes the 5th slot: 4 counted, none pending below it; trial 3 does not count
    assert void_reason(trials[4], trials[:9], 5) is None
    v = run_values(tmp_path / "trial_0")
    assert v == {"val_acc": pytest.approx(0.4), "reward_area": pytest.approx(0.5), "steps_done": 2}
    assert run_values(tmp_path / "trial_1") == {"val_acc": None, "reward_area": 0.125, "steps_done": 1}


def test_run_values_skip_an_unreadable_summary_and_a_corrupt_line(tmp_path):
    from qerl.results import ResultsWarning

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.2}\n{"ste\n{"step": 3, "reward": 0.4}\n')
    (tmp_path / "summary.json").write_text('{"finished": true, "ev')
    with pytest.warns(ResultsWarning) as caught:
        v = run_values(tmp_path)
    assert v == {"val_acc": None, "reward_area": pytest.approx(0.3), "steps_done": 2}
    said = [str(w.message) for w in caught]
    assert any(f"{tmp_path / 'metrics.jsonl'}:2" in m for m in said)
    assert any(f"{tmp_path / 'summary.json'} is unreadable" in m for m in said)


def test_report_files(tmp_path):
    study = _synthetic_study(tmp_path)
    study.set_user_attr("sweep", {"objective": "val_acc", "scale": "smoke", "overrides": ["x=1"]})
    files = write_report(study, tmp_path / "rep")
    assert {f.name for f in files} == {"trials.csv", "trials.md", "history.png", "importances.png", "sigma.png"}
    for f in files:
        assert f.stat().st_size > 100
        if f.suffix == ".png":
            assert f.read_bytes()[:4] == b"\x89PNG"
    import pandas as pd

    df = pd.read_csv(tmp_path / "rep" / "trials.csv")
    assert list(df.number) == list(range(8))
    r0 = df.iloc[0]
    assert (r0.state, r0.val_acc, r0.reward_area, r0.steps_done) == ("COMPLETE", 0.4, 0.5, 2)
    assert r0.sigma_end == pytest.approx(0.01 * 0.05)
    assert df.iloc[3].error == "worker lost; retried as trial 4" and df.iloc[4].retry_of == 3
    assert df.iloc[2].error == "ValueError: bad K" and df.iloc[5].error.startswith("surplus")
    assert list(df.counted) == [True, True, True, False, False, False, False, True]
    md = (tmp_path / "rep" / "trials.md").read_text()
    assert "best: trial 7" in md and "| 3 | FAIL |" in md
    assert trials_frame(study).shape[0] == 8


def _cmd(tmp_path, study, trials, workers, extra=()):
    return [sys.executable, "-m", "sweeps.aqn", "--study", study, "--trials", str(trials), "--workers", str(workers),
            "--heartbeat", "2", "--pruner", "none", *FAST, f"out_dir={tmp_path}", *extra]


def _load(tmp_path, study):
    return optuna.load_study(study_name=study, storage=make_storage(default_storage(tmp_path, study), 1))


_ASK = """
import sys, time, warnings
warnings.simplefilter("ignore")
import optuna
optuna.logging.set_verbosity(optuna.logging.ERROR)
from sweeps.aqn import make_storage
study = optuna.load_study(study_name="race", storage=make_storage(sys.argv[1], 5))
study.get_trials()
while time.time() < float(sys.argv[2]):
    pass
print(study.ask().number)
"""


def test_sqlite_waiting_trial_is_popped_by_one_process_only(tmp_path):
    # Optuna relies on SELECT ... FOR UPDATE, which SQLite ignores: without BEGIN IMMEDIATE several processes asking
    # at the same instant all get the enqueued trial 0 and train the same run (seen here: 8 extra pops in 4 rounds).
    for rep in range(2):
        url = f"sqlite:///{tmp_path / f'race{rep}.db'}"
        study = optuna.create_study(study_name="race", storage=make_storage(url, 5))
        study.enqueue_trial({"x": 1.0})
        t0 = time.time() + 4
        procs = [subprocess.Popen([sys.executable, "-c", _ASK, url, str(t0)], stdout=subprocess.PIPE, text=True)
                 for _ in range(5)]
        numbers = sorted(int(p.communicate(timeout=120)[0]) for p in procs)
        assert numbers == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_two_workers_share_one_sqlite_study(tmp_path):
    res = subprocess.run(_cmd(tmp_path, "pair", 4, 2, ["train.steps=2"]), capture_output=True, text=True, timeout=600,
                         env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    trials = _load(tmp_path, "pair").get_trials()
    counted, pending, _ = census(trials)
    assert [t.state for t in counted] == [TrialState.COMPLETE] * 4 and not pending, res.stdout[-3000:]
    # both workers may open a trial at the very moment the last slot goes: the later one is void, trains nothing
    assert all(t.user_attrs["void"].startswith("surplus") for t in trials if t not in counted)
    assert len({t.user_attrs["worker"].rsplit(":", 1)[1] for t in counted}) == 2  # both workers ran trials
    assert trials[0].params == {"sigma_start": 0.01, "sigma_ratio": 0.05, "stages": 2, "schedule": "exponential"}
    runs = sorted(p.name for p in (tmp_path / "sweeps" / "pair").glob("trial_*"))
    assert runs == sorted(f"trial_{t.number}" for t in counted)  # one run directory per trial, none shared
    assert sorted(t.user_attrs["run_dir"] for t in counted) == sorted(str(tmp_path / "sweeps" / "pair" / r)
                                                                       for r in runs)
    assert "[w0]" in res.stdout and "[w1]" in res.stdout
    assert (tmp_path / "sweeps" / "pair" / "trials.csv").exists()


@pytest.mark.slow
def test_sigkill_mid_trial_then_rerun_finishes_the_study(tmp_path):
    env = ENV
    sdir = tmp_path / "sweeps" / "res"
    p = subprocess.Popen(_cmd(tmp_path, "res", 3, 1), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    deadline, victim = time.time() + 400, None
    while time.time() < deadline and victim is None:  # kill once a trial has a checkpoint but no summary
        for d in sdir.glob("trial_*"):
            if list((d / "checkpoints").glob("step_*[0-9]")) and not (d / "summary.json").exists():
                victim = d
        time.sleep(0.05)
    assert victim is not None, "no trial reached its first checkpoint"
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    before = _load(tmp_path, "res").get_trials()
    assert [t.state for t in before].count(TrialState.RUNNING) == 1
    killed = next(t for t in before if t.state == TrialState.RUNNING)
    res = subprocess.run(_cmd(tmp_path, "res", 3, 1), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    after = _load(tmp_path, "res").get_trials()
    assert not [t for t in after if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    counted, _, retried_as = census(after)
    assert len(counted) == 3 and all(t.state == TrialState.COMPLETE for t in counted)
    assert after[killed.number].state == TrialState.FAIL and killed.number in retried_as
    retry = after[retried_as[killed.number]]
    assert retry.params == killed.params and retry.user_attrs["run_dir"] == str(victim)  # same run, resumed
    assert f"resuming {victim}" in res.stdout
    assert [r["step"] for r in read_jsonl(victim / "metrics.jsonl")] == [1, 2, 3]
    assert (sdir / "trials.csv").exists() and (sdir / "sigma.png").exists()
    assert math.isfinite(retry.value)


def _cli(argv):
    """``python -m sweeps.aqn argv`` in this process: (exit status, stderr lines)."""
    import contextlib
    import io

    from qerl.errors import cli_main
    from sweeps.aqn import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        cli_main(main, argv)
    return e.value.code, err.getvalue().splitlines()


def test_a_corrupt_or_truncated_sqlite_study_is_one_line_naming_the_file(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not a database, it is text\n" * 200)
    good = tmp_path / "good.db"
    study = optuna.create_study(study_name="s", storage=make_storage(f"sqlite:///{good}", 5))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=10)
    truncated = tmp_path / "truncated.db"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    for db, why in ((garbage, "file is not a database"), (truncated, "database disk image is malformed")):
        code, err = _cli(["--study", "s", "--storage", f"sqlite:///{db}", *FAST, f"out_dir={tmp_path}"])
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith(f"sweeps.aqn: error: study storage 'sqlite:///{db}': {db} is not a readable "
                                 f"SQLite study ({why})")
    # the default study file (no --storage) is named the same way
    default = tmp_path / "sweeps" / "d.db"
    default.parent.mkdir()
    shutil.copy(garbage, default)
    code, err = _cli(["--study", "d", "--report-only", f"out_dir={tmp_path}"])
    assert code == 2 and f"{default} is not a readable SQLite study" in err[0]


def test_a_bad_storage_url_is_one_line_echoing_it(tmp_path):
    for url, why in (("notaurl", "is not a valid storage URL"), ("foo://bar/x", "is not a valid storage URL"),
                     ("postgresql://me:secret@localhost:1/db", "")):
        code, err = _cli(["--study", "s", "--storage", url, *FAST, f"out_dir={tmp_path}"])
        shown = url.replace(":secret@", ":***@")  # a password never reaches the log
        assert code == 2 and len(err) == 1 and err[0].startswith(f"sweeps.aqn: error: study storage {shown!r}"), err
        assert why in err[0] and "secret" not in err[0]


def test_bad_sweep_settings_are_one_line_through_the_command(tmp_path):
    code, err = _cli(["--study", "s", *FAST, "aqn=off", f"out_dir={tmp_path}"])
    assert code == 2 and err == ["sweeps.aqn: error: the sweep needs AQN enabled (drop aqn=off / aqn.enabled=false)"]
    code, err = _cli(["--study", "nope", "--report-only", f"out_dir={tmp_path}"])
    assert code == 2 and len(err) == 1 and "no study 'nope'" in err[0]
