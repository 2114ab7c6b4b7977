"""benchmarks/lora_gemv_bench.py on the CPU: the linears it times, its argument errors and its table (the timing
itself needs a GPU and runs on the device: results/speed/lora_gemv_h100.md)."""

from __future__ import annotations

import pytest

from benchmarks import kernel_bench
from benchmarks import lora_gemv_bench as lb


def test_groups_are_the_layers_fused_decode_linears():
    for model, (h, inter, nh, nkv, hd) in kernel_bench.MODELS.items():
        gs = {name: (members, k) for name, members, k in lb.groups(model, 16)}
        assert list(gs) == ["q|k|v", "o", "gate|up", "down"]
        assert gs["q|k|v"] == ([(nh * hd, 16), (nkv * hd, 16), (nkv * hd, 16)], h)
        assert gs["gate|up"] == ([(inter, 16), (inter, 16)], h) and gs["down"] == ([(h, 16)], inter)
        assert all(rows % 16 == 0 for members, _ in gs.values() for rows, _ in members)  # LoraOperand's rule


@pytest.mark.parametrize("argv, why", [(["--models", "9b"], "unknown --models"), (["--fmts", "nf4"], "--fmts must"),
                                       (["--m", "32"], "decode sizes"), (["--chunks", "0"], "--chunks must")])
def test_bad_arguments_name_the_value_and_the_choices(argv, why):
    with pytest.raises(SystemExit, match=why):
        lb.main(argv)


def test_linears_parse_and_bad_ones_name_the_choices():
    assert lb.parse_linears("o, q|k|v,o") == ["o", "q|k|v"]
    for text, why in (("qkv", r"\['qkv'\] not among \['q\|k\|v', 'o', 'gate\|up', 'down'\]"), (",", "nothing")):
        with pytest.raises(ValueError, match=why):
            lb.parse_linears(text)
    with pytest.raises(SystemExit, match="--linears 'gate'"):
        lb.main(["--ncu", "--linears", "gate"])
    with pytest.raises(SystemExit, match="--linears 'o' applies only with --ncu"):
        lb.main(["--linears", "o"])


def test_ablate_variants_parse_and_bad_ones_name_the_bits():
    assert lb.parse_ablate("1,2,4,1,10") == [1, 2, 4, 10] and lb.parse_ablate("") == []
    for text, why in (("16", r"\[16\] not a bit set"), ("0", r"\[0\] not a bit set"),
                      ("a", "expected comma-separated")):
        with pytest.raises(ValueError, match=why):
            lb.parse_ablate(text)
    with pytest.raises(ValueError, match="no LoRA term in the output warps.*the term before the main loop"):
        lb.main(["--ablate", "17"])


def test_markdown_shows_each_mode_and_its_overhead_over_plain():
    rows = []
    for mode, chunks, us in [("plain", "", 10.0), ("one-launch", 4, 12.5), ("split", "", 17.0)]:
        rows.append(dict(model="7b", fmt="nvfp4", M=8, linear="o", mode=mode, chunks=chunks, us=us,
                         overhead_us=us - 10.0, floor_us=0.15))
    md = lb.markdown(rows, "## header")
    assert "### 7b nvfp4, M = 8" in md and "one-launch c4 µs (+LoRA)" in md
    assert "| o | 10.0 | 12.5 (+2.5) | 17.0 (+7.0) | 0.15 |" in md


@pytest.mark.parametrize("argv, why", [(["--models", "9b"], "unknown --models"), (["--kv", "5000"], "--kv must"),
                                       (["--configs", "64:3:0"], "--configs must"), (["--configs", "x"], "--configs must")])
def test_attn_bench_bad_arguments(argv, why):
    from benchmarks import attn_bench
    with pytest.raises(SystemExit, match=why):
        attn_bench.main(argv)


@pytest.mark.parametrize("argv, why", [(["--shapes", "7b-lm_head"], "unknown --shapes"), (["--loads", "3"], "--loads must"),
                                       (["--splits", "0"], "--splits must"), (["--splits", "a"], "must be integers"),
                                       (["--threads", "48"], "--threads must"),
                                       (["--patterns", "bf16"], "unknown --patterns 'bf16'; choose from fp4, ")])
def test_hbm_pattern_bench_bad_arguments(argv, why):
    from benchmarks import hbm_pattern_bench
    with pytest.raises(SystemExit, match=why):
        hbm_pattern_bench.main(argv)


def test_hbm_pattern_shapes_are_the_fused_decode_linears():
    from benchmarks import hbm_pattern_bench
    for model, (h, inter, nh, nkv, hd) in kernel_bench.MODELS.items():
        assert hbm_pattern_bench.SHAPES[f"{model}-gate_up"] == (2 * inter, h)
        assert hbm_pattern_bench.SHAPES[f"{model}-down"] == (h, inter)
        assert hbm_pattern_bench.SHAPES[f"{model}-qkv"] == ((nh + 2 * nkv) * hd, h)


def test_write_report_writes_csv_and_markdown(tmp_path, capsys):
    out = tmp_path / "new" / "dir"
    kernel_bench.write_report(str(out), "x_h100", [dict(a=1, b=2.5), dict(a=3, b=4.0)], "## table")
    assert (out / "x_h100.csv").read_text().splitlines() == ["a,b", "1,2.5", "3,4.0"]
    assert (out / "x_h100.md").read_text() == "## table\n" and "## table" in capsys.readouterr().out
