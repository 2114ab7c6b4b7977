"""``scripts/gpu_bench.sh abk`` (a kernel-level A/B of one wgmma build switch) run on the CPU with a stand-in
``python3`` on PATH: it records every call with the switch's value in its environment and writes profile CSVs whose
times depend on that value, so the test checks which builds were made, which tests ran on which build, the order of
the timed runs, that each run saw its own build's switch, and the gains the real ``benchmarks.ab_compare`` computes."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_bench.sh"

STUB = r"""#!/usr/bin/env bash
echo "${QERL_WGMMA_TMA:-unset}|$*" >> "$STUB_LOG"
case "$1 ${2:-}" in
  "-m benchmarks.wgmma_profile")
    out=""; prev=""
    for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
    mkdir -p "$out"
    us=$([ "$QERL_WGMMA_TMA" = 0 ] && echo 100.0 || echo 80.0)
    printf 'fmt,N,K,M,config,us\nnvfp4,37888,3584,128,"(16, 0, 2, 2)",%s\n' "$us" > "$out/wgmma_profile_h200.csv"
    echo "[prof] nvfp4 37888x3584 M= 128 $us us" ;;
  "-m benchmarks.ab_compare") exec "$REAL_PY" "$@" ;;
  "-m pytest") echo "1 passed in 0.1s" ;;
  "-c "*) echo "pipe 2 build True None" ;;
  *) echo "stub python3: unexpected call: $*" >&2; exit 3 ;;
esac
"""


def _run(tmp_path, mode="abk", stub_text=STUB, **env):
    """``gpu_bench.sh MODE`` with ``stub_text`` as python3 on PATH: (the finished process, the stub's logged calls)."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "python3").write_text(stub_text)
    (stub / "python3").chmod((stub / "python3").stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "calls.txt"
    e = {k: v for k, v in os.environ.items() if not k.startswith("QERL_")}
    e.update(PATH=f"{stub}:{e['PATH']}", STUB_LOG=str(log), REAL_PY=sys.executable, PYTHONPATH=str(REPO),
             OUT=str(tmp_path / "out"), **env)
    work = tmp_path / "work"  # no .whl here: the script installs nothing
    work.mkdir(exist_ok=True)
    p = subprocess.run(["bash", str(SCRIPT), mode], cwd=work, env=e, capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return p, calls


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_abk_builds_tests_and_times_each_build_in_order(tmp_path):
    p, calls = _run(tmp_path, ABK_SWITCH="QERL_WGMMA_TMA", ABK_RUNS="0:1 1:1 1:2 0:2", ABK_TESTS="tma_is_bit_identical")
    assert p.returncode == 0, p.stderr
    builds = sorted(c.split("|")[0] for c in calls if "|-c " in c)
    assert builds == ["0", "1"]  # one build per value, each with its own switch value
    tests = [c for c in calls if "|-m pytest" in c]
    assert len(tests) == 1 and tests[0].startswith("1|") and "-k tma_is_bit_identical" in tests[0]  # not the base
    prof = [(c.split("|")[0], c.split("--out ")[1].split()[0].rsplit("/", 1)[1])
            for c in calls if "benchmarks.wgmma_profile" in c]
    assert prof == [("0", "abk_0_1"), ("1", "abk_1_1"), ("1", "abk_1_2"), ("0", "abk_0_2")]
    assert "--configs tuned --lora 32 --m 64,128,256" in next(c for c in calls if "wgmma_profile" in c)
    ab = (tmp_path / "out" / "ab.md").read_text()
    # 100 us (base 0) against 80 us (build 1) in both passes: +25 %, range +25…+25, two passes
    assert "| 1 | nvfp4 gate\\|up | 128 | (16, 0, 2, 2) | 100.0 | 80.0 | +25.0 % | +25.0…+25.0 | 2 |" in ab


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_abk_takes_the_stsm_switch_and_times_the_plain_products_with_abk_lora_0(tmp_path):
    """QERL_WGMMA_STSM (session 72's epilogue experiment) is an A/B abk runs; ABK_LORA=0 times the products without a
    LoRA term (as issue 10's layer table does), the default a rank-32 term."""
    stub = STUB.replace('echo "${QERL_WGMMA_TMA:-unset}|$*"', 'echo "${QERL_WGMMA_STSM:-unset}|$*"')
    p, calls = _run(tmp_path, stub_text=stub, ABK_SWITCH="QERL_WGMMA_STSM", ABK_LORA="0", ABK_TESTS="wgmma")
    assert p.returncode == 0, p.stderr
    assert sorted(c.split("|")[0] for c in calls if "|-c " in c) == ["0", "1"]
    assert [c.split("|")[0] for c in calls if "|-m pytest" in c] == ["1"]
    prof = [c for c in calls if "benchmarks.wgmma_profile" in c]
    assert [c.split("|")[0] for c in prof] == ["0", "1", "1", "0"]
    assert all("--configs tuned --lora 0 --m 64,128,256" in c for c in prof), prof


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_abk_tests_only_the_builds_abk_tested_names(tmp_path):
    """ABK_TESTED (for tests that set the switch themselves) runs the tests on the named build only; every value is
    still built once and timed in RUNS' order."""
    p, calls = _run(tmp_path, ABK_SWITCH="QERL_WGMMA_TMA", ABK_RUNS="1:1 0:1 0:2 1:2",
                    ABK_TESTED="0", ABK_TESTS="tma_is_bit_identical")
    assert p.returncode == 0, p.stderr
    assert sorted(c.split("|")[0] for c in calls if "|-c " in c) == ["0", "1"]
    tests = [c for c in calls if "|-m pytest" in c]
    assert len(tests) == 1 and tests[0].startswith("0|") and "-k tma_is_bit_identical" in tests[0]
    prof = [c.split("|")[0] for c in calls if "benchmarks.wgmma_profile" in c]
    assert prof == ["1", "0", "0", "1"]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_tail_builds_tests_and_times_the_tail_splits_twice(tmp_path):
    """``tail`` (session 50): the default (tail) and QERL_WGMMA_TAIL=0's builds at once, the tail-split GPU tests on
    the default build (they set the switch themselves), then two passes of the 7B products at their tuned grid configs
    and tail splits; with TAIL=roll one NVFP4 rollout process alternating fused-no-tail / fused and back."""
    stub = STUB.replace('echo "${QERL_WGMMA_TMA:-unset}|$*"', 'echo "${QERL_WGMMA_TAIL:-unset}|$*"')
    p, calls = _run(tmp_path, "tail", stub)
    assert p.returncode == 0, p.stderr
    assert sorted(c.split("|")[0] for c in calls if "|-c " in c) == ["0", "unset"]
    tests = [c for c in calls if "|-m pytest" in c]
    assert len(tests) == 1 and tests[0].startswith("unset|") and "-k tail_split" in tests[0]
    prof = [c for c in calls if "benchmarks.wgmma_profile" in c]
    assert [c.split("|")[0] for c in prof] == ["unset", "unset"]
    assert all("--configs tail --lora 32 --m 64,128,256" in c for c in prof)
    assert [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in prof] == ["tail_1", "tail_2"]
    (tmp_path / "roll").mkdir()
    p, calls = _run(tmp_path / "roll", "tail", stub, TAIL="roll", TAIL_M="512")
    assert p.returncode == 0, p.stderr
    assert not [c for c in calls if "wgmma_profile" in c]
    roll = [c for c in calls if "|-m qerl.bench rollout" in c]
    assert len(roll) == 1 and roll[0].startswith("unset|")
    assert "--decode fused-no-tail,fused,fused,fused-no-tail " in roll[0]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_abk_refuses_an_unknown_switch_before_building(tmp_path):
    p, calls = _run(tmp_path, ABK_SWITCH="QERL_WGMMA_PIPE")  # build() pins the pipe: not an A/B this mode can run
    assert p.returncode == 2
    assert "ABK_SWITCH='QERL_WGMMA_PIPE'; valid: QERL_WGMMA_TMA, QERL_WGMMA_LORA, QERL_WGMMA_STSM" in p.stderr
    assert not [c for c in calls if "|-c " in c or "wgmma_profile" in c]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_next43_reads_both_bf16_patterns_then_ab_tests_pdl_at_batch_8(tmp_path):
    """``next43``: the HBM pattern benchmark over the FP4 layout and both BF16 load patterns, then one BF16 rollout
    process at batch 8 alternating the default and the GEMV under PDL (A B B A)."""
    p, calls = _run(tmp_path, "next43", '#!/usr/bin/env bash\necho "$*" >> "$STUB_LOG"\n')
    assert p.returncode == 0, p.stderr
    hbm = [c for c in calls if c.startswith("-m benchmarks.hbm_pattern_bench")]
    roll = [c for c in calls if c.startswith("-m qerl.bench rollout")]
    assert len(hbm) == 1 and "--patterns fp4,bf16-pair,bf16-sector" in hbm[0]
    assert len(roll) == 1 and "--formats bf16 --batch 8" in roll[0]
    assert "--decode fused,fused-bf16-pdl,fused-bf16-pdl,fused " in roll[0]
    assert calls.index(hbm[0]) < calls.index(roll[0])


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
@pytest.mark.parametrize("ablate", [None, "2,3,8,10"])
def test_lora44_builds_each_ablation_variant_then_times_them_twice(tmp_path, ablate):
    """``lora44``: the default build and one timing-only module per QFP4_LORA_ABLATE variant (1,2,3,4 unless ABLATE
    names others), then two passes of lora_gemv_bench over exactly those variants."""
    env = {} if ablate is None else {"ABLATE": ablate}
    p, calls = _run(tmp_path, "lora44", '#!/usr/bin/env bash\necho "x|$*" >> "$STUB_LOG"\n', **env)
    assert p.returncode == 0, p.stderr
    want = (ablate or "1,2,3,4").split(",")
    built = sorted(c.split("wa.module(")[1].split(",")[0] for c in calls if "wa.module(" in c)
    assert built == sorted(want)
    timed = [c for c in calls if "-m benchmarks.lora_gemv_bench" in c]
    assert len(timed) == 2 and all(f"--ablate {','.join(want)} " in c for c in timed)
    assert [c.split("--out ")[1].split()[0].rsplit("/", 1)[1] for c in timed] == ["lora_1", "lora_2"]


REGRESS_STUB = r"""#!/usr/bin/env bash
echo "x|$*" >> "$STUB_LOG"
printf '%s\0' "$@" > "$STUB_LOG.args"
echo "tests/test_x.py::test_gpu_y PASSED [100%]"
echo "============ 1 passed in 0.1s ============"
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_regress_parts_cover_every_gpu_test_once(tmp_path):
    """``regress``: each PART runs one pytest -v over its share of the GPU tests (PART=2 and all after the builds the
    wgmma tests compare against, all at once), and the three shares, collected by
    the real pytest on this repository, are every GPU test exactly once -- the tests PART=all (the default) runs. A
    PART that is not one names the choices."""
    parts = {}
    for part in ("1", "2", "3"):
        p, calls = _run(tmp_path, "regress", REGRESS_STUB, PART=part)
        assert p.returncode == 0, p.stderr
        assert len([c for c in calls if "|-m pytest" in c]) == 1
        # PART=2 first builds the default, QERL_WGMMA_TMA=0's and QERL_WGMMA_TAIL=0's (the wgmma tests' references)
        assert len([c for c in calls if "|-c " in c]) == (3 if part == "2" else 0)
        args = (tmp_path / "calls.txt.args").read_bytes().decode().split("\0")[:-1]
        assert args[:5] == ["-m", "pytest", "-v", "-m", "gpu"]
        parts[part] = args[5:]
        (tmp_path / "calls.txt").unlink()
        log = (tmp_path / "out" / "log.txt").read_text()
        assert "tests finished: 1" in log and "1 passed" in log
        assert (tmp_path / "out" / f"tests_regress_{part}.txt").exists()
    bad, _ = _run(tmp_path, "regress", REGRESS_STUB, PART="4")
    assert bad.returncode == 2 and "PART=4" in bad.stderr and "all, 1, 2 or 3" in bad.stderr
    whole, calls = _run(tmp_path, "regress", REGRESS_STUB)  # PART unset: every file in one run
    assert whole.returncode == 0, whole.stderr
    parts["all"] = (tmp_path / "calls.txt.args").read_bytes().decode().split("\0")[:-1][5:]
    assert parts["all"][0] == "tests" and (tmp_path / "out" / "tests_regress_all.txt").exists()

    def collect(args):  # the part's own pytest arguments, collecting only
        return subprocess.Popen([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *args],
                                cwd=REPO, stdout=subprocess.PIPE, text=True)

    runs = {k: collect(v) for k, v in parts.items()}  # at once
    ids = {k: [line for line in r.communicate()[0].splitlines() if "::" in line] for k, r in runs.items()}
    shares = ids["1"] + ids["2"] + ids["3"]
    assert all(ids[k] for k in ("1", "2", "3")) and len(ids["all"]) > 50
    assert sorted(shares) == sorted(ids["all"])  # every GPU test, none twice
    assert all("wgmma" in t for t in ids["2"]) and all(t.startswith("tests/test_cuda_fp4.py") for t in ids["1"])


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_row32_builds_beside_the_32b_rollout_then_profiles_each_rank(tmp_path):
    """``row32`` (session 57): the extension's build started in the background before the 32B NVFP4 batch-8 rollout
    (256 + 2048, a warm-up pass and a timed one), then one profile process per ROW32_RANKS entry, rank 32 first."""
    # the build takes a second and logs its end: the rollout must start before it, and the profiles after it
    stub = STUB.replace('"-c "*) echo "pipe 2 build True None" ;;',
                        '"-c "*) sleep 1; echo "built" >> "$STUB_LOG"; echo "pipe 2 build True None" ;;')
    p, calls = _run(tmp_path, "row32", stub)
    assert p.returncode == 0, p.stderr
    kinds = [("build" if "|-c " in c else "built" if c == "built" else "rollout" if "qerl.bench rollout" in c else
              "profile" if "qerl.bench profile" in c else c) for c in calls]
    assert sorted(kinds[:2]) == ["build", "rollout"] and kinds[2:] == ["built", "profile", "profile"], kinds
    roll = calls[kinds.index("rollout")]
    assert "--models 32b --formats nvfp4 --batch 8 --prompt 256 --new 2048 --decode fused,fused" in roll
    assert [c.split("--ranks ")[1].split()[0] for c in calls[3:]] == ["32", "0"]
    assert all("--models 32b" in c and "--batch 8" in c for c in calls[3:])
    (tmp_path / "one").mkdir()
    p, calls = _run(tmp_path / "one", "row32", ROW32_RANKS="0")
    assert p.returncode == 0, p.stderr
    assert [c.split("--ranks ")[1].split()[0] for c in calls if "qerl.bench profile" in c] == ["0"]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_ends_builds_beside_the_first_rollout_then_tests_profiles_and_the_other_formats(tmp_path):
    """``ends`` (session 58): the build in the background beside the 7B NVFP4 A/B (old / new / new / old), then, once
    it has ended, the fused step's GPU tests, the profiles of both steps, and the MXFP4 / BF16-LoRA A/B."""
    stub = STUB.replace('"-c "*) echo "pipe 2 build True None" ;;',
                        '"-c "*) sleep 1; echo "built" >> "$STUB_LOG"; echo "pipe 2 build True None" ;;')
    p, calls = _run(tmp_path, "ends", stub)
    assert p.returncode == 0, p.stderr
    kinds = [("build" if "|-c " in c else "built" if c == "built" else "rollout" if "qerl.bench rollout" in c else
              "profile" if "qerl.bench profile" in c else "tests" if "-m pytest" in c else c) for c in calls]
    assert sorted(kinds[:2]) == ["build", "rollout"] and kinds[2:] == ["built", "tests", "profile", "rollout"], kinds
    first, last = (c for c in calls if "qerl.bench rollout" in c)
    ab = "--decode fused-torch-ends,fused,fused,fused-torch-ends"
    assert "--models 7b --formats nvfp4 --batch 8,2 --prompt 256 --new 2048 " + ab in first
    assert "--models 7b --formats mxfp4,bf16 --batch 8 --prompt 256 --new 2048 " + ab in last
    assert "--decode fused,fused-torch-ends" in calls[kinds.index("profile")]
    assert "step_ends" in calls[kinds.index("tests")]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_rope_builds_beside_the_first_rollout_then_tests_profiles_and_the_reuse_bench(tmp_path):
    """``rope`` (session 59): the build in the background beside the 7B NVFP4 A/B (old / new / new / old), then, once
    it has ended, the fused step's GPU tests (the new ones among them), the profiles of both steps, and the buffer-reuse
    bench with its passes in order; ``rope32`` the 32B A/B beside the build, then 14B and the other formats."""
    stub = STUB.replace('"-c "*) echo "pipe 2 build True None" ;;',
                        '"-c "*) sleep 1; echo "built" >> "$STUB_LOG"; echo "pipe 2 build True None" ;;')
    p, calls = _run(tmp_path, "rope", stub)
    assert p.returncode == 0, p.stderr
    kinds = [("build" if "|-c " in c else "built" if c == "built" else "rollout" if "qerl.bench rollout" in c else
              "profile" if "qerl.bench profile" in c else "tests" if "-m pytest" in c else
              "reuse" if "qerl.bench reuse" in c else c) for c in calls]
    assert sorted(kinds[:2]) == ["build", "rollout"] and kinds[2:] == ["built", "tests", "profile", "reuse"], kinds
    ab = "--decode fused,fused-rope-in-split,fused-rope-in-split,fused"
    assert "--models 7b --formats nvfp4 --batch 8,2 --prompt 256 --new 2048 " + ab in calls[kinds.index("rollout")]
    assert "--decode fused-rope-in-split,fused" in calls[kinds.index("profile")]
    assert all(k in calls[kinds.index("tests")] for k in ("rope_in_the_attention", "graphs_replayed", "graph_captures"))
    assert "--passes 0,1,1,0" in calls[kinds.index("reuse")]
    (tmp_path / "r32").mkdir()
    p, calls = _run(tmp_path / "r32", "rope32", stub)
    assert p.returncode == 0, p.stderr
    rolls = [c for c in calls if "qerl.bench rollout" in c]
    assert [c.split("--models ")[1].split()[0] for c in rolls] == ["32b", "14b", "7b"] and all(ab in c for c in rolls)
    assert calls.index(rolls[0]) < 2 < calls.index("built") + 1 < calls.index(rolls[1]) + 1  # 32B beside the build


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_ncu32_profiles_the_small_products_gemv_launches(tmp_path):
    """``ncu32``: the build, then Nsight Compute (found on PATH) over ``lora_gemv_bench --ncu`` for the 32B small
    products at M = 8 (q|k|v, o, and gate|up to compare), only the FP4 GEMV kernels; NCU_LINEARS / NCU_M override."""
    stub = '#!/usr/bin/env bash\necho "py|$*" >> "$STUB_LOG"\n'
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ncu").write_text('#!/usr/bin/env bash\necho "ncu|$*" >> "$STUB_LOG"\n')
    (tmp_path / "bin" / "ncu").chmod(0o755)
    p, calls = _run(tmp_path, "ncu32", stub)
    assert p.returncode == 0, p.stderr
    assert "py|-c " in calls[0] and len(calls) == 2, calls  # the build first, then the profile
    ncu = calls[1]
    assert ncu.startswith("ncu|") and "--kernel-name regex:fp4_gemv " in ncu and "--section WarpStateStats" in ncu
    assert "python3 -m benchmarks.lora_gemv_bench --ncu --models 32b --m 8 --fmts nvfp4 --linears q|k|v,o,gate|up" in ncu
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "bin").mkdir()
    (tmp_path / "again" / "bin" / "ncu").write_text((tmp_path / "bin" / "ncu").read_text())
    (tmp_path / "again" / "bin" / "ncu").chmod(0o755)
    p, calls = _run(tmp_path / "again", "ncu32", stub, NCU_LINEARS="o", NCU_M="2")
    assert p.returncode == 0 and "--m 2 --fmts nvfp4 --linears o" in calls[1], (p.stderr, calls)


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_tune32_tunes_the_32b_linears_then_ab_tests_the_table_in_the_rollout(tmp_path):
    """``tune32``: the build, the tuner on the 32B linears at M = 8 with rank 32 writing the table, then one 32B
    rollout process with the table (fused) and the heuristic alternating, A B B A."""
    stub = '#!/usr/bin/env bash\necho "py|$*" >> "$STUB_LOG"\n'
    p, calls = _run(tmp_path, "tune32", stub)
    assert p.returncode == 0, p.stderr
    assert "py|-c " in calls[0] and len(calls) == 3, calls
    assert "-m benchmarks.gemv_tune --models 32b --fmts nvfp4 --m 8 --ranks 32" in calls[1]
    assert calls[1].endswith("--write-table")
    assert "-m qerl.bench rollout --models 32b --formats nvfp4 --batch 8 --prompt 256 --new 2048" in calls[2]
    assert "--decode fused,fused-heuristic-gemv,fused-heuristic-gemv,fused" in calls[2]


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_tune32ab_ab_tests_the_installed_table_at_14b_and_32b(tmp_path):
    """``tune32ab``: the build, then one rollout process at 14B batch 8 and one at 32B batch 2 and 8, each with the
    installed table (fused) and the rule alternating, A B B A."""
    stub = '#!/usr/bin/env bash\necho "py|$*" >> "$STUB_LOG"\n'
    p, calls = _run(tmp_path, "tune32ab", stub)
    assert p.returncode == 0, p.stderr
    assert "py|-c " in calls[0] and len(calls) == 3, calls
    ab = "--decode fused,fused-heuristic-gemv,fused-heuristic-gemv,fused"
    assert "--models 14b --formats nvfp4 --batch 8 --prompt 256 --new 2048 " + ab in calls[1]
    assert "--models 32b --formats nvfp4 --batch 2,8 --prompt 256 --new 2048 " + ab in calls[2]


DQ_STUB = r"""#!/usr/bin/env bash
echo "${QERL_CUDA_GEMV:-unset}|$*" >> "$STUB_LOG"
case "$1 ${2:-}" in
  "-m pytest") [ -n "${STUB_FAIL:-}" ] && echo "1 failed, 3 passed in 0.1s" || echo "4 passed in 0.1s" ;;
  "-m benchmarks.dq_gemm_bench") echo "| 7b | bwd | nvfp4 | 512 | 1.0 |" ;;
  "-m benchmarks.dq_probe") echo probed ;;
  "-c "*) echo "build True None" ;;
  *) echo "stub python3: unexpected call: $*" >&2; exit 3 ;;
esac
"""


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
@pytest.mark.parametrize("mode", ["dq", "dqlean"])
def test_dq_modes_build_test_and_bench_and_dqlean_leaves_the_default_extension_out(tmp_path, mode):
    """``dq``: the default extension's build beside the dq one, the dq GPU tests, the bench over both formats and every
    split count, installing its table. ``dqlean``: no default build, every step with QERL_CUDA_GEMV=0 (the tests'
    oracle is pure torch; the bench's prev column the Triton path), NVFP4 and kz 0 (stream-K), 1, 2, 4 unless set. A failed test
    runs the probe, a passing one does not."""
    p, calls = _run(tmp_path, mode, DQ_STUB)
    assert p.returncode == 0, p.stderr
    builds = [c for c in calls if "|-c " in c]
    assert any("cuda_dq" in c for c in builds)
    assert any("cuda_fp4" in c for c in builds) == (mode == "dq"), builds
    assert {c.split("|")[0] for c in calls} == ({"unset"} if mode == "dq" else {"0"}), calls
    (t,) = [c for c in calls if "-m pytest" in c]
    assert "tests/test_cuda_dq.py" in t and "-m gpu" in t
    (b,) = [c for c in calls if "dq_gemm_bench" in c]
    want = "--fmts nvfp4,mxfp4 --ops bwd,fwd --m 512,2048 --kz 0,1,2,3,4,6,8" if mode == "dq" else \
        "--fmts nvfp4 --ops bwd,fwd --m 512,2048 --kz 0,1,2,4"
    assert want in b and "--write-table" in b, b
    assert not any("dq_probe" in c for c in calls)
    assert "4 passed" in (tmp_path / "out" / "log.txt").read_text()
    (tmp_path / "f").mkdir()
    p, calls = _run(tmp_path / "f", mode, DQ_STUB, STUB_FAIL="1", DQ_FMTS="mxfp4")
    assert p.returncode == 0, p.stderr
    assert sum("dq_probe" in c for c in calls) == 1 and "--fmts mxfp4 " in next(c for c in calls if "dq_gemm" in c)


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_dqablate_builds_every_ablation_then_benches_each_and_sweeps_the_wgmma_gemm(tmp_path):
    """``dqablate``: the default build and one dq build per QERL_DQ_ABLATE value (0 1 2 3 4) at once, the bench per
    value (NVFP4, 7B, M 2048, kz 1, no table) into its own folder, then the wgmma sweep at large M on the kernels'
    layout with no table installed; everything in $OUT/abl.tgz."""
    stub = ('#!/usr/bin/env bash\necho "${QERL_DQ_ABLATE:-unset}|$*" >> "$STUB_LOG"\n'
            'case "$1 ${2:-}" in "-m benchmarks.cuda_gemm_bench") mkdir -p "${@: -1}"; echo "| x |" ;; '
            '"-m benchmarks.dq_gemm_bench") echo "| 7b | fwd |" ;; *) echo "build True None" ;; esac\n')
    p, calls = _run(tmp_path, "dqablate", stub)
    assert p.returncode == 0, p.stderr
    builds = [c for c in calls if "|-c " in c]
    assert sum("cuda_fp4" in c for c in builds) == 1
    assert sorted(c.split("|")[0] for c in builds if "cuda_dq" in c) == ["0", "1", "2", "3", "4"]
    benches = [c for c in calls if "dq_gemm_bench" in c]
    assert [c.split("|")[0] for c in benches] == ["0", "1", "2", "3", "4"]
    for c in benches:
        v = c.split("|")[0]
        assert "--fmts nvfp4 --ops bwd,fwd --m 2048 --kz 1 --out" in c and c.endswith(f"/abl/{v}"), c
        assert "--write-table" not in c
    (sw,) = [c for c in calls if "cuda_gemm_bench" in c]
    assert "--prev-layout kernel --sweep-m 512,1024,2048 --m 512,1024,2048" in sw and "--write-table" not in sw
    assert (tmp_path / "out" / "abl.tgz").exists()
    (tmp_path / "lean").mkdir()  # DQABL_SWEEP_SECS=0: the ablations alone, without the default build
    p, calls = _run(tmp_path / "lean", "dqablate", stub, DQABL_SWEEP_SECS="0", DQABL="0 1")
    assert p.returncode == 0, p.stderr
    assert not any("cuda_fp4" in c or "cuda_gemm_bench" in c for c in calls), calls
    assert [c.split("|")[0] for c in calls if "dq_gemm_bench" in c] == ["0", "1"]
    assert (tmp_path / "lean" / "out" / "abl.tgz").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_dqdecode_builds_tests_and_benches_both_decodes(tmp_path):
    """``dqdecode``: both QERL_DQ_DECODE builds at once (no default build: QERL_CUDA_GEMV=0), then per decode its GPU
    tests and the bench (both formats, both ops, M 512 and 2048, kz 0 1 2, no table) into its own folder."""
    stub = ('#!/usr/bin/env bash\necho "${QERL_DQ_DECODE:-unset}|${QERL_CUDA_GEMV:-unset}|$*" >> "$STUB_LOG"\n'
            'case "$1 ${2:-}" in "-m pytest") echo "4 passed in 0.1s" ;; *) echo "| x |" ;; esac\n')
    p, calls = _run(tmp_path, "dqdecode", stub)
    assert p.returncode == 0, p.stderr
    assert {c.split("|")[1] for c in calls} == {"0"}
    builds = [c for c in calls if "|-c " in c]
    assert sorted(c.split("|")[0] for c in builds) == ["exact", "mma"] and all("cuda_dq" in c for c in builds)
    runs = [c for c in calls if "|-c " not in c]
    assert [(c.split("|")[0], "-m pytest" in c) for c in runs] == [("exact", True), ("exact", False), ("mma", True),
                                                                 ("mma", False)]
    for c in runs:
        if "-m pytest" in c:
            assert "-m gpu tests/test_cuda_dq.py" in c
        else:
            d = c.split("|")[0]
            assert "--fmts nvfp4,mxfp4 --ops bwd,fwd --m 512,2048 --kz 0,1,2" in c and c.endswith(f"dec_{d}"), c
            assert "--write-table" not in c
    log = (tmp_path / "out" / "log.txt").read_text()
    assert "exact: 4 passed" in log and "mma: 4 passed" in log


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_dqvar_runs_the_dequant_variants_bench_and_logs_its_table(tmp_path):
    """``dqvar``: no extension build, one ``benchmarks.dequant_variants`` process into $OUT/dqvar (DQVAR_VARIANTS picks
    the variants, DQVAR_PASSES the passes), its table appended to the log."""
    stub = r"""#!/usr/bin/env bash
echo "py|$*" >> "$STUB_LOG"
out=""; prev=""
for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
mkdir -p "$out" && printf '| fmt | linear |\n| nvfp4 | gate_proj |\n' > "$out/dequant_variants.md"
"""
    p, calls = _run(tmp_path, "dqvar", stub)
    assert p.returncode == 0, p.stderr
    assert calls == [f"py|-m benchmarks.dequant_variants --passes 5 --out {tmp_path / 'out' / 'dqvar'}"], calls
    assert "| nvfp4 | gate_proj |" in (tmp_path / "out" / "log.txt").read_text()
    p, calls = _run(tmp_path, "dqvar", stub, DQVAR_VARIANTS="vec,lines", DQVAR_PASSES="3")
    assert p.returncode == 0, p.stderr
    assert calls[-1] == f"py|-m benchmarks.dequant_variants --passes 3 --variants vec,lines --out {tmp_path / 'out' / 'dqvar'}"


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_next72_builds_two_runs_the_variants_the_stsm_tests_and_ab(tmp_path):
    """``next72``: the default and STSM builds (in the background) beside the dequantization variants, then the STSM
    GPU tests on the STSM build, the plain tuned products at 64-512 tokens in STSM 0 1 1 0 order with their
    comparison; the archive written after each phase (a call cut short keeps what it has)."""
    stub = STUB.replace('echo "${QERL_WGMMA_TMA:-unset}|$*"', 'echo "${QERL_WGMMA_STSM:-0},${QERL_GEMM_KZ:-0}|$*"')
    stub = stub.replace('''  "-m pytest") echo "1 passed in 0.1s" ;;''', '''  "-m pytest") echo "1 passed in 0.1s" ;;
  "-m benchmarks.dequant_variants") echo "[dqvar] stub" ;;''')
    p, calls = _run(tmp_path, "next72", stub)
    assert p.returncode == 0, p.stderr
    assert sorted(c.split("|")[0] for c in calls if "|-c " in c) == ["0,0", "1,0"]  # default, STSM
    rest = [c for c in calls if "|-c " not in c]
    assert "-m benchmarks.dequant_variants --passes 5 --out" in rest[0]
    assert rest[1].startswith("1,0|-m pytest") and "-k stsm" in rest[1]
    prof = rest[2:6]
    assert [c.split("|")[0] for c in prof] == ["0,0", "1,0", "1,0", "0,0"]
    assert all("benchmarks.wgmma_profile --configs tuned --lora 0 --m 64,128,256,512" in c for c in prof), prof
    assert "-m benchmarks.ab_compare" in rest[6] and "--prefix abk --base 0" in rest[6] and len(rest) == 7
    assert (tmp_path / "out" / "ab.md").exists()
    import tarfile
    with tarfile.open(tmp_path / "out" / "next72.tgz") as tf:
        names = tf.getnames()
    assert "ab.md" in names and "log.txt" in names and any(n.startswith("abk_") for n in names), names
