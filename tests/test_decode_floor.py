"""The memory floor of a decode step (benchmarks.decode_floor): bytes by part, the ceiling and the required bandwidth,
the copy bandwidths read from the HBM benchmark's reports, the best measured row per GPU model, bad input."""

import math

import pandas as pd
import pytest

from benchmarks import decode_floor as df


def test_step_bytes_by_part_at_the_7b_shapes():
    h, i, kv, L = 3584, 18944, 512, 28
    params = L * (2 * h * h + 2 * kv * h + 3 * i * h)
    bf16 = df.step_bytes("qwen2.5-7b", "bf16", 8, 1280)
    assert bf16["linears"] == 2 * params  # 16 bits a weight
    nv = df.step_bytes("qwen2.5-7b", "nvfp4", 8, 1280)
    # 4-bit codes, one 8-bit scale per 16 and one float32 per linear (seven a layer)
    assert math.isclose(nv["linears"], params * 4.5 / 8 + L * 7 * 4, rel_tol=1e-12)
    assert df.step_bytes("qwen2.5-7b", "mxfp4", 8, 1280)["linears"] == params * 4.25 / 8
    assert bf16["lm_head"] == 152064 * h * 2
    assert bf16["kv_cache"] == L * 2 * kv * 2 * 8 * 1280  # K and V, BF16, every sequence
    # rank r adds r (in + out) BF16 values per projection; rank 0 none
    r0, r32 = df.step_bytes("qwen2.5-7b", "nvfp4", 8, 1280, rank=0), nv
    assert r0["lora"] == 0 and r32["lora"] == L * 32 * 2 * (2 * 2 * h + 2 * (h + kv) + 3 * (h + i))
    assert nv["total"] == pytest.approx(sum(v for k, v in nv.items() if k != "total"))
    # the KV cache grows with the batch and the length, nothing else does
    b2 = df.step_bytes("qwen2.5-7b", "nvfp4", 2, 1280)
    assert b2["kv_cache"] * 4 == nv["kv_cache"] and b2["linears"] == nv["linears"]


def test_ceiling_and_required_bandwidth_are_inverse():
    total = df.step_bytes("qwen2.5-32b", "nvfp4", 8, 1280)["total"]
    ceil = df.ceiling_tokens_per_s(total, 8, 3.0)
    assert df.required_tbps(total, 8, ceil) == pytest.approx(3.0)
    assert df.ceiling_tokens_per_s(total, 16, 3.0) == pytest.approx(2 * ceil)


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown model preset 'qwen9'"):
        df.step_bytes("qwen9", "nvfp4", 8, 1280)
    with pytest.raises(ValueError, match="fp3"):
        df.step_bytes("qwen2.5-7b", "fp3", 8, 1280)
    with pytest.raises(ValueError, match="batch 0"):
        df.step_bytes("qwen2.5-7b", "nvfp4", 0, 1280)
    with pytest.raises(ValueError, match="unknown GPU model 'A100'; valid: \\['H100', 'H200'\\]"):
        df.floor_table(gpu="A100")


def _rows(*rows):
    cols = ["model", "weights", "batch_size", "prompt_len", "new_tokens", "lora_rank", "status", "device",
            "tokens_per_s", "run"]
    return pd.DataFrame([dict(zip(cols, r, strict=True)) for r in rows])


def test_report_reads_copy_bandwidth_and_best_row_per_gpu_model(tmp_path):
    for run, dev, bw in (("h100_a", "NVIDIA H100 80GB HBM3", 2.9), ("h100_b", "NVIDIA H100 80GB HBM3", 3.1),
                         ("h200_a", "NVIDIA H200", 4.2)):
        (tmp_path / "raw" / run).mkdir(parents=True)
        (tmp_path / "raw" / run / "hbm_pattern_x.md").write_text(
            f"## HBM\n\n{dev}, torch 2.11, copy bandwidth {bw} TB/s (read + write), 128 threads\n")
    assert df.copy_bandwidths(tmp_path) == {"H100": (3.1, "h100_b"), "H200": (4.2, "h200_a")}
    m7 = "Qwen2.5-7B-Instruct"
    _rows((m7, "BF16", 8, 256, 2048, 32, "ok", "NVIDIA H100 80GB HBM3", 1200.0, "r1"),
          (m7, "BF16", 8, 256, 2048, 32, "ok", "NVIDIA H100 80GB HBM3", 1300.0, "r2"),
          (m7, "BF16", 8, 256, 2048, 32, "ok", "NVIDIA H200", 1500.0, "r3"),  # another GPU model
          (m7, "BF16", 8, 256, 512, 32, "ok", "NVIDIA H100 80GB HBM3", 1400.0, "r4"),  # other lengths
          (m7, "BF16", 8, 256, 2048, 32, "OOM", "NVIDIA H100 80GB HBM3", 1600.0, "r5"),
          ).to_csv(tmp_path / "rollout.csv", index=False)
    md = df.floor_table(tmp_path, "H100")
    assert "copy bandwidth 3.10 TB/s (`raw/h100_b`)" in md
    row = next(line for line in md.splitlines() if line.startswith(f"| {m7} | BF16 | 8 |"))
    total = df.step_bytes("qwen2.5-7b", "bf16", 8, 1280)["total"]
    ceil = df.ceiling_tokens_per_s(total, 8, 3.1)
    assert f"| 1300 (r2) | {1300 / ceil:.2f} |" in row and f"| {ceil:.0f} |" in row
    need = df.required_tbps(total, 8, 1650)
    assert f"{need:.2f} ({100 * need / 3.1:.0f} % of copy)" in row
    assert len([line for line in md.splitlines() if line.startswith("| Qwen")]) == len(df.TARGETS)
    # no measurement on that model: dashes, not a number from another GPU
    assert "| — | — |" in next(line for line in md.splitlines() if line.startswith(f"| {m7} | NVFP4 | 8 |"))
    h200 = df.floor_table(tmp_path, "H200")
    assert "| 1500 (r3) |" in h200


def test_step_flops_and_the_roofline_per_part():
    h, i, kv, L, heads_dim = 3584, 18944, 512, 28, 3584
    params = L * (2 * h * h + 2 * kv * h + 3 * i * h)
    f = df.step_flops("qwen2.5-7b", 128, 512)
    assert f["linears"] == 2 * params * 128 and f["lm_head"] == 2 * 152064 * h * 128
    assert f["kv_cache"] == 2 * 2 * L * heads_dim * 512 * 128  # q·kᵀ and p·v over every head
    # 7B at 128 sequences on an H200-like machine: the NVFP4 linears bound by FLOPs, the BF16 ones by bytes
    nv = df.step_floor_s("qwen2.5-7b", "nvfp4", 128, 512, 4.27, 989.4)
    bf = df.step_floor_s("qwen2.5-7b", "bf16", 128, 512, 4.27, 989.4)
    assert nv["linears"] == pytest.approx(f["linears"] / 989.4e12)
    assert bf["linears"] == pytest.approx(2 * params / 4.27e12)
    assert nv["kv_cache"] == bf["kv_cache"] == pytest.approx(df.step_bytes("qwen2.5-7b", "bf16", 128, 512)["kv_cache"]
                                                            / 4.27e12)  # attention reads more than it computes
    assert nv["total"] == pytest.approx(sum(v for k, v in nv.items() if k != "total"))
    # with infinite compute the floor is the bytes' alone
    assert df.step_floor_s("qwen2.5-7b", "nvfp4", 128, 512, 4.27, 1e9)["total"] == pytest.approx(
        df.step_bytes("qwen2.5-7b", "nvfp4", 128, 512)["total"] / 4.27e12)


def test_roofline_table_pairs_formats_of_one_run_and_gpu(tmp_path):
    (tmp_path / "raw" / "h").mkdir(parents=True)
    (tmp_path / "raw" / "h" / "hbm_pattern_x.md").write_text("NVIDIA H100 80GB HBM3, copy bandwidth 3.0 TB/s\n")
    m7, h100 = "Qwen2.5-7B-Instruct", "NVIDIA H100 80GB HBM3"
    cols = ["run", "model", "weights", "batch_size", "prompt_len", "new_tokens", "lora_rank", "status", "device",
            "decode", "tokens_per_s", "decode_tokens_per_s"]
    rows = [("old", m7, "NVFP4", 128, 256, 512, 32, "ok", h100, "fused", 9000.0, 10000.0),
            ("old", m7, "BF16", 128, 256, 512, 32, "ok", h100, "fused", 9000.0, 10000.0),
            ("new", m7, "NVFP4", 128, 256, 512, 32, "ok", h100, "fused", 13000.0, 16000.0),
            ("new", m7, "NVFP4", 128, 256, 512, 32, "ok", h100, "fused-s37", 99999.0, 99999.0),  # another mode
            ("new", m7, "BF16", 128, 256, 512, 32, "ok", h100, "fused", 10000.0, 14000.0),
            ("h200", m7, "NVFP4", 128, 256, 512, 32, "ok", "NVIDIA H200", "fused", 1.0, 1.0),
            ("solo", m7, "NVFP4", 64, 256, 512, 32, "ok", h100, "fused", 5000.0, 6000.0)]  # no BF16 row: no pair
    pd.DataFrame([dict(zip(cols, r, strict=True)) for r in rows]).to_csv(tmp_path / "rollout.csv", index=False)
    md = df.roofline_table(tmp_path, "H100")
    nv = df.step_floor_s("qwen2.5-7b", "nvfp4", 128, 512, 3.0, df.PEAK_TFLOPS["H100"])["total"]
    bf = df.step_floor_s("qwen2.5-7b", "bf16", 128, 512, 3.0, df.PEAK_TFLOPS["H100"])["total"]
    row = next(line for line in md.splitlines() if line.startswith("| 128 |"))
    assert row.split(" | ")[1:] == [f"{1e3 * nv:.2f} (FLOPs)", f"{1e3 * bf:.2f} (bytes)", f"{bf / nv:.2f}×",
                                    "≥ 1.3×", "1.30×", f"{16000 * nv / 128:.2f}", f"{14000 * bf / 128:.2f}", "new |"]
    assert next(line for line in md.splitlines() if line.startswith("| 64 |")).endswith("| — | — | — | — |")
    assert "_no copy bandwidth measured on an H200" in df.roofline_table(tmp_path, "H200")


def test_layer_roofline_against_the_measured_layer_table(tmp_path):
    (tmp_path / "raw" / "h").mkdir(parents=True)
    (tmp_path / "raw" / "h" / "hbm_pattern_x.md").write_text("NVIDIA H100 80GB HBM3, copy bandwidth 3.0 TB/s\n")
    h, i, kv = 3584, 18944, 512
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    # M = 32: every NVFP4 linear bound by its bytes; M = 512: every one by its FLOPs, and BF16's too
    assert df.layer_floor_s("qwen2.5-7b", "nvfp4", 32, 3.0, 989.4) == pytest.approx(
        sum(n * k * 4.5 / 8 + 4 for n, k in shapes) / 3.0e12)
    flops = sum(2.0 * n * k * 512 for n, k in shapes) / 989.4e12
    assert df.layer_floor_s("qwen2.5-7b", "bf16", 512, 3.0, 989.4) == pytest.approx(flops)
    cols = ["model", "fmt", "path", "M", "us"]
    pd.DataFrame([dict(zip(cols, r, strict=True)) for r in [
        ("7b", "bf16", "bf16", 128, 200.0), ("7b", "nvfp4", "qmm", 128, 160.0), ("7b", "nvfp4", "prev", 128, 1.0),
        ("7b", "bf16", "bf16", 48, 200.0)]]).to_csv(tmp_path / "cuda_gemm_h100.csv", index=False)  # 48: no FP4 row
    md = df.layer_roofline_table(tmp_path, "H100")
    nv = df.layer_floor_s("qwen2.5-7b", "nvfp4", 128, 3.0, df.PEAK_TFLOPS["H100"])
    bf = df.layer_floor_s("qwen2.5-7b", "bf16", 128, 3.0, df.PEAK_TFLOPS["H100"])
    (row,) = [line for line in md.splitlines() if line.startswith("| 1")]
    assert row.split(" | ")[1:] == [f"{1e6 * nv:.1f} (FLOPs)", f"{1e6 * bf:.1f} (bytes)", f"{bf / nv:.2f}×", "≥ 1.15×",
                                    "1.25×", f"{1e6 * nv / 160:.2f}", f"{1e6 * bf / 200:.2f} |"]
    assert "measured: `cuda_gemm_h100.csv`" in md
    assert df.layer_roofline_table(tmp_path, "H200").startswith("_no copy bandwidth or layer table")
