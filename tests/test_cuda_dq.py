"""qerl.kernels.cuda_dq (the backward's g @ Ŵ with the FP4 weight dequantized inside a wgmma GEMM): its launch rules
and argument errors on any machine, its sm_90a build (registers, no spills) where nvcc is installed, and, with
``-m gpu`` on an sm_90 device, the kernel against g @ the exactly dequantized weight over shapes, token counts and
every launch configuration, a column slice, the dispatcher's route, determinism and CUDA-graph replay."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch

from benchmarks import dq_gemm_bench as bench
from benchmarks import wgmma_sass_check as wsc
from benchmarks.dq_probe import exact_weight
from qerl.kernels import cuda_dq as dq
from qerl.kernels import cuda_fp4 as cf
from qerl.quant import FORMATS

FP4 = ("nvfp4", "mxfp4")


def _quantized(fmt: str, n: int, k: int, seed: int, device="cpu") -> dict[str, torch.Tensor]:
    """A random (n, k) weight in the format's compressed-tensors tensors, rows of spread magnitudes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device=device) * torch.exp(torch.randn(n, 1, generator=gen, device=device))
    return FORMATS[fmt].quantize(0.02 * w)


def _prepared(fmt: str, q) -> cf.CudaFP4Weight:
    return cf.prepare(fmt, q["weight_packed"], q["weight_scale"], q.get("weight_global_scale"))


def _weight(fmt: str, n: int, k: int, seed: int, device="cpu") -> cf.CudaFP4Weight:
    return _prepared(fmt, _quantized(fmt, n, k, seed, device))


# ------------------------------------------------------------------------------------------ CPU

def test_configs_and_the_rule():
    # 7B's down_proj backward (N 3584 -> K 18944) and gate_proj's (N 18944 -> K 3584)
    assert (256, 1) in dq.configs(512, 3584, 18944) and (128, 8) in dq.configs(512, 3584, 18944)
    assert all(nb == 128 for nb, _ in dq.configs(64, 256, 384))  # 384 columns: no 256-column tiles
    assert dq.configs(64, 256, 384) == [(128, 0), (128, 1)]  # 4 contraction chunks: no splits (each keeps >= 4)
    assert max(kz for _, kz in dq.configs(512, 18944, 3584)) == dq.MAX_KZ
    assert dq.tiles(512, 3584, 256) == 4 * 14 and dq.tiles(200, 3584, 128) == 2 * 28
    for m, n, k in ((512, 18944, 3584), (512, 3584, 18944), (2048, 4608, 3584), (17, 3584, 3584), (1, 64, 128)):
        nb, kz = dq.pick_config(m, n, k, 132)
        est = {c: dq.estimate_us(m, n, k, *c, 132) for c in dq.configs(m, n, k)}
        assert est[(nb, kz)] == pytest.approx(min(est.values())), (m, n, k, nb, kz)
    # gate_proj's backward at M 512: 4 x 14 tiles of 256 columns fill 56 of 132 SMs, so the rule splits the 296
    # contraction chunks (by stream-K: 132 even ranges); down_proj's (296 tiles, 56 chunks) does not pay 4 splits'
    # 155 MB of fp32 partials
    assert dq.pick_config(512, 18944, 3584, 132) in ((256, 0), (256, 2), (128, 1))
    assert dq.pick_config(512, 3584, 18944, 132)[1] < 4
    one = dq.estimate_us(512, 18944, 3584, 256, 1, 132)
    assert one == pytest.approx(296 * dq.CHUNK_US[256])  # one wave of 56 CTAs, each all 296 chunks
    assert dq.estimate_us(512, 18944, 3584, 256, 2, 132) == pytest.approx(
        148 * dq.CHUNK_US[256] + 2 * 2 * 512 * 3584 * 4 / 2.5e6 + dq.REDUCE_US)
    with pytest.raises(ValueError, match=r"no config for contraction 64, output width 96"):
        dq.pick_config(8, 64, 96, 132)


def test_check_config_names_the_bad_value_and_the_valid_ones():
    assert dq.check_config([256, 2], 512, 18944, 3584) == (256, 2)
    with pytest.raises(ValueError, match=r"dq config \(256, 1\) for contraction 256, output width 384: "
                                         r"valid \[\(128, 0\), \(128, 1\)\]"):
        dq.check_config((256, 1), 64, 256, 384)
    with pytest.raises(ValueError, match=r"expected \(nb, kz\)"):
        dq.check_config("fast", 64, 256, 384)


def test_switch_and_argument_errors(monkeypatch):
    monkeypatch.delenv("QERL_DQ_GEMM", raising=False)
    assert not dq.enabled("bwd") and not dq.enabled("fwd")
    for v, bwd, fwd in (("bwd", True, False), ("fwd", False, True), ("all", True, True), ("0", False, False)):
        monkeypatch.setenv("QERL_DQ_GEMM", v)
        assert (dq.enabled("bwd"), dq.enabled("fwd")) == (bwd, fwd), v
    with pytest.raises(ValueError, match=r"dq op 'grad'; valid: bwd, fwd"):
        dq.enabled("grad")
    monkeypatch.setenv("QERL_DQ_GEMM", "yes")
    with pytest.raises(ValueError, match=r"QERL_DQ_GEMM='yes'; valid: 0, bwd, fwd, all"):
        dq.enabled()
    w = _weight("nvfp4", 64, 128, seed=1)
    assert dq.supported(w, "bwd") and not dq.supported(w, "fwd")  # the forward's 64 output columns: no 128 tile
    assert dq.dims(w, "bwd") == (64, 128) and dq.dims(w, "fwd") == (128, 64)
    assert not dq.supported(_weight("nvfp4", 48, 128, seed=1), "bwd")
    with pytest.raises(ValueError, match=r"dq_gemm bwd: weight nvfp4 \(48, 128\) not supported"):
        dq.gemm_t(torch.zeros(4, 48, dtype=torch.bfloat16), _weight("nvfp4", 48, 128, seed=1))
    with pytest.raises(ValueError, match=r"dq_gemm fwd: weight nvfp4 \(64, 128\) not supported"):
        dq.gemm(torch.zeros(4, 128, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"bf16 \(M, 64\) tensor.*torch.bfloat16 \(4, 64\).*cpu"):
        dq.gemm_t(torch.zeros(4, 64, dtype=torch.bfloat16), w)


def test_cpu_backward_is_unchanged_by_the_switch(monkeypatch):
    """Off the GPU the kernels' layout's backward stays the reference product whatever the switch says."""
    from qerl import kernels as qk
    from qerl.kernels import relaid
    q = relaid.from_compressed(FORMATS["nvfp4"], FORMATS["nvfp4"].quantize(torch.randn(64, 128) * 0.02))
    g = torch.randn(3, 64).bfloat16()
    monkeypatch.setenv("QERL_DQ_GEMM", "0")
    ref = qk.qmm_t(g, "nvfp4", q)
    monkeypatch.setenv("QERL_DQ_GEMM", "all")
    assert torch.equal(qk.qmm_t(g, "nvfp4", q), ref)


def test_bench_arguments_and_summary(capsys):
    assert bench.parse_ints("256,512", "m") == [256, 512]
    assert bench.parse_ints("0,2", "kz", least=0) == [0, 2]  # kz 0: stream-K
    with pytest.raises(ValueError, match=r"--kz '-1': integers >= 0 expected"):
        bench.parse_ints("-1", "kz", least=0)
    for text in ("", "a", "0", "-1"):
        with pytest.raises(ValueError, match=r"--m"):
            bench.parse_ints(text, "m")
    for argv, msg in ((["--fmts", "nf4"], "not FP4 formats; valid: nvfp4, mxfp4"), (["--kz", "9"], "at most 8"),
                      (["--m", "x"], "comma-separated integers"), (["--ops", "grad"], "valid: bwd, fwd")):
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert msg in capsys.readouterr().err, argv
    base = dict(model="7b", op="bwd", M=512, N=18944, K=3584, mode="graph", device="d")
    rows = [dict(base, fmt="bf16", linear="gate", path="bf16", nb="", kz="", us=100.0, rel_err=""),
            dict(base, fmt="nvfp4", linear="gate", path="prev", nb="", kz="", us=160.0, rel_err=""),
            dict(base, fmt="nvfp4", linear="gate", path="rule", nb="", kz="", us=125.0, rel_err=""),
            dict(base, fmt="nvfp4", linear="gate", path="cfg", nb=256, kz=2, us=125.0, rel_err="1.0e-03"),
            dict(base, fmt="nvfp4", linear="gate", path="cfg", nb=128, kz=4, us=120.0, rel_err="2.0e-03")]
    md = bench.summary(rows)
    assert ("| 7b | bwd | nvfp4 | 512 | 100.0 | 160.0 (0.62×) | 125.0 (0.80×) | 120.0 (0.83×) | gate (128, 4) | "
            "2.0e-03 |") in md, md
    assert bench.prev_note({}).startswith("prev: the library's default path")
    for env in ({"QERL_CUDA_GEMV": "0"}, {"QERL_CUDA_DEQUANT": "0"}):
        assert bench.prev_note(env).startswith("prev: Triton dequantization + cuBLAS"), env


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (sm_90a code is compiled, not run)")
def test_sm90a_build_has_every_kernel_without_spills(tmp_path):
    """Every (format, global scale, tile width) kernel compiles for sm_90a within the 255 registers its one CTA an SM
    allows, without spills or serialized MMAs; the dense dequantization kernel that shares its decode still builds."""
    src = dq._CU[0]
    r = subprocess.run(["nvcc", "-c", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        f"-I{src.parent}", "-o", str(tmp_path / "dq.o"), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    kern = {}
    for block in r.stderr.split("Compiling entry function '")[1:]:
        kern[block.split("'")[0]] = (int(re.search(r"Used (\d+) registers", block).group(1)),
                                     int(re.search(r"(\d+) bytes spill stores", block).group(1)))
    gemms = [n for n in kern if "dq_gemm_kernel" in n]  # (format, global scale, width) x (backward, forward)
    assert len(gemms) == 12 and any("dq_reduce_kernel" in n for n in kern), sorted(kern)
    assert any("dq_stream_reduce_kernel" in n for n in kern), sorted(kern)
    for n in gemms:
        assert kern[n][0] <= 255 and kern[n][1] == 0, (n, kern[n])
    assert "Performance Loss" not in r.stderr, r.stderr  # e.g. C7512 / C7513 / C7518: serialized MMAs
    # the warp-specialized build (QERL_DQ_LOOP=ws): its kernels alone, three warpgroups an SM within 65536 registers
    r = subprocess.run(["nvcc", "-c", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        "-DQFP4_DQ_WS=1", f"-I{src.parent}", "-o", str(tmp_path / "dqws.o"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    ws = {}
    for block in r.stderr.split("Compiling entry function '")[1:]:
        ws[block.split("'")[0]] = (int(re.search(r"Used (\d+) registers", block).group(1)),
                                   int(re.search(r"(\d+) bytes spill stores", block).group(1)))
    assert sorted(n.split("dq_ws_kernel")[1] for n in ws if "dq_ws_kernel" in n) == sorted(
        n.split("dq_gemm_kernel")[1] for n in gemms)  # the same instantiations
    assert not any("dq_gemm_kernel" in n for n in ws), sorted(ws)
    for n, (regs, spill) in ws.items():
        assert regs * 384 <= 65536 and spill == 0, (n, regs, spill)
    # its MMAs pipelined: session 66's loop touched the accumulators on a branch inside it and ptxas serialized them
    assert "Performance Loss" not in r.stderr, r.stderr
    # the deepest copy ring (QERL_DQ_STAGES=6) fits its shared memory (a static_assert) and spills nothing; 7 does not
    for st, ok in ((6, True), (7, False)):
        r = subprocess.run(["nvcc", "-c", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                            f"-DQFP4_DQ_STAGES={st}", f"-I{src.parent}", "-o", str(tmp_path / f"st{st}.o"), str(src)],
                           capture_output=True, text=True)
        assert (r.returncode == 0) == ok, (st, r.stderr[-3000:])
        assert ok or "227 KB" in r.stderr, r.stderr[-3000:]
        if ok:
            spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
            assert spills and set(spills) == {"0"}, r.stderr[-3000:]
    r = subprocess.run(["nvcc", "-c", "-O3", "-gencode=arch=compute_90a,code=sm_90a", f"-I{src.parent}", "-o",
                        str(tmp_path / "deq.o"), str(src.parent / "fp4_dequant.cu")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def sass_builds() -> dict[str, list[tuple]]:
    """{test: its ``wgmma_sass_check.compile_sass`` builds}, started ahead by conftest."""
    src = dq._CU[0].read_text()
    return {"test_ablation_and_decode_builds": [(2, src, (f"QFP4_DQ_ABLATE={v}",)) for v in (0, 1, 2, 4)]
            + [(2, src, ("QFP4_DQ_MMA_DECODE=1",))],
            "test_warp_specialized_build": [(2, src, ("QFP4_DQ_WS=1",))]}


def test_ablation_and_decode_switches():
    """QERL_DQ_ABLATE (timing only) is a sum of the parts a build leaves out, QERL_DQ_DECODE exact or mma; anything
    else names the choices (the bench: an argument error, and no table from an ablated build)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("QERL_DQ_ABLATE", raising=False)
        assert dq.ablate() == 0
        mp.setenv("QERL_DQ_ABLATE", "5")
        assert dq.ablate() == 5
        for bad in ("8", "-1", "x", ""):
            mp.setenv("QERL_DQ_ABLATE", bad)
            with pytest.raises(ValueError, match=rf"QERL_DQ_ABLATE={bad!r}: a sum of 1 \(no dequantization\), 2 "
                                                 r"\(no MMAs\), 4 \(no barrier before the MMAs\), 0 to 7"):
                dq.ablate()
        for name, fn, default, good, bads, valid in (
                ("QERL_DQ_LOOP", dq.loop, "plain", ("ws", "ws"), ("1",), "plain, ws"),
                ("QERL_DQ_STAGES", dq.stages, 4, ("6", 6), ("7", "2", "four"), "4, 3, 5, 6")):
            mp.delenv(name, raising=False)
            assert fn() == default, name
            mp.setenv(name, good[0])
            assert fn() == good[1], name
            for bad in bads:
                mp.setenv(name, bad)
                with pytest.raises(ValueError, match=rf"{name}={bad!r}; valid: {valid}"):
                    fn()
            mp.delenv(name)
        mp.delenv("QERL_DQ_DECODE", raising=False)
        assert dq.decode() == "exact"
        mp.setenv("QERL_DQ_DECODE", "mma")
        assert dq.decode() == "mma"
        mp.setenv("QERL_DQ_DECODE", "fast")
        with pytest.raises(ValueError, match=r"QERL_DQ_DECODE='fast'; valid: exact, mma"):
            dq.decode()
        with pytest.raises(SystemExit) as e:  # the bench's argument error, before any device is asked for
            bench.main([])
        assert e.value.code == 2
        mp.delenv("QERL_DQ_DECODE")
        mp.setenv("QERL_DQ_ABLATE", "1")
        with pytest.raises(SystemExit) as e:  # a wrong kernel's times are never installed as the table
            bench.main(["--write-table"])
        assert e.value.code == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None or wsc._tool("cuobjdump") is None,
                    reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_ablation_and_decode_builds():
    """-DQFP4_DQ_ABLATE=1 drops the dequantization's shared-memory stores (the MMAs stay), 2 every MMA, 4 a barrier a
    chunk; -DQFP4_DQ_MMA_DECODE=1 drops float32 -> bf16 packs (F2FP) from the decode: in every GEMM kernel, against
    the default build."""
    builds = {}
    for src, defines in (b[1:] for b in sass_builds()["test_ablation_and_decode_builds"]):
        funcs = wsc.functions(wsc.compile_sass(2, src, defines)[0])
        key = "mma" if "MMA_DECODE" in defines[0] else int(defines[0].split("=")[1])
        builds[key] = {n: [wsc.opcode(t) for _, t in b] for n, b in funcs.items() if "dq_gemm_kernel" in n}
    assert len(builds[0]) == 12 and all(b.keys() == builds[0].keys() for b in builds.values())
    mma_build = builds.pop("mma")  # QERL_DQ_DECODE=mma: no float32 products rounded to bf16 pairs in the decode
    for name in builds[0]:
        f2fp = [sum(op.startswith("F2FP") for op in b[name]) for b in (builds[0], mma_build)]
        assert f2fp[1] < f2fp[0], (name, f2fp)

    def count(v, name, prefix):
        return sum(op.startswith(prefix) for op in builds[v][name])

    for name in builds[0]:
        # the MMAs: fp32-accumulating HGMMA (without any, ptxas keeps a placeholder F16 one of zero registers)
        sts, bar = ({v: count(v, name, p) for v in builds} for p in ("STS", "BAR.SYNC"))
        mma = {v: sum(op.startswith("HGMMA") and ".F32" in op for op in builds[v][name]) for v in builds}
        assert mma[0] > 0 and mma[1] == mma[4] == mma[0] and mma[2] == 0, (name, mma)
        assert sts[1] < sts[0] and sts[0] > 0, (name, sts)
        assert bar[4] < bar[0] == bar[1], (name, bar)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None or wsc._tool("cuobjdump") is None,
                    reason="needs nvcc and cuobjdump (sm_90a code is built, not run)")
def test_warp_specialized_build():
    """-DQFP4_DQ_WS=1: every kernel waits on and arrives at mbarriers (SYNCS), keeps its fp32 MMAs (HGMMA .F32) and
    the decode's shared stores, and uses the producer's named barrier (BAR.SYNC with an id) besides the CTA's."""
    src, defines = sass_builds()["test_warp_specialized_build"][0][1:]
    funcs = wsc.functions(wsc.compile_sass(2, src, defines)[0])
    kernels = {n: [wsc.opcode(t) for _, t in b] for n, b in funcs.items() if "dq_ws_kernel" in n}
    assert len(kernels) == 12, sorted(funcs)
    for name, ops in kernels.items():
        assert sum(op.startswith("HGMMA") and ".F32" in op for op in ops) > 0, name
        assert sum(op.startswith("SYNCS") for op in ops) >= 3, (name, sorted({o for o in ops if "SYNC" in o}))
        assert sum(op.startswith("STS") for op in ops) > 0, name
        assert sum(op.startswith("BAR.SYNC") for op in ops) >= 2, (name, sorted({o for o in ops if "BAR" in o}))


# ------------------------------------------------------------------------------------------ GPU

needs_sm90 = pytest.mark.skipif(not (torch.cuda.is_available() and cf.wgmma_supported()),
                                reason="needs an sm_90 GPU")


def _exact(fmt: str, q, rounded: bool | None = None) -> torch.Tensor:
    """The weight the kernel's build multiplies by (``exact_weight``): rounded to bf16 for QERL_DQ_DECODE=exact, the
    float32 products for mma (``rounded`` overrides: the dequantize + cuBLAS path's is always rounded)."""
    return exact_weight(fmt, q, dq.decode() == "exact" if rounded is None else rounded)


def _ref(g: torch.Tensor, whole: torch.Tensor, op: str = "bwd") -> tuple[torch.Tensor, torch.Tensor]:
    """g @ Ŵ (bwd) or g @ Ŵᵀ (fwd) in float32 from the exact Ŵ (``dq_probe.exact_weight``: the format's pure-torch
    dequantization), and |g| @ |Ŵ| (the magnitudes)."""
    if op == "fwd":
        whole = whole.t()
    return g.float() @ whole, g.float().abs() @ whole.abs()


def _close(y: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, what) -> None:
    """One bf16 rounding of the output (half an ulp: 2^-8 relative) plus fp32 summation in another order (~sqrt(n)
    roundings of 2^-24 of the magnitudes over a contraction of n <= 27648: 5e-5 of them bounds it with margin). A
    misplaced operand element errs by about one term, ~1/n of the magnitudes: far above the margin on the small
    shapes' contractions (<= 1024), which run every config; layout slips move whole 16-byte units or tiles."""
    y = y.float()
    assert torch.isfinite(y).all(), (what, "unwritten or non-finite output")
    err = (y - ref).abs() - (2**-8 * ref.abs() + 5e-5 * mag)
    assert (err <= 0).all(), (what, float(err.max()), float((y - ref).abs().max()))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_dq_gemm_every_config(fmt):
    """Both products at token counts around the 128-row tiles, on small shapes at every launch config and on the 7B /
    32B shapes at the rule's and a few others."""
    assert dq.available(), dq._STATE.get("error")
    gen = torch.Generator(device="cuda").manual_seed(11)
    small = [(64, 128), (192, 256), (320, 384), (1024, 512), (256, 640)]
    big = [(4608, 3584), (18944, 3584), (3584, 18944), (5120, 27648)]
    for i, (n, k) in enumerate(small + big):
        q = _quantized(fmt, n, k, seed=40 + i, device="cuda")
        w, whole = _prepared(fmt, q), _exact(fmt, q)
        for op in dq.OPS:
            if not dq.supported(w, op):
                continue
            r, c = dq.dims(w, op)
            for m in (1, 17, 128, 200, 512):
                g = torch.randn(m, r, device="cuda", generator=gen).bfloat16()
                ref, mag = _ref(g, whole, op)
                cfgs = dq.configs(m, r, c) if (n, k) in small else \
                    {dq.pick_config(m, r, c, 132), (256, 1), (128, 3), (256, 8), (128, 0), (256, 0)} & set(dq.configs(m, r, c))
                for cfg in sorted(cfgs):
                    out = torch.full((m, c), float("nan"), device="cuda", dtype=torch.bfloat16)
                    y = (dq.gemm_t if op == "bwd" else dq.gemm)(g, w, out, cfg)
                    _close(y, ref, mag, (fmt, op, n, k, m, cfg))


@pytest.mark.gpu
@needs_sm90
def test_gpu_dq_gemm_without_global_scale_on_a_column_slice_into_strided_out():
    """NVFP4 without its global scale (the kernel's HAS_G = false build), a column slice of a weight (its strips
    read where they lie: cs > C), g and out with row strides wider than their rows."""
    from qerl.kernels import dequant as kd
    q = _quantized("nvfp4", 1024, 1024, seed=7, device="cuda")
    w = dataclasses.replace(_prepared("nvfp4", q), global_scale=None)
    whole = _exact("nvfp4", {k: v for k, v in q.items() if k != "weight_global_scale"})
    gen = torch.Generator(device="cuda").manual_seed(12)
    gw = torch.randn(300, 1024 + 24, device="cuda", generator=gen).bfloat16()
    g = gw[:, 8:8 + 1024]
    part = kd._relaid_cols(w, 256, 768)  # 512 columns of 1024
    ref, mag = _ref(g, whole[:, 256:768])
    wide = torch.full((300, 512 + 16), float("nan"), device="cuda", dtype=torch.bfloat16)
    for cfg in ((256, 1), (128, 2), (256, 4), (128, 0), (256, 0)):  # 16 contraction chunks: up to 4 splits
        assert cfg in dq.configs(300, 1024, 512)
        wide.fill_(float("nan"))
        out = dq.gemm_t(g, part, wide[:, 8:8 + 512], cfg)
        _close(out, ref, mag, cfg)
        assert torch.isnan(wide[:, :8]).all() and torch.isnan(wide[:, 8 + 512:]).all(), cfg


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fmt", FP4)
def test_gpu_dispatcher_route_determinism_and_graphs(fmt, monkeypatch):
    """``qmm_t`` on a weight in the kernels' layout takes the kernel with ``QERL_DQ_GEMM=bwd`` (its output bit for
    bit, a misaligned g copied first) and dequantize + cuBLAS with 0; ``qmm`` at M 4096 takes it with ``fwd``; the
    kernel gives the same bits twice and inside a replayed CUDA graph."""
    from qerl import kernels as qk
    from qerl.kernels import relaid
    qc = FORMATS[fmt].quantize(
        torch.randn(4608, 3584, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3)) * 0.02)
    q = relaid.from_compressed(FORMATS[fmt], qc)
    w, whole = relaid.weight(FORMATS[fmt], q), _exact(fmt, qc)
    g = torch.randn(2, 256, 4608, device="cuda").bfloat16()
    direct = dq.gemm_t(g.reshape(-1, 4608), w)
    assert torch.equal(dq.gemm_t(g.reshape(-1, 4608), w), direct)
    monkeypatch.setenv("QERL_DQ_GEMM", "bwd")
    calls, orig = [], dq.gemm_t
    monkeypatch.setattr(dq, "gemm_t", lambda *a, **k: calls.append(a[0].shape) or orig(*a, **k))
    y = qk.qmm_t(g, fmt, q)
    assert calls == [(512, 4608)] and y.shape == (2, 256, 3584) and torch.equal(y.reshape(512, 3584), direct)
    gv = torch.zeros(512, 4608 + 8, device="cuda", dtype=torch.bfloat16)[:, 1:4609]  # rows 2 bytes off alignment
    gv.copy_(g.reshape(512, 4608))
    assert torch.equal(qk.qmm_t(gv, fmt, q), direct) and len(calls) == 2  # the route copies it, same bits
    calls.pop()
    monkeypatch.setenv("QERL_DQ_GEMM", "0")
    prev = qk.qmm_t(g, fmt, q)
    assert calls == [(512, 4608)]  # not taken
    ref, mag = _ref(g.reshape(-1, 4608), _exact(fmt, qc, rounded=True))  # dequantize + cuBLAS: bf16 weights
    _close(prev.reshape(512, 3584), ref, mag, "prev")
    monkeypatch.setattr(dq, "gemm_t", orig)
    # the forward: where the dispatcher dequantizes (M 4096, above the wgmma GEMM's range), QERL_DQ_GEMM=fwd takes the
    # kernel (its output bit for bit), and leaves the backward alone
    x = torch.randn(4096, 3584, device="cuda").bfloat16()
    monkeypatch.setenv("QERL_DQ_GEMM", "fwd")
    fcalls, forig = [], dq.gemm
    monkeypatch.setattr(dq, "gemm", lambda *a, **k: fcalls.append(a[0].shape) or forig(*a, **k))
    yf = qk.qmm(x, fmt, q)
    assert fcalls == [(4096, 3584)] and torch.equal(yf, dq.gemm(x, w)), fcalls
    assert torch.equal(qk.qmm_t(g, fmt, q), prev) and calls == [(512, 4608)]
    monkeypatch.setattr(dq, "gemm", forig)
    ref, mag = _ref(x, whole, "fwd")
    _close(yf, ref, mag, "fwd route")
    for cfg in ((256, 1), (128, 6), (256, 0)):
        gs = g.reshape(-1, 4608).clone()
        out = torch.empty(512, 3584, device="cuda", dtype=torch.bfloat16)
        eager = dq.gemm_t(gs, w, None, cfg).clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dq.gemm_t(gs, w, out, cfg)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), cfg
        gs.copy_(torch.randn_like(gs))
        graph.replay()
        assert torch.equal(out, dq.gemm_t(gs, w, None, cfg)), cfg


def test_probe_locates_misplaced_outputs():
    """benchmarks.dq_probe's lookup (its GPU run needs a kernel to probe): a tile whose two 16-byte units of one row
    are swapped shows as wrong outputs in that row's units only, each found at its true place in the weight."""
    from benchmarks import dq_probe
    mat = torch.arange(16 * 128, dtype=torch.float32).reshape(16, 128)
    y = mat.clone()
    y[3, 8:16], y[3, 16:24] = mat[3, 16:24], mat[3, 8:16]  # units 1 and 2 of row 3 swapped
    nbad, lines = dq_probe.locate(y, mat, first=2)
    assert nbad == 16
    assert "by 64-column block [16, 0]" in lines[0] and "by unit (col % 64 // 8) [0, 8, 8, 0, 0, 0, 0, 0]" in lines[0]
    assert "by row % 16 [0, 0, 0, 16" in lines[0]
    assert lines[1].startswith("  out (3, 8) = 400, expected 392; that value is at [[3, 16]]"), lines[1]
    assert dq_probe.locate(mat[:4], mat) == (0, [])


def test_config_table_lookup_and_its_writer(tmp_path, monkeypatch):
    """The measured config table: the nearest measured M in ratio (ties to the larger), none above the largest or for
    another shape (the rule then decides), a bad entry an error naming the file; the bench's writer picks the least
    mean time per shape and M."""
    import json
    monkeypatch.setattr(dq, "_TABLE_DIR", tmp_path)
    dq._TABLES.clear()
    try:
        rows = [dict(op="bwd", N=18944, K=3584, M=512, path="cfg", nb=256, kz=2, us=u) for u in (100.0, 110.0)]
        rows += [dict(op="bwd", N=18944, K=3584, M=512, path="cfg", nb=128, kz=1, us=u) for u in (104.0, 105.0)]
        rows += [dict(op="bwd", N=18944, K=3584, M=2048, path="cfg", nb=256, kz=1, us=300.0),
                 dict(op="fwd", N=18944, K=3584, M=512, path="cfg", nb=128, kz=2, us=90.0),
                 dict(op="bwd", N=18944, K=3584, M=512, path="prev", nb="", kz="", us=1.0)]
        entries = bench.table(rows)
        assert entries == [dict(op="bwd", r=18944, c=3584, M=512, nb=128, kz=1, us=104.5),  # 104.5 beats 105
                           dict(op="bwd", r=18944, c=3584, M=2048, nb=256, kz=1, us=300.0),
                           dict(op="fwd", r=3584, c=18944, M=512, nb=128, kz=2, us=90.0)]
        dq.install_table("NVIDIA H100 80GB HBM3", json.dumps(dict(entries=entries)))
        assert (tmp_path / "dq_gemm_nvidia_h100_80gb_hbm3.json").exists()
        look = lambda m, op="bwd": dq.tuned_config(op, m, 18944, 3584, "NVIDIA H100 80GB HBM3")  # noqa: E731
        assert look(512) == (128, 1) and look(700) == (128, 1) and look(1500) == (256, 1)
        assert look(1024) == (256, 1)  # 2x from both: the larger
        assert look(4096) is None and look(512, "fwd") is None  # above the largest; the forward's shape is (3584, 18944)
        assert dq.tuned_config("fwd", 512, 3584, 18944, "NVIDIA H100 80GB HBM3") == (128, 2)
        assert dq.tuned_config("bwd", 512, 4608, 3584, "NVIDIA H100 80GB HBM3") is None
        dq.install_table("Bad GPU", json.dumps(dict(entries=[dict(op="bwd", r=256, c=384, M=64, nb=256, kz=1)])))
        with pytest.raises(ValueError, match=r"dq_gemm_bad_gpu.json: entry .*\(nb, kz\) one of \[\(128, 0\), \(128, 1\)\]"):
            dq.load_table("Bad GPU")
    finally:
        dq._TABLES.clear()


def _swizzle(addr):
    """The 128-byte swizzle on a shared-memory byte address: bits 4-6 XOR bits 7-9 (Swizzle<3,4,3>)."""
    return addr ^ (((addr >> 7) & 7) << 4)


@pytest.mark.parametrize("loop", dq.LOOPS)
@pytest.mark.parametrize("op,nb", [("bwd", 128), ("bwd", 256), ("fwd", 128), ("fwd", 256)])
def test_shared_memory_addressing_matches_the_descriptors(op, nb, loop):
    """The kernel's index math on the CPU: where its threads write the activations' tile (cp.async) and the
    dequantized weight tile (st.shared), read back through wgmma's canonical 128-byte-swizzle layouts with the
    descriptors the kernel builds (K-major: SBO 1 KB, k16 step j at +32 j bytes; the backward's MN-major weight tile:
    LBO 8 KB between 64-column blocks, SBO 1 KB between 8-row groups, step j at +2 KB), gives each MMA step exactly
    the operand elements it multiplies: for the plain main loop (256 threads stage the tokens, rows gr + 32 j) and the
    warp-specialized one (the producer's 128 threads, rows gr + 16 i; the consumers' MMAs). The constants are read
    from the kernel's source, so an edit there that is not made here fails the test."""
    src = dq._CU[0].read_text()
    shared = ("((8192u >> 4) << 16)", "gr * 128 + ((gu ^ (gr & 7)) << 4)", "(FWD ? 0 : (b % CB) * 8192) + row * 128",
              "FWD ? 16 * b + g : 16 * (b / CB) + g", "p + 1024 + u0", "((2 * t) ^ (row & 7)) << 4",
              "blo + 128 * j", "blo + 2 * j", "alo + 2 * j")  # chunk_mmas's steps
    own = {"plain": ("wg * 64 * 128", "j * 32 * 128", "chunk_mmas<NB, FWD>(acc, alo, tbase + (idx & 1) * L::TILE)"),
           "ws": ("cw * 64 * 128", "dst + i * 16 * 128",
                  "chunk_mmas<NB, FWD>(acc, alo, sbase + L::TOFF + (j % kWsTiles) * L::TILE)",
                  "COPY = (SOFF + BLOCKS * scale_bytes<FMT>() + 1023) / 1024 * 1024")}[loop]
    for const in shared + own:
        assert const in src, const
    cb_n = nb // 64
    # the activations' tile: thread tid writes unit gu = tid & 7 of rows gr + step j, gr = tid >> 3
    threads, step = (256, 32) if loop == "plain" else (128, 16)
    act = {}
    for tid in range(threads):
        gu, gr = tid & 7, tid >> 3
        for j in range(128 // step):
            row = gr + step * j
            base = gr * 128 + ((gu ^ (gr & 7)) << 4) + j * step * 128
            for e in range(8):
                act[base + 2 * e] = (row, 8 * gu + e)  # (token row, contraction column of the chunk)
    # the weight tile: block b, lane (g, t) writes rows row and row + 8, columns 16 t .. 16 t + 15 of its block
    wt = {}
    for b in range(4 * cb_n if op == "bwd" else nb // 16):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            row = 16 * b + g if op == "fwd" else 16 * (b // cb_n) + g
            p = (0 if op == "fwd" else (b % cb_n) * 8192) + row * 128
            for half, u in ((0, 2 * t), (1, 2 * t + 1)):
                for dr in (0, 8):
                    for e in range(8):
                        addr = p + dr * 128 + ((u ^ (row & 7)) << 4) + 2 * e
                        col = 16 * t + 8 * half + e  # the lane's column of the (strip, chunk) block
                        # backward: contraction row 16 (b / CB) + g(+8), output column 64 (b % CB) + col
                        # forward: weight (output) row 16 b + g(+8), contraction column col
                        wt[addr] = (row + dr, 64 * (b % cb_n) + col) if op == "bwd" else (row + dr, col)
    assert len(act) == 128 * 64 and len(wt) == 64 * nb
    for j in range(4):  # k16 step j of the chunk
        for wg in range(2):  # A: K-major, start + 32 j, SBO 1024
            start = wg * 64 * 128 + 32 * j
            for mm in range(64):
                for kk in range(16):
                    assert act[_swizzle(start + (mm // 8) * 1024 + (mm % 8) * 128 + 2 * kk)] == (64 * wg + mm,
                                                                                                  16 * j + kk)
        for kk in range(16):
            for nn in range(nb):
                if op == "bwd":  # B MN-major: start + 2048 j, LBO 8192 (64-column blocks), SBO 1024 (8-row groups)
                    addr = 2048 * j + (nn // 64) * 8192 + (kk // 8) * 1024 + (kk % 8) * 128 + 2 * (nn % 64)
                    want = (16 * j + kk, nn)  # contraction row, output column
                else:  # B K-major: rows are the output (weight rows), start + 32 j, SBO 1024
                    addr = 32 * j + (nn // 8) * 1024 + (nn % 8) * 128 + 2 * kk
                    want = (nn, 16 * j + kk)  # output row, contraction column
                assert wt[_swizzle(addr)] == want, (j, kk, nn)


_STREAM_WALK = r"""
#include <cstdio>
#include <cstdlib>
#include <set>
#include <utility>
#include <vector>
#include "fp4_dq_stream.h"
using namespace qfp4::dq;
// argv: triples (tiles, chunks a tile, CTAs). Prints every CTA's segments ("S b tile s e") as the kernel walks them,
// then "OK" when every iteration is covered once, every tile one CTA covers whole was written whole, and for every
// other tile the reduction's (CTA, slot) list (sk_owner, sk_slot) is exactly what the kernel's CTAs wrote, in order,
// each CTA using a slot at most once; else "BAD ...".
int main(int argc, char** argv) {
  for (int a = 1; a + 2 < argc; a += 3) {
    const long tiles = atol(argv[a]);
    const int nc = atoi(argv[a + 1]), G = atoi(argv[a + 2]);
    const long T = tiles * nc;
    std::vector<int> cover(T, 0), whole(tiles, 0);
    std::vector<std::vector<std::pair<int, int>>> parts(tiles);
    std::set<std::pair<int, int>> used;
    bool ok = true;
    for (int b = 0; b < G; ++b) {
      long i = sk_begin(T, G, b);
      const long i1 = sk_begin(T, G, b + 1);
      for (int seg = 0; i < i1; ++seg) {
        int tile, s, e;
        sk_segment(nc, i, i1, tile, s, e);
        printf("S %d %d %d %d\n", b, tile, s, e);
        for (int c = s; c < e; ++c) cover[(long)tile * nc + c]++;
        if (s == 0 && e == nc) {
          whole[tile]++;
        } else {
          const std::pair<int, int> slot(b, seg == 0 ? 0 : 1);
          if (!used.insert(slot).second) { printf("BAD slot %d %d twice\n", b, slot.second); ok = false; }
          parts[tile].push_back(slot);
        }
        i += e - s;
      }
    }
    for (long j = 0; j < T; ++j)
      if (cover[j] != 1) { printf("BAD cover %ld %d\n", j, cover[j]); ok = false; }
    for (long t = 0; t < tiles; ++t) {
      const long j0 = t * nc;
      const int lo = sk_owner(T, G, j0), hi = sk_owner(T, G, j0 + nc - 1);
      if (lo == hi) {
        if (whole[t] != 1 || !parts[t].empty()) { printf("BAD tile %ld not whole\n", t); ok = false; }
        continue;
      }
      std::vector<std::pair<int, int>> want;
      for (int b = lo; b <= hi; ++b) want.push_back({b, sk_slot(T, G, b, j0)});
      if (want != parts[t] || whole[t]) { printf("BAD tile %ld reduction list\n", t); ok = false; }
    }
    printf(ok ? "OK\n" : "BAD\n");
  }
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_stream_k_walk_and_its_reduction_agree(tmp_path):
    """Stream-K's index math (csrc/fp4_dq_stream.h, compiled as plain C++): the kernel's walk covers every (tile,
    chunk) once, a tile one CTA covers whole is written once in bf16, and the reduction finds exactly the CTAs and
    slots that wrote each other tile's partials, in CTA order; ``cuda_dq.stream_segments`` (the time model's view)
    is the same walk. Cases: 7B shapes at M 512 / 2048 on 132 SMs, ranges shorter and longer than a tile, one CTA,
    as many CTAs as iterations."""
    src = tmp_path / "walk.cpp"
    src.write_text(_STREAM_WALK)
    exe = tmp_path / "walk"
    r = subprocess.run(["g++", "-O1", "-std=c++17", f"-I{dq._CSRC}", "-o", str(exe), str(src)], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    shapes = [(512, 18944, 3584, 256, 132), (512, 3584, 3584, 128, 132), (2048, 3584, 18944, 256, 132),
              (200, 512, 3584, 128, 132), (17, 64, 128, 128, 1), (64, 256, 384, 128, 132), (1, 1024, 256, 128, 5)]
    cases = [(dq.tiles(m, c, nb), r // 64, dq.stream_ctas(m, r, c, nb, sms)) for m, r, c, nb, sms in shapes]
    cases += [(7, 3, 21), (7, 3, 20), (5, 100, 3), (1, 1, 1)]
    out = subprocess.run([str(exe), *(str(v) for cs in cases for v in cs)], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    results = [ln for ln in out if ln in ("OK", "BAD")]
    assert results == ["OK"] * len(cases), [ln for ln in out if ln.startswith("BAD")][:5]
    segs = [ln.split()[1:] for ln in out if ln.startswith("S ")]
    k = 0
    for m, r, c, nb, sms in shapes:  # the Python walk of the time model, case by case
        want = [(b, *seg) for b, sg in enumerate(dq.stream_segments(m, r, c, nb, sms)) for seg in sg]
        got = [tuple(int(v) for v in s) for s in segs[k:k + len(want)]]
        assert got == want, (m, r, c, nb)
        k += len(want)
    assert dq.stream_ctas(512, 3584, 3584, 128, 132) == 132 and dq.stream_ctas(1, 64, 128, 128, 132) == 1


def test_ncu_driver_rejects_bad_arguments(capsys):
    """benchmarks.dq_ncu names the bad value and the choices before it asks for a device."""
    from benchmarks import dq_ncu
    for argv, msg in ((["--config", "256"], "2 non-negative integers separated by ','"),
                      (["--ops", "grad"], "valid: bwd, fwd"), (["--fmt", "int4"], "valid: nvfp4, mxfp4"),
                      (["--shape", "18944"], "--shape '18944'"),
                      (["--config", "100,1"], "dq config (100, 1) for contraction 3584")):
        with pytest.raises(SystemExit) as e:
            dq_ncu.main(argv)
        assert e.value.code == 2 and msg in capsys.readouterr().err, argv
