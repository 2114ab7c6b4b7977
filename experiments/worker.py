"""One row x seed of an experiment matrix in its own process; ``experiments.common.run_rows(workers=N)`` starts it:

    python -m experiments.worker --runner qerl.train:run --workers N --parent-pid PID -- key=value ...

It composes the config from the overrides (``qerl.config.load_config``) and calls the runner (a
``"module:function"`` path, see ``experiments.common.RUNNERS``) with it; the runner skips a finished run and resumes
an interrupted one. ``--workers`` only records how many rows shared the device (it lands in env.json's argv).
Exit status: 0 done, 2 a mistake in the row (one line), 1 anything else (with its traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from qerl.errors import UserError


def die_with_parent(parent_pid: int | None) -> None:
    """Linux: be SIGKILLed when the runner dies, however it dies (a killed row resumes from its checkpoint); exit now
    if it is already gone."""
    if parent_pid is None:
        return
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # under torchrun (NPROC > 1) the direct parent is torchrun, which itself dies with the runner: check the runner
    alive = _alive(parent_pid) if "LOCAL_RANK" in os.environ else os.getppid() == parent_pid
    if not alive:
        sys.exit(f"experiments.worker: the runner (pid {parent_pid}) is gone; not starting")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--runner", required=True, help="package.module:function, called with the TrainConfig")
    p.add_argument("--workers", type=int, default=1, help="how many rows share the device (recorded only)")
    p.add_argument("--parent-pid", type=int, default=None, help="die with this process")
    p.add_argument("overrides", nargs="*", help="key=value overrides composing the row's config")
    a = p.parse_args(argv)
    die_with_parent(a.parent_pid)
    import torch

    from experiments.common import load_runner
    from qerl.config import ConfigError, load_config

    try:
        fn = load_runner(a.runner)
        cfg = load_config(a.overrides)
        print(f"[worker] {cfg.run_dir}: {a.runner}, {a.workers} worker(s) on this device, {torch.get_num_threads()} "
              f"torch threads, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
        fn(cfg)
    except (UserError, ConfigError) as e:  # the row's mistake: one line (the runner prints the log's tail)
        if os.environ.get("RANK", "0") == "0":  # under torchrun: once for the row, not once per rank
            print(f"experiments.worker: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
