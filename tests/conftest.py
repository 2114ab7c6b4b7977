"""Shared test helpers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qerl.lora import lora_modules


def perturb_lora_b(policy, std: float = 0.05) -> None:
    """Give every adapter a non-zero B (PEFT initialises B = 0), so its path is exercised."""
    with torch.no_grad():
        for m in lora_modules(policy).values():
            if m.rank:
                m.lora_B.weight.normal_(0, std)


def assert_teacher_forced(policy, ro, temperature: float, atol: float = 2e-5, entropy: bool = True) -> None:
    """The sampler's per-token log-probs (and entropies) equal the training forward's (teacher forcing), to
    ``atol``, on every generated token of every row of the rollout ``ro``."""
    from qerl.train import completion_logprobs

    with torch.no_grad():
        lp, ent = completion_logprobs(policy, ro, slice(0, ro.completion_ids.shape[0]), temperature, entropy)
    m = ro.completion_mask
    torch.testing.assert_close(lp[m], ro.logp[m], rtol=0, atol=atol)
    if entropy:
        torch.testing.assert_close(ent[m], ro.entropy[m], rtol=0, atol=atol)


def run_under_triton_interpreter(test_file: str, marker: str, code: str | None = None, timeout: int = 300) -> None:
    """Run ``test_file`` as a script (or ``code`` with ``python -c``) in a subprocess with TRITON_INTERPRET=1, the
    tests folder and the repository on PYTHONPATH (the interpreter must be on before Triton is imported, hence the
    subprocess); it must exit 0 and print ``marker`` (a failure shows the tail of its output)."""
    pytest.importorskip("triton")
    here = os.path.dirname(os.path.abspath(test_file))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-c", code] if code else [sys.executable, os.path.abspath(test_file)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and marker in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


def pytest_collection_finish(session):
    """Start the sm_90a builds the selected SASS tests will read (a test module's ``sass_builds()``: {test name:
    builds}) in the background at the lowest CPU priority (``benchmarks.wgmma_sass_check.prebuild``), in the order the
    tests run: most run last, and their ~5 min of nvcc builds overlap the rest of the suite instead of following it.
    QERL_TEST_PREBUILD=0 turns it off."""
    if os.environ.get("QERL_TEST_PREBUILD", "1") == "0" or session.config.option.collectonly:
        return
    by_module: dict = {}
    builds = []
    for item in session.items:
        module = getattr(item, "module", None)
        fn = getattr(module, "sass_builds", None)
        if fn is None:
            continue
        if module not in by_module:
            by_module[module] = fn()
        builds += by_module[module].get(getattr(item, "originalname", item.name), [])
    if builds:
        from benchmarks import wgmma_sass_check as wsc
        wsc.prebuild(builds)


def pytest_sessionfinish(session, exitstatus):
    """Builds no test collected (a run stopped early, -x) are dropped, not waited for."""
    wsc = sys.modules.get("benchmarks.wgmma_sass_check")
    if wsc is not None:
        wsc.stop_prebuilds()
