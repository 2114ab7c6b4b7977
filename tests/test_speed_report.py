"""The speed report's bookkeeping (``experiments.speed``): merging a GPU session's CSVs into results, the tables
(same-run ratios, † across runs, the fused decode step as the current one, Table 9 beside the paper), and
``qerl.bench profile`` end to end on the CPU."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from experiments import speed, speed_tables, speed_targets


def _rollout(rows, run, sha="abc1234"):
    base = dict(bench="rollout", prompt_len=256, new_tokens=2048, status="ok", run=run, git_sha=sha)
    return pd.DataFrame([dict(base, **r) for r in rows])


def _row(model, method, weights, batch, tps, decode="fused", rank=32):
    return dict(model=model, method=method, weights=weights, batch_size=batch, lora_rank=rank, decode=decode,
                tokens_per_s=tps)


def test_merge_replaces_same_identity_and_keeps_the_rest(tmp_path):
    root = tmp_path / "speed"
    root.mkdir()
    # an older top-level CSV: float batch sizes, no decode column (older builds decoded unfused)
    old = _rollout([_row("Qwen2.5-7B-Instruct", "LoRA", "BF16", 8.0, 700.0),
                    _row("Qwen2.5-14B-Instruct", "LoRA", "BF16", 8.0, 400.0)], "run1").drop(columns="decode")
    old.to_csv(root / "rollout.csv", index=False)
    src = tmp_path / "out"
    src.mkdir()
    _rollout([_row("Qwen2.5-7B-Instruct", "LoRA", "BF16", 8, 1000.0, "unfused"),
              _row("Qwen2.5-7B-Instruct", "LoRA", "BF16", 8, 1100.0, "fused")], "ignored",
             sha="deadbeef00").drop(columns=["run"]).to_csv(src / "rollout.csv", index=False)
    (src / "env.json").write_text(json.dumps({"gpu": "H100"}))
    merged = speed.merge_run(src, root, "h100_runX", sha="cafe123")
    assert merged == [str(root / "rollout.csv")]
    d = pd.read_csv(root / "rollout.csv")
    # the 7B unfused row replaced run1's (8.0 == 8, missing decode == unfused); 14B kept; fused added
    assert sorted(d["tokens_per_s"]) == [400.0, 1000.0, 1100.0]
    assert set(d.loc[d["tokens_per_s"] > 900, "run"]) == {"h100_runX"}
    assert set(d.loc[d["tokens_per_s"] > 900, "git_sha"]) == {"cafe123"}
    assert (root / "raw" / "h100_runX" / "env.json").exists()
    assert (root / "raw" / "h100_runX" / "rollout.csv").exists()
    with pytest.raises(FileNotFoundError, match="no benchmark output folder"):
        speed.merge_run(tmp_path / "missing", root, "x")


def test_merge_keeps_the_same_row_from_another_gpu(tmp_path):
    """An H200 row does not replace the H100 row of the same configuration (the issues' targets are per GPU); a
    second H200 row replaces the first."""
    root = tmp_path / "speed"
    root.mkdir()
    row = _row("Qwen2.5-7B-Instruct", "QeRL", "NVFP4", 8, 2451.0)
    _rollout([dict(row, device="NVIDIA H100 80GB HBM3")], "h100").to_csv(root / "rollout.csv", index=False)
    for name, tps in (("h200_a", 2886.0), ("h200_b", 2900.0)):
        src = tmp_path / name
        src.mkdir()
        _rollout([dict(row, tokens_per_s=tps, device="NVIDIA H200")], name).to_csv(src / "rollout.csv", index=False)
        speed.merge_run(src, root, name)
    d = pd.read_csv(root / "rollout.csv")
    got = sorted(zip(d["device"], d["tokens_per_s"], d["run"], strict=True))
    assert got == [("NVIDIA H100 80GB HBM3", 2451.0, "h100"),
                   ("NVIDIA H200", 2900.0, "h200_b")]


def test_rollout_table_ratios_and_cross_run_mark(tmp_path):
    d = pd.concat([_rollout([_row("Qwen2.5-32B-Instruct", "QeRL", "NVFP4", 8, 520.0),
                             _row("Qwen2.5-32B-Instruct", "QLoRA", "NF4", 8, 130.0),
                             _row("Qwen2.5-32B-Instruct", "QeRL", "NVFP4", 8, 300.0, "unfused")], "a"),
                   _rollout([_row("Qwen2.5-32B-Instruct", "LoRA", "BF16", 8, 260.0)], "b")])
    d.to_csv(tmp_path / "rollout.csv", index=False)
    md = speed_tables.rollout_table(tmp_path, decode="fused")
    line = next(x for x in md.splitlines() if "| QeRL |" in x)
    cells = [c.strip() for c in line.split("|")]
    assert cells[7] == "520" and cells[8] == "2.00†" and cells[9] == "4.00"  # ×LoRA from run b: marked
    assert "688.2" in line  # the paper's 32B batch-8 NVFP4 figure beside ours (Table 8)
    assert "unfused" not in md


def test_kernel_layout_rows_pair_within_a_session(tmp_path):
    """A kernel-layout row sits in the main table with its decode step (compared with the same BF16-LoRA row) and
    in the layout table beside the compressed row of the same configuration and session only."""
    m = "Qwen2.5-7B-Instruct"
    d = pd.concat([_rollout([dict(_row(m, "QeRL", "NVFP4", 8, 2000.0), layout="compressed", peak_mem_gb=14.9),
                             dict(_row(m, "QeRL", "NVFP4", 8, 2200.0), layout="kernel", peak_mem_gb=8.7),
                             dict(_row(m, "LoRA", "BF16", 8, 1000.0), layout="compressed", peak_mem_gb=20.0)],
                            "s27/ab"),
                   # another session's kernel row of another batch: no compressed partner there, not paired
                   _rollout([dict(_row(m, "QeRL", "NVFP4", 64, 7600.0), layout="kernel", peak_mem_gb=18.0)], "s28"),
                   _rollout([dict(_row(m, "QeRL", "NVFP4", 64, 7000.0), layout="compressed", peak_mem_gb=24.0)],
                            "s27/c3")])
    d.to_csv(tmp_path / "rollout.csv", index=False)
    main = speed_tables.rollout_table(tmp_path, decode="fused")
    kl = next(x for x in main.splitlines() if "fused (kernel layout)" in x and "| 8 |" in x)
    assert [c.strip() for c in kl.split("|")][8] == "2.20"  # against the BF16-LoRA row of its own group
    lay = speed_tables.layout_table(tmp_path)
    rows = [x for x in lay.splitlines() if x.startswith("| rollout")]
    assert len(rows) == 1 and "2000.0 tok/s" in rows[0] and "2200.0 tok/s" in rows[0]
    assert "| 1.100 |" in rows[0] and "14.9 → 8.7" in rows[0]
    assert "no kernel-layout rows" in speed_tables.layout_table(tmp_path / "missing")
    # a later run of the same configuration replaces the s27 kernel row at the top level: the pair is taken from
    # the session's raw folder (raw/s27/ab), not lost and not paired with the later row
    (tmp_path / "raw" / "s27" / "ab").mkdir(parents=True)
    d[d["run"] == "s27/ab"].to_csv(tmp_path / "raw" / "s27" / "ab" / "rollout.csv", index=False)
    later = d.copy()
    later.loc[(later["run"] == "s27/ab") & (later["layout"] == "kernel"), ["run", "tokens_per_s"]] = ["s29", 2500.0]
    later.to_csv(tmp_path / "rollout.csv", index=False)
    rows = [x for x in speed_tables.layout_table(tmp_path, sessions=("s27",)).splitlines() if x.startswith("| rollout")]
    assert len(rows) == 1 and "| 1.100 |" in rows[0] and "2500" not in rows[0]
    assert not [x for x in speed_tables.layout_table(tmp_path, sessions=()).splitlines() if x.startswith("| rollout")]


def test_rank_table_beside_paper_table9(tmp_path):
    d = _rollout([_row("Qwen2.5-7B-Instruct", m, w, 2, t, rank=r)
                  for r, t0 in ((16, 280.0), (64, 270.0))
                  for m, w, t in (("LoRA", "BF16", t0), ("QeRL", "NVFP4", 2 * t0))], "r")
    later = _rollout([_row("Qwen2.5-7B-Instruct", "QeRL", "NVFP4", 2, 420.0, rank=16)], "s")  # a newer build's row
    d = pd.concat([d[~((d.lora_rank == 16) & (d.weights == "NVFP4"))], later])
    d.to_csv(tmp_path / "rollout.csv", index=False)
    md = speed_tables.rank_table(tmp_path)
    row = next(x for x in md.splitlines() if "| NVFP4 | 64 |" in x)
    cells = [c.strip() for c in row.split("|")]
    assert cells[5] == "540" and cells[6] == "2.00" and cells[7] == "137.7"  # paper Table 9, 7B NVFP4 r64
    assert cells[8] == f"{137.7 / 108.3:.2f}"
    row = next(x for x in md.splitlines() if "| NVFP4 | 16 |" in x)
    assert [c.strip() for c in row.split("|")][6] == "1.50†"  # against the BF16 row of run r: marked
    assert [c.strip() for c in row.split("|")][9] == "s"  # and its own run named


def test_bench_profile_runs_on_cpu(tmp_path):
    import os

    from qerl import bench

    before = {k: os.environ.get(k) for k in ("QERL_CUDA_LORA", "QERL_FUSED_SAMPLE", "QERL_FUSED_SILU", "QERL_GEMV_TABLE",
                                             "QERL_PDL")}
    modes = ("fused", "fused-split-lora", "fused-torch-sample", "fused-pdl", "fused-torch-ends", "unfused")
    rows = bench.bench_profile(["tiny"], ["nvfp4"], [2], 64, "cpu", modes, steps=2, kv=128)
    assert {k: os.environ.get(k) for k in before} == before  # each mode restores its switches
    decodes = {r["decode"] for r in rows}
    assert decodes == set(modes)
    for dec in decodes:
        sub = [r for r in rows if r["decode"] == dec]
        assert sub[0]["graph_step_us"] > 0 and sub[0]["launches"] > 0
        assert abs(sum(r["kernel_us"] for r in sub) - sub[0]["kernels_us"]) < 1e-6 * sub[0]["kernels_us"] + 1e-9

    class _S:
        fused = None
    for dec, env in [("fused", {}), ("fused-split-lora", {"QERL_CUDA_LORA": "0"}),
                     ("fused-torch-sample", {"QERL_FUSED_SAMPLE": "0"}), ("fused-split-silu", {"QERL_FUSED_SILU": "0"}),
                     ("fused-heuristic-gemv", {"QERL_GEMV_TABLE": "0"}),
                     ("fused-pdl", {"QERL_PDL": "1"}),
                     ("fused-no-pdl", {"QERL_PDL": "0"}), ("fused-torch-ends", {"QERL_FUSED_STEP_ENDS": "0"}),
                     ("unfused", {})]:
        s = _S()
        with bench.decode_mode(s, dec):
            assert s.fused == (dec != "unfused")
            assert all(os.environ.get(k) == v for k, v in env.items())
        assert {k: os.environ.get(k) for k in before} == before
    with pytest.raises(ValueError, match=r"unknown decode mode 'fast'; valid: \['fused', 'fused-split-lora'"):
        bench.bench_profile(["tiny"], ["nvfp4"], [2], 64, "cpu", ("fast",), steps=2)
    with pytest.raises(ValueError, match="steps must be"):
        bench.bench_profile(["tiny"], ["nvfp4"], [2], 64, "cpu", ("fused",), steps=50)


def test_bench_rollout_keeps_every_pass_of_an_ab(tmp_path):
    """``qerl.bench rollout --decode a,b,a,b`` on the CPU: the repeated settings' rows carry pass = 2 and the CSV keeps
    all four (it used to keep the last pass only: a later row of the same identity replaced the first); merging keeps
    every pass under raw/<name> and the last one at the top level; the raw table labels the later pass."""
    from qerl import bench

    out, root = tmp_path / "out", tmp_path / "speed"
    out.mkdir()
    root.mkdir()
    rows = bench.bench_rollout(["tiny"], ["nvfp4"], [2], [8], 16, 4, "cpu", decodes=("fused", "unfused") * 2,
                               sink=lambda r: bench._write_csv([r], out / "rollout.csv"))
    assert [(r["decode"], r.get("pass")) for r in rows] == [("fused", None), ("unfused", None), ("fused", 2),
                                                             ("unfused", 2)]
    d = pd.read_csv(out / "rollout.csv")
    assert len(d) == 4 and sorted(d["pass"].fillna(1)) == [1, 1, 2, 2]
    assert list(d["tokens_per_s"]) == [r["tokens_per_s"] for r in rows]
    speed.merge_run(out, root, "cpu_ab", sha="cafe125")
    top = pd.read_csv(root / "rollout.csv")
    assert "pass" not in top and sorted(top["decode"]) == ["fused", "unfused"]
    assert sorted(top["tokens_per_s"]) == sorted(r["tokens_per_s"] for r in rows[2:])  # the last pass
    assert len(pd.read_csv(root / "raw" / "cpu_ab" / "rollout.csv")) == 4
    md = speed_tables.rollout_table(root / "raw" / "cpu_ab", decode=None, rank=8)
    assert md.count(", pass 2 |") == 2 and md.count("| fused") == 2, md


def test_batch_rollout_table_gemm_on_and_off(tmp_path):
    """Ratios against the GEMM-off process's BF16-LoRA row (the 'auto' process's BF16 is not used), per batch."""
    raw = tmp_path / "raw" / "run"
    raw.mkdir(parents=True)
    cols = ["model", "weights", "batch_size", "tokens_per_s"]
    on = [("7B", "BF16", 64, 999.0), ("7B", "NVFP4", 64, 1500.0), ("7B", "NVFP4", 128, 1800.0)]
    off = [("7B", "BF16", 64, 1000.0), ("7B", "NVFP4", 64, 800.0), ("7B", "BF16", 128, 2000.0),
           ("7B", "NVFP4", 128, 1400.0), ("7B", "BF16", 256, 3000.0)]
    pd.DataFrame(on, columns=cols).to_csv(raw / "rollout_gemm_auto.csv", index=False)
    pd.DataFrame(off, columns=cols).to_csv(raw / "rollout_gemm_0.csv", index=False)
    rows = speed_tables.batch_rollout_table(tmp_path, "run").splitlines()
    assert rows[2] == "| 7B | 64 | 1000 | 1500 | 1.50 | 800 | 0.80 |"
    assert rows[3] == "| 7B | 128 | 2000 | 1800 | 0.90 | 1400 | 0.70 |"
    assert len(rows) == 4  # batch 256 has no NVFP4 rows: left out
    assert speed_tables.batch_rollout_table(tmp_path, "missing").startswith("_not measured_")


def test_bench_step_groups_and_micro_batches_on_cpu(tmp_path):
    """`qerl.bench step --group --micro` (issue 10's realistic GRPO step: prompts × G completions, micro-batches)
    runs the configured groups through qerl.train, and the step table names the configuration per row."""
    import yaml

    from qerl import bench

    rows = bench.bench_step(["tiny"], ["nvfp4", "bf16"], [8], [True], 2, 64, 8, "cpu", tmp_path / "runs",
                            group=4, micro=4)
    assert [(r["status"], r["group_size"], r["micro_batch"], r["steps"]) for r in rows] == [("ok", 4, 4, 2)] * 2
    run = tmp_path / "runs" / "step" / "tiny-nvfp4-b8-g4-mb4-gc"
    cfg = yaml.safe_load((run / "config.yaml").read_text())  # 8 completions = 2 prompts x G 4, micro-batches of 4
    assert (cfg["algo"]["group_size"], cfg["train"]["batch_size"], cfg["train"]["micro_batch"]) == (4, 8, 4)
    assert all(r["step_s"] > 0 and r["rollout_tokens"] > 0 for r in rows)
    with pytest.raises(ValueError, match="not a whole number of groups"):
        bench.bench_step(["tiny"], ["nvfp4"], [8], [True], 1, 64, 8, "cpu", tmp_path / "runs", group=3)
    out = tmp_path / "res"
    out.mkdir()
    bench._write_csv([dict(r, run="r1") for r in rows], out / "step.csv")
    old = dict(rows[0], group_size="", micro_batch="", batch_size=8, run="r0")  # a row from before the columns
    bench._write_csv([old], out / "step.csv")
    lines = [ln for ln in speed_tables.step_table(out).splitlines() if ln.startswith("| tiny")]
    assert len(lines) == 3, lines
    assert any("| 8 (2 × 4) | 4 | 8 | on | QeRL | ok |" in ln for ln in lines)
    assert any("| 8 (1 × 8) | 8 | 8 | on | QeRL | ok |" in ln for ln in lines)  # the old row: one group
    nv = next(ln for ln in lines if "(2 × 4)" in ln and "QeRL" in ln)
    ratio = float(nv.split("|")[13])
    assert ratio == pytest.approx(rows[1]["step_s"] / rows[0]["step_s"], abs=0.006)  # LoRA's s/step over QeRL's
    bench._write_csv([dict(rows[0], weights="MXFP4", method="MXFP4-LoRA", run="r2")], out / "step.csv")
    mx = next(ln for ln in speed_tables.step_table(out).splitlines() if "MXFP4-LoRA" in ln)
    assert mx.split("|")[13].strip().endswith("†") and not nv.split("|")[13].strip().endswith("†")  # other run


def test_batch_rollout_table_one_process_per_format(tmp_path):
    """A session's single rollout.csv (dispatcher as committed): ratios against its own BF16-LoRA row per batch,
    the warm-up batch (16) left out, a missing format shown as —."""
    raw = tmp_path / "raw" / "s"
    raw.mkdir(parents=True)
    rows = [("7B", "BF16", 16, 900.0), ("7B", "NVFP4", 16, 100.0), ("7B", "BF16", 64, 1000.0),
            ("7B", "NVFP4", 64, 1250.0), ("7B", "MXFP4", 64, 1500.0), ("7B", "BF16", 128, 2000.0),
            ("7B", "NVFP4", 128, 1900.0)]
    pd.DataFrame(rows, columns=["model", "weights", "batch_size", "tokens_per_s"]).to_csv(raw / "rollout.csv",
                                                                                          index=False)
    lines = speed_tables.batch_rollout_table(tmp_path, "s").splitlines()
    assert lines[2:] == ["| 7B | 64 | 1000 | 1250 | 1.25 | 1500 | 1.50 |", "| 7B | 128 | 2000 | 1900 | 0.95 | — | — |"]


def _scaling(world, tps, run, device, sha="abc1234"):
    return dict(bench="scaling", model="Qwen2.5-7B-Instruct", method="QeRL", weights="NVFP4", world_size=world,
                global_batch=128, group_size=8, per_gpu_batch=128 // world, micro_batch=8, gc=True, new_tokens=1024,
                step_s=100.0 / world, rollout_s=10.0, logprob_s=5.0, update_s=10.0 / world, comm_s=0.1,
                tokens_per_s=tps, peak_mem_gb=20.0, status="ok", device=device, run=run, git_sha=sha)


def test_scaling_rows_keep_each_machine_and_compare_within_a_session(tmp_path):
    """Scaling rows of two machines (2 H200s, then 4 H100s) both stay after a merge, and each N-GPU row's efficiency
    is taken against the 1-GPU row of its own session, not the other machine's."""
    root = tmp_path / "speed"
    root.mkdir()
    pd.DataFrame([_scaling(1, 3000.0, "h200x2", "NVIDIA H200 x2"),
                  _scaling(2, 4800.0, "h200x2", "NVIDIA H200 x2")]).to_csv(root / "scaling.csv", index=False)
    src = tmp_path / "out"
    src.mkdir()
    pd.DataFrame([_scaling(w, t, "x", "NVIDIA H100 80GB HBM3") for w, t in ((1, 4000.0), (2, 7200.0), (4, 12000.0))]
                 ).drop(columns="run").to_csv(src / "scaling.csv", index=False)
    speed.merge_run(src, root, "h100x4", sha="cafe123")
    d = pd.read_csv(root / "scaling.csv")
    assert len(d) == 5 and set(d["run"]) == {"h200x2", "h100x4"}
    eff = {(r["run"], int(r["world_size"])): r["efficiency"] for r in speed_tables.scaling_rows(d)}
    assert eff[("h200x2", 2)] == pytest.approx(0.8)  # 4800 / 2 / 3000
    assert eff[("h100x4", 2)] == pytest.approx(0.9)  # 7200 / 2 / 4000, not against the H200's 3000
    assert eff[("h100x4", 4)] == pytest.approx(0.75)
    assert not any(r.get("cross_run") for r in speed_tables.scaling_rows(d))
    # the same machine measured again replaces its rows
    speed.merge_run(src, root, "h100x4b", sha="cafe124")
    assert sorted(pd.read_csv(root / "scaling.csv")["run"]) == ["h100x4b"] * 3 + ["h200x2"] * 2


def test_bench_memory_reports_what_decode_adds_on_cpu(tmp_path):
    """``qerl.bench memory`` loads each format, decodes two tokens, and records the resident weights before and the
    decode kernels' copy after (none on the CPU: no CUDA kernels); the memory table shows both."""
    from qerl import bench

    bench.main(["memory", "--models", "tiny", "--formats", "nvfp4,bf16", "--device", "cpu", "--out", str(tmp_path)])
    d = pd.read_csv(tmp_path / "memory.csv")
    assert list(d["weights"]) == ["NVFP4", "BF16"] and (d["model_size_gb"] > 0).all()
    assert (d["decode_copy_gb"] == 0).all() and (d["resident_after_decode_gb"] == d["quantized_linears_gb"]).all()
    assert list(d["layout"]) == ["compressed", "compressed"]  # auto on the CPU
    md = speed_tables.memory_table(tmp_path)
    assert "+ decode kernels' copy (GB)" in md and "| 0.00 |" in md


def test_rollout_ratios_compare_rows_of_one_gpu_model(tmp_path):
    """×LoRA uses the BF16 row of the same run; else one of the same GPU (†); never another GPU's (—)."""
    rows = [dict(_row("Qwen2.5-7B-Instruct", "LoRA", "BF16", 8, 1000.0), device="NVIDIA H100 80GB HBM3"),
            dict(_row("Qwen2.5-7B-Instruct", "QeRL", "NVFP4", 8, 2000.0), device="NVIDIA H100 80GB HBM3")]
    d = pd.concat([_rollout(rows, "h100_a"),
                   _rollout([dict(_row("Qwen2.5-7B-Instruct", "QeRL", "NVFP4", 8, 2500.0),
                                  device="NVIDIA H100 80GB HBM3")], "h100_b"),
                   _rollout([dict(_row("Qwen2.5-7B-Instruct", "QeRL", "NVFP4", 8, 2900.0), device="NVIDIA H200")],
                            "h200_a")])
    d.to_csv(tmp_path / "rollout.csv", index=False)
    table = speed_tables.rollout_table(tmp_path)
    cells = {line.split(" | ")[6]: line.split(" | ")[7] for line in table.splitlines() if "| QeRL |" in line}
    assert cells == {"2000": "2.00", "2500": "2.50†", "2900": "—"}, table
    body = [line for line in table.splitlines()[2:] if line.startswith("| Qwen")]
    assert len(body) == 4 and all(line.endswith("| 256 + 2048 |") for line in body)  # each row's lengths
    # the paper's figure (vLLM, one H100, 256 + 2048) beside the H100 rows only; each run cell names its GPU
    by_tps = {line.split(" | ")[6]: line.split(" | ") for line in body}
    assert by_tps["2000"][9:12] == ["2091.8", "1.27", "h100_a (abc1234), H100"]
    assert by_tps["2900"][9:12] == ["—‡", "—‡", "h200_a (abc1234), H200"]
    assert "‡ The paper's figure is not shown beside the rows marked ‡: it was measured on one H100 at 256 + 2048 " \
           "tokens" in table
    # other lengths on the paper's GPU: withheld too
    d.loc[d["run"] == "h100_b", "new_tokens"] = 512
    d.to_csv(tmp_path / "rollout.csv", index=False)
    line = next(x for x in speed_tables.rollout_table(tmp_path).splitlines() if x.startswith("| Qwen") and "| 2500 |" in x)
    assert line.split(" | ")[9:11] == ["—‡", "—‡"] and line.endswith("| 256 + 512 |")
    # a table with nothing withheld has no footnote
    d = d[d["run"] == "h100_a"]
    d.to_csv(tmp_path / "rollout.csv", index=False)
    assert "‡" not in speed_tables.rollout_table(tmp_path)


def test_bench_update_runs_on_cpu_and_renders(tmp_path):
    """``qerl.bench update`` end to end on the tiny preset (CPU): a summary row per kernel category whose times add up
    to the profiled total, the variant columns; merged twice (two runs) both runs stay in update.csv; the table
    gives NVFP4 against BF16 of the same run and variant only."""
    from qerl import bench, bench_update

    out = tmp_path / "out"
    rows = bench.bench_update(["tiny"], ["nvfp4", "bf16"], 2, 8, 16, True, "cpu", repeats=1,
                              sink=lambda r: bench._write_csv(r, out / "update.csv", bench.UPDATE_IDENT))
    cats = [r for r in rows if r["kernel"] == ""]
    for w in ("NVFP4", "BF16"):
        sub = [r for r in cats if r["weights"] == w]
        assert sub and sub[0]["update_ms"] > 0 and sub[0]["logprob_ms"] > 0 and sub[0]["fused_train"] is True
        assert abs(sum(r["kernel_ms"] for r in sub) - sub[0]["kernels_ms"]) < 1e-6 * sub[0]["kernels_ms"] + 1e-9
        assert len({r["category"] for r in sub}) == len(sub)
    assert bench_update.kernel_category("void (anonymous namespace)::dequant_kernel<0, true>") == "dequantize"
    assert bench_update.kernel_category("_rms_bwd_kernel") == "norm" and bench_update.kernel_category("_rope_kernel") == "rope"
    assert bench_update.kernel_category("nvjet_sm90_tst_192x192_64x4_1x2_h_bz_coopB_TNN") == "cublas_gemm"
    assert bench_update.kernel_category("something_else") == "other"
    root = tmp_path / "speed"
    root.mkdir()
    for run in ("r1", "r2"):
        assert speed.merge_run(out, root, run) == [str(root / "update.csv")]
    d = pd.read_csv(root / "update.csv")
    assert set(d["run"]) == {"r1", "r2"} and len(d) == 2 * len(rows)
    table = speed_tables.update_table(root)
    n = [r for r in cats if r["weights"] == "NVFP4"][0]["update_ms"]
    b = [r for r in cats if r["weights"] == "BF16"][0]["update_ms"]
    assert table.count(f"| {n / b:.3f}× |") == 2  # one per run, each against its own BF16 row


def test_dequant_and_step_ab_tables(tmp_path):
    root = tmp_path / "speed"
    (root / "raw" / "new").mkdir(parents=True)
    (root / "raw" / "old").mkdir(parents=True)
    base = dict(bench="dequant", model="7b", fmt="nvfp4", linear="gate_proj", n=18944, k=3584, device="H100")
    pd.DataFrame([dict(base, backend="triton", us=287.0, tb_s=0.61, bits_equal=True),
                  dict(base, backend="cuda", us=129.0, tb_s=1.35, bits_equal=True)]).to_csv(root / "dequant.csv",
                                                                                              index=False)
    t = speed_tables.dequant_table(root)
    assert "| 287.0 (0.61) | 129.0 (1.35) | 2.22× | yes |" in t
    step = dict(bench="step", step_s=31.0, rollout_s=11.4, logprob_s=5.1, update_s=14.5, peak_mem_gb=23.5)
    pd.DataFrame([dict(step, weights="NVFP4")]).to_csv(root / "raw" / "new" / "step.csv", index=False)
    pd.DataFrame([dict(step, weights="NVFP4", step_s=34.1, update_s=16.7)]).to_csv(root / "raw" / "old" / "step.csv",
                                                                                   index=False)
    t = speed_tables.step_ab_table(root, "new", "old", "fused")
    assert "31.00 / 34.10 (-9.1%)" in t and "14.50 / 16.70 (-13.2%)" in t and "11.40 / 11.40 (+0.0%)" in t
    assert speed_tables.step_ab_table(root, "new", "missing", "x") == "_not measured_\n"


def _layers(path, rows):
    """A ``benchmarks.kernel_bench`` CSV of layer rows: (fmt, op, M, µs)."""
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([dict(model="7b", fmt=f, op=op, M=m, linear="layer", us=us) for f, op, m, us in rows]).to_csv(
        path / "layers_h100.csv", index=False)


def test_slices_ab_table_per_pass_gain_and_ratio(tmp_path):
    """The slice A/B: per format, op and M the FP4 µs with the table and without in each pass, the gain (without /
    with - 1), and each against BF16 of its own process."""
    raw = tmp_path / "raw" / "ab"
    for on, p, us in (("1", "1", 90.0), ("0", "1", 100.0), ("0", "2", 99.0), ("1", "2", 95.0)):
        _layers(raw / f"layers_s{on}_{p}", [("bf16", "bwd", 2048, 80.0), ("nvfp4-kernel", "bwd", 2048, us)])
    lines = speed_tables.slices_ab_table(tmp_path, "ab").splitlines()
    assert lines[2:] == ["| nvfp4 | bwd | 2048 | 90 / 95 | 100 / 99 | +11.1% / +4.2% | 0.89× / 0.84× | "
                         "0.80× / 0.81× |"]
    assert speed_tables.slices_ab_table(tmp_path, "none").startswith("_no slice A/B")


def test_targets_table_judges_each_target_by_its_h100_run(tmp_path):
    """Issues 10 and 11's targets: the layer ratios from the named runs (forward and backward from different runs),
    the rollout from its last pass, the step, peak and decode rows from the top-level CSVs' H100 rows only (the row
    merged last; the step's NVFP4 against BF16-LoRA of the same run), 'not measured' where nothing is, and no
    rounding before the comparison."""
    _layers(tmp_path / "raw" / "fw", [("bf16", "fwd", 128, 115.0), ("nvfp4-kernel", "fwd", 128, 100.0),
                                      ("bf16", "bwd", 2048, 50.0), ("nvfp4-kernel", "bwd", 2048, 100.0)])
    _layers(tmp_path / "raw" / "bw", [("bf16", "bwd", 2048, 96.0), ("nvfp4-kernel", "bwd", 2048, 100.0)])
    (tmp_path / "raw" / "ro").mkdir()
    pd.DataFrame([dict(model="7B", weights="BF16", batch_size=64, tokens_per_s=100.0),
                  dict(model="7B", weights="NVFP4", batch_size=64, tokens_per_s=120.0),
                  dict(model="7B", weights="BF16", batch_size=64, tokens_per_s=100.0, **{"pass": 2}),
                  dict(model="7B", weights="NVFP4", batch_size=64, tokens_per_s=135.0, **{"pass": 2})]).to_csv(
        tmp_path / "raw" / "ro" / "rollout.csv", index=False)
    step = dict(model="Qwen2.5-7B-Instruct", batch_size=128, group_size=8, new_tokens=1024, gc=True, status="ok",
                peak_mem_gb=20.0, layout="kernel")
    pd.DataFrame([dict(step, weights="BF16", step_s=30.0, device="NVIDIA H100 80GB HBM3", run="a"),
                  dict(step, weights="NVFP4", step_s=31.0, device="NVIDIA H100 80GB HBM3", run="a"),
                  dict(step, weights="NVFP4", step_s=29.0, device="NVIDIA H100 80GB HBM3", run="b"),
                  dict(step, weights="BF16", step_s=30.0, device="NVIDIA H100 80GB HBM3", run="b"),
                  dict(step, weights="BF16", step_s=40.0, device="NVIDIA H100 80GB HBM3", run="c"),
                  dict(step, weights="NVFP4", step_s=10.0, device="NVIDIA H200", run="h200"),
                  dict(step, model="Qwen2.5-32B-Instruct", weights="NVFP4", step_s=40.0, peak_mem_gb=46.2,
                       device="NVIDIA H100 80GB HBM3", run="big")]).to_csv(tmp_path / "step.csv", index=False)
    roll = _rollout([_row("Qwen2.5-7B-Instruct", "QeRL", "NVFP4", 8, 2650.0),
                     _row("Qwen2.5-7B-Instruct", "QeRL", "NVFP4", 2, 699.9)], "dec")
    roll["device"] = "NVIDIA H100 80GB HBM3"
    h200 = _rollout([_row("Qwen2.5-32B-Instruct", "QeRL", "NVFP4", 8, 900.0)], "h200")
    h200["device"] = "NVIDIA H200"
    pd.concat([roll, h200]).to_csv(tmp_path / "rollout.csv", index=False)
    _layers(tmp_path / "raw" / "two" / "p1", [("bf16", "fwd", 256, 90.0), ("nvfp4-kernel", "fwd", 256, 100.0)])
    _layers(tmp_path / "raw" / "two" / "p2", [("bf16", "fwd", 256, 100.0), ("nvfp4-kernel", "fwd", 256, 100.0)])
    rows = {r["what"]: r for r in speed_targets.target_rows(tmp_path, "two", "bw", "ro")}
    assert rows["7B layer NVFP4 fwd M = 256: ≥ 0.95× BF16"]["value"] == pytest.approx(0.95)  # the passes' mean µs
    assert rows["7B layer NVFP4 fwd M = 256: ≥ 0.95× BF16"]["met"]
    got = {ln.split("|")[2].strip(): (ln.split("|")[3].strip(), ln.split("|")[4].strip(), ln.split("|")[5].strip())
           for ln in speed_targets.targets_table(tmp_path, "fw", "bw", "ro").splitlines()[2:]}
    assert got["7B layer NVFP4 fwd M = 128: ≥ 1.15× BF16"] == ("1.150×", "yes", "`fw`")
    assert got["7B layer NVFP4 bwd M = 2048: ≥ 0.95× BF16"] == ("0.960×", "yes", "`bw`")  # the backward's run
    assert got["7B layer NVFP4 fwd M = 32: ≥ 2.3× BF16"] == ("not measured", "—", "—")
    assert got["7B rollout, 64 sequences: NVFP4 ≥ 1.3× BF16-LoRA"] == ("1.350×", "yes", "`ro`")  # the last pass
    assert got["realistic GRPO step (7B, 16 × G 8): NVFP4 faster than BF16-LoRA"] == ("1.034×", "yes", "`b`")  # not 40 / 29
    assert got["32B NVFP4 GRPO step peak < 45 GB"] == ("46.2 GB", "no", "`big`")
    assert got["7B NVFP4 resident weights (kernel layout) ≤ 5.9 GB"][0] == "not measured"
    assert got["Qwen2.5-7B NVFP4 batch 8: ≥ 2600 tok/s"] == ("2650", "yes", "`dec`")
    assert got["Qwen2.5-7B NVFP4 batch 2: ≥ 700 tok/s"] == ("700", "no", "`dec`")  # 699.9 is not 700
    assert got["Qwen2.5-32B NVFP4 batch 8: ≥ 800 tok/s"][0] == "not measured"  # only an H200 row


def test_missed_targets_table_gives_each_missed_target_its_gap_and_one_named_limit(tmp_path):
    """Only measured, unmet targets are listed; the gap is value / bound - 1 (negative short of an at-least bound,
    positive over a below one); each is named by the one limit entry matching it ("not analysed" without one), each
    used limit's text and evidence follow once, in order of first use; two entries matching one target are refused;
    a table with every target met says so. The TOML loader refuses an entry with a missing key by name."""
    rows = [dict(issue=10, what="7B layer NVFP4 fwd M = 32: ≥ 2.3× BF16", bound=2.3, value=2.07,
                 text="2.070×", met=False, run="a"),
            dict(issue=10, what="7B layer MXFP4 fwd M = 32: ≥ 2.3× BF16", bound=2.3, value=2.3,
                 text="2.300×", met=True, run="a"),
            dict(issue=10, what="7B layer MXFP4 fwd M = 64: ≥ 1.6× BF16", bound=1.6, value=None,
                 text=None, met=None, run=""),
            dict(issue=10, what="32B NVFP4 GRPO step peak < 45 GB", bound=45.0, value=46.8,
                 text="46.8 GB", met=False, run="b"),
            dict(issue=11, what="Qwen2.5-7B BF16 batch 8: ≥ 1650 tok/s", bound=1650, value=1291.0,
                 text="1291", met=False, run="c"),
            dict(issue=10, what="7B layer MXFP4 fwd M = 256: ≥ 0.95× BF16", bound=0.95, value=0.9,
                 text="0.900×", met=False, run="a")]
    limits = [dict(name="Small GEMM", match="fwd M = (32|256): ", limit="the  mma\n loop", evidence="raw/x"),
              dict(name="Peak", match="peak", limit="memory", evidence="raw/y")]
    md = speed_targets.missed_targets_table(rows, limits)
    lines = md.splitlines()
    assert lines[2:6] == ["| 10 | 7B layer NVFP4 fwd M = 32: ≥ 2.3× BF16 | 2.070× | -10.0% | Small GEMM |",
                          "| 10 | 32B NVFP4 GRPO step peak < 45 GB | 46.8 GB | +4.0% | Peak |",
                          "| 11 | Qwen2.5-7B BF16 batch 8: ≥ 1650 tok/s | 1291 | -21.8% | not analysed |",
                          "| 10 | 7B layer MXFP4 fwd M = 256: ≥ 0.95× BF16 | 0.900× | -5.3% | Small GEMM |"]
    assert lines[7:] == ["- **Small GEMM.** the mma loop *Evidence:* raw/x.", "- **Peak.** memory *Evidence:* raw/y."]
    with pytest.raises(ValueError, match="'32B NVFP4 GRPO step peak < 45 GB': 2 limit entries match it"):
        speed_targets.missed_targets_table(rows, limits + [dict(name="P2", match="GB", limit="-", evidence="-")])
    assert speed_targets.missed_targets_table(rows[1:3], limits) == "_every measured target is met_\n"
    assert speed_targets._limits_or_none(tmp_path) == []  # no target_limits.toml: every missed target "not analysed"
    bad = tmp_path / "limits.toml"
    bad.write_text('[[limit]]\nname = "x"\nmatch = "y"\nlimit = "z"\n')
    with pytest.raises(ValueError, match="limit entry 1 \\('y'\\) has keys \\['limit', 'match', 'name'\\]"):
        speed_targets.target_limits(bad)


def test_committed_target_limits_cover_every_missed_target():
    """results/speed/target_limits.toml against the committed results: every target the targets table marks unmet has
    exactly one limit entry, every entry matches some target, and every raw run an entry cites exists."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "results" / "speed"
    rows = speed_targets.target_rows(root, *speed_targets.TARGET_RUNS)
    limits = speed_targets.target_limits(root / "target_limits.toml")
    missed = [r for r in rows if r["met"] is False]
    assert missed, "no missed target: the limits file would have nothing to explain"
    for r in missed:
        assert sum(bool(re.search(e["match"], r["what"])) for e in limits) == 1, r["what"]
    for e in limits:
        assert any(re.search(e["match"], r["what"]) for r in rows), e["name"]
        for run in re.findall(r"raw/([\w./-]+)", e["evidence"]):
            assert (root / "raw" / run.rstrip(".,")).exists(), (e["name"], run)


def test_batch_rollout_table_takes_the_default_mode_and_the_last_pass(tmp_path):
    """A run with several decode modes and passes (session 39's `--decode fused,fused`; session 37's `fused,fused-s36`):
    the table shows the `fused` rows of the last pass, whatever order the CSV holds them in."""
    raw = tmp_path / "raw" / "p"
    raw.mkdir(parents=True)
    rows = [("7B", "BF16", 64, "fused", None, 1000.0), ("7B", "BF16", 64, "fused", 2, 1100.0),
            ("7B", "NVFP4", 64, "fused", 2, 1650.0), ("7B", "NVFP4", 64, "fused", None, 1500.0),
            ("7B", "NVFP4", 64, "fused-s36", 2, 9999.0), ("7B", "BF16", 64, "fused-s36", None, 1.0)]
    pd.DataFrame(rows, columns=["model", "weights", "batch_size", "decode", "pass", "tokens_per_s"]).to_csv(
        raw / "rollout.csv", index=False)
    lines = speed_tables.batch_rollout_table(tmp_path, "p").splitlines()
    assert lines[2:] == ["| 7B | 64 | 1100 | 1650 | 1.50 | — | — |"]


def test_step_table_ratio_against_the_same_run_and_never_another_gpu(tmp_path):
    """Each step row's ×LoRA: the LoRA row of its own run, else († ) one from the same device; a GPU without a LoRA
    row of its own gets none (an H200's step against an H100's BF16 baseline would mix two machines)."""
    cols = ["bench", "model", "method", "weights", "batch_size", "group_size", "micro_batch", "gc", "new_tokens",
            "step_s", "rollout_s", "logprob_s", "update_s", "peak_mem_gb", "status", "device", "git_sha", "run"]
    rows = [("step", "7B", "LoRA", "BF16", 128, 8, 16, True, 1024, 30.0, 1, 1, 1, 9, "ok", "H100", "a", "h1"),
            ("step", "7B", "QeRL", "NVFP4", 128, 8, 16, True, 1024, 25.0, 1, 1, 1, 9, "ok", "H100", "a", "h1"),
            ("step", "7B", "LoRA", "BF16", 128, 8, 16, True, 1024, 20.0, 1, 1, 1, 9, "ok", "H200", "b", "h2"),
            ("step", "7B", "QeRL", "NVFP4", 128, 8, 16, True, 1024, 16.0, 1, 1, 1, 9, "ok", "H200", "b", "h2"),
            ("step", "7B", "QLoRA", "NF4", 128, 8, 16, True, 1024, 40.0, 1, 1, 1, 9, "ok", "H100", "c", "h3"),
            ("step", "7B", "MXFP4-LoRA", "MXFP4", 128, 8, 16, True, 1024, 10.0, 1, 1, 1, 9, "ok", "B200", "d", "b1")]
    pd.DataFrame(rows, columns=cols).to_csv(tmp_path / "step.csv", index=False)
    ratio = {(ln.split("|")[6].strip(), ln.split("|")[15].split("(")[0].strip()): ln.split("|")[13].strip()
             for ln in speed_tables.step_table(tmp_path).splitlines() if ln.startswith("| 7B")}
    assert ratio == {("LoRA", "h1"): "1.00", ("QeRL", "h1"): "1.20", ("LoRA", "h2"): "1.00", ("QeRL", "h2"): "1.25",
                     ("QLoRA", "h3"): "0.75†", ("MXFP4-LoRA", "b1"): "—"}


def test_devices_line_counts_the_rows_of_each_gpu(tmp_path):
    """The report's device line names every GPU behind its rows, the most frequent first; nothing when no row names
    one (the caller then falls back to the raw runs' env.json)."""
    assert speed_tables._devices(tmp_path) == ""
    pd.DataFrame({"device": ["H100", "H200", "H100"], "tokens_per_s": [1, 2, 3]}).to_csv(tmp_path / "rollout.csv",
                                                                                         index=False)
    pd.DataFrame({"device": ["H200", "H200", "H200"], "step_s": [1, 2, 3]}).to_csv(tmp_path / "step.csv", index=False)
    assert speed_tables._devices(tmp_path) == "H200 (4 rows), H100 (2 rows); a ratio never pairs rows of two GPU models"
    (tmp_path / "step.csv").unlink()
    pd.DataFrame({"device": ["H100"], "tokens_per_s": [1]}).to_csv(tmp_path / "rollout.csv", index=False)
    assert speed_tables._devices(tmp_path) == "H100 (1 row)"


def test_bench_rank_zero_is_the_base_alone():
    """``qerl.bench rollout|profile --ranks 0``: the policy without adapters (what the LoRA term costs a decode step
    is the difference to a rank's rows): no trainable parameters, rows labelled "<format> base", fewer profiled
    operations per step than with a rank-8 LoRA on every target; a negative rank names itself."""
    from qerl import bench

    policy, _ = bench._policy("tiny", "nvfp4", 0, "cpu")
    assert not any(p.requires_grad for p in policy.parameters())
    assert policy.qerl["lora"] is None
    policy8, _ = bench._policy("tiny", "nvfp4", 8, "cpu")
    assert any(p.requires_grad for p in policy8.parameters())
    rows = bench.bench_profile(["tiny"], ["nvfp4"], [2], 64, "cpu", ("fused",), steps=2, kv=128, ranks=(0, 8))
    launches = {r["lora_rank"]: r["launches"] for r in rows}
    assert set(launches) == {0, 8} and launches[0] < launches[8]
    (ro,) = bench.bench_rollout(["tiny"], ["nvfp4"], [2], [0], 16, 4, "cpu")
    assert ro["status"] == "ok" and ro["lora_rank"] == 0 and ro["method"] == "NVFP4 base"
    assert ro["generated_tokens"] == 2 * 4
    with pytest.raises(ValueError, match="LoRA rank -1: expected >= 1, or 0 for no adapters"):
        bench._policy("tiny", "nvfp4", -1, "cpu")


def test_every_decode_mode_sets_valid_build_switches(monkeypatch):
    """Each decode mode's switches, while it runs, name a build the CUDA extension accepts (a mode with a misspelled
    value would otherwise fail only on a GPU, mid-run), and a build switch's value reaches the build flags."""
    from qerl import bench
    from qerl.kernels import cuda_fp4 as cf

    monkeypatch.setattr(cf, "_arch_flags", lambda: ["-gencode=arch=compute_90a,code=sm_90a"])  # no GPU here
    for k in cf.BUILD_SWITCHES:
        monkeypatch.delenv(k, raising=False)

    class _S:
        fused = None

    flags = {}
    assert set(bench._DECODE_ENV) <= set(bench.DECODES), set(bench._DECODE_ENV) - set(bench.DECODES)
    for dec in bench.DECODES:
        with bench.decode_mode(_S(), dec):
            flags[dec] = cf._build_flags()  # raises on a value the switch does not know
    assert "-DQFP4_WGMMA_TMA=1" not in flags["fused-no-tma"] and "-DQFP4_WGMMA_TMA=1" in flags["fused"]
    assert "-DQFP4_WGMMA_TAIL=1" in flags["fused-tail"] and "-DQFP4_WGMMA_TAIL=1" in flags["fused"]
    assert "-DQFP4_WGMMA_TAIL=1" not in flags["fused-no-tail"]
    assert "-DQFP4_DENSE_SECTOR=1" in flags["fused-bf16-sector"] and "-DQFP4_DENSE_SECTOR=1" in flags["fused"]
    assert "-DQFP4_DENSE_SECTOR=1" not in flags["fused-bf16-pair"]
    assert "-DQFP4_WGMMA_PDL=1" in flags["fused"] and "-DQFP4_WGMMA_PDL=1" not in flags["fused-s36"]


def test_bench_reuse_rows_per_step_and_pass_on_cpu(tmp_path):
    """``qerl.bench reuse`` on the CPU (tiny preset, GSM8K train prompts through its tokenizer): one row per step and
    one per pass, every pass on the same prompts; session 57's rule (0) builds new buffers whenever the prompt length
    changes, the default (1) only when it grows, so it builds no more often; the environment is restored; a bad pass
    value is refused before anything loads."""
    from qerl import bench

    before = os.environ.get("QERL_SAMPLER_REUSE")
    rows = bench.bench_reuse(["tiny"], ["nvfp4"], 4, 3, 2, 3, "cpu", passes=("0", "1"),
                             sink=lambda r: bench._write_csv(r, tmp_path / "reuse.csv", bench.REUSE_IDENT),
                             max_prompt_tokens=400)
    assert os.environ.get("QERL_SAMPLER_REUSE") == before
    d = pd.read_csv(tmp_path / "reuse.csv")
    assert len(d) == len(rows) == 2 * (4 + 1)
    steps, passes = d[d["kind"] == "step"], d[d["kind"] == "pass"].set_index("reuse")
    assert list(steps.groupby("reuse")["step"].apply(list)) == [[0, 1, 2, 3]] * 2
    lens = steps.groupby("reuse")["prompt_len"].apply(list)
    assert lens[0] == lens[1] and len(set(lens[0])) > 1  # the same draws, and their lengths vary
    changes = 1 + sum(a != b for a, b in zip(lens[0], lens[0][1:], strict=False))
    grows = sum(1 for i, x in enumerate(lens[0]) if x > max(lens[0][:i], default=0))
    assert passes.loc[0, "builds"] == changes and passes.loc[1, "builds"] == grows <= changes
    assert passes.loc[0, "wall_s"] == pytest.approx(steps[steps["reuse"] == 0]["wall_s"].sum())
    raw = tmp_path / "root" / "raw" / "cpu_reuse"
    raw.mkdir(parents=True)
    d.to_csv(raw / "reuse.csv", index=False)
    md = speed_tables.reuse_table(tmp_path / "root", "cpu_reuse", "absent")
    lines = [ln for ln in md.splitlines() if ln.startswith("| 1 ") or ln.startswith("| 2 ")]
    assert "3 prompts x G 2" in md and len(lines) == 2 and "every new length" in lines[0]
    assert lines[0].split("|")[5].strip() == str(changes) and lines[1].endswith(f"| {' '.join(str(int(x)) for x in lens[0])} |")
    assert f"{passes.loc[0, 'wall_s'] / passes.loc[1, 'wall_s']:.3f}x" in lines[0]  # pass 2 is the only later default
    assert speed_tables.reuse_table(tmp_path / "root", "absent") == "_not measured_\n"
    with pytest.raises(ValueError, match=r"reuse pass '2'.*\['0', '1'\]"):
        bench.bench_reuse(["tiny"], ["nvfp4"], 1, 1, 1, 1, "cpu", passes=("2",))
