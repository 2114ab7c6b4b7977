"""Build-once loading of qerl's hand-written CUDA extensions (``torch.utils.cpp_extension.load``).

Each extension is named after a hash of its sources, headers, binding and flags, so an edit or another flag set gets
a build of its own; builds live under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/qerl_kernels``. A failed build is
remembered in the caller's state (``state["error"]``) and not retried in the same process. A build killed midway
leaves torch's ``lock`` file in its directory, on which every later load of that build would wait forever: one older
than :data:`STALE_LOCK_S` is removed with a warning (``clear_stale_lock``).
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
STALE_LOCK_S = 1200  # a build takes 1-4 min; a lock this old belongs to a killed one


def clear_stale_lock(bdir: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``bdir``'s build lock (torch's FileBaton file) when it is older than ``max_age_s`` seconds: a build
    killed midway (a timeout, Ctrl-C) never removes it, and torch's loader waits on it without end. Returns whether one
    was removed."""
    lock = os.path.join(bdir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:  # no lock
        return False
    if age <= max_age_s:
        return False
    warnings.warn(f"removing the build lock {lock}, {age:.0f} s old (a build killed midway; > {max_age_s:.0f} s)",
                  stacklevel=2)
    try:
        os.remove(lock)
    except OSError:  # another process removed it first
        pass
    return True


def arch_flags() -> list[str]:
    """nvcc's -gencode for the current device (sm_90a on Hopper, for its wgmma and setmaxnreg)."""
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) == (9, 0):
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def builds(load) -> bool:
    """Whether ``load()`` (an extension's loader, e.g. ``cuda_fp4._ext``) returns without raising; the loader's state
    keeps the build's error for its caller to report."""
    try:
        load()
    except Exception:
        return False
    return True


def load_extension(prefix: str, sources, headers, binding: str, flags: list[str], state: dict):
    """The compiled module of ``binding`` (C++ source text) plus the ``sources`` (.cu paths), cached in ``state`` per
    ``flags``: a switch read when the extension loads (``QERL_WGMMA_PIPE``, ``QERL_WGMMA_LORA=pdl``) selects its own
    build even after another build was loaded in the same process (each is a module of its own name)."""
    key = ("mod", tuple(flags))
    mod = state.get(key)
    if mod is not None:
        return mod
    if ("error", key) in state:
        raise RuntimeError(state[("error", key)])
    from torch.utils.cpp_extension import load
    src = "".join(Path(p).read_text() for p in (*sources, *headers))
    tag = hashlib.sha1((src + binding + " ".join(flags) + torch.__version__).encode()).hexdigest()[:12]
    name = f"{prefix}_{tag}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                  "qerl_kernels")
    bdir = os.path.join(root, name)
    os.makedirs(bdir, exist_ok=True)
    clear_stale_lock(bdir)
    cpp = os.path.join(bdir, "binding.cpp")
    if not os.path.exists(cpp) or open(cpp).read() != binding:
        with open(cpp, "w") as fh:
            fh.write(binding)
    try:
        mod = load(name=name, sources=[cpp, *map(str, sources)], extra_cflags=["-O3"],
                   extra_cuda_cflags=[*flags, f"-I{CSRC}"],
                   build_directory=bdir, verbose=os.environ.get("QERL_KERNELS_VERBOSE") == "1")
    except Exception as e:  # compiler missing or build failure: remembered, reported by the caller
        state["error"] = state[("error", key)] = f"{type(e).__name__}: {e}"
        raise
    state[key] = mod
    return mod
