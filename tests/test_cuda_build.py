"""qerl.kernels.cuda_build: the extension loader's cache, on the CPU (a C++-only module built by the real
torch.utils.cpp_extension.load with the host compiler; the CUDA builds go through the same function on the GPU)."""
import pytest

from qerl.kernels import cuda_build

# A module of plain Python C API (no torch headers: it builds in a second): f() returns the FLAG the build was given.
_BINDING = r"""
#include <Python.h>
#define QCAT(a, b) a##b
#define QXCAT(a, b) QCAT(a, b)
static PyObject* flag(PyObject*, PyObject*) { return PyLong_FromLong(QERL_TEST_FLAG); }
static PyMethodDef methods[] = {{"flag", flag, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "m", nullptr, -1, methods};
PyMODINIT_FUNC QXCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&mod); }
"""


def test_load_extension_keeps_one_build_per_flags(tmp_path, monkeypatch):
    """Two flag sets in one process give two modules, each built once and then served from the cache (session 37:
    the first build loaded used to be returned for every later flag set, so ``QERL_WGMMA_LORA=pdl`` set after the
    default build had loaded ran the default build, which refuses the PDL launch); a failed build is remembered per
    flag set and raised again without rebuilding."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    state: dict = {}
    mods = {}
    for v in (1, 2):
        binding = _BINDING.replace("QERL_TEST_FLAG", str(v))
        mods[v] = cuda_build.load_extension("qerl_test", [], [], binding, [f"-DV={v}"], state)
        assert mods[v].flag() == v
    assert mods[1] is not mods[2]
    assert cuda_build.load_extension("qerl_test", [], [], "not C++", ["-DV=1"], state) is mods[1]  # cached: no build
    with pytest.raises(RuntimeError, match="Error building extension 'qerl_test_"):
        cuda_build.load_extension("qerl_test", [], [], "not C++", ["-DV=3"], state)
    assert ("error", ("mod", ("-DV=1",))) not in state and state["error"]
    with pytest.raises(RuntimeError, match="qerl_test"):  # remembered: the same error again, no second build
        cuda_build.load_extension("qerl_test", [], [], "not C++", ["-DV=3"], state)
    assert cuda_build.load_extension("qerl_test", [], [], "", ["-DV=2"], state) is mods[2]


def test_a_killed_builds_lock_is_cleared_not_waited_on(tmp_path, monkeypatch):
    """A build killed midway leaves torch's ``lock`` in its directory and every later load of that build waited on it
    forever (session 50 lost a device call to one): a lock older than STALE_LOCK_S is removed with a warning and the
    load goes on; a younger one (a build running now) is left alone."""
    import os
    import threading
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    binding = _BINDING.replace("QERL_TEST_FLAG", "7")
    assert cuda_build.load_extension("qerl_lock", [], [], binding, ["-DV=7"], {}).flag() == 7
    (bdir,) = [p for p in tmp_path.iterdir() if p.name.startswith("qerl_lock_")]
    lock = bdir / "lock"
    lock.write_text("")
    assert not cuda_build.clear_stale_lock(str(bdir)) and lock.exists()  # fresh: a build may be running
    old = time.time() - cuda_build.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    got = {}

    def load():  # in a thread: without the fix torch's loader sleeps on the lock without end
        with pytest.warns(UserWarning, match="removing the build lock .* s old"):
            got["mod"] = cuda_build.load_extension("qerl_lock", [], [], binding, ["-DV=7"], {})

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the load waited on the stale lock"
    assert got["mod"].flag() == 7 and not lock.exists()
    assert not cuda_build.clear_stale_lock(str(bdir))  # no lock: nothing to do


def test_builds_reports_a_loader_that_raises():
    from qerl.kernels import cuda_build

    def broken():
        raise RuntimeError("nvcc: not found")
    assert cuda_build.builds(lambda: object()) is True
    assert cuda_build.builds(broken) is False
