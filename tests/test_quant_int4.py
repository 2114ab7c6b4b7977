"""INT4 W4A16 (symmetric, group 128) against compressed-tensors 0.20: the quantizer bit for bit, the int32 packing,
and decompression of our tensors by compressed-tensors' own ``pack-quantized`` compressor. Checkpoint round trips
through transformers run in tests/test_quant_checkpoint.py (parametrized over every format with a scheme).

The reference is built as tests/test_quant_formats.py builds NVFP4/MXFP4's: llm-compressor's memoryless min-max
observer re-enacted with compressed-tensors' ``calculate_qparams``, then its registered compressor.
"""

from __future__ import annotations

import pytest
import torch

from qerl.quant import FORMATS
from qerl.quant.int4 import pack_int4, unpack_int4

ct_base = pytest.importorskip("compressed_tensors.compressors.base")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from test_quant_formats import assert_bits_equal  # noqa: E402

F = FORMATS["int4"]


def _scheme():
    return preset_name_to_scheme(F.checkpoint.preset, ["Linear"])


def ct_reference(w: torch.Tensor):
    """compressed-tensors' packed dict and decompressed weight (in the scale's dtype) for w."""
    scheme = _scheme()
    wg = w.unflatten(-1, (-1, scheme.weights.group_size))
    scale, zp = calculate_qparams(torch.amin(wg, dim=-1), torch.amax(wg, dim=-1), scheme.weights)
    sd = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zp}
    comp = ct_base.BaseCompressor.get_value_from_registry(F.checkpoint.compression)
    packed = comp.compress(sd, scheme)
    return packed, comp.decompress(dict(packed), scheme)["weight"]


def check_against_ct(w: torch.Tensor) -> dict:
    ref, ref_dense = ct_reference(w)
    q = F.quantize(w)
    assert set(q) == set(ref) == set(F.checkpoint.tensors), (sorted(q), sorted(ref))
    for name in ref:
        if q[name].element_size() == 8:  # weight_shape: int64 values
            assert q[name].dtype == ref[name].dtype and torch.equal(q[name], ref[name].to(q[name].device)), name
        else:
            assert_bits_equal(q[name], ref[name].to(q[name].device), f"int4 {name}")
    assert_bits_equal(F.dequantize(q, ref_dense.dtype), ref_dense, "int4 dequantized")
    return q


def _cases():
    g = torch.Generator().manual_seed(0)
    for shape in [(8, 128), (33, 256), (64, 512)]:
        for mag in (1.0, 0.02, 1e-30, 1e30):
            yield f"randn{shape}x{mag:g}", torch.randn(*shape, generator=g) * mag
    w = torch.randn(16, 512, generator=g)
    w[:, :128] = 0.0  # all-zero groups: compressed-tensors' eps scale
    w[3] = 0.0
    yield "zero_groups", w
    w = torch.randn(16, 256, generator=g).abs()  # one-signed groups: min(w, 0) = 0 or max(w, 0) = 0
    w[8:] *= -1
    yield "one_signed", w
    w = torch.randn(16, 256, generator=g)
    w[0, :128] *= 1e30
    w[1, :128] *= 1e-30
    w[2, :128] = 1e-40  # float32 subnormals
    yield "mixed_magnitudes", w
    heavy = torch.distributions.StudentT(3.0).sample((64, 512))
    heavy[:, 7] *= 40.0
    yield "student_t_outliers", heavy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_int4_bit_identical_to_compressed_tensors(dtype):
    for name, w in _cases():
        if not torch.isfinite(w.to(dtype)).all():
            continue  # float16 cannot hold 1e30
        try:
            check_against_ct(w.to(dtype))
        except AssertionError as e:
            raise AssertionError(f"case {name} ({dtype}): {e}") from None


def test_int4_exact_ties_round_half_to_even_and_clamp():
    # amax 7.5 gives scale exactly 1: every half-integer is an exact tie; -8 is reachable only below -7.5
    vals = torch.tensor([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, -0.5, -1.5, -2.5, -6.5, -7.5, 7.5, 7.4, -7.4, -0.0, 0.0])
    row = torch.zeros(128)
    row[: vals.numel()] = vals
    row[-1] = 7.5
    w = torch.stack([row, -row])
    for dtype in (torch.bfloat16, torch.float32):
        q = check_against_ct(w.to(dtype))
        assert q["weight_scale"][:, 0].float().tolist() == [1.0, 1.0]
        codes = unpack_int4(q["weight_packed"])[0, : vals.numel()].tolist()
        assert codes == [0, 2, 2, 4, 4, 6, 6, 0, -2, -2, -6, -8, 7, 7, -7, 0, 0]


def test_int4_packing_matches_compressed_tensors_helpers():
    codes = torch.randint(-8, 8, (24, 256), generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    packed = pack_int4(codes)
    assert_bits_equal(packed, pack_to_int32(codes, 4), "pack")
    assert torch.equal(unpack_int4(packed), codes)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size(codes.shape)), codes)
    assert packed.dtype == torch.int32 and packed.shape == (24, 32)
    # element j of a row sits in bits 4*(j % 8) of word j // 8, stored as j's code + 8
    one = torch.full((1, 128), -8, dtype=torch.int8)
    one[0, 9] = 7
    assert pack_int4(one)[0, 1].item() == 15 << 4


def test_compressed_tensors_decompresses_our_tensors():
    w = torch.randn(48, 384, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    q = F.quantize(w)
    comp = ct_base.BaseCompressor.get_value_from_registry(F.checkpoint.compression)
    dense = comp.decompress(dict(q), _scheme())["weight"]
    assert_bits_equal(F.dequantize(q, torch.bfloat16), dense, "decompressed by compressed-tensors")


def test_int4_linear_is_the_reference_and_shapes_are_checked():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 256, generator=g)
    q = F.quantize(w)
    x, gy = torch.randn(3, 256, generator=g), torch.randn(3, 40, generator=g)
    wd = F.dequantize(q, torch.float32)
    assert torch.equal(F.linear(x, q), torch.nn.functional.linear(x, wd))
    assert torch.equal(F.linear_t(gy, q), gy @ wd)
    with pytest.raises(ValueError, match=r"\(40, 192\).*multiple of the block size 128"):
        F.quantize(torch.randn(40, 192))
