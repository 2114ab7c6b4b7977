"""benchmarks/wgmma_peak.py (the wgmma MMA schedule's ceiling with no loads and no decode): its argument checks and
FLOP count on any machine, and, where nvcc and cuobjdump are installed, its sm_90a machine code -- each variant's loop
two chunks' four MMAs each (register A for rs and rsdec, none for ss), rsdec's shared-memory reads of what it decodes
inside the loop, the wait depth asked for, and no spills."""

import re
import shutil

import pytest

from benchmarks import wgmma_peak as wp
from benchmarks import wgmma_sass_check as wsc


def test_arguments_and_flops():
    assert wp.parse_list("128,64,128", "n", wp.WIDTHS) == [128, 64]
    assert wp.parse_list("ss", "ops", wp.OPS) == ["ss"]
    for text, name, valid in (("96", "n", wp.WIDTHS), ("x", "n", wp.WIDTHS), ("", "wgs", wp.WGS),
                              ("rr", "ops", wp.OPS), ("2", "depth", wp.DEPTHS)):
        with pytest.raises(ValueError, match=f"--{name} .*one of"):
            wp.parse_list(text, name, valid)
    with pytest.raises(SystemExit, match="--n '96': each must be one of 64, 128, 256"):
        wp.main(["--n", "96"])
    for bad in (["--ctas", "3"], ["--iters", "7"], ["--iters", "0"], ["--grid", "-1"]):
        with pytest.raises(SystemExit, match="--iters must be even and >= 2, --ctas 1 or 2 and --grid >= 0"):
            wp.main(bad)
    row = dict(N=128, op="rs", warpgroups=4, depth=1, ctas_per_sm=1, grid=296, iters=28, us=30.5, tflops=500.0,
               of_peak=0.505)
    assert "| 128 | rs | 4 | 1 | 1 | 296 | 28 | 30.5 | 500.0 | 0.505 |" in wp.markdown([row], "h")
    assert wp.chunk_flops(128) == 2 * 64 * 128 * 16 * 4
    # 132 SMs x 2 warpgroups x 1000 chunks of m64n128k16 x 4 in 1 ms: 0.1384 PFLOPS
    assert wp.tflops(128, 2, 132, 1000, 1.0) == pytest.approx(132 * 2 * 1000 * 2 * 64 * 128 * 16 * 4 / 1e-3 / 1e12)
    assert (256, 4) not in wp.VARIANTS and (128, 4) in wp.VARIANTS and len(wp.VARIANTS) == 8
    host = wp.host_src()
    assert host.count("return launch<") == len(wp.VARIANTS) * len(wp.OPS) * len(wp.DEPTHS)
    assert host.count("op == 2 &&") == host.count(", false, true, ") == len(wp.VARIANTS) * len(wp.DEPTHS)  # rsdec


def _peak_src() -> str:
    """The benchmark's device code with every variant instantiated."""
    return wp.DEVICE_SRC + "".join(f"template __global__ void wgmma_peak_kernel<{n}, {str(op == 'ss').lower()}, "
                                   f"{str(op == 'rsdec').lower()}, {d}, {128 * w}>(int, float*);\n"
                                   for n, w in wp.VARIANTS for op in wp.OPS for d in wp.DEPTHS)


def sass_builds() -> dict[str, list[tuple]]:
    """{test: its ``wsc.compile_sass`` builds}, started ahead by conftest (see test_wgmma_sass_check.sass_builds)."""
    return {"test_machine_code_is_the_schedule_it_names": [(2, _peak_src(), ())]}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None or wsc._tool("cuobjdump") is None,
                    reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_machine_code_is_the_schedule_it_names():
    sass, msgs = wsc.compile_sass(2, _peak_src())
    funcs = {n: b for n, b in wsc.functions(sass).items() if "wgmma_peak_kernel" in n}
    assert len(funcs) == len(wp.VARIANTS) * len(wp.OPS) * len(wp.DEPTHS), sorted(funcs)
    for name, body in funcs.items():
        n, ss, dec, depth, _ = (int(v) for v in re.findall(r"L[ib](\d+)E", name)[:5])
        loop = wsc.main_loop(body)  # two chunks a pass
        mmas = [t for t in loop if wsc.opcode(t).startswith("HGMMA")]
        assert len(mmas) == 8 and all(f"HGMMA.64x{n}x16.F32.BF16" in t for t in mmas), (name, mmas)
        assert any(wsc._HGMMA_A.search(t) for t in mmas) == (not ss), name  # register A only for rs / rsdec
        lds = sum(wsc.opcode(t).startswith("LDS") for t in loop)
        assert lds == (4 if dec else 0), (name, lds)  # rsdec: a word and a scale pair a chunk, in the loop
        deps = [int(m.group(1), 16) for t in loop if (m := wsc._DEPBAR.search(t))]
        assert deps == [depth, depth], (name, deps)  # one wait a chunk
        assert not any(wsc.opcode(t).startswith(("LDL", "STL")) for _, t in body), name  # no spills
    assert "C7512" not in msgs and "C7513" not in msgs, msgs  # ptxas serialized no kernel's MMAs
