"""The wgmma SASS check (benchmarks/wgmma_sass_check.py): the loop walk on hand-written SASS, and, where nvcc and
cuobjdump are installed, both pipelines of the real kernel clean and session 30's broken first version caught."""

import functools
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks import wgmma_sass_check as wsc
from qerl.kernels import cuda_fp4 as cf


def _gemv_src() -> str:
    return (wsc.SRC.parent / "fp4_mma_gemv.cu").read_text()


def _gemm_src() -> str:
    return (wsc.SRC.parent / "fp4_mma_gemm.cu").read_text()


@functools.cache
def _gemv_sass(*defines: str) -> dict:
    """The decode GEMV's functions (``wsc.functions``) built for sm_90a with these -D's; cached: several tests
    compare against the same build."""
    return wsc.functions(wsc.compile_sass(2, _gemv_src(), defines)[0])


# session 30's first kernel: one register set, wait_group 1 (the next chunk decoded while the MMAs ran), planted in
# the main loop (not the LoRA epilogue's)
_FIRST_OLD = "        wgmma_wait<0>();\n        keep_regs(a);\n#pragma unroll\n"
_FIRST_NEW = "        wgmma_wait<1>();\n#pragma unroll\n"
_ABLATE_ALL = ("QFP4_WGMMA_ABLATE=31", "QFP4_WGMMA_NO_SK=1")
_TMA_TAIL = (("QFP4_WGMMA_PDL=1", "QFP4_WGMMA_TMA=1", "QFP4_WGMMA_TAIL=1"), ("QFP4_WGMMA_PDL=1", "QFP4_WGMMA_TMA=1"))
_STSM = (*_TMA_TAIL[0], "QFP4_WGMMA_STSM=1")  # the default build's switches and session 72's epilogue experiment
_LORA_ABLATE = tuple(f"QFP4_LORA_ABLATE={v}" for v in (1, 2, 4, 8))


def _both_pipes_builds() -> list[tuple]:
    """The builds users get: QERL_WGMMA_PIPE=1 with the other switches at their defaults (PDL, tail splits; no TMA,
    which needs pipe 2), pipe 2 with QERL_WGMMA_TMA=0 (the default build, pipe 2 with TMA: test_tma_build_...), and
    the first version planted (its grid kernels suffice)."""
    return [(1, None, _user_defines(QERL_WGMMA_PIPE="1")), (2, None, _user_defines(QERL_WGMMA_TMA="0")),
            (1, wsc.SRC.read_text().replace(_FIRST_OLD, _FIRST_NEW), ("QFP4_WGMMA_NO_SK=1",))]


def _gemv_lora_builds(*defines: str) -> tuple[list[dict], list[str]]:
    """The default GEMV build and one per define, checked to have the same functions and, but for the LoRA kernels,
    the same machine code; returns (builds, the LoRA kernels' names)."""
    with ThreadPoolExecutor(2) as pool:  # nvcc is single-threaded: two builds at once on CI's two cores
        builds = list(pool.map(lambda d: _gemv_sass(*d), [(), *((d,) for d in defines)]))
    lora = [n for n in builds[0] if "fp4_gemv_lora_kernel" in n]
    assert len(lora) >= 12 and len(builds[0]) > len(lora)
    for b in builds[1:]:
        assert b.keys() == builds[0].keys()
        for name in builds[0]:
            if name not in lora:
                assert [t for _, t in b[name]] == [t for _, t in builds[0][name]], name
    return builds, lora


def _sass(body: list[str]) -> str:
    lines = ["        Function : _ZN4qfp42wg16fp4_wgmma_kernelILi0ELi32ELi1ELi1EEEvv"]
    for i, ins in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {ins} ;      /* 0x0000000000000000 */")
    return "\n".join(lines) + "\n"


def _loop(body: list[str]) -> str:
    """body, then a branch back to its first instruction (a loop)."""
    return _sass([*body, "@!P4 BRA 0x0"])


MMA1 = ["WARPGROUP.ARRIVE", "HGMMA.64x32x16.F32.BF16 R24, R88, gdesc[UR8], R24",
        "HGMMA.64x32x16.F32.BF16 R24, R92, gdesc[UR8], R24, gsb0"]
MMA2 = ["WARPGROUP.ARRIVE", "HGMMA.64x32x16.F32.BF16 R24, R104, gdesc[UR8], R24",
        "HGMMA.64x32x16.F32.BF16 R24, R108, gdesc[UR8], R24, gsb0"]


def test_walk_finds_a_write_to_an_in_flight_operand_and_accepts_one_after_the_wait():
    bad = wsc.check(_loop([*MMA1, "HMUL2.BF16_V2 R93, R116, R93", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]))
    assert bad["kernels"] == 1 and bad["loops"] == 1 and len(bad["hazards"]) == 2  # both passes
    assert "writes in-flight A registers [93]" in bad["hazards"][0]
    ok = wsc.check(_loop([*MMA1, "WARPGROUP.DEPBAR.LE gsb0, 0x0", "HMUL2.BF16_V2 R93, R116, R93"]))
    assert ok["loops"] == 1 and ok["hazards"] == []
    # the accumulators are the MMAs' own; scalar and uniform registers, predicates and stores write none of A
    ok = wsc.check(_loop([*MMA1, "IADD3 R7, R7, 0x1, RZ", "UIADD3 UR8, UR8, 0x20, URZ", "ISETP.GE.AND P4, PT, R7, R6, PT",
                          "STS [R88], R5", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]))
    assert ok["hazards"] == []


def test_walk_counts_groups_for_wait_group_1_and_carries_them_over_the_back_edge():
    # two register sets, wait_group 1: refilling the retired set is fine, the newest one is not
    two = [*MMA1, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "LDS.128 R104, [R2]", *MMA2, "WARPGROUP.DEPBAR.LE gsb0, 0x1",
           "LDS.128 R88, [R2]"]
    assert wsc.check(_loop(two))["hazards"] == []
    one = [*MMA1, "WARPGROUP.DEPBAR.LE gsb0, 0x1", "LDS.128 R88, [R2]"]  # one set, wait_group 1: session 30's bug
    found = wsc.check(_loop(one))["hazards"]
    assert found and all("[88, 89, 90, 91]" in h for h in found)
    # in flight only over the back edge: found on the second pass
    edge = ["LDS.64 R92, [R2]", *MMA1, "WARPGROUP.DEPBAR.LE gsb0, 0x1"]
    found = wsc.check(_loop(edge))["hazards"]
    assert len(found) == 1 and "(pass 2)" in found[0] and "[92, 93]" in found[0]
    # a straight-line block (no loop) is not walked
    assert wsc.check(_sass(one))["loops"] == 0


def test_dest_regs_widths():
    assert wsc._dest_regs("LDS.128 R8, [R0]") == {8, 9, 10, 11}
    assert wsc._dest_regs("IMAD.WIDE.U32 R4, R2, 0x10, R4") == {4, 5}
    assert wsc._dest_regs("CS2R R24, SRZ") == {24, 25}
    assert wsc._dest_regs("@!P0 F2FP.BF16.F32.PACK_AB R3, R5, R4") == {3}
    assert wsc._dest_regs("@!PT LDS RZ, [RZ]") == set()
    assert wsc._dest_regs("LDGSTS.E.BYPASS.128 [R7], desc[UR4][R2.64]") == set()
    assert wsc._dest_regs("R2UR UR4, R5") == set()


_HAVE = shutil.which("nvcc") is not None and wsc._tool("cuobjdump") is not None


def _user_defines(**env: str) -> tuple[str, ...]:
    """The -D's of the extension build (``cuda_fp4.switch_defines``) with these switches set (the others at their
    defaults), less the pipe's (``compile_sass`` passes it)."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        flags = cf.switch_defines()
    return tuple(f[2:] for f in flags if f.startswith("-D") and not f.startswith("-DQFP4_WGMMA_PIPE="))


def test_user_defines_are_the_switches_builds(monkeypatch):
    """The switches' builds: the default (pipe 2, PDL, TMA, tail splits); QERL_WGMMA_TMA=0 without the tensor copies;
    QERL_WGMMA_PIPE=1 without them too (they need pipe 2: before session 52 pipe 1 with the defaults asked for them,
    and the kernel's #error stopped the build), and QERL_WGMMA_TMA=1 with pipe 1 a clear error."""
    for k in ("QERL_WGMMA_PIPE", "QERL_WGMMA_TMA", "QERL_WGMMA_TAIL", "QERL_WGMMA_LORA"):
        monkeypatch.delenv(k, raising=False)
    assert {"QFP4_WGMMA_PDL=1", "QFP4_WGMMA_TMA=1", "QFP4_WGMMA_TAIL=1"} <= set(_user_defines())
    pipe1 = _user_defines(QERL_WGMMA_PIPE="1")
    assert "QFP4_WGMMA_TMA=1" not in pipe1 and {"QFP4_WGMMA_PDL=1", "QFP4_WGMMA_TAIL=1"} <= set(pipe1)
    no_tma = _user_defines(QERL_WGMMA_TMA="0")
    assert "QFP4_WGMMA_TMA=1" not in no_tma and {"QFP4_WGMMA_PDL=1", "QFP4_WGMMA_TAIL=1"} <= set(no_tma)
    assert "QERL_WGMMA_TMA" not in os.environ  # restored
    with pytest.raises(ValueError, match="QERL_WGMMA_TMA='1' needs QERL_WGMMA_PIPE=2.*valid: 0"):
        _user_defines(QERL_WGMMA_PIPE="1", QERL_WGMMA_TMA="1")


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_real_kernel_both_pipes_clean_and_the_first_version_caught():
    assert wsc.SRC.read_text().count(_FIRST_OLD) == 1  # the first version is planted in the main loop only
    with ThreadPoolExecutor(3) as pool:  # three nvcc processes at once (or the prebuilt ones)
        (s1, m1), (s2, m2), (s3, m3) = pool.map(lambda b: wsc.compile_sass(*b), _both_pipes_builds())
    for pipe, (sass, msgs) in ((1, (s1, m1)), (2, (s2, m2))):
        r = wsc.check(sass, msgs)
        # every variant x 2 formats x (without, with the LoRA epilogue, whose 64-rank passes are a loop with MMAs
        # too), and the stream-K ones (their segment loop holds the main loop's MMAs: one more loop each)
        nk = 4 * (len(cf.WGMMA_VARIANTS) + len(cf.WGMMA_SK_VARIANTS))
        loops = 6 * len(cf.WGMMA_VARIANTS) + 10 * len(cf.WGMMA_SK_VARIANTS)
        assert r["kernels"] == nk and r["loops"] >= loops and not r["serialized"], (pipe, r["kernels"], r["loops"])
        assert r["hazards"] == [], r["hazards"][:3]
    r = wsc.check(s3, m3)
    assert len(r["hazards"]) > 64, len(r["hazards"])


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_ablation_build_leaves_the_parts_out_of_the_main_loop():
    """benchmarks.wgmma_ablate's build with every bit (-DQFP4_WGMMA_ABLATE=31): no decode (HMUL2, the scale step's
    only instruction) anywhere in a plain grid kernel, no copy into shared memory (LDGSTS) after its first MMA (the
    pipeline's first chunks only), no group barrier (BAR.SYNC with a register id) inside its main loop, and its main
    loop's MMAs without a register A operand (SS: bit 16), as many as the library's RS ones."""
    from benchmarks import wgmma_ablate as wa
    assert wa.parse_variants("3,0,3,8") == [0, 3, 8] and wa.describe(5) == "tokens staged once + no decode"
    assert wa.describe(20) == "no decode + A from shared memory"
    for bad in ("32", "-1", "a", ""):
        with pytest.raises(ValueError, match="--variants"):
            wa.parse_variants(bad)
    sass, _ = wsc.compile_sass(2, None, _ABLATE_ALL)
    plain = {n: b for n, b in wsc.functions(sass).items() if "fp4_wgmma_kernel" in n and "Lb0ELb0E" in n}
    assert len(plain) == 2 * len(cf.WGMMA_VARIANTS)
    for name, body in plain.items():
        assert _ablated_parts(body) == [], name
        loop = wsc.main_loop(body)
        assert sum(wsc.opcode(t).startswith("HGMMA") for t in loop) == 8, name
        assert not any(wsc._HGMMA_A.search(t) for t in loop), name  # no register A operand


def _ablated_parts(body: list[tuple[int, str]]) -> list[str]:
    """The parts of a plain wgmma grid kernel that -DQFP4_WGMMA_ABLATE=15 leaves out and ``body`` still has."""
    ops = [wsc.opcode(ins) for _, ins in body]
    mmas = [i for i, op in enumerate(ops) if op.startswith("HGMMA")]
    found = ["decode"] if any(op.startswith("HMUL2") for op in ops) else []
    if any(op.startswith("LDGSTS") for op in ops[mmas[0]:]):
        found.append("copies after the first MMA")
    if any(op.startswith("BAR") for op in ops[mmas[0]:mmas[-1]]):
        found.append("barrier between the MMAs")
    return found


def _cuda_include() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    import os
    for root in (os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"):
        if os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


_EXTS = ("cuda_fp4", "cuda_attn", "cuda_dq")
# each extension's binding with a launcher called with one argument too few: the check must fail on it
_SLIPS = {"cuda_fp4": ("(int)ctr.numel(), lora ? t.data_ptr() : nullptr", "(int)ctr.numel()"),
          "cuda_attn": ("(float)scale, (int)nst,\n                               pdl ? 1 : 0,", "(float)scale, (int)nst,"),
          "cuda_dq": ("(float)out_mult,\n", "(float)out_mult);\n//")}
_BINDING_DIR: list = []  # the temporary directory of the binding checks' sources, kept for the process's life


@functools.cache
def _binding_commands(ext: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The g++ -fsyntax-only commands of ``ext``'s binding and of its slip (``_SLIPS``), against this torch's headers
    (a CPU-only torch wheel lacks c10/cuda/impl/cuda_cmake_macros.h: an empty one stands in); their sources written
    into one temporary directory (conftest starts them at collection, the test reads their results)."""
    import importlib
    import sysconfig
    import tempfile
    from pathlib import Path

    from torch.utils.cpp_extension import include_paths

    if not _BINDING_DIR:
        _BINDING_DIR.append(tempfile.TemporaryDirectory(prefix="qerl-binding-"))
    root = Path(_BINDING_DIR[0].name)
    (root / "c10" / "cuda" / "impl").mkdir(parents=True, exist_ok=True)
    (root / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    binding = importlib.import_module(f"qerl.kernels.{ext}")._BINDING
    good, bad = root / f"{ext}_binding.cpp", root / f"{ext}_slip.cpp"
    good.write_text(binding)
    bad.write_text(binding.replace(*_SLIPS[ext], 1))
    incs = [*include_paths(), _cuda_include(), sysconfig.get_paths()["include"], str(root)]
    cmd = ("g++", "-std=c++17", "-fsyntax-only", *[f"-I{i}" for i in incs], "-DTORCH_EXTENSION_NAME=qerl_check")
    return (*cmd, str(good)), (*cmd, str(bad))


def sass_builds() -> dict[str, list]:
    """{test: the ``wsc.compile_sass`` builds (pipe, source, defines) or ``wsc.Command``s it reads}: conftest starts
    the selected tests' builds in the background when collection ends (``wsc.prebuild``), in this order, the order
    the tests run."""
    gemv = _gemv_src()
    out = {"test_real_kernel_both_pipes_clean_and_the_first_version_caught": _both_pipes_builds(),
           "test_ablation_build_leaves_the_parts_out_of_the_main_loop": [(2, None, _ABLATE_ALL)],
           "test_tma_build_stages_the_grid_variants_by_tensor_copies": [(2, None, d) for d in _TMA_TAIL],
           "test_stsm_build_stores_the_epilogue_through_shared_memory": [(2, None, _STSM)],
           "test_bf16_sector_loads_build_changes_only_the_dense_gemv": [(2, gemv, ()),
                                                                        (2, gemv, ("QFP4_DENSE_SECTOR=1",))],
           "test_gemm_kz_build_adds_the_split_of_k_across_ctas": [(2, _gemm_src(), ()),
                                                                  (2, _gemm_src(), ("QFP4_GEMM_KZ=1",))],
           "test_lora_ablate_builds_leave_out_what_they_name": [(2, gemv, ()),
                                                                 *((2, gemv, (d,)) for d in _LORA_ABLATE)]}
    if shutil.which("g++") is not None and _cuda_include() is not None:
        out["test_extension_binding_compiles_against_torch_headers"] = [
            wsc.Command(c) for ext in _EXTS for c in _binding_commands(ext)]
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or _cuda_include() is None,
                    reason="needs g++ and the CUDA headers (nvcc's include directory)")
@pytest.mark.parametrize("ext", _EXTS)
def test_extension_binding_compiles_against_torch_headers(ext):
    """An extension's C++ binding (``_BINDING``: the launchers' declarations and the torch wrappers) passes
    g++ -fsyntax-only against this torch's headers, so a signature slip fails here and not as a failed build on a GPU
    host; the check must fail on a slip: a launcher called with one argument too few."""
    from pathlib import Path
    good, bad = _binding_commands(ext)
    assert Path(bad[-1]).read_text() != Path(good[-1]).read_text()  # the slip is planted
    with ThreadPoolExecutor(2) as pool:  # both at once (or the prebuilt ones)
        (rc_good, _, err_good), (rc_bad, _, err_bad) = pool.map(wsc.run_command, (good, bad))
    assert rc_good == 0, err_good[-3000:]
    assert rc_bad != 0 and "too few arguments" in err_bad, err_bad[-2000:]


def test_the_wgmma_wrappers_are_the_generators_output():
    """fp4_wgmma_ops.cuh is generated (gen_wgmma_ops.py): the committed header is exactly the generator's text, and
    every wrapper takes the descriptor as two 32-bit halves joined inside its asm (session 40: as one 64-bit value,
    ptxas re-derived it with a carry for every MMA)."""
    import importlib.util
    from pathlib import Path
    src = Path(__file__).resolve().parents[1] / "qerl" / "kernels" / "csrc" / "gen_wgmma_ops.py"
    spec = importlib.util.spec_from_file_location("gen_wgmma_ops", src)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.text()
    assert gen.OUT.read_text() == text, "fp4_wgmma_ops.cuh differs from gen_wgmma_ops.py's output: rerun it"
    n_ss = len(gen.WIDTHS) + len(gen.TB_WIDTHS)  # wgmma_ss, and wgmma_ss_tb (B MN-major) for csrc/fp4_dq_gemm.cu
    assert text.count("mov.b64 dsc, {%") == len(gen.WIDTHS) + n_ss  # wgmma_rs and the SS wrappers
    assert text.count("mov.b64 asc, {%") == n_ss
    assert text.count('"r"(dlo), "r"(dhi)') == len(gen.WIDTHS) + n_ss and "uint64_t desc" not in text
    # the transpose immediates (imm-trans-a, imm-trans-b): K-major B for wgmma_ss, MN-major B for wgmma_ss_tb only
    assert text.count("asc, dsc, p, 1, 1, 0, 0;") == len(gen.WIDTHS)
    assert text.count("asc, dsc, p, 1, 1, 0, 1;") == len(gen.TB_WIDTHS)
    for n in gen.TB_WIDTHS:
        body = text[text.index(f"wgmma_ss_tb<{n}>(float"):]
        assert f"m64n{n}k16" in body[:body.index("}\n\n")] and "0, 1;" in body[:body.index("}\n\n")], n


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_tma_build_stages_the_grid_variants_by_tensor_copies():
    """QERL_WGMMA_TMA=1's build (-DQFP4_WGMMA_TMA=1, with the default -DQFP4_WGMMA_TAIL=1): every grid variant of
    128+ tokens a CTA issues tensor copies
    (UTMALDG: three a chunk at five places -- the two prologue chunks, the two of a loop pass, and the loop's first pass
    peeled by ptxas), no cp.async (LDGSTS) in a plain one (a LoRA one keeps it for its t tile) and no group barrier
    inside its main loop; the 32- and 64-token grid variants and the stream-K ones keep cp.async and issue no tensor
    copy; the loop check stays clean. QERL_WGMMA_TAIL=0's build (beside it: session 49's kernel, without the
    tail-split launches' tile mapping and their two kernel parameters) the same."""
    with ThreadPoolExecutor(2) as pool:  # both builds at once
        builds = list(pool.map(lambda d: wsc.compile_sass(2, None, d), _TMA_TAIL))
    for tail, (sass, msgs) in zip((True, False), builds, strict=True):
        r = wsc.check(sass, msgs)
        assert r["kernels"] == 4 * (len(cf.WGMMA_VARIANTS) + len(cf.WGMMA_SK_VARIANTS)), r["kernels"]
        assert r["hazards"] == [] and not r["serialized"], (tail, r)
        seen = {True: 0, False: 0}
        for name, body in wsc.functions(sass).items():
            if "fp4_wgmma_kernel" not in name:
                continue
            fmt, ntok, rw, ks, lora, sk = _wgmma_args(name)
            ops = [wsc.opcode(ins) for _, ins in body]
            tma, cp = sum(o.startswith("UTMALDG") for o in ops), sum(o.startswith("LDGSTS") for o in ops)
            by_tma = ntok >= 128 and not sk
            seen[by_tma] += 1
            if not by_tma:
                assert tma == 0 and cp > 0, (name, tma, cp)
                continue
            assert tma == 15 and (cp == 0) == (not lora), (name, tail, tma, cp)
            loop = [wsc.opcode(t) for t in wsc.main_loop(body)]
            assert not any(t.startswith("BAR.SYNC") for t in loop), name
            assert any(t.startswith("SYNCS.ARRIVE.TRANS64.A1T0") for t in loop), name  # the threads' stage releases
            assert sum(t.startswith("UTMALDG") for t in loop) == 6 and len(loop) < 400, (name, len(loop))
        big = sum(ntok >= 128 for ntok, _, _ in cf.WGMMA_VARIANTS)
        assert seen[True] == 4 * big, seen
        assert seen[False] == 4 * (len(cf.WGMMA_VARIANTS) - big + len(cf.WGMMA_SK_VARIANTS)), seen
        if tail:  # the default build
            waves = _sm90_ctas_by_lora(msgs)
            assert len(waves) == 2 * len(cf.WGMMA_VARIANTS) and max(p for p, _ in waves.values()) > 1, waves
            assert all(p == lo >= 1 for p, lo in waves.values()), {k: v for k, v in waves.items() if v[0] != v[1]}


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_stsm_build_stores_the_epilogue_through_shared_memory():
    """QERL_WGMMA_STSM=1's build (with the default's switches): the loop check stays clean, and every wgmma kernel
    writes its tile by stmatrix.trans (STSM.16.MT88.4) each followed by one 16-byte global store (STG.E.128), the
    2-byte stores (STG.E.U16) kept for an out whose row stride or start is not 16-byte aligned; the CTAs an SM hold
    stay those of the default build (compared on the CPU in session 72: all equal but one stream-K variant, 2 -> 3)."""
    sass, msgs = wsc.compile_sass(2, None, _STSM)
    r = wsc.check(sass, msgs)
    assert r["kernels"] == 4 * (len(cf.WGMMA_VARIANTS) + len(cf.WGMMA_SK_VARIANTS)), r["kernels"]
    assert r["hazards"] == [] and not r["serialized"], r
    n = 0
    for name, body in wsc.functions(sass).items():
        if "fp4_wgmma_kernel" not in name:
            continue
        ops = [wsc.opcode(ins) for _, ins in body]
        stsm, st16, st2 = (sum(o.startswith(p) for o in ops) for p in ("STSM.16.MT88.4", "STG.E.128", "STG.E.U16"))
        assert stsm > 0 and st16 == stsm and st2 > 0, (name, stsm, st16, st2)
        n += 1
    assert n == r["kernels"]


def _wgmma_args(name: str) -> tuple[int, ...]:
    """A wgmma kernel's template arguments <FMT, NTOK, RW, KS, LORA, SK> from its mangled name."""
    return tuple(int(v) for v in re.findall(r"L[ib](\d+)E", name.split("EEv")[0])[:6])


def _sm90_ctas_by_lora(messages: str) -> dict[tuple[int, ...], tuple[int, int]]:
    """{(FMT, NTOK, RW, KS): CTAs an sm_90 SM holds of the grid variant without and with its LoRA epilogue} from a
    build's ptxas lines. The dispatcher's tail pick and the tuner's candidates split a last wave by the variant
    without LoRA, the launcher by the one it runs: the same wave only when the two hold as many CTAs."""
    out: dict[tuple[int, ...], list[int]] = {}
    for name, (regs, static) in wsc.resources(messages).items():
        if "fp4_wgmma_kernel" not in name:
            continue
        fmt, ntok, rw, ks, lora, sk = _wgmma_args(name)
        if not sk:
            smem = static + cf.wgmma_smem_bytes(ntok, rw, ks)
            out.setdefault((fmt, ntok, rw, ks), [0, 0])[lora] = wsc.sm90_ctas(rw * ks * 128, regs, smem)
    return {k: tuple(v) for k, v in out.items()}


def test_resources_and_sm90_occupancy():
    """ptxas -v's lines per kernel, and CTAs an SM holds as the CUDA occupancy calculator counts them on sm_90."""
    msgs = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90a'\n"
            "ptxas info    : Function properties for _Z1av\n    0 bytes stack frame, 0 bytes spill stores\n"
            "ptxas info    : Used 95 registers, used 1 barriers, 80 bytes smem, 400 bytes cmem[0]\n"
            "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90a'\n"
            "ptxas info    : Used 254 registers, 384 bytes cmem[0]\n")
    assert wsc.resources(msgs) == {"_Z1av": (95, 80), "_Z1bv": (254, 0)}
    assert wsc.sm90_ctas(256, 128, 0) == 2 and wsc.sm90_ctas(256, 129, 0) == 1  # 129 rounds up to 136 a thread
    assert wsc.sm90_ctas(128, 32, 0) == 16 and wsc.sm90_ctas(64, 16, 0) == 32  # threads, then the 32-CTA cap
    # 228 KB an SM, + 1 KB reserved a CTA
    assert [wsc.sm90_ctas(128, 32, kb * 1024) for kb in (100, 113, 114)] == [2, 2, 1]


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_bf16_sector_loads_build_changes_only_the_dense_gemv():
    """QERL_BF16_LOADS=sector's build of the decode GEMV (-DQFP4_DENSE_SECTOR=1): the FP4 variants' machine code is
    the default build's, every BF16 (FMT = 2) variant changes, and in the plain BF16 kernels a lane's two 16-byte
    pieces of a row chunk (and of its x fragment) sit 64 bytes apart instead of 16: the weight and x loads' offsets
    within a 128-byte chunk are {0, 0x40} instead of {0, 0x10}."""
    with ThreadPoolExecutor(2) as pool:
        builds = list(pool.map(lambda d: _gemv_sass(*d), [(), ("QFP4_DENSE_SECTOR=1",)]))
    assert builds[0].keys() == builds[1].keys()
    dense = [n for n in builds[0] if re.search(r"fp4_gemv(?:_lora)?_kernelILi2E", n)]
    assert len(dense) >= 6 and len(builds[0]) > len(dense)
    for name in builds[0]:
        same = [t for _, t in builds[0][name]] == [t for _, t in builds[1][name]]
        assert same == (name not in dense), name
    for name in (n for n in dense if "fp4_gemv_kernel" in n):
        for build, want in zip(builds, ({0, 0x10}, {0, 0x40}), strict=True):
            offs = _chunk_offsets(build[name])
            assert offs <= want and len(offs - {0}) == 1, (name, sorted(offs))


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_gemm_kz_build_adds_the_split_of_k_across_ctas():
    """QERL_GEMM_KZ=1's build of the mma.sync GEMM (-DQFP4_GEMM_KZ=1, session 68's experiment): the same kernels,
    each with the workspace and counter parameters appended (float*, int*), and the split's per-tile counter (a
    global atomic add) in every kernel, which the default build has in none. (Its registers differ: e.g. 107 -> 128
    for the 32-token (4, 2, *, *) variants, 141-184 -> 236-240 for the 64-token two-strip ones; gpu_bench.sh kz68
    times the default build beside it.)"""
    with ThreadPoolExecutor(2) as pool:
        (base, _), (kz, kz_msgs) = pool.map(lambda d: wsc.compile_sass(2, _gemm_src(), d),
                                                    [(), ("QFP4_GEMM_KZ=1",)])
    fb, fk = wsc.functions(base), wsc.functions(kz)
    assert len(fb) >= 40 and {n + "PfPi" for n in fb} == set(fk), sorted(set(fk) ^ {n + "PfPi" for n in fb})[:4]
    rk = wsc.resources(kz_msgs)
    assert all(0 < rk[n][0] <= 255 for n in fk), {n: rk[n] for n in fk if n not in rk or rk[n][0] > 255}
    atomic = lambda body: any(wsc.opcode(t).startswith(("ATOMG", "RED")) for _, t in body)  # noqa: E731
    assert not any(atomic(b) for b in fb.values()) and all(atomic(b) for b in fk.values())


def _chunk_offsets(body) -> set[int]:
    """The immediate offsets of a function's global loads within a 128-byte (64 bf16) chunk."""
    return {int(o, 16) % 0x80 for _, t in body if wsc.opcode(t).startswith("LDG")
            for o in re.findall(r"\+(0x[0-9a-f]+)\]", t)}


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_hbm_pattern_bf16_rows_read_as_the_bf16_gemv_does():
    """benchmarks.hbm_pattern_bench's BF16 row kernels (its device code, built for sm_90a): the pair kernel's loads of
    a row chunk sit at offsets {0, 0x10} within 128 bytes and the sector kernel's at {0, 0x40} -- the two BF16 GEMV
    builds' pattern (test_bf16_sector_loads_build_changes_only_the_dense_gemv) -- four loads a chunk in flight per
    unrolled chunk."""
    from benchmarks import hbm_pattern_bench as hb

    dev = hb._SRC[:hb._SRC.index("template <bool SECTOR>\nvoid launch_rows")]
    src = dev + "template __global__ void read_rows<2, false>(const uint4*, long long, int, int, unsigned*);\n" \
                "template __global__ void read_rows<2, true>(const uint4*, long long, int, int, unsigned*);\n"
    funcs = wsc.functions(wsc.compile_sass(2, src)[0])
    for sector, want in ((False, {0, 0x10}), (True, {0, 0x40})):
        (name,) = [n for n in funcs if "read_rows" in n and (f"ILi2ELb{int(sector)}E" in n)]
        offs = _chunk_offsets(funcs[name])
        assert offs <= want and len(offs - {0}) == 1, (name, sorted(offs))
        ldg = [t for _, t in funcs[name] if wsc.opcode(t).startswith("LDG")]
        assert len(ldg) >= 2 * 4 + 4, name  # the unrolled pair of chunks (4 loads each) and the tail's four


@pytest.mark.slow
@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_lora_ablate_builds_leave_out_what_they_name():
    """benchmarks.lora_gemv_bench --ablate's GEMV builds (-DQFP4_LORA_ABLATE=V, timing only): the plain kernels are the
    default build's in each; in the LoRA kernels bit 1 drops the output warps' term (fewer MMAs: its one MMA per 16
    ranks), bit 2 the LoRA CTAs' work (fewer MMAs: theirs over A's chunks), bit 4 only the spin on the count (fewer
    NANOSLEEPs, the same MMAs), bit 8 the spin too, its term moved before the main loop (the same MMAs in other
    machine code than bit 4's)."""
    found, lora = _gemv_lora_builds(*_LORA_ABLATE)
    builds = dict(zip((0, 1, 2, 4, 8), found, strict=True))

    def count(v, name, pred):
        return sum(pred(wsc.opcode(t)) for _, t in builds[v][name])

    for name in lora:
        mma = {v: count(v, name, lambda o: o.startswith("HMMA")) for v in builds}
        sleeps = {v: count(v, name, lambda o: o == "NANOSLEEP") for v in builds}
        assert mma[1] < mma[0] and mma[2] < mma[0] and mma[4] == mma[0] == mma[8], (name, mma)
        assert sleeps[4] < sleeps[0] and sleeps[8] < sleeps[0] and sleeps[0] >= 1, (name, sleeps)
        assert [t for _, t in builds[8][name]] != [t for _, t in builds[4][name]], name


@pytest.mark.skipif(not _HAVE, reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_prebuild_hands_its_build_over_once_and_stop_kills_the_rest():
    """wsc.prebuild (conftest starts the SASS tests' builds with it): compile_sass with the same arguments gets the
    background build (once: the next call builds again). In a child process (this suite's own prebuilds are left
    alone): the builds run at nice 19 in the caller's session (Linux's autogroups give a new session an equal CPU
    share whatever its nice); a queued command asked for is cancelled and run at once; a running build asked for is
    moved back to nice 0 (where the OS lets this user); stop_prebuilds kills a running one (its process group) and
    returns at once."""
    import os
    import subprocess
    import sys
    import time

    src = "__global__ void k(float* p) { p[threadIdx.x] = A; }\n"
    assert wsc.prebuild([(2, src, ("A=1.f",)), (2, src, ("A=1.f",))]) == 1  # the same build twice: started once
    key = wsc._build_key(2, src, ("A=1.f",), "nvcc")
    sass, msgs = wsc.compile_sass(2, src, ("A=1.f",))  # the prebuild's (or, still queued here, built now)
    assert key not in wsc._PREBUILT and "_Z1kPf" in sass and "Used" in msgs
    assert wsc._build_key(2, src, ("A=2.f",), "nvcc") != key and wsc._build_key(2, src + " ", ("A=1.f",), "nvcc") != key
    code = ("import os, threading, time\nfrom benchmarks import wgmma_sass_check as w\n"
            "big = (1, None, ('QFP4_WGMMA_NO_SK=1',))\n"
            "w.prebuild([big, w.Command(('echo', 'hi'))], workers=1)\n"
            "while not w._RUNNING: time.sleep(0.05)\n"
            "(p,) = w._RUNNING.values()\ntime.sleep(0.5)\nprint('nice', os.getpriority(os.PRIO_PROCESS, p.pid))\n"
            "print('session', os.getsid(p.pid) == os.getsid(0), os.getpgid(p.pid) == p.pid)\n"
            "fut = w._PREBUILT[('cmd', ('echo', 'hi'))]\n"
            "rc, out, err = w.run_command(('echo', 'hi'))\n"
            "print('queued', fut.cancelled(), rc, out.strip())\n"
            "th = threading.Thread(target=w._collect, args=(w._build_key(*big, 'nvcc'),), daemon=True)\n"
            "th.start(); time.sleep(1.0)\nprint('renice', os.getpriority(os.PRIO_PROCESS, p.pid))\n"
            "t = time.time(); w.stop_prebuilds(); print('stop', time.time() - t, p.returncode)\n")
    t = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=str(wsc.SRC.parents[3]))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert int(lines["nice"]) == 19, r.stdout
    # this session (one scheduler autogroup with the tests: nice then counts), a process group of its own
    assert lines["session"] == "True True", r.stdout
    assert lines["queued"] == "True 0 hi", r.stdout  # cancelled in the queue, run at once
    assert int(lines["renice"]) == (0 if os.geteuid() == 0 else 19), r.stdout
    took, rc = lines["stop"].split()
    assert float(took) < 5 and int(rc) < 0 and time.time() - t < 60, r.stdout  # killed, not finished (~60 s)
