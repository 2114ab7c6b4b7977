"""Run directories under faults: a corrupt metrics line, deleted metrics, two writers at once, a truncated
checkpoint, a full disk, an unreadable summary. No line up to the resumed checkpoint is ever lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qerl.errors import UserError, cli_main
from qerl.results import ResultsWarning, RunWriter, load_runs, read_jsonl, verify_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# pytest.warns checks the warning each test is about; the others a resume also gives are expected
pytestmark = pytest.mark.filterwarnings("ignore::qerl.runfiles.ResultsWarning")


def _state(step: int) -> dict:
    return {"step": step, "trainable": {"w": torch.full((64,), float(step))}}


def _run(tmp_path: Path, steps: int = 10, ckpts=(4, 8), keep: int = 2) -> RunWriter:
    """A run directory as a killed run leaves it: ``steps`` metrics lines, checkpoints at ``ckpts``."""
    w = RunWriter(tmp_path / "run", keep_checkpoints=keep)
    for s in range(1, steps + 1):
        w.log(s, reward=s / 100, entropy=1.0 - s / 100)
        if s in ckpts:
            w.save_checkpoint(s, _state(s))
    return w


def _lines(w: RunWriter) -> list[str]:
    return w.metrics_path.read_text().splitlines()


def _corrupt_line(w: RunWriter, step: int, text: str = '{"step": 3, "rew') -> list[str]:
    lines = _lines(w)
    good = list(lines)
    lines[step - 1] = text
    w.metrics_path.write_text("\n".join(lines) + "\n")
    return good


# ------------------------------------------------------------------------------------------------- metrics lines
def test_a_corrupt_middle_line_is_skipped_with_its_file_and_line(tmp_path):
    w = _run(tmp_path, ckpts=())
    _corrupt_line(w, 3)
    with pytest.warns(ResultsWarning, match=r"metrics\.jsonl:3: skipping a corrupt line"):
        rows = read_jsonl(w.metrics_path)
    assert [r["step"] for r in rows] == [1, 2, 4, 5, 6, 7, 8, 9, 10]  # the lines after it are still read


def test_a_torn_last_line_is_dropped_silently(tmp_path, recwarn):
    w = _run(tmp_path, steps=3, ckpts=())
    with open(w.metrics_path, "a") as f:
        f.write('{"step": 4, "rew')  # killed mid-append
    assert [r["step"] for r in read_jsonl(w.metrics_path)] == [1, 2, 3]
    assert not [x for x in recwarn if issubclass(x.category, ResultsWarning)]


def test_resume_keeps_every_valid_line_up_to_the_checkpoint_and_the_corrupt_original(tmp_path):
    w = _run(tmp_path)
    good = _corrupt_line(w, 9, "\x00\x00garbage")  # after the step-8 checkpoint
    original = w.metrics_path.read_bytes()
    with pytest.warns(ResultsWarning, match=r"metrics\.jsonl:9"):
        k, state = w.resume()
    assert k == 8 and torch.equal(state["trainable"]["w"], _state(8)["trainable"]["w"])
    assert _lines(w) == good[:8]  # byte-for-byte the lines of steps 1..8
    (kept,) = w.dir.glob("metrics.jsonl.corrupt-*")
    assert kept.read_bytes() == original


def test_resume_falls_back_to_a_checkpoint_whose_steps_the_metrics_hold(tmp_path):
    # step 7's line is lost: the step-8 checkpoint cannot be resumed consistently, the step-4 one can
    w = _run(tmp_path)
    good = _corrupt_line(w, 7)
    with pytest.warns(ResultsWarning, match=r"not resuming from .*step_0000008: .*no line for step 7"):
        k, _ = w.resume()
    assert k == 4 and _lines(w) == good[:4]
    assert [p.name for p in w.checkpoints()] == ["step_0000004"]
    assert len(list((w.dir / "checkpoints").glob("step_0000008.unused-*"))) == 1  # set aside, not deleted


def test_resume_refuses_when_no_checkpoint_is_covered_and_changes_nothing(tmp_path):
    w = _run(tmp_path)
    _corrupt_line(w, 3)
    before = w.metrics_path.read_bytes()
    with pytest.raises(UserError, match=r"cannot resume .*: step_0000008, step_0000004: .*metrics\.jsonl has no line "
                                        r"for step 3 \(corrupt: line 3\)\. Restore metrics\.jsonl"):
        w.resume()
    assert w.metrics_path.read_bytes() == before  # never rewritten past the bad line
    assert [p.name for p in w.checkpoints()] == ["step_0000004", "step_0000008"]


def test_deleted_metrics_with_checkpoints_kept_refuses(tmp_path):
    w = _run(tmp_path)
    w.metrics_path.unlink()
    with pytest.raises(UserError, match=r"step_0000008, step_0000004: .*metrics\.jsonl is missing\. Restore metrics"):
        w.resume()
    assert [p.name for p in w.checkpoints()] == ["step_0000004", "step_0000008"]


def test_training_refuses_to_resume_without_its_metrics_before_building_the_model(tmp_path):
    # the audit's probe: metrics.jsonl deleted, checkpoints kept. It used to "resume", and summary.json said
    # finished with reward_first taken from a later step.
    from qerl.config import load_config
    from qerl.train import run

    cfg = load_config(["scale=smoke", "train.steps=4", f"out_dir={tmp_path}", "train.progress=false"])
    w = RunWriter(cfg.run_dir)
    w.save_checkpoint(2, _state(2))
    w.close()
    with pytest.raises(UserError, match=r"cannot resume .*metrics\.jsonl is missing"):
        run(cfg)
    assert not (cfg.run_dir / "summary.json").exists()


def test_duplicate_steps_are_never_kept(tmp_path):
    # two unlocked writers interleaved their lines (1, 1, 2, 2, 3): which copy belongs to the checkpoint is unknown
    w = RunWriter(tmp_path / "run")
    for s in (1, 1, 2, 2, 3):
        w.log(s, reward=0.1)
    w.save_checkpoint(2, _state(2))
    with pytest.raises(UserError, match=r"repeats steps \(step 1 on lines 1, 2; step 2 on lines 3, 4"):
        w.resume()
    # duplicates past the checkpoint are dropped with the rest of those lines
    w2 = RunWriter(tmp_path / "b")
    for s in (1, 2, 3, 3):
        w2.log(s, reward=0.1)
    w2.save_checkpoint(2, _state(2))
    assert w2.resume()[0] == 2 and [r["step"] for r in read_jsonl(w2.metrics_path)] == [1, 2]


def test_eval_lines_are_cut_back_with_the_metrics(tmp_path):
    w = _run(tmp_path, steps=6, ckpts=(4,))
    for s in (2, 4, 4, 6):
        w.log_eval(s, {"toy": {"pass@1": s / 10}})
    assert w.resume()[0] == 4
    assert [(r["step"], r["toy"]["pass@1"]) for r in read_jsonl(w.dir / "eval.jsonl")] == [(2, 0.2), (4, 0.4)]


# ------------------------------------------------------------------------------------------------- the lock
_HOLD = """
import sys, time
from qerl.results import RunWriter
w = RunWriter(sys.argv[1])
w.log(1, reward=0.5)
print("holding", flush=True)
time.sleep(600)
"""


def test_a_second_writer_of_a_run_directory_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert p.stdout.readline().strip() == "holding"
        with pytest.raises(UserError, match=rf"run directory {run} is in use by pid {p.pid} on host \S+"):
            RunWriter(run)
        assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1]  # the refused writer wrote nothing
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # SIGKILL left no stale lock: the next writer (a resume) gets the directory
    with RunWriter(run) as w:
        w.log(2, reward=0.5)
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2]


def test_writers_of_one_process_share_the_lock_until_the_last_closes(tmp_path):
    a = RunWriter(tmp_path)
    b = RunWriter(tmp_path)  # e.g. evaluation after training, in the same process
    a.close()
    code = f"from qerl.results import RunWriter; RunWriter({str(tmp_path)!r})"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    busy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert busy.returncode != 0 and "is in use by pid" in busy.stderr
    b.close()
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).returncode == 0


# ------------------------------------------------------------------------------------------------- checkpoints
def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    w = _run(tmp_path)
    assert json.loads((w.checkpoint_dir(8) / "sha256.json").read_text()).keys() == {"state.pt"}
    bad = w.checkpoint_dir(8) / "state.pt"
    bad.write_bytes(bad.read_bytes()[:-300])
    assert "does not match the sha256" in verify_checkpoint(w.checkpoint_dir(8))
    with pytest.warns(ResultsWarning, match=rf"{bad}"):
        k, state = w.resume()
    assert k == 4 and torch.equal(state["trainable"]["w"], _state(4)["trainable"]["w"])
    assert [r["step"] for r in read_jsonl(w.metrics_path)] == [1, 2, 3, 4]
    assert len(list((w.dir / "checkpoints").glob("step_0000008.corrupt-*"))) == 1
    # the fallback is durable: the set-aside checkpoint no longer counts for rotation or a later resume
    w.save_checkpoint(6, _state(6))
    assert [p.name for p in w.checkpoints()] == ["step_0000004", "step_0000006"]


def test_no_intact_checkpoint_is_an_error_naming_each(tmp_path):
    w = _run(tmp_path)
    for s in (4, 8):
        p = w.checkpoint_dir(s) / "state.pt"
        p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(UserError, match=r"step_0000008: .*step_0000008/state\.pt does not match.*"
                                        r"step_0000004: .*step_0000004/state\.pt does not match.*No intact checkpoint"):
        w.resume()


def test_a_checkpoint_without_checksums_is_checked_through_its_zip(tmp_path):
    # saved before checksums were recorded: torch.save's zip container carries CRCs
    w = _run(tmp_path, steps=4, ckpts=(2, 4))
    for s in (2, 4):
        (w.checkpoint_dir(s) / "sha256.json").unlink()
    assert verify_checkpoint(w.checkpoint_dir(4)) is None
    p = w.checkpoint_dir(4) / "state.pt"
    p.write_bytes(p.read_bytes()[:-300])
    assert "not a readable checkpoint" in verify_checkpoint(w.checkpoint_dir(4))
    with pytest.warns(ResultsWarning, match="step_0000004"):
        assert w.resume()[0] == 2


def test_a_checkpoint_killed_midway_leaves_nothing_that_counts(tmp_path):
    w = _run(tmp_path, steps=4, ckpts=(2,))
    (w.dir / "checkpoints" / "step_0000004.tmp").mkdir()
    (w.dir / "checkpoints" / "step_0000004.tmp" / "state.pt").write_bytes(b"PK\x03\x04partial")
    assert w.resume()[0] == 2
    assert sorted(p.name for p in (w.dir / "checkpoints").iterdir()) == ["step_0000002"]


# ------------------------------------------------------------------------------------------------- a full disk
_FULL_DISK = """
import json, sys, torch
from pathlib import Path
from qerl.errors import UserError
from qerl.results import RunWriter, atomic_write_text, read_jsonl
d = Path(sys.argv[1]) / "run"
w = RunWriter(d)
out = {}
try:
    w.save_checkpoint(1, {"w": torch.zeros(200_000)})  # 800 KB into 256 KB
except UserError as e:
    out["ckpt"] = str(e)
out["ckpt_dir"] = sorted(p.name for p in (d / "checkpoints").iterdir())
try:
    atomic_write_text(d / "summary.json", "x" * 400_000)
except UserError as e:
    out["summary"] = str(e)
out["files"] = sorted(p.name for p in d.iterdir())
try:
    for s in range(1, 100_000):
        w.log(s, reward=0.5, pad="y" * 200)
except UserError as e:
    out["log"] = str(e)
rows = read_jsonl(d / "metrics.jsonl")
out["steps_ok"] = [r["step"] for r in rows] == list(range(1, len(rows) + 1))
out["ends_with_newline"] = (d / "metrics.jsonl").read_bytes().endswith(b"\\n")
print(json.dumps(out))
"""


def test_a_full_disk_names_the_file_and_leaves_no_temporary_behind(tmp_path):
    """A real full disk: a 256 KiB tmpfs mounted in a private user+mount namespace (skipped where unavailable)."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare not available")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    script = textwrap.dedent(f"""
        mount -t tmpfs -o size=256k tmpfs {mnt} || exit 77
        exec {sys.executable} -c "$0" {mnt}
    """)
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, _FULL_DISK],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    if r.returncode == 77 or "unshare failed" in r.stderr or "Operation not permitted" in r.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    run = f"{mnt}/run"
    assert out["ckpt"].startswith(f"no space left writing {run}/checkpoints/step_0000001")
    assert out["ckpt_dir"] == []  # no orphan step_0000001.tmp
    assert out["summary"].startswith(f"no space left writing {run}/summary.json")
    assert "summary.json.tmp" not in out["files"]
    assert out["log"].startswith(f"no space left writing {run}/metrics.jsonl")
    assert out["steps_ok"] and out["ends_with_newline"]  # no half line left for a resume to trip on


# ------------------------------------------------------------------------------------------------- summaries
def test_an_unreadable_summary_skips_that_run_only(tmp_path):
    for name in ("a", "b"):
        w = RunWriter(tmp_path / name)
        (w.dir / "config.yaml").write_text(f"run_name: {name}\n")
        w.write_summary({"finished": True, "eval": {"toy": {"pass@1": 0.5}}})
        w.close()
    s = tmp_path / "b" / "summary.json"
    s.write_text(s.read_text()[:20])
    with pytest.warns(ResultsWarning, match=rf"skipping run {tmp_path / 'b'}: {s} is unreadable"):
        df = load_runs(tmp_path)
    assert list(df["cfg.run_name"]) == ["a"]
    # the writer of that run sets the torn file aside and writes a whole one
    w = RunWriter(tmp_path / "b")
    with pytest.warns(ResultsWarning, match="unreadable"):
        assert not w.is_finished()
    with pytest.warns(ResultsWarning, match=r"kept as summary\.json\.corrupt-"):
        w.write_summary({"finished": True})
    assert json.loads(s.read_text()) == {"finished": True}


# ------------------------------------------------------------------------------------------------- entry points
def test_cli_main_prints_a_user_error_as_one_line_and_exits_2(capsys):
    def main(argv):
        if argv == ["bad"]:
            raise UserError("bad value 'x'\nchoose one of [a, b]")
        if argv == ["bug"]:
            raise KeyError("a bug keeps its traceback")
        return 3

    with pytest.raises(SystemExit) as e:
        cli_main(main, ["bad"])
    assert e.value.code == 2
    assert capsys.readouterr().err == f"{__name__}: error: bad value 'x' choose one of [a, b]\n"
    with pytest.raises(SystemExit) as e:
        cli_main(main, ["ok"])
    assert e.value.code == 3
    with pytest.raises(KeyError):
        cli_main(main, ["bug"])


def test_a_signal_during_a_checkpoint_write_arrives_after_it(tmp_path):
    """A sweep turns SIGTERM into KeyboardInterrupt; arriving in the middle of a checkpoint write it used to leave
    no checkpoint (and, inside torch.save, a RuntimeError instead of the interrupt). Now the write finishes and the
    interrupt is raised right after it."""
    import signal

    import torch

    from qerl.results import RunWriter

    def to_interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, to_interrupt)
    try:
        w = RunWriter(tmp_path / "run", "{}\n")
        with pytest.raises(KeyboardInterrupt):
            w.save_checkpoint(1, {"x": torch.arange(10)},
                              extra_files={"mid.txt": lambda p: (os.kill(os.getpid(), signal.SIGTERM),
                                                                  p.write_text("written after the signal"))})
        assert signal.getsignal(signal.SIGTERM) is to_interrupt  # the handler is back
        ck = tmp_path / "run" / "checkpoints" / "step_0000001"
        assert (ck / "mid.txt").read_text() == "written after the signal"
        assert torch.equal(torch.load(ck / "state.pt")["x"], torch.arange(10))
        w.close()
    finally:
        signal.signal(signal.SIGTERM, old)
