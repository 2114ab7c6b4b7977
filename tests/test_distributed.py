"""Data-parallel training under torchrun (CPU, gloo): real processes, no mocks.

* 2 ranks = 1 rank with the same global batch: the same rewards and advantages for every completion (per-group
  sampling seeds, ``rollout.seed_scope=group``), the same LoRA weights after the updates to float tolerance, also
  with gradient accumulation (several micro-batches and minibatches) and with DAPO's dynamic sampling;
* a rank killed mid-run takes the job down within the process-group timeout, and the rerun resumes with no gap and
  no duplicate in metrics.jsonl;
* bad launches (a world size that does not divide the step's groups, device=cuda without a GPU per rank) fail with
  one clear line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qerl.dist import check_launch
from qerl.errors import UserError
from qerl.results import read_jsonl

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# The committed smoke model; 4 prompts x 4 samples per step, 2 steps (at least one with an update), one held-out
# batch per rank.
FAST = ["scale=smoke", "train.steps=2", "train.batch_size=16", "algo.group_size=4", "train.micro_batch=16",
        "data.max_new_tokens=48", "eval.limit=4", "eval.n_samples=1", "eval.max_new_tokens=24", "eval.batch_prompts=2",
        "algo.ppo_epochs=1", "train.progress=false", "optim.name=adamw", "rollout.seed_scope=group",
        "train.log_samples=true", "dist.timeout_s=30"]
TIMING = ("time_", "peak_mem_gib", "rollout_tokens_per_s")
# logged exactly the same by 1 and 2 ranks (the rollouts and rewards are the same; the rest are means whose float
# sums depend on the split: one process takes a float32 mean of the lengths, ranks a float64 sum over ranks)
EXACT = ("reward", "reward_std", "rewards/accuracy/mean", "rewards/accuracy/std", "reward_errors", "groups_kept",
         "groups_sampled", "rollout_tokens", "response_length_max", "prompts_truncated", "sigma", "lr", "updates")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(nproc: int, out: Path, name: str, extra=()) -> list[str]:
    args = ["-m", "qerl.train", *FAST, f"out_dir={out}", "experiment=dist", f"run_name={name}", *extra]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), *args]


def env() -> dict:
    # one torch thread per rank (CI has 2 cores); single-threaded reductions also keep 1 and 2 ranks comparable
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", QERL_REWARD_WORKERS="1", PYTHONUNBUFFERED="1")


def train(nproc: int, out: Path, name: str, extra=()) -> Path:
    res = subprocess.run(command(nproc, out, name, extra), env=env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return out / "dist" / name


def trainable(run: Path) -> dict[str, torch.Tensor]:
    ck = sorted((run / "checkpoints").glob("step_*"))[-1]
    return torch.load(ck / "state.pt", weights_only=False)["trainable"]


def assert_equivalent(one: Path, two: Path, fsdp: bool = False) -> None:
    ma, mb = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in ma] == [r["step"] for r in mb]
    assert any(r.get("grad_norm") for r in ma), "no step updated the weights"
    for ra, rb in zip(ma, mb, strict=True):
        assert set(ra) == set(rb)
        for k in ra:
            if k in EXACT:
                assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
            elif k.startswith("mismatch/"):  # sampler-vs-trainer rounding noise (~1e-5): other batch shapes per rank
                assert abs(rb[k] - ra[k]) <= 1e-4, (ra["step"], k, ra[k], rb[k])
            elif not k.startswith(TIMING):
                assert rb[k] == pytest.approx(ra[k], rel=1e-4, abs=1e-6), (ra["step"], k, ra[k], rb[k])
    # every completion, its reward and its advantage, in the step's group order
    sa, sb = read_jsonl(one / "samples.jsonl"), read_jsonl(two / "samples.jsonl")
    assert [s["step"] for s in sa] == [s["step"] for s in sb] == [r["step"] for r in ma]
    for a, b in zip(sa, sb, strict=True):
        assert a["groups"], "no groups were recorded"
        assert [g["group"] for g in a["groups"]] == list(range(len(a["groups"])))
        assert a["groups"] == b["groups"]
    # the trained weights (LoRA A and B of every layer): the same update from the same global batch. The gradient
    # itself is compared through grad_norm above (rel 1e-4); Adam divides each element by its own RMS, so an element
    # whose gradient is near 0 turns float-order noise into a visible share of a step: allow 1% of one step (lr 1e-3)
    wa, wb = trainable(one), trainable(two)
    assert wa.keys() == wb.keys()
    moved = 0
    far = total = 0
    for k in wa:
        if fsdp:  # every weight (~50x the LoRA elements): the near-zero-gradient tail is longer; none beyond 5% of a
            # step, at most 0.1% of the elements beyond 1%
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=5e-5, msg=lambda m, k=k: f"{k}: {m}")
            far += int(((wb[k] - wa[k]).abs() > 1e-5 + 1e-4 * wa[k].abs()).sum())
            total += wa[k].numel()
        else:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
        moved += int(not torch.equal(wa[k], torch.zeros_like(wa[k])))
    assert far <= 1e-3 * total, f"{far} of {total} weights differ by more than 1% of one step"
    assert moved, "no trainable weight moved"
    # the gradient exchange is timed: nothing to exchange on one rank, a measured time on two (FSDP reduce-scatters
    # inside the backward: not timed apart, 0)
    assert all(r.get("time_comm_s", 0) == 0 for r in ma)  # absent on a step with no update
    if not fsdp:
        assert all(r["time_comm_s"] > 0 for r in mb if r.get("grad_norm") is not None)
        assert all(r["time_comm_s"] <= r["time_update_s"] for r in mb if r.get("grad_norm") is not None)
    ea = json.loads((one / "env.json").read_text())["distributed"]
    eb = json.loads((two / "env.json").read_text())["distributed"]
    assert (ea["world_size"], eb["world_size"], eb["backend"], len(eb["devices"])) == (1, 2, "gloo", 2)
    assert (ea["sharding"], eb["sharding"]) == ("none", "fsdp2" if fsdp else "none")
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert (sa["world_size"], sb["world_size"]) == (1, 2)
    assert sa["eval"]["toy"]["pass@1"] == sb["eval"]["toy"]["pass@1"]  # eval batches sharded, same samples


@pytest.mark.parametrize("case,extra", [
    ("grpo", ()),
    # gradient accumulation: 4 micro-batches per minibatch, 2 minibatches x 2 epochs = 4 updates
    ("accum", ("train.micro_batch=4", "algo.minibatches=2", "algo.ppo_epochs=2", "train.batch_size=32")),
    # DAPO: dynamic sampling drops uniform groups and refills from fresh draws, the same groups on 1 or 2 ranks
    ("dapo", ("algo=dapo", "algo.group_size=4", "algo.max_refills=2", "train.micro_batch=8")),
])
def test_two_ranks_train_like_one_with_the_same_global_batch(tmp_path, case, extra):
    one = train(1, tmp_path, f"{case}-1", extra)
    two = train(2, tmp_path, f"{case}-2", extra)
    assert_equivalent(one, two)
    if case == "dapo":
        m = read_jsonl(one / "metrics.jsonl")[0]
        assert m["groups_sampled"] > 4, "the refill path was not exercised"


FULL = ("lora=none", "quant=bf16")


@pytest.mark.parametrize("case,extra", [
    ("grpo", ()),
    # DAPO keeps different numbers of groups per rank, micro-batches of 4 rows: ranks with fewer rows run zero-weight
    # passes to keep FSDP's collectives in step; two minibatches accumulate gradients
    ("dapo-accum", ("algo=dapo", "algo.max_refills=2", "train.micro_batch=4", "algo.minibatches=2")),
    # a checkpoint after every step, the first of which has nothing to learn from (24 new tokens: all truncated):
    # gathering an optimizer with no state must not run torch's zero-gradient initialising step (Adam would count
    # it, and every later update would get the wrong bias correction)
    ("save-before-update", ("train.steps=3", "train.save_every=1", "data.max_new_tokens=24")),
])
def test_fsdp_full_finetuning_on_two_ranks_equals_one_process(tmp_path, case, extra):
    """dist.fsdp=true (FSDP2: gradients and optimizer state sharded) trains every weight like one process does."""
    one = train(1, tmp_path, f"full-{case}-1", (*FULL, *extra))
    two = train(2, tmp_path, f"fsdp-{case}-2", (*FULL, *extra, "dist.fsdp=true"))
    assert_equivalent(one, two, fsdp=True)
    if case == "save-before-update":
        assert read_jsonl(one / "metrics.jsonl")[0].get("skipped_update") == 1, "step 1 updated: not the case tested"
        return
    wa, wb = trainable(one), trainable(two)
    assert wa.keys() == wb.keys() and any("embed_tokens" in k for k in wb) and len(wb) > 10  # every weight, gathered full, in the checkpoint
    # the final model (HF safetensors, written from the gathered state) loads and matches the one-process model
    from safetensors.torch import load_file
    fa, fb = (load_file(d / "checkpoints" / "final_model" / "model.safetensors") for d in (one, two))
    assert fa.keys() == fb.keys()
    for k in fa:
        torch.testing.assert_close(fb[k].float(), fa[k].float(), rtol=1e-3, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")


def test_fsdp_config_errors(tmp_path):
    from qerl.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="dist.fsdp=true shards a full fine-tuning run"):
        load_config(["scale=smoke", "dist.fsdp=true"])
    with pytest.raises(ConfigError, match="needs optim.name=adamw"):
        load_config(["scale=smoke", *FULL, "optim.name=adamw8bit", "dist.fsdp=true"])
    with pytest.raises(ConfigError, match="AQN"):
        load_config(["scale=smoke", *FULL, "optim.name=adamw", "aqn=paper", "dist.fsdp=true"])
    # one process: FSDP needs torchrun ranks
    res = subprocess.run(command(1, tmp_path, "solo", (*FULL, "dist.fsdp=true")), env=env(), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode != 0 and "dist.fsdp=true shards the training state over torchrun ranks" in res.stderr


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _rank_after(p: subprocess.Popen, run: Path, lines: int, rank: int = 1) -> int | None:
    """Wait (up to 300 s) until the running job has logged ``lines`` metrics lines; the pid of its ``rank``."""
    deadline = time.time() + 300
    while time.time() < deadline and len(read_jsonl(run / "metrics.jsonl")) < lines and p.poll() is None:
        time.sleep(0.05)
    assert p.poll() is None, p.stdout.read()[-3000:]
    return _rank_pid(p.pid, rank)


def _rank_pid(torchrun_pid: int, rank: int) -> int | None:
    for pid in _children(torchrun_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.parametrize("mode", ["lora", "fsdp"])
def test_a_killed_rank_fails_the_job_and_the_rerun_resumes(tmp_path, mode):
    extra = ("train.steps=4", "train.save_every=1", "eval.sets=[]", "data.max_new_tokens=24",
             *((*FULL, "dist.fsdp=true") if mode == "fsdp" else ()))
    cmd = command(2, tmp_path, "killed", extra)
    run = tmp_path / "dist" / "killed"
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        victim = _rank_after(p, run, lines=2)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        t_kill = time.time()
        out, _ = p.communicate(timeout=120)
        waited = time.time() - t_kill
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0, out[-3000:]
    assert waited < 30 + 15, f"the job took {waited:.0f} s to fail after a rank was killed"  # dist.timeout_s=30
    assert not (run / "summary.json").exists()
    lines = len(read_jsonl(run / "metrics.jsonl"))
    assert 2 <= lines < 4
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "resuming" in res.stdout
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # no gap, no duplicate
    assert [s["step"] for s in read_jsonl(run / "samples.jsonl")] == [1, 2, 3, 4]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


def test_world_size_must_divide_the_groups_of_a_step(tmp_path):
    # 12 completions / 4 per group = 3 groups: 2 ranks cannot share them evenly
    res = subprocess.run(command(2, tmp_path, "bad", ("train.batch_size=12",)), env=env(), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, res.stderr[-3000:]  # once for the job (rank 0), not once per rank
    assert "world size 2 does not divide the 3 prompts (groups)" in lines[0]
    assert "[1, 3]" in lines[0] and "multiple of 8" in lines[0]
    assert not (tmp_path / "dist" / "bad").exists()  # nothing was started


def test_device_cuda_needs_a_gpu_per_local_rank():
    with pytest.raises(UserError, match=r"device=cuda with 4 ranks on this node but 2 GPU\(s\) visible.*"
                                        r"--nproc_per_node <= 2"):
        check_launch(8, 4, 32, "cuda", world=8, local_world=4, cuda_count=2)
    with pytest.raises(UserError, match=r"device='cuda:1' puts every rank on one GPU"):
        check_launch(8, 4, 32, "cuda:1", world=2, local_world=2, cuda_count=2)
    check_launch(8, 4, 32, "cuda", world=8, local_world=4, cuda_count=4)  # fits
    check_launch(8, 4, 32, "cpu", world=8, local_world=8, cuda_count=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's message")
def test_device_cuda_on_a_cpu_machine_is_a_clear_launch_error(tmp_path):
    res = subprocess.run(command(2, tmp_path, "nogpu", ("device=cuda",)), env=env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "device=cuda with 2 ranks on this node but 0 GPU(s) visible" in lines[0], \
        res.stderr[-3000:]


ROW = tuple(o for o in FAST if not o.startswith(("train.log_samples", "train.steps"))) + ("train.steps=1",)


def test_nproc_launches_torchrun_for_data_parallel_runners(tmp_path):
    """``--nproc 2`` (Make ``NPROC=2``): each training or evaluation row is a torchrun job of 2 ranks; a runner that is
    not data-parallel keeps one process."""
    from experiments.common import RUNNERS, Row, compose, worker_command

    rows = [Row("a", ROW), Row("base", ROW, runner="base")]
    jobs = compose("np", "smoke", rows, (0,), [f"out_dir={tmp_path}"])
    for j in jobs:
        cmd = worker_command(j, 1, nproc=2)
        assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m"]
    RUNNERS["probe-single"] = "tests.test_distributed:free_port"  # any runner not known to be data-parallel
    try:
        one = compose("np", "smoke", [Row("p", ROW, runner="probe-single")], (0,), [f"out_dir={tmp_path}"])[0]
        assert worker_command(one, 1, nproc=2)[1:3] == ["-m", "experiments.worker"]
    finally:
        del RUNNERS["probe-single"]


@pytest.mark.slow  # two torchrun jobs: ~60 s on 2 cores
def test_experiment_rows_run_on_nproc_ranks(tmp_path):
    from experiments.common import Row, run_rows

    rows = [Row("a", ROW), Row("base", ROW, runner="base")]
    res = run_rows("np", "smoke", rows, (0,), [f"out_dir={tmp_path}"], workers=1, nproc=2)
    assert res["failed"] == [] and len(res["done"]) == 2, res
    for key in ("a-s0", "base-s0"):
        run = tmp_path / "np" / "smoke" / key
        assert json.loads((run / "summary.json").read_text())["world_size"] == 2
        assert json.loads((run / "env.json").read_text())["distributed"]["world_size"] == 2
    assert [r["step"] for r in read_jsonl(tmp_path / "np" / "smoke" / "a-s0" / "metrics.jsonl")] == [1]


@pytest.mark.slow  # ~70 s: the timeout, then torchrun's grace period for a rank that does not stop
def test_a_hung_rank_fails_the_job_within_the_timeout(tmp_path):
    """A rank that stops answering (SIGSTOP: alive, silent) makes the others' next collective time out after
    dist.timeout_s with an error, and torchrun takes the job down: never a silent hang."""
    cmd = command(2, tmp_path, "hung", ("train.steps=50", "train.save_every=0", "eval.sets=[]",
                                        "data.max_new_tokens=24", "dist.timeout_s=10"))
    run = tmp_path / "dist" / "hung"
    p = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    victim = None
    try:
        victim = _rank_after(p, run, lines=1)
        os.kill(victim, signal.SIGSTOP)
        t_stop = time.time()
        out, _ = p.communicate(timeout=180)
        waited = time.time() - t_stop
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    assert "timed out" in out.lower() or "timeout" in out.lower(), out[-3000:]
    # 10 s for the collective, then torchrun stops the job (it gives a stopped rank up to 30 s before SIGKILL)
    assert waited < 10 + 30 + 20, f"the job took {waited:.0f} s to fail after a rank hung"
    assert len(read_jsonl(run / "metrics.jsonl")) < 50


def test_sweep_devices_give_each_worker_its_own_gpu():
    from sweeps.aqn import parse_args, parse_devices, worker_envs

    envs = worker_envs(3, ["0", "1"], environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "0"]
    assert all("CUDA_VISIBLE_DEVICES" not in e for e in worker_envs(2, [], environ={}))
    assert parse_args(["--study", "s", "--devices", "0,1,2"]).workers == 3  # one worker per device by default
    assert parse_args(["--study", "s", "--devices", "0,1", "--workers", "4"]).workers == 4
    with pytest.raises(UserError, match="--devices"):
        parse_devices("0,,1")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU is visible"):
            parse_devices("0,1")


def test_scaling_benchmark_runs_one_and_two_ranks_with_the_same_global_batch(tmp_path):
    """``qerl.bench scaling`` (issue 13's measurement) on the CPU: a one-process and a two-rank run of the same
    global batch, each split into phases with the all-reduce timed, and a world size that cannot split the groups
    recorded as skipped; the speed report turns the rows into an efficiency against the one-rank row."""
    import pandas as pd

    from experiments.speed_tables import scaling_rows, scaling_table

    res = subprocess.run([sys.executable, "-m", "qerl.bench", "scaling", "--models", "tiny", "--formats", "nvfp4",
                          "--nproc", "1,2,3", "--batch", "8", "--group", "4", "--micro", "4", "--new", "16",
                          "--prompt", "64", "--steps", "2", "--gc", "off", "--device", "cpu", "--out", str(tmp_path)],
                         env=env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    d = pd.read_csv(tmp_path / "scaling.csv")
    assert list(d.world_size) == [1, 2, 3]
    assert list(d.status[:2]) == ["ok", "ok"] and d.status[2].startswith("skipped: 2 groups of 4")
    one, two = d.iloc[0], d.iloc[1]
    assert (one.per_gpu_batch, two.per_gpu_batch, one.global_batch, two.global_batch) == (8, 4, 8, 8)
    assert one.comm_s == 0 and 0 < two.comm_s <= two.update_s
    for r in (one, two):
        assert r.timed_steps == 1 and r.steps == 2  # the first (warm-up) step is left out
        assert max(r.rollout_s, r.logprob_s, r.update_s) <= r.step_s + 1e-6
        assert r.tokens_per_s == pytest.approx(r.rollout_tokens / r.step_s)
    # one rank: its phases are disjoint parts of its step. Two: each phase is the slowest rank's (qerl.train's _max),
    # and two ranks can be slowest in different phases, so their sum may pass the slowest step (seen on 2 busy cores:
    # 0.284 s against 0.281)
    assert one.rollout_s + one.logprob_s + one.update_s <= one.step_s + 1e-6
    rows = scaling_rows(d)
    assert rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["efficiency"] == pytest.approx(two.tokens_per_s / 2 / one.tokens_per_s)
    assert "efficiency" not in rows[2]
    assert "skipped" in scaling_table(tmp_path)
    env_dist = json.loads((tmp_path / "runs" / "scaling" / "tiny-nvfp4-b8-g4-w2-nogc" / "env.json").read_text())
    assert env_dist["distributed"]["world_size"] == 2


# ------------------------------------------------------------------------------------------ two GPUs, NCCL
needs_two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                    reason="needs 2 CUDA GPUs")

ALL_REDUCE_PROBE = """
import json, os, sys, torch
from qerl import dist
D, dev = dist.setup("cuda", "auto", 60)
g = torch.Generator().manual_seed(0)
sizes = [3, 1000, 70000, 5]
params = [torch.nn.Parameter(torch.zeros(n, device=dev)) for n in sizes]
for i, p in enumerate(params):
    if not (D.rank == 1 and i == 3):  # a parameter without a gradient on one rank counts as zero there
        p.grad = (D.rank + 1) * torch.arange(p.numel(), dtype=torch.float32, device=dev) + i
secs = D.all_reduce_grads(params, bucket_elems=1024)  # several buckets
expect = [3 * torch.arange(n, dtype=torch.float32) + 2 * i for i, n in enumerate(sizes)]
expect[3] = torch.arange(5, dtype=torch.float32) + 3  # rank 0's only
ok = all(torch.equal(p.grad.cpu(), e) for p, e in zip(params, expect))
out = {"rank": D.rank, "ok": ok, "secs": secs, "backend": D.backend, "device": str(dev)}
open(os.path.join(sys.argv[1], f"rank{D.rank}.json"), "w").write(json.dumps(out))
dist.shutdown()
"""


@pytest.mark.gpu
@needs_two_gpus
def test_nccl_gradient_all_reduce_sums_over_two_gpus(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(ALL_REDUCE_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           str(tmp_path)]
    res = subprocess.run(cmd, env=dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["device"] for g in got] == ["cuda:0", "cuda:1"]
    assert all(g["ok"] and g["backend"] == "nccl" and g["secs"] > 0 for g in got), got


@pytest.mark.gpu
@needs_two_gpus
def test_two_gpus_train_with_nccl(tmp_path):
    """The smoke run on 2 GPUs (NCCL) next to 1 GPU: both finish with the same steps and metric names, the
    2-GPU one on cuda:0 and cuda:1 with its gradient exchange timed. (Bit-equality is the CPU test's: on GPUs
    the per-rank batch changes which matmul kernels run, so sampled tokens may differ after the first.)"""
    extra = ("device=cuda",)
    one = train(1, tmp_path, "gpu-1", extra)
    two = train(2, tmp_path, "gpu-2", extra)
    ma, mb = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == [1, 2]
    assert set(ma[0]) == set(mb[0])
    assert all(r["time_comm_s"] > 0 for r in mb if r.get("grad_norm") is not None)
    e = json.loads((two / "env.json").read_text())["distributed"]
    assert (e["world_size"], e["backend"]) == (2, "nccl") and len(e["devices"]) == 2


@pytest.mark.gpu
@needs_two_gpus
def test_two_gpus_fsdp_full_finetuning_with_nccl(tmp_path):
    """dist.fsdp=true on 2 GPUs (NCCL): the full fine-tuning smoke run finishes like the 1-GPU one (same steps and
    metric names), records its sharding, and writes a full final model that loads (its tensors the unsharded
    shapes of the one-GPU model's)."""
    extra = ("device=cuda", *FULL)
    one = train(1, tmp_path, "gpu-full-1", extra)
    two = train(2, tmp_path, "gpu-fsdp-2", (*extra, "dist.fsdp=true"))
    ma, mb = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [r["step"] for r in ma] == [r["step"] for r in mb] == [1, 2]
    assert set(ma[0]) == set(mb[0])
    e = json.loads((two / "env.json").read_text())["distributed"]
    assert (e["world_size"], e["backend"], e["sharding"]) == (2, "nccl", "fsdp2")
    from safetensors.torch import load_file
    fa, fb = (load_file(d / "checkpoints" / "final_model" / "model.safetensors") for d in (one, two))
    assert {k: v.shape for k, v in fa.items()} == {k: v.shape for k, v in fb.items()}
    assert all(torch.isfinite(v.float()).all() for v in fb.values())
