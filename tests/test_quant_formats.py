"""Weight formats against the real libraries: compressed-tensors 0.20 (NVFP4A16, MXFP4A16) and bitsandbytes (NF4).

The compressed-tensors reference is built from its own functions: llm-compressor's weight calibration
(a memoryless min-max observer: per-group amin/amax, ``generate_gparam`` for the NVFP4 global scale,
``calculate_qparams`` for the block scales, the scale kept in a parameter of the weight's dtype) followed by
compressed-tensors' registered compressor (``compress`` / ``decompress``). llm-compressor itself cannot be
installed next to compressed-tensors 0.20 (it pins 0.19 and transformers <= 5.17), so its observer is
re-enacted here with compressed-tensors' helpers.
"""

from __future__ import annotations

import pytest
import torch

from qerl.errors import UserError
from qerl.quant import FORMATS, MXFP4Format, NF4Format, NonFiniteWeightError, NVFP4Format, get_format
from qerl.quant.fp4 import e2m1_encode, pack_nibbles, unpack_nibbles
from qerl.quant.nf4 import to_bnb_quant_state

ct_base = pytest.importorskip("compressed_tensors.compressors.base")
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

PRESET = {"nvfp4": "NVFP4A16", "mxfp4": "MXFP4A16"}
COMPRESSOR = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}


def ct_reference(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None):
    """compressed-tensors' packed dict and decompressed bf16 weight for w (llm-compressor's RTN calibration)."""
    scheme = preset_name_to_scheme(PRESET[fmt], ["Linear"])
    args = scheme.weights
    wg = w.unflatten(-1, (-1, args.group_size))
    mn, mx = torch.amin(wg, dim=-1), torch.amax(wg, dim=-1)
    gs = None
    if fmt == "nvfp4":
        if global_scale is None:
            a = torch.max(torch.max(mx.max(), -mn.min()), mx.max())
            gs = generate_gparam(-a.reshape(1), a.reshape(1))
        else:
            gs = global_scale
    scale, zp = calculate_qparams(mn, mx, args, global_scale=gs)
    sd = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zp}
    if gs is not None:
        sd["weight_global_scale"] = gs
    comp = ct_base.BaseCompressor.get_value_from_registry(COMPRESSOR[fmt])
    packed = comp.compress(sd, scheme)
    dense = comp.decompress(dict(packed), scheme)["weight"]
    return packed, dense


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    # compared as raw bytes, whatever the dtype (NF4's and INT4's int64 weight_shape included)
    ai, bi = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
    bad = (ai != bi).nonzero()
    assert bad.numel() == 0, f"{what}: {len(bad)} differing elements, first at {bad[0].tolist()}"


def check_against_ct(w: torch.Tensor, fmt: str, global_scale: torch.Tensor | None = None):
    ref, ref_dense = ct_reference(w, fmt, global_scale)
    f = FORMATS[fmt]
    q = f.quantize(w) if global_scale is None else f.quantize(w, global_scale=global_scale)
    assert set(q) == set(ref), (sorted(q), sorted(ref))
    for name in ref:
        assert_bits_equal(q[name], ref[name], f"{fmt} {name}")
    assert_bits_equal(f.dequantize(q, torch.bfloat16), ref_dense, f"{fmt} dequantized")
    return q


def _random_cases():
    g = torch.Generator().manual_seed(0)
    for shape in [(8, 64), (33, 256), (64, 512)]:
        for mag in (1.0, 0.02, 1e-30, 1e30):
            yield f"randn{shape}x{mag:g}", torch.randn(*shape, generator=g) * mag
    w = torch.randn(16, 512, generator=g)
    w[:, :64] = 0.0  # all-zero blocks
    w[3] = 0.0  # an all-zero row
    yield "zero_blocks", w
    yield "all_zero", torch.zeros(4, 128)
    w = torch.randn(16, 256, generator=g)
    w[0, :32] *= 1e30  # huge and tiny blocks in one tensor: tiny block scales underflow E4M3
    w[1, :32] *= 1e-30
    w[2, :32] = 1e-40  # float32 subnormals
    yield "mixed_magnitudes", w
    heavy = torch.distributions.StudentT(3.0).sample((64, 512))
    heavy[:, 7] *= 40.0  # an outlier input channel
    yield "student_t_outliers", heavy


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_formats_bit_identical_to_compressed_tensors(fmt, dtype):
    for name, w in _random_cases():
        try:
            check_against_ct(w.to(dtype), fmt)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from None


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_formats_float16_inputs(fmt):
    # float16 keeps compressed-tensors' scale parameter in float16 too (subnormal block maxima matter there)
    for _, w in _random_cases():
        if torch.isfinite(w.half()).all():
            check_against_ct(w.half(), fmt)
    w = torch.zeros(10, 64)
    for i, amax in enumerate([2.0**-23, 2.0**-20, -3e-8, 1.75 * 2**-15, 1.74 * 2**-15, 2.0**-14, 0.7 * 2**-14,
                              0.75 * 2**-14, 0.74 * 2**-14, 0.999 * 2**-14]):
        w[i, :32] = torch.linspace(-1, 1, 32) * amax
    check_against_ct(w.half(), fmt)


def _tie_values(unit: float) -> torch.Tensor:
    """Exact E2M1 ties (midpoints between grid points), their negatives, grid points, saturating values."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    near = [0.2, 0.3, 0.1, 5.5, 5.9]
    vals = ties + [-t for t in ties] + grid + [-g for g in grid] + near + [-n for n in near] + [-0.0]
    return torch.tensor(vals) * unit


def _row(values: torch.Tensor, amax: float, block: int, k: int = 128) -> torch.Tensor:
    """A row of length k whose every block holds block-1 of ``values`` followed by ``amax`` (its scale)."""
    row = torch.zeros(k)
    for b, start in enumerate(range(0, values.numel(), block - 1)):
        chunk = values[start : start + block - 1]
        row[b * block : b * block + chunk.numel()] = chunk
        row[b * block + block - 1] = amax
    return row


def test_nvfp4_exact_ties_and_saturation():
    # global scale 448 and block amax 6*u make the effective block scale exactly u: ties stay exact ties;
    # amax 6.1875 and 6.5 round the E4M3 block scale down, so the block's top values saturate.
    cases = [(1.0, 6.0), (0.5, 3.0), (1.0, 6.0 * 33 / 32), (1.0, 6.5), (0.25, 1.5)]
    w = torch.stack([_row(_tie_values(u), a, 16) for u, a in cases])
    for dtype in (torch.bfloat16, torch.float32):
        q = check_against_ct(w.to(dtype), "nvfp4", global_scale=torch.tensor([448.0]))
        check_against_ct(w.to(dtype), "nvfp4")  # and with the observed global scale
    # hand-check the first row (effective scale 1): ties to even; a negative value keeps its sign bit
    # even when it rounds to 0 (code 8)
    codes = unpack_nibbles(q["weight_packed"])[0]
    assert codes[:15].tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    # three blocks carry the values; the five all-zero blocks get compressed-tensors' eps scale 0.125
    assert q["weight_scale"][0].float().tolist() == [448.0] * 3 + [0.125] * 5


def test_mxfp4_exact_ties_and_saturation():
    cases = [(1.0, 4.0), (0.5, 2.0), (1.0, 6.5), (1.0, 7.0), (2.0**-120, 2.0**-118)]
    w = torch.stack([_row(_tie_values(u), a, 32) for u, a in cases])
    for dtype in (torch.bfloat16, torch.float32):
        q = check_against_ct(w.to(dtype), "mxfp4")
    assert q["weight_scale"][:, 0].tolist() == [127, 126, 127, 128, 7]  # 6.5 saturates at 2^0, 7 bumps to 2^1
    codes = unpack_nibbles(q["weight_packed"])[0]
    assert codes[:15].tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 0]
    assert codes[31].item() == 6 and unpack_nibbles(q["weight_packed"])[2, 31].item() == 7  # 4 -> 4, 6.5 -> 6


def test_e2m1_rounding_exhaustive_against_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every bf16
    x = x[torch.isfinite(x)]
    x = x[x.abs() <= 6.0].float()  # compressed-tensors clamps to ±6 before rounding
    x = x[: x.numel() // 2 * 2].reshape(1, -1)
    ref = pack_fp4_to_uint8(cast_to_fp4(x.clone()))
    ours = pack_nibbles(e2m1_encode(x))
    assert_bits_equal(ours, ref, "e2m1 codes")


@pytest.mark.parametrize(
    "amax, expected",
    [  # biased exponents by rule: ct (round significand >= 1.75 up), floor (OCP), ceil, rceil (ceil(log2(amax/6)))
        (1.0, {"ct": 125, "floor": 125, "ceil": 125, "rceil": 125}),
        (1.5, {"ct": 125, "floor": 125, "ceil": 126, "rceil": 125}),
        (1.625, {"ct": 125, "floor": 125, "ceil": 126, "rceil": 126}),
        (1.75, {"ct": 126, "floor": 125, "ceil": 126, "rceil": 126}),
        (6.0, {"ct": 127, "floor": 127, "ceil": 128, "rceil": 127}),
        (7.0, {"ct": 128, "floor": 127, "ceil": 128, "rceil": 128}),
        (0.0, {"ct": 0, "floor": 0, "ceil": 0, "rceil": 0}),
        (2.0 ** -130, {"ct": 0, "floor": 0, "ceil": 0, "rceil": 0}),
    ],
)
def test_mxfp4_scale_rules_hand_computed(amax, expected):
    for rule, e in expected.items():
        got = MXFP4Format(scale_rule=rule).shared_exponent(torch.tensor([amax])).item()
        assert got == e, (rule, amax, got, e)


def test_mxfp4_rules_never_saturate_when_they_should_not():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 3
    blocks = w.reshape(64, -1, 32)
    for rule in ("ceil", "rceil"):
        f = MXFP4Format(scale_rule=rule)
        q = f.quantize(w)
        scale = torch.exp2(q["weight_scale"].float() - 127)
        assert (blocks.abs().amax(-1) / scale <= 6.0).all(), rule
    assert FORMATS["mxfp4"].scale_rule == "ct" and MXFP4Format(scale_rule="floor").name == "mxfp4"
    with pytest.raises(ValueError, match="valid rules"):
        MXFP4Format(scale_rule="nearest")


# ------------------------------------------------------------------------------------------------ NF4
bnbf = pytest.importorskip("bitsandbytes.functional")


def _nf4_cases():
    g = torch.Generator().manual_seed(2)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for shape in [(4, 64), (33, 256), (100, 1024)]:  # 4, 132, 1600 blocks: partial nested blocks
            mags = (1.0, 0.02, 1e-30, 1e30) if dtype != torch.float16 else (1.0, 0.02, 1e-4, 1e4)
            for mag in mags:
                yield dtype, (torch.randn(*shape, generator=g) * mag).to(dtype)
        w = torch.randn(16, 512, generator=g)
        w[:, :64] = 0.0
        w[5] = 0.0
        yield dtype, w.to(dtype)


def test_nf4_bit_identical_to_bitsandbytes_cpu():
    f = FORMATS["nf4"]
    for dtype, w in _nf4_cases():
        packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        q = f.quantize(w)
        ref = state.as_dict(packed=True)
        assert_bits_equal(q["weight_packed"], packed, "nf4 packed")
        for name in ("absmax", "quant_map", "nested_absmax", "nested_quant_map"):
            assert_bits_equal(q[name], ref[name], f"nf4 {name}")
        assert_bits_equal(q["nested_offset"].reshape(1), state.offset.reshape(1), "nf4 offset")
        assert q["weight_shape"].tolist() == list(w.shape)
        dense = bnbf.dequantize_4bit(packed, state)
        assert_bits_equal(f.dequantize(q, dtype), dense, "nf4 dequantized")
        # a bnb QuantState rebuilt from our dict drives bnb's own kernel to the same weights
        rebuilt = to_bnb_quant_state(q, "cpu", dtype)
        assert_bits_equal(bnbf.dequantize_4bit(q["weight_packed"], rebuilt), dense, "nf4 via bnb QuantState")


def test_nf4_without_double_quant_matches_bitsandbytes():
    w = torch.randn(40, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    packed, state = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    f = NF4Format(double_quant=False)
    q = f.quantize(w)
    assert_bits_equal(q["weight_packed"], packed, "packed")
    assert_bits_equal(q["absmax"], state.absmax, "absmax")
    assert_bits_equal(f.dequantize(q), bnbf.dequantize_4bit(packed, state), "dequantized")


def test_nf4_dynamic_map_matches_bitsandbytes():
    from qerl.quant.nf4 import dynamic_map

    assert_bits_equal(dynamic_map(), bnbf.create_dynamic_map(), "dynamic map")


# ------------------------------------------------------------------------------------------ all formats
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_roundtrip_error_within_bounds(fmt):
    # relative Frobenius error of RTN on N(0, 1): ~0.09 (nvfp4), ~0.11 (mxfp4), ~0.09 (nf4), ~0.11 (int4), 0.002 (bf16)
    bound = {"nvfp4": 0.11, "mxfp4": 0.14, "nf4": 0.11, "int4": 0.13, "bf16": 0.004}[fmt]
    w = torch.randn(128, 512, generator=torch.Generator().manual_seed(4))
    f = get_format(fmt)
    for dtype in (torch.bfloat16, torch.float32):
        wd = w.to(dtype)
        w_hat = f.dequantize(f.quantize(wd), torch.float32)
        assert w_hat.shape == w.shape and w_hat.dtype == torch.float32
        rel = ((wd.float() - w_hat).norm() / wd.float().norm()).item()
        assert rel < bound, (fmt, dtype, rel)
        assert (rel == 0) == (fmt == "bf16" and dtype == torch.bfloat16), (fmt, dtype, rel)
        if f.block:  # no element is off by more than a fifth of its block's largest magnitude
            err = (wd.float() - w_hat).abs().reshape(128, -1, f.block).amax(-1)
            assert (err <= 0.2 * wd.float().abs().reshape(128, -1, f.block).amax(-1)).all()


def test_quantize_keeps_device_and_names():
    w = torch.randn(32, 128)
    expect = {
        "nvfp4": {"weight_packed": (torch.uint8, (32, 64)), "weight_scale": (torch.float8_e4m3fn, (32, 8)),
                  "weight_global_scale": (torch.float32, (1,))},
        "mxfp4": {"weight_packed": (torch.uint8, (32, 64)), "weight_scale": (torch.uint8, (32, 4))},
        "nf4": {"weight_packed": (torch.uint8, (2048, 1)), "absmax": (torch.uint8, (64,)),
                "quant_map": (torch.float32, (16,)), "nested_absmax": (torch.float32, (1,)),
                "nested_quant_map": (torch.float32, (256,)), "nested_offset": (torch.float32, ()),
                "weight_shape": (torch.int64, (2,))},
        "int4": {"weight_packed": (torch.int32, (32, 16)), "weight_scale": (torch.float32, (32, 1)),
                 "weight_shape": (torch.int64, (2,))},
        "bf16": {"weight": (torch.bfloat16, (32, 128))},
    }
    assert set(expect) == set(FORMATS)
    for fmt, names in expect.items():
        q = FORMATS[fmt].quantize(w)
        assert {k: (v.dtype, tuple(v.shape)) for k, v in q.items()} == names, fmt
        assert all(v.device == w.device for v in q.values())


def test_bits_per_weight():
    n, k = 3584, 3584
    assert FORMATS["bf16"].bits_per_weight(n, k) == 16.0
    assert FORMATS["mxfp4"].bits_per_weight(n, k) == 4.25
    assert FORMATS["nvfp4"].bits_per_weight(n, k) == pytest.approx(4.5 + 32 / (n * k))
    nb = n * k // 64
    assert FORMATS["nf4"].bits_per_weight(n, k) == pytest.approx(4 + 8 / 64 + (32 * -(-nb // 256) + 32) / (n * k))
    assert FORMATS["nf4"].bits_per_weight(n, k) == pytest.approx(4.127, abs=1e-3)  # QLoRA's number
    assert FORMATS["int4"].bits_per_weight(n, k) == pytest.approx(4 + 16 / 128 + 128 / (n * k))


@pytest.mark.parametrize("fmt, k", [("nvfp4", 24), ("mxfp4", 48), ("nf4", 96), ("int4", 64), ("nvfp4", 0)])
def test_bad_shapes_raise(fmt, k):
    f = get_format(fmt)
    with pytest.raises(ValueError, match=rf"\(8, {k}\).*multiple of the block size {f.block}"):
        f.check_shape(8, k)
    if k:
        with pytest.raises(ValueError, match="multiple of the block size"):
            f.quantize(torch.randn(8, k))
    with pytest.raises(ValueError, match="2-D"):
        f.quantize(torch.randn(64))


def test_get_format_lists_valid_names():
    assert set(FORMATS) == {"bf16", "nf4", "mxfp4", "nvfp4", "int4"}
    assert all(FORMATS[n].name == n for n in FORMATS)
    assert {n: FORMATS[n].block for n in FORMATS} == {"bf16": None, "nf4": 64, "mxfp4": 32, "nvfp4": 16, "int4": 128}
    with pytest.raises(UserError, match=r"'fp8'.*\['bf16', 'int4', 'mxfp4', 'nf4', 'nvfp4'\]"):
        get_format("fp8")


def test_nvfp4_fused_global_scale():
    g = torch.Generator().manual_seed(5)
    wq, wk = torch.randn(64, 64, generator=g), torch.randn(32, 64, generator=g) * 3
    gs = NVFP4Format.global_scale(wq, wk)
    assert torch.equal(gs, NVFP4Format.global_scale(torch.cat([wq, wk])))
    check_against_ct(wq.to(torch.bfloat16), "nvfp4", global_scale=NVFP4Format.global_scale(wq.bfloat16(), wk.bfloat16()))


NON_FINITE_HANDLERS = {**FORMATS, **{f"mxfp4-{r}": MXFP4Format(r) for r in ("floor", "ceil", "rceil")},
                       "nf4-no-double-quant": NF4Format(double_quant=False)}


@pytest.mark.parametrize("handler", sorted(NON_FINITE_HANDLERS))
def test_non_finite_weights_are_refused(handler):
    f = NON_FINITE_HANDLERS[handler]
    # Before: nvfp4 turned one inf into global scale 0 (all NaN), mxfp4 zeroed a NaN block, nf4 gave NaN codes.
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for bad, counts in [((float("inf"), float("-inf")), "2 inf, 0 nan"), ((float("nan"),) * 2, "0 inf, 2 nan"),
                            ((float("inf"), float("nan")), "1 inf, 1 nan")]:
            w = torch.randn(8, 128)
            w[1, 3], w[6, 100] = bad
            with pytest.raises(UserError, match=rf"^the weight has 2 non-finite values \({counts}\); "
                                                           rf"cannot quantize to {f.name} "):
                f.quantize(w.to(dtype))  # a UserError: entry points print it as one line


def test_nvfp4_global_scale_refuses_non_finite_and_bad_given_scales():
    w = torch.randn(16, 64)
    bad = w.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightError, match=r"1 non-finite value \(1 inf, 0 nan\); cannot quantize to nvfp4"):
        NVFP4Format.global_scale(w, bad)  # before: 0, and every element of the group dequantized to NaN
    for gs in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="global_scale must be one finite positive number"):
            FORMATS["nvfp4"].quantize(w, global_scale=torch.tensor([gs]))
    # an all-zero weight (g overflows to inf) still gets compressed-tensors' fallback g = 1
    assert NVFP4Format.global_scale(torch.zeros(4, 16)).tolist() == [1.0]


def test_bf16_refuses_float32_values_beyond_its_range():
    w = torch.zeros(2, 4)
    w[0, 0] = 3.4e38  # finite in float32, inf in bfloat16
    with pytest.raises(NonFiniteWeightError, match=r"1 inf, 0 nan.*bf16"):
        FORMATS["bf16"].quantize(w)


def test_report_runs_small(tmp_path):
    from qerl.quant import report

    text = report.build_report(rows=8, shapes={"q_proj": (64, 256), "down_proj": (64, 512)})
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| format")]
    rows = {(c[0], c[1]): c[2:] for c in ([x.strip() for x in ln.strip("|").split("|")] for ln in table)}
    assert set(rows) == {("bf16", "-"), ("nf4", "-"), ("nvfp4", "-"), ("int4", "-"), ("mxfp4", "ct (default)"),
                         ("mxfp4", "floor"), ("mxfp4", "ceil"), ("mxfp4", "rceil")}
    assert [rows[k][0] for k in [("bf16", "-"), ("mxfp4", "floor")]] == ["16.000", "4.250"]
    assert all(float(e) == 0.0 for e in rows[("bf16", "-")][1:])
    for key, cells in rows.items():
        if key[0] != "bf16":
            assert all(0.03 < float(e) < 0.3 for e in cells[1:]), (key, cells)
    out = tmp_path / "r.md"
    written = report.main(["--rows", "2", "--out", str(out)])
    assert out.read_text() == written and "down_proj-like 3584x18944" in written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for fmt, f in FORMATS.items():
        qc, qg = f.quantize(w), f.quantize(w.cuda())
        for name in qc:
            assert qg[name].is_cuda
            assert_bits_equal(qg[name].cpu(), qc[name], f"{fmt} {name} cuda vs cpu")
        assert_bits_equal(f.dequantize(qg).cpu(), f.dequantize(qc), f"{fmt} dequantized cuda vs cpu")
