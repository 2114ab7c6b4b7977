"""The CUDA dequantization's build variants (benchmarks/dequant_variants.py, csrc/fp4_dequant.cu's QFP4_DQ_*
switches): the names and their errors, and, where nvcc and cuobjdump are (sm_90a code is built here, not run), that
every variant builds, that ``base`` is the library's kernel (the extension's flags: the same machine code), and that
each switch does what its comment says in the machine code (16-byte stores only, whole lines by one more shuffle
round, the evict-first hint, no spills where the bench relies on the register budget)."""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks import dequant_variants as dv
from benchmarks import wgmma_sass_check as wsc

ARCH = ["-gencode=arch=compute_90a,code=sm_90a"]
_HAVE = shutil.which("nvcc") is not None and wsc._tool("cuobjdump") is not None


def test_variant_names_base_first_and_bad_names_named():
    assert dv.parse_variants("lines,vec") == ["base", "lines", "vec"]
    assert dv.parse_variants("vec,base,vec") == ["base", "vec"]
    assert dv.parse_variants(dv.DEFAULT) == list(dv.VARIANTS)
    with pytest.raises(ValueError, match=r"unknown dequant variant\(s\) \['fast'\]; valid: base, vec, lines"):
        dv.parse_variants("vec,fast")
    # every variant's switches are ones the source reads (a typo would build the base kernel under another name)
    src = dv.SOURCE.read_text()
    for flags in dv.VARIANTS.values():
        for f in flags:
            assert f"#ifndef {f.split('=')[0]}" in src, f


def test_cli_refuses_bad_names_before_looking_for_a_gpu():
    with pytest.raises(ValueError, match=r"unknown dequant variant\(s\) \['nope'\]"):
        dv.main(["--variants", "vec,nope"])
    with pytest.raises(ValueError, match=r"unknown format\(s\) \['int4'\]; valid: nvfp4, mxfp4"):
        dv.main(["--formats", "nvfp4,int4"])
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            dv.main(["--variants", "vec"])


def _sass(name: str, tmp_path, extra: list[str] | None = None) -> tuple[str, str]:
    """(SASS, ptxas messages) of variant ``name`` (``extra``: nvcc's command for another build of the file instead)."""
    obj = tmp_path / f"{name}.o"
    cmd = extra or dv.nvcc_command(name, obj, ARCH, shared=False)
    r = subprocess.run([*cmd[:1], "-Xptxas", "-v", *cmd[1:]], capture_output=True, text=True)
    assert r.returncode == 0, (name, r.stderr[-3000:])
    d = subprocess.run([wsc._tool("cuobjdump"), "-sass", str(obj)], capture_output=True, text=True)
    assert d.returncode == 0, d.stderr[-2000:]
    return d.stdout, r.stderr


def _code(sass: str) -> list[str]:
    """The instructions with their encodings, without addresses and the names (which hash the file's path)."""
    return [re.sub(r"/\*[0-9a-f]{4,}\*/", "", ln).strip() for ln in sass.splitlines()
            if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", ln)]


def _count(sass: str, op: str) -> int:
    return len(re.findall(rf"\s{re.escape(op)}\s", sass))


@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_variants_build_and_their_machine_code(tmp_path):
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    from qerl.kernels import cuda_fp4 as cf
    lib_cmd = ["nvcc", "-c", "-O3", *COMMON_NVCC_FLAGS, *ARCH, *cf.switch_defines(), f"-I{dv.CSRC}", "-o",
               str(tmp_path / "library.o"), str(dv.SOURCE)]
    with ThreadPoolExecutor(2) as pool:  # nvcc is single-threaded: two builds at once on CI's two cores
        futs = {n: pool.submit(_sass, n, tmp_path) for n in dv.VARIANTS}
        futs["library"] = pool.submit(_sass, "library", tmp_path, lib_cmd)
        got = {n: f.result() for n, f in futs.items()}
    sass = {n: s for n, (s, _) in got.items()}
    # base is the library's kernel: the extension's flags (the wgmma switches' -D are not read by this file)
    assert _code(sass["base"]) == _code(sass["library"]) and _code(sass["base"])
    # every switch changes the machine code
    for n in dv.VARIANTS:
        assert n == "base" or _code(sass[n]) != _code(sass["base"]), n
    # the library's build: the first chunk's first store of each row split into four 4-byte stores (QFP4_DQ_VEC's
    # reason: 2 of each kernel's 16 row stores at CPW 4, in the three kernels), the rest 16 bytes
    base_st = {op: _count(sass["base"], op) for op in ("STG.E", "STG.E.128", "STG.E.EF.128")}
    assert base_st["STG.E"] > 0 and base_st["STG.E.128"] > 0, base_st
    stores_16 = base_st["STG.E.128"] + base_st["STG.E"] // 4  # the same rows' stores, each as one instruction
    for n in ("vec", "lines", "vec_warps4"):
        assert (_count(sass[n], "STG.E"), _count(sass[n], "STG.E.128")) == (0, stores_16), n
    for n in ("stcs", "lines_stcs"):  # the evict-first hint on every store
        assert (_count(sass[n], "STG.E"), _count(sass[n], "STG.E.128"), _count(sass[n], "STG.E.EF.128")) \
            == (0, 0, stores_16), n
    assert _count(sass["vec_cpw8"], "STG.E.128") == 2 * stores_16  # twice the chunks a warp, unrolled
    # whole lines: one more butterfly round (xor 4) for each pair of row pieces: 3 shuffle rounds instead of 2
    shfl = {n: _count(sass[n], "SHFL.BFLY") for n in ("base", "vec", "lines")}
    assert shfl["vec"] == shfl["base"] and 2 * shfl["lines"] == 3 * shfl["base"], shfl
    # the bulk copies: the rows staged in shared memory (16-byte stores), one copy a row by the tensor memory
    # accelerator, no global store instruction
    for n in ("bulk", "bulk_persist4"):
        assert "UBLKCP.G.S" in sass[n] and _count(sass[n], "STG.E.128") + _count(sass[n], "STG.E") == 0, n
        assert _count(sass[n], "STS.128") > 0, n
    # the persistent grids' register budget: no spill at 2 CTAs an SM (3 spills a few bytes: the bench times both)
    msgs = got["vec_persist2"][1]
    assert re.findall(r"(\d+) bytes spill stores", msgs) and set(re.findall(r"(\d+) bytes spill stores", msgs)) \
        == {"0"}, msgs[-2000:]


@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_bench_builds_shared_libraries_ctypes_loads_and_names_a_failed_build(tmp_path):
    """The bench's own build path (a shared library a variant, loaded by ctypes with the launcher's signature), and a
    build that fails raising with the variant's name and nvcc's message."""
    libs = dv.build(["vec"], tmp_path, ARCH)
    assert list(libs) == ["vec"] and len(libs["vec"].qfp4_dequant.argtypes) == 10
    dv.VARIANTS["broken"] = ("QFP4_DQ_WARPS=",)  # an empty value: "constexpr int kWarps = ;" does not compile
    try:
        with pytest.raises(RuntimeError, match="dequant variant broken did not build"):
            dv.build(["broken"], tmp_path, ARCH)
    finally:
        del dv.VARIANTS["broken"]


def test_table_puts_each_variant_beside_base_per_linear():
    rows = [dict(fmt="nvfp4", linear=lin, n=n, k=k, variant=v, us=us, tb_s=tb, vs_base=r)
            for lin, n, k in (("gate_proj", 18944, 3584), ("k_proj", 512, 3584))
            for v, us, tb, r in (("base", 80.0, 2.15, 1.0), ("vec", 70.0, 2.46, 80 / 70))]
    md = dv.table(rows).splitlines()
    assert md[0] == "| fmt | linear | N × K | base µs (TB/s, vs base) | vec µs (TB/s, vs base) |"
    assert md[2] == "| nvfp4 | gate_proj | 18944 × 3584 | 80.0 (2.15, 1.000×) | 70.0 (2.46, 1.143×) |"
    assert len(md) == 4 and md[3].startswith("| nvfp4 | k_proj | 512 × 3584 |")
