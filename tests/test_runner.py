"""The experiment runner: rows name a registered runner; ``workers=N`` runs each row x seed as its own process
(``experiments.worker``), at most N at a time, with per-worker logs and CPU shares; a killed worker is reported, the
others are unaffected, and its row resumes exactly; the runner leaves no orphans; finished rows start nothing."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from experiments import common
from experiments.common import RUNNERS, WORKER_LOG, Row, artifact_main, run_rows, worker_env
from qerl.errors import UserError
from qerl.results import RunWriter, read_jsonl
from qerl.runfiles import atomic_write_text

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# Small but real training runs on the committed smoke model: 2 prompts x 4 samples, a checkpoint every step.
FAST = ("quant=bf16", "train.steps=5", "train.save_every=1", "train.batch_size=8", "algo.group_size=4",
        "train.micro_batch=8", "data.max_new_tokens=24", "eval.limit=2", "eval.n_samples=1", "eval.max_new_tokens=24",
        "algo.ppo_epochs=1", "train.progress=false")


def _timing(key: str) -> bool:  # wall-clock and memory readings differ between any two runs
    return key.startswith("time_") or key.endswith("_per_s") or key == "peak_mem_gib"


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs of the same config and seed logged the same steps, metrics and held-out accuracy."""
    ma, mb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == list(range(1, len(ma) + 1))
    for ra, rb in zip(ma, mb, strict=True):
        assert {k: v for k, v in ra.items() if not _timing(k)} == {k: v for k, v in rb.items() if not _timing(k)}
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["finished"] and sb["finished"] and sa["eval"]["toy"]["pass@1"] == sb["eval"]["toy"]["pass@1"]


def worker_pids(run_name: str, out_dir: Path) -> list[int]:
    """The live worker processes this test process started for ``run_name`` (found through /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (b"experiments.worker" in argv and f"run_name={run_name}".encode() in argv
                and f"out_dir={out_dir}".encode() in argv):
            pids.append(int(proc.name))
    return pids


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # a zombie has exited and waits only to be reaped by whoever adopted it


def wait_for(predicate, timeout_s: float = 600, what: str = ""):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ------------------------------------------------------------------------------------------- a probe runner
def probe(cfg) -> dict:
    """A registered runner for the tests: records what its process sees; tags.fail raises, tags.sleep blocks."""
    if cfg.tags.get("sleep"):
        atomic_write_text(cfg.run_dir / "started", str(os.getpid()))  # never seen empty by the test polling it
        time.sleep(float(cfg.tags["sleep"]))
    if cfg.tags.get("fail"):
        raise RuntimeError("probe failure, as asked")
    keys = ("OMP_NUM_THREADS", "QERL_REWARD_WORKERS", "CUDA_VISIBLE_DEVICES")
    return RunWriter(cfg.run_dir).write_summary({"finished": True, "pid": os.getpid(), "argv": sys.argv,
                                                 "torch_threads": torch.get_num_threads(),
                                                 "env": {k: os.environ.get(k) for k in keys}})


@pytest.fixture
def probe_runner(monkeypatch):
    monkeypatch.setitem(common.RUNNERS, "probe", "tests.test_runner:probe")


# ------------------------------------------------------------------------------------------------ fast tests
def test_bad_runner_name_lists_the_valid_ones(tmp_path, capsys):
    rows = [Row("ok", ()), Row("typo", (), runner="trian")]
    valid = sorted(RUNNERS)  # other modules (experiments.evidence) register theirs on import
    assert {"base", "train"} <= set(valid)
    with pytest.raises(UserError, match=re.escape(f"row 'typo': unknown runner 'trian'; valid runners: {valid}")):
        run_rows("bad", "smoke", rows, (0,), [f"out_dir={tmp_path}"], workers=2)
    assert not any(tmp_path.iterdir())  # nothing ran, not even the good row
    with pytest.raises(SystemExit) as e:  # the CLI: one line, status 2
        artifact_main("bad", lambda scale: rows, "doc", None, ["--root", str(tmp_path), "--workers", "2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == f"bad: row 'typo': unknown runner 'trian'; valid runners: {valid}"


def test_rows_sharing_a_run_directory_are_refused(tmp_path):
    rows = [Row("same", ("train.steps=2",)), Row("same", ("train.steps=3",))]
    with pytest.raises(UserError, match="rows 'same' and 'same' .* both write"):
        run_rows("dup", "smoke", rows, (0,), [f"out_dir={tmp_path}"], workers=2)


@pytest.mark.parametrize("workers", [0, 2])
def test_finished_row_is_skipped_without_starting_anything(tmp_path, workers):
    run_dir = tmp_path / "skip" / "smoke" / "done-s0"
    RunWriter(run_dir).write_summary({"finished": True})
    t0 = time.perf_counter()
    res = run_rows("skip", "smoke", [Row("done", FAST)], (0,), [f"out_dir={tmp_path}"], workers=workers)
    assert res["skipped"] == res["done"] == [str(run_dir)] and res["failed"] == []
    assert not (run_dir / WORKER_LOG).exists()  # every started worker appends to this log first
    assert not (run_dir / "metrics.jsonl").exists() and time.perf_counter() - t0 < 30


def test_worker_env_shares_the_cpu_and_respects_what_the_caller_set():
    cores = len(os.sched_getaffinity(0))
    env = worker_env(4, {"CUDA_VISIBLE_DEVICES": "1", "PATH": "/bin"})
    share = max(1, cores // 4)
    assert env["OMP_NUM_THREADS"] == str(share) and env["QERL_REWARD_WORKERS"] == str(min(4, share))
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(common.__file__).resolve().parents[1])
    env = worker_env(4, {"OMP_NUM_THREADS": "3", "QERL_REWARD_WORKERS": "5"})
    assert env["OMP_NUM_THREADS"] == "3" and env["QERL_REWARD_WORKERS"] == "5"


# ------------------------------------------------------------------------------------ worker processes
def test_registered_runner_in_workers_one_failure_does_not_stop_the_others(tmp_path, probe_runner, monkeypatch,
                                                                          capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # passed through untouched (empty: no GPU, on any host)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("QERL_REWARD_WORKERS", raising=False)
    rows = [Row("bad", ("+tags.fail=1",), runner="probe"), Row("ok", (), runner="probe")]
    res = run_rows("probe", "smoke", rows, (0,), [f"out_dir={tmp_path}"], workers=2)
    root = tmp_path / "probe" / "smoke"
    assert res["failed"] == [(str(root / "bad-s0"), "exit status 1")] and res["done"] == [str(root / "ok-s0")]
    out, err = capsys.readouterr()
    assert "probe failure, as asked" in err  # the failed row's log tail is shown
    assert out.count(" start ") == 2 and out.count(" done ") == 1
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    summary = json.loads((root / "ok-s0" / "summary.json").read_text())
    assert summary["env"] == {"OMP_NUM_THREADS": str(share), "QERL_REWARD_WORKERS": str(min(4, share)),
                              "CUDA_VISIBLE_DEVICES": ""}
    assert summary["torch_threads"] == share and summary["pid"] != os.getpid()
    assert summary["argv"][summary["argv"].index("--workers") + 1] == "2"  # what env.json's argv records
    assert "[worker]" in (root / "ok-s0" / WORKER_LOG).read_text()


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_stopping_the_runner_stops_its_workers(tmp_path, how):
    """SIGTERM: the runner terminates its workers and exits 130; SIGKILL: the workers die with it (PDEATHSIG)."""
    code = ("import sys; from experiments import common; from experiments.common import Row, artifact_main; "
            "common.RUNNERS['probe'] = 'tests.test_runner:probe'; "
            "artifact_main('stop', lambda s: [Row('a', ('+tags.sleep=600',), runner='probe'), "
            "Row('b', ('+tags.sleep=600',), runner='probe')], 'doc', None, sys.argv[1:])")
    env = dict(os.environ, PYTHONPATH=str(Path(common.__file__).resolve().parents[1]))
    runner = subprocess.Popen([sys.executable, "-c", code, "--root", str(tmp_path), "--workers", "2"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = [tmp_path / "stop" / "smoke" / f"{k}-s0" / "started" for k in "ab"]
    wait_for(lambda: all(p.exists() for p in started), 300, "both workers to start")
    pids = [int(p.read_text()) for p in started]
    os.kill(runner.pid, how)
    out, _ = runner.communicate(timeout=60)
    wait_for(lambda: all(gone(p) for p in pids), 30, f"workers {pids} to exit")
    if how == signal.SIGTERM:
        assert runner.returncode == 130, out
        assert out.count(" stopped ") == 2 and "interrupted; run the same command again to resume" in out


@pytest.mark.slow
def test_workers_give_the_same_results_as_in_process(tmp_path, monkeypatch):
    """Three rows (two trainings, one base evaluation) with 2 workers equal the in-process sequential mode, metric
    for metric; a second run of the matrix starts nothing."""
    rows = [Row("a", FAST), Row("b", (*FAST, "optim.lr=3e-3")), Row("base", FAST, runner="base")]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast as the workers' share on a 2-core host; the numbers do not depend on it
    try:
        seq = run_rows("same", "smoke", rows, (0,), [f"out_dir={tmp_path / 'seq'}"], workers=0)
    finally:
        torch.set_num_threads(threads)
    par = run_rows("same", "smoke", rows, (0,), [f"out_dir={tmp_path / 'par'}"], workers=2)
    assert seq["failed"] == par["failed"] == [] and len(seq["done"]) == len(par["done"]) == 3
    s, p = tmp_path / "seq" / "same" / "smoke", tmp_path / "par" / "same" / "smoke"
    for key in ("a-s0", "b-s0"):
        assert_same_run(s / key, p / key)
        assert any(r.get("grad_norm") for r in read_jsonl(p / key / "metrics.jsonl"))  # updates were compared
    assert (json.loads((s / "base-s0" / "summary.json").read_text())["eval"]["toy"]["pass@1"]
            == json.loads((p / "base-s0" / "summary.json").read_text())["eval"]["toy"]["pass@1"])
    logs = {k: (p / k / WORKER_LOG).read_text() for k in ("a-s0", "b-s0", "base-s0")}
    again = run_rows("same", "smoke", rows, (0,), [f"out_dir={tmp_path / 'par'}"], workers=2)
    assert len(again["skipped"]) == 3 and again["failed"] == []
    assert {k: (p / k / WORKER_LOG).read_text() for k in logs} == logs  # no worker started


@pytest.mark.slow
def test_killed_worker_fails_alone_and_its_row_resumes_exactly(tmp_path, capsys):
    """SIGKILL one worker mid-run while another runs: that row is reported failed, the other finishes; running the
    matrix again resumes the killed row from its checkpoint to the same metrics as its uninterrupted twin."""
    rows = [Row("killed", FAST), Row("twin", FAST)]  # same config and seed: the twin is the uninterrupted run
    extra = [f"out_dir={tmp_path}"]
    root = tmp_path / "kill" / "smoke"
    res = {}
    t = threading.Thread(target=lambda: res.update(run_rows("kill", "smoke", rows, (0,), extra, workers=2)))
    t.start()
    wait_for(lambda: len(read_jsonl(root / "killed-s0" / "metrics.jsonl")) >= 2, 600, "two logged steps")
    (pid,) = worker_pids("killed-s0", tmp_path)
    os.kill(pid, signal.SIGKILL)
    t.join(900)
    at_kill = len(read_jsonl(root / "killed-s0" / "metrics.jsonl"))
    assert 2 <= at_kill < 5 and not (root / "killed-s0" / "summary.json").exists()
    assert res["failed"] == [(str(root / "killed-s0"), "killed by SIGKILL")]
    assert res["done"] == [str(root / "twin-s0")]
    assert "FAILED 1/2" in capsys.readouterr().err

    again = run_rows("kill", "smoke", rows, (0,), extra, workers=2)
    assert again["failed"] == [] and again["skipped"] == [str(root / "twin-s0")]
    log = (root / "killed-s0" / WORKER_LOG).read_text()
    assert log.count("\n=== ") == 2 and "resuming" in log  # appended across attempts; resumed, not restarted
    assert_same_run(root / "killed-s0", root / "twin-s0")


@pytest.mark.slow
def test_concurrency_benchmark_on_cpu(tmp_path):
    from experiments import concurrency

    concurrency.main(["--scale", "smoke", "--workers", "1,2", "--rows", "2", "--steps", "1", "--root",
                      str(tmp_path), *FAST])  # FAST's train.steps gives way to --steps
    out = tmp_path / "concurrency" / "smoke"
    lines = list(csv.DictReader((out / "concurrency.csv").open()))
    assert [ln["workers"] for ln in lines] == ["1", "2"] and list(lines[0]) == list(concurrency.COLUMNS)
    for ln in lines:
        assert ln["rows"] == "2" and ln["steps"] == "1" and ln["device"] == "cpu"
        assert float(ln["runs_per_min"]) == pytest.approx(2 / float(ln["wall_s"]) * 60, rel=1e-2)
        runs = sorted((out / f"w{ln['workers']}").iterdir())
        assert [r.name for r in runs] == ["bench-s0", "bench-s1"]
        assert all(len(read_jsonl(r / "metrics.jsonl")) == 1 for r in runs)
        assert {yaml.safe_load((r / "config.yaml").read_text())["tags"]["workers"] for r in runs} == {int(ln["workers"])}
    assert float(lines[0]["gain_vs_1"]) == 1.0
    assert float(lines[1]["gain_vs_1"]) == pytest.approx(float(lines[1]["runs_per_min"])
                                                         / float(lines[0]["runs_per_min"]), rel=1e-2)
    assert "| 2 |" in (out / "concurrency.md").read_text()


def test_concurrency_merge_keeps_earlier_batches_and_refuses_mismatches(tmp_path):
    """--merge: an earlier one-at-a-time batch (an older CSV without `measured`) joins a new 8-worker batch; the
    gain is computed from the two; batches of other run lengths or devices are refused, naming both."""
    from experiments import concurrency

    out = tmp_path / "concurrency" / "small"
    out.mkdir(parents=True)
    (out / "concurrency.csv").write_text("workers,rows,steps,wall_s,runs_per_min,gain_vs_1,mean_run_s,device,gpu\n"
                                         "1,2,10,120.0,1.0,1.0,38.0,cuda,H100\n")
    old = concurrency.read_csv(out / "concurrency.csv")
    new = [dict(workers=8, rows=8, steps=10, wall_s=100.0, runs_per_min=4.8, mean_run_s=80.0, device="cuda",
                gpu="H100", measured="2026-11-23T21:20:00Z")]
    lines = concurrency.with_gain(concurrency.merge(old, new))
    assert [ln["workers"] for ln in lines] == [1, 8] and lines[0]["measured"] == ""
    assert lines[1]["gain_vs_1"] == pytest.approx(4.8)
    concurrency.write(lines, out, "small", [], earlier=1)
    assert "1 batch(es) kept from an earlier invocation" in (out / "concurrency.md").read_text()
    assert [r["gain_vs_1"] for r in csv.DictReader((out / "concurrency.csv").open())] == ["1.0", "4.8"]
    assert concurrency.merge(old, [dict(new[0], workers=1)]) == [dict(new[0], workers=1)]  # re-measured: replaced
    with pytest.raises(UserError, match=r"1-worker batch ran 10 steps on 'H100', this one 20 on 'H100'"):
        concurrency.merge(old, [dict(new[0], steps=20)])
    with pytest.raises(UserError, match=r"on 'H100', this one 10 on 'A100'"):
        concurrency.merge(old, [dict(new[0], gpu="A100")])
