#!/usr/bin/env bash
# The GPU measurements behind results/speed/ (run on an H100 from the repo root). CSV rows land in $OUT (default
# results/speed) one at a time, so a run cut short keeps what it measured; the log goes to $OUT/log.txt.
#   scripts/gpu_bench.sh core    GPU tests + memory (7B) + rollout (7B, 4 formats, batch 8/2, fused and unfused
#                                decode) + decode-step profile + CUDA GEMV vs Triton vs BF16 per layer
#   scripts/gpu_bench.sh step    E2E GRPO step 7B (4 formats, batch 8, GC on/off) + 32B NVFP4/BF16 step (GC)
#   scripts/gpu_bench.sh large   rollout 14B/32B (4 formats, batch 8/2)
#   scripts/gpu_bench.sh small   rollout 3B (4 formats) + LoRA-rank sweep 7B (Table 9)
#   scripts/gpu_bench.sh gemm    issue 10: CUDA GEMM tests, tuning sweep (the mma.sync kernel and, on sm_90, the wgmma
#                                kernel with its CTA splits; installs the tuned table into the tree and $OUT: copy it
#                                back into qerl/kernels/tuned/), layer table, 7B rollouts at 16-256 sequences (NVFP4,
#                                BF16; 16 = warm-up). The sweep took about a minute for both formats on an H100 (s30)
#   scripts/gpu_bench.sh pipe    issue 10: the wgmma GEMM's opt-in main loop (QERL_WGMMA_PIPE=2: two chunks of MMAs in
#                                flight) against the default: both builds, the wgmma GPU tests with each (LoRA epilogue
#                                included), the layer table of each at the installed table's configurations (1, 2, 1:
#                                drift shows), pipe 2's own sweep ($OUT/pipe2s, not installed); ~5 min
#   scripts/gpu_bench.sh abroll  7B rollouts at 16-256 sequences (16 = warm-up), one process each: NVFP4, NVFP4 with
#                                QERL_WGMMA_PIPE=2, NVFP4 with QERL_WGMMA_LORA=1 (LoRA in the wgmma GEMM's epilogue),
#                                BF16-LoRA ($OUT/roll_*); ~5 min, after `pipe` on the same machine (builds cached)
#   scripts/gpu_bench.sh prof    issue 10: both builds (pipes 1 and 2), the wgmma GPU tests with each, the tuning sweep
#                                with each pipe ($OUT/sweep1, $OUT/sweep2; each installs its table for its own layer
#                                table, pipe 2's last), then bytes and FLOPs per wgmma configuration against time
#                                (benchmarks.wgmma_profile, pipe 2: $OUT/prof); ~8-9 min
#   scripts/gpu_bench.sh ncu     Nsight Compute on the 7B gate|up wgmma GEMM at M = 128 (NCU_CONFIGS), pipe 2, with
#                                each section's details (the warp stall reasons: what session 32's profile lacked) and
#                                the sampled stalls per source line ($OUT/prof/ncu_*.txt); builds first (~5 min cold)
#   scripts/gpu_bench.sh tune    issue 10, the default build: the CUDA FP4 GPU tests, the tuning sweep (installs the table
#                                into the tree and $OUT/sweep: copy it back into qerl/kernels/tuned/), the layer table,
#                                bytes and FLOPs per wgmma configuration ($OUT/prof); ~6 min (SKIP_TESTS=1: no tests;
#                                SKIP_PROF=1: no profile)
#   scripts/gpu_bench.sh roll    7B rollouts at 16-256 sequences (16 = warm-up): NVFP4, NVFP4 with QERL_WGMMA_LORA=1,
#                                BF16-LoRA ($OUT/roll_*; ROLLS="nvfp4:1 bf16:0" picks), then the realistic GRPO step
#                                (as `grpo`; GRPO_LORA=1: with QERL_WGMMA_LORA=1); ~8 min
#   scripts/gpu_bench.sh decode  issue 11: GEMV/LoRA/fused-decode GPU tests, 7B rollouts at batch 8/2 (256 + 2048) with
#                                base + LoRA in one launch and split (same run), decode-step profiles (MODELS=7b)
#   scripts/gpu_bench.sh attn    decode attention: the GPU tests of the fused decode step (the CUDA kernel's among
#                                them), the sweep of the CUDA kernel against the Triton split kernel (benchmarks.attn_bench:
#                                ring stages, split targets; $OUT/attn), 7B rollouts at 64-256 sequences (256 + 512) with
#                                each in one process (FORMATS="nvfp4 bf16"; $OUT/roll_big), 7B NVFP4 at batch 8 and 2
#                                (256 + 2048, $OUT/roll_b8); ~7 min
#   scripts/gpu_bench.sh bf16    issue 11, the BF16 baseline's decode GEMV: its GPU tests and the fused decode's
#                                ($OUT/tests_bf16.txt; SKIP_TESTS=1 skips), the launch tuner for the BF16 products
#                                (installs its table; $OUT/tune), 7B rollouts at batch 8 and 2 (256 + 512) alternating
#                                cuBLAS / the GEMV / the GEMV by the heuristic / the GEMV under PDL in one process
#                                ($OUT/roll_ab), issue 11's BF16 rows (256 + 2048, $OUT/roll_b8), the per-layer table
#                                (7B: cuBLAS and the GEMV; $OUT/bench); ~8 min
#   scripts/gpu_bench.sh bf16pdl PDL for the BF16 GEMV by batch (PDL_BATCHES, 7B, 256 + 512: cuBLAS, never, always, auto
#                                alternating in one process; $OUT/roll_pdl), decode-step profiles of BF16 and NVFP4 at
#                                batch 8 ($OUT/prof), issue 11's BF16 rows ($OUT/roll_b8); ~6 min
#   scripts/gpu_bench.sh bf16tune the BF16 GEMV's launch tuner on another GPU (the rule against the best; installs the
#                                table: copy $OUT/tune/*.json into qerl/kernels/tuned/), 7B rollouts cuBLAS / table /
#                                rule alternating at batch 8 and 2 ($OUT/roll_ab); ~5 min
#   scripts/gpu_bench.sh loraa   issue 10 / 13: the LoRA term at 17-64 sequences — session 35's path (x·Aᵀ by cuBLAS,
#                                an addmm: fused-cublas-lora), the default (x·Aᵀ by the Triton kernel, the term in the
#                                mma.sync GEMM's epilogue: fused), the GEMM under PDL overlapping the x·Aᵀ kernel
#                                (fused-gemm-lora-pdl): their GPU tests, decode-step profiles at 32 sequences
#                                ($OUT/prof), 7B NVFP4 rollouts at 32 and 64 sequences, the three alternating
#                                ($OUT/roll_loraa); ~7 min
#   scripts/gpu_bench.sh wgpdl   issue 10: the LoRA term at 64-256 sequences — session 36's default (x·Aᵀ by cuBLAS above
#                                64, the wgmma GEMM's epilogue: fused-s36; `fused` when session 37 ran it), x·Aᵀ by the
#                                Triton kernel up to 256 (fused-lora-a-256),
#                                the wgmma GEMM under PDL overlapping the x·Aᵀ launch (fused-wgmma-lora-pdl, its own
#                                build), both (fused-wgmma-lora-pdl-a-256): the GPU tests, 7B NVFP4 rollouts at 64, 128
#                                and 256 sequences, the four alternating twice ($OUT/roll_wgpdl); ~8-9 min (the
#                                steps' timeouts sum to the device's 10-minute limit with the two builds)
#   scripts/gpu_bench.sh cmp     issue 10 with the defaults: the LoRA-path GPU tests, 7B rollouts NVFP4 and BF16-LoRA at
#                                16 (warm-up), 32, 64, 128 and 256 sequences in one process, the default (fused) and
#                                session 36's (fused-s36) alternating ($OUT/roll_cmp), then the realistic GRPO step
#                                (as `grpo`, $OUT/grpo); session 37's run hit the 10-minute limit in the step's
#                                second format: SKIP_TESTS=1 skips the tests (~150 s)
#   scripts/gpu_bench.sh prof128 issue 10 after session 37: where the 7B decode step at 128 and 256 sequences spends its
#                                GPU time, NVFP4 and BF16-LoRA with the defaults ($OUT/prof; the remaining gap at 128 is
#                                1.07x against the 1.3x target), after the wgmma PDL GPU test session 37 changed
#                                without a GPU and the GEMM tests on the shared graph-replay helper
#                                ($OUT/tests_prof128.txt); ~6 min
#   scripts/gpu_bench.sh perm    issue 10, session 38: the wgmma GEMM's tokens written in its K permutation by the
#                                norm / SwiGLU / attention launch before it (the default) against session 37's permute
#                                launch (fused-s37): the GPU tests, 7B NVFP4 rollouts at 64-256 sequences alternating
#                                twice ($OUT/roll_perm), then (LORA_A=1) benchmarks.lora_a_bench --quick; ~8 min
#   scripts/gpu_bench.sh tableab 7B NVFP4 rollouts at 16-256 sequences (16 = warm-up) with the installed tuned GEMM table
#                                and with TABLE_OLD (a JSON file), one process each, new/old/new/old ($OUT/roll_tab_*)
#   scripts/gpu_bench.sh cmp38   issue 10 after session 38's call 2: the permuted-input GPU test again, the x·Aᵀ
#                                sweep (benchmarks.lora_a_bench --quick, $OUT/lora_a), 7B NVFP4 vs BF16-LoRA rollouts
#                                at 16 (warm-up) to 256 sequences, one pass ($OUT/roll_cmp); ~7 min
#   scripts/gpu_bench.sh next38  issue 10 after session 38: its opt-ins GPU-tested (x·Aᵀ under PDL itself,
#                                QERL_LORA_A_PDL=1; the permuted copy in 16-byte stores, QERL_PERMUTE_STORE=vector;
#                                ~6-8 min); NEXT38=roll: 7B NVFP4 rollouts at 16-256 sequences, the default, each and
#                                both, twice, the second pass reversed ($OUT/roll_next38; ~8 min; session 37's 32 such
#                                runs: 270 s)
#   scripts/gpu_bench.sh cmp39   issue 10 after session 39's call 2 (x·Aᵀ under PDL itself made the default): 7B NVFP4
#                                vs BF16-LoRA rollouts at 16 (warm-up) to 256 sequences, two passes in one process
#                                ($OUT/roll_cmp; ~6 min); CMP39=prof: where the step at 128 sequences spends its GPU time
#                                now, both formats ($OUT/prof; ~3 min)
#   scripts/gpu_bench.sh grpo    issue 10: the realistic GRPO step, 7B, 16 prompts x G 8, 1024 new tokens, micro-batches
#                                of 16, GC on (FORMATS=nvfp4,bf16 by default; all four: FORMATS=nvfp4,bf16,mxfp4,nf4)
#   scripts/gpu_bench.sh update  where one micro-batch of that step spends its GPU time (qerl.bench update), with the
#                                fused training kernels and without (QERL_FUSED_TRAIN=0), and the kernel layout's
#                                dense weight, Triton vs CUDA (benchmarks.dequant_bench)
#   scripts/gpu_bench.sh waves   issue 10, session 40: why a wave of the wgmma GEMM (gate|up at 128 tokens, 16,0,2,2)
#                                takes ~1.8x its tensor-core time: ncu's per-SASS-instruction stall samples
#                                ($OUT/prof/src_sass.csv; the report itself, src_gateup_m128.ncu-rep), and the same
#                                launch config on 8448 / 16896 / 37888 rows (half, one and 2.24 waves) with the caches
#                                flushed before each pass and without (the weights of the smaller two then come from
#                                L2), $OUT/prof/waves_{cold,warm}.txt; ~3 min
#   scripts/gpu_bench.sh desc40  issue 10, session 40: the wgmma MMAs' descriptor passed as two 32-bit halves (the main
#                                loop 7% shorter in SASS) against the code before (git f6974de, or DESC40_BASE): the
#                                wgmma GPU tests on the new build ($OUT/tests_desc40.txt), then each 7B product at 64, 128
#                                and 256 tokens at its tuned configuration (benchmarks.wgmma_profile --configs tuned),
#                                old / new / new / old in four processes ($OUT/desc_{old,new}_{1,2}); ~6 min
#   scripts/gpu_bench.sh ablate40 issue 10, session 40: what each part of the wgmma GEMM's main loop costs, by timing
#                                builds that leave it out (benchmarks.wgmma_ablate; their results are wrong, only their
#                                time counts): variants 1 (tokens staged once), 3 (no staging), 4 (no decode), 7 (no
#                                staging, no decode), 8 (no group barrier) against the full kernel, built in parallel,
#                                7B gate|up and down at 64-256 tokens ($OUT/ablate; ~5 min). ABLATE40_V replaces the
#                                variants: ABLATE40_V="4 16 20" (session 48's plan) times the MMAs with A from shared
#                                memory (16) and that without the decode (20) beside no decode alone (4)
#   scripts/gpu_bench.sh abk     a kernel-level A/B of one build switch of the wgmma GEMM: ABK_SWITCH (QERL_WGMMA_TMA,
#                                QERL_WGMMA_LORA or QERL_WGMMA_STSM), ABK_RUNS="VALUE:PASS ..." in the order run
#                                (default "0:1 1:1 1:2 0:2"; the first run's value is the baseline), every build at once,
#                                ABK_TESTS (pytest -k over tests/test_cuda_fp4.py) on each other build (or on those of
#                                ABK_TESTED, e.g. one, where the tests set the switch themselves), then each 7B
#                                product at its tuned config with a rank-32 LoRA term (benchmarks.wgmma_profile
#                                --configs tuned --lora ${ABK_LORA:-32} --m ${ABK_M:-64,128,256}; ABK_LORA=0: the plain
#                                products, as issue 10's layer table times them) once per run ($OUT/abk_VALUE_PASS),
#                                and the gains per product and pass (benchmarks.ab_compare: $OUT/ab.md); ~3-5 min
#   scripts/gpu_bench.sh lora42  issue 10 / 11: what the LoRA term costs the decode step, as a bound on what fusing it
#                                could gain: 7B NVFP4 and BF16 rollouts at 16 (warm-up), 64, 128, 256 sequences (256 +
#                                512) with no adapters (--ranks 0: the base alone) and with rank 32, one process per
#                                format ($OUT/roll_lora); LORA42=prof: the 128-sequence step's kernels for both
#                                ($OUT/prof); ~5 / ~4 min
#   scripts/gpu_bench.sh bf16sec issue 11, session 43's QERL_BF16_LOADS=sector (the default since; decode mode
#                                fused-bf16-sector: the BF16 GEMV's load instructions each covering whole 32-byte
#                                sectors) against pair (session 34's loads): both builds, the BF16 GPU tests on the
#                                sector one ($OUT/tests_bf16.txt; SKIP_TESTS=1 skips), the 7B
#                                per-layer table at M = 1 and 8 (benchmarks.cuda_bench: cuBLAS and the GEMV) pair /
#                                sector / sector / pair ($OUT/bench_{pair,sector}_{1,2}), then 7B BF16-LoRA rollouts at
#                                batch 8 and 2 (256 + 512), fused-bf16-pair / fused / fused / fused-bf16-pair in one
#                                process per batch ($OUT/roll_sec); ~5 min
#   scripts/gpu_bench.sh next43  issue 11 after session 43, on any GPU: what the BF16 GEMV's access pattern alone reads
#                                (benchmarks.hbm_pattern_bench, 7B gate|up / down / q|k|v, the FP4 layout and both BF16
#                                load patterns; $OUT/hbm), then the BF16 GEMV under PDL at batch 8 (7B BF16-LoRA, 256 +
#                                512: fused / fused-bf16-pdl / fused-bf16-pdl / fused in one process, $OUT/roll_pdl;
#                                the decode step uses PDL for it only up to M = 4, an H100 rule); ~4 min
#   scripts/gpu_bench.sh lora44  issue 11, session 44: where the LoRA's ~10% of the 7B NVFP4 batch-8 decode step goes:
#                                benchmarks.lora_gemv_bench --pdl (the four decode linears of a layer as PDL chains,
#                                M = 8 and 2) with the timing-only builds -DQFP4_LORA_ABLATE=1 (no LoRA term in the
#                                output warps), 2 (the LoRA CTAs only count), 3 (both), 4 (no wait for the LoRA CTAs),
#                                built in parallel first, two passes ($OUT/lora_{1,2}); ~4 min. ABLATE replaces the
#                                variants: ABLATE=2,3,8,10 (session 45's plan) adds 8 (the term before the main loop,
#                                no wait) and 10 (that with the LoRA CTAs idle: as if the kernel before had written t)
#   scripts/gpu_bench.sh wgpeak  issue 10, session 48: the wgmma MMA schedule's ceiling with no loads and no decode
#                                (benchmarks.wgmma_peak: m64nNk16 rs / ss, 1-4 warpgroups a CTA, wait_group 0 / 1,
#                                one CTA an SM on every SM; $OUT/peak), beside the GEMM's own time at its tuned
#                                configs (benchmarks.wgmma_profile --configs tuned, $OUT/prof); ~3 min
#   scripts/gpu_bench.sh kfix    issue 10, session 49: the wgmma GEMM's cost per CTA outside its main loop. The tuned
#                                128-token gate|up config (16,0,2,2) over one wave (16896 rows: 132 CTAs) at K = 896 ..
#                                14336, without and with a rank-32 LoRA epilogue, and the 7B shape (296 CTAs)
#                                ($OUT/prof0, $OUT/prof32; the intercept of time against K is the per-CTA fixed cost);
#                                the MMA schedule alone (benchmarks.wgmma_peak, N 128, rs, 4 warpgroups, wait 1) at
#                                28 .. 4096 chunks a warpgroup over one wave and at the GEMM's 28 chunks over its 296
#                                CTAs ($OUT/peak); ~3 min
#   scripts/gpu_bench.sh dec49   issue 10, session 49: the MMA schedule with the GEMM's decode and nothing else
#                                (benchmarks.wgmma_peak --ops rs,rsdec, N 128 / 256, 2 and 4 warpgroups, wait 1) over one
#                                wave of long loops, and at the 7B gate|up launch's shape (296 CTAs x 28 chunks)
#                                ($OUT/peak); ~2 min
#   scripts/gpu_bench.sh tail    issue 10, session 50: the wgmma grid launches' last partial wave split along K
#                                (QERL_WGMMA_TAIL=1, the default; configs (nt, WGMMA_SK - kt, r, ks)): the default and
#                                QERL_WGMMA_TAIL=0's builds at once, the tail GPU tests ($OUT/tests_tail.txt), then each
#                                7B product at 64, 128, 256 tokens (TAIL_M) at its tuned grid config and that config's
#                                tail splits kt = 2, 3, 4 with a rank-32 LoRA (benchmarks.wgmma_profile --configs tail),
#                                two passes ($OUT/tail_1, tail_2); ~4 min. TAIL=roll: the builds and tests, then 7B
#                                NVFP4 rollouts at 16 (warm-up), 64, 128, 256 sequences in one process, decode modes
#                                fused-no-tail / fused (cuda_fp4.wgmma_tail_pick on the tuned configs) and back
#                                ($OUT/roll_tail); ~8 min
#   scripts/gpu_bench.sh regress every GPU test (-m gpu) with pytest -v, so a run cut short by SECS (default 560) keeps
#                                each finished test's outcome ($OUT/tests_regress_PART.txt): PART=all (default) every
#                                file, ~7 min from a cold H200 since session 48 (the extension builds included); or in
#                                parts, one per call: 1 test_cuda_fp4.py's tests but the wgmma GEMM's (19 s with the
#                                builds cached), 2 the wgmma GEMM's (238 s cold in session 48; since session 50 it
#                                first builds the default, QERL_WGMMA_TMA=0's and QERL_WGMMA_TAIL=0's at once), 3 every
#                                other file (151 s). QERL_WGMMA_PIPE=1 in the environment runs them on pipe 1's builds
#                                (session 53: PART=2 94 s, the builds included; the TMA test skips, TMA needs pipe 2)
#   scripts/gpu_bench.sh layers  issue 10's per-layer targets at the current code: 7B decoder linears, BF16 cuBLAS against
#                                NVFP4 and MXFP4 in the kernel layout (the default resident layout) through the
#                                dispatcher, forward at M = LAYERS_M and backward (grad_input = g·W) from M 512
#                                (benchmarks.kernel_bench --layout kernel; $OUT/layers); ~3 min with the build
#   scripts/gpu_bench.sh slices  issue 10, large M: dequantize + cuBLAS in slices of Ŵ (forward: rows; backward: columns).
#                                The dequantization GPU tests ($OUT/tests_slices.txt), the slice sweep of the 7B
#                                linears at M = 512-4096 (benchmarks.dequant_slices_bench --write-table: installs
#                                qerl/kernels/tuned/dequant_slices_<gpu>.json in the tree and $OUT/slices: copy it back),
#                                then the layer table with the new table and without (QERL_DEQUANT_SLICES=1 / 0 / 0 / 1,
#                                $OUT/layers_s*); ~7 min with the build. SLICES_MODELS=7b,14b,32b (and SLICES_SECS) sweeps
#                                more shapes (session 54's H200 table: 7B only); SLICES_M the A/B's Ms; SLICES_OPS=bwd
#                                sweeps and tabulates the backward alone (session 55's H100 table covers only it)
#   scripts/gpu_bench.sh upslice issue 10, session 55: one GRPO micro-batch's log-prob pass and forward + backward
#                                (qerl.bench update, 7B, UPSLICE_MICRO=2 completions of 64 + 1024 tokens: M ≈ 2.2 K, where
#                                the slice tables apply; GC on) with the device's slice table and without
#                                (QERL_DEQUANT_SLICES=1 / 0 / 0 / 1, one process each, UPSLICE_FMTS=nvfp4,bf16;
#                                $OUT/up_<on>_<pass>, the log's lines in that order); ~5 min with the build. The H100's old GEMM table for `tableab`:
#                                TABLE_OLD=results/speed/raw/h100_s55_tune/cuda_gemm_table_h100_s32.json
#   scripts/gpu_bench.sh row32   issue 11's 32B NVFP4 batch-8 row (256 + 2048, r32, two passes: the first a warm-up;
#                                $OUT/roll32) and its decode-step profiles with and without adapters (ROW32_RANKS=32,0,
#                                one process each; $OUT/prof32). The extension builds beside the first 32B load (on a
#                                cold machine the build takes ~100-130 s and the load ~80 s: session 56 lost both rows
#                                to limits that left no room for them). ~8 min cold
#   scripts/gpu_bench.sh ends    issue 11, session 58: the decode step's opening (slot, embedding, rotary rows) and close
#                                (the bookkeeping after the draw, from bf16 logits) in one launch each (fused) against
#                                session 57's ~30 torch launches (fused-torch-ends): the extension's build beside 7B
#                                NVFP4 rollouts at batch 8 and 2 (256 + 2048; old / new / new / old in one process;
#                                $OUT/roll_ends), the GPU tests of the fused step's tokens ($OUT/tests_ends.txt),
#                                decode-step profiles of both at batch 8 ($OUT/prof), then MXFP4 and BF16-LoRA at
#                                batch 8 the same way ($OUT/roll_ends_fmt); ~7 min cold
#   scripts/gpu_bench.sh rope    issue 11, session 59: bias + RoPE + cache write inside the Triton attention split kernel
#                                (fused-rope-in-split, an opt-in since session 60 measured it slower) against their own
#                                launch (fused, the default): the build beside 7B NVFP4 rollouts
#                                at batch 8 and 2 (256 + 2048; old / new / new / old in one process; $OUT/roll_rope),
#                                the fused step's GPU tests (the graph reuse across prompt lengths and the captures'
#                                draws among them;
#                                $OUT/tests_rope.txt), decode-step profiles of both at batch 8 ($OUT/prof), then the
#                                sampler's buffer reuse across GSM8K prompt lengths (qerl.bench reuse, 8 prompts x G 8,
#                                prompts up to 512 tokens, 256 new, 6 steps, QERL_SAMPLER_REUSE 0 / 1 / 1 / 0;
#                                $OUT/reuse; SKIP_REUSE=1 skips); ROPE_TESTS: the tests' -k; ~8 min cold
#   scripts/gpu_bench.sh rope32  the same A/B for 32B NVFP4 at batch 8 ($OUT/roll_rope32) and 14B ($OUT/roll_rope14),
#                                then 7B MXFP4 and BF16-LoRA at batch 8 ($OUT/roll_rope_fmt); ~9 min cold
#   scripts/gpu_bench.sh ncu32   issue 11, session 60: Nsight Compute on the decode GEMV of the 32B row's small products
#                                (q|k|v, o; gate|up beside them for comparison) at M = 8, plain and with LoRA in the
#                                launch, two launches each (benchmarks.lora_gemv_bench --ncu; NCU_MODELS, NCU_M,
#                                NCU_LINEARS): $OUT/prof/ncu_gemv.txt, its throughput / stall / occupancy lines in the log
#   scripts/gpu_bench.sh tune32  issue 11, session 61: benchmarks.gemv_tune on the 32B decode linears (NVFP4, M = 8, LoRA
#                                r32; --write-table: the tree's table, copied to $OUT/tune), then the 32B batch-8 rollout,
#                                256 + 2048, with that table against the heuristic (fused, fused-heuristic-gemv x 2, fused)
#   scripts/gpu_bench.sh tune32ab  the installed table (32B / 14B shapes: the two share q|k|v and o) against the
#                                heuristic in the rollouts it reaches: 14B batch 8, 32B batch 2 and 8 (A B B A, 256 + 2048)
#   scripts/gpu_bench.sh dq      issue 10, item 2: the in-loop dequantizing GEMM (qerl.kernels.cuda_dq: the backward g·Ŵ and
#                                the forward x·Ŵᵀ) built beside the default extension, its GPU tests ($OUT/tests_dq.txt),
#                                then benchmarks.dq_gemm_bench (DQ_OPS, DQ_M, DQ_FMTS, DQ_KZ, DQ_SECS; $OUT/dq): BF16
#                                cuBLAS, the library's path and the kernel at every launch config per 7B linear, each
#                                config's output checked against the library's first; installs the fastest configs
#                                (qerl/kernels/tuned/dq_gemm_<gpu>.json in the tree and $OUT/dq: copy it back); ~6 min
#                                cold. SKIP_TESTS=1: no tests.
#                                Failed tests run benchmarks.dq_probe ($OUT/dq_probe.txt: where the wrong outputs land)
#   scripts/gpu_bench.sh dqlean  the same without the default extension's build (QERL_CUDA_GEMV=0: the tests' oracle is the
#                                pure-torch reference, and the bench's "prev" column becomes the Triton dequantization +
#                                cuBLAS, which its .md says): for a short device call (~2-3 min cold). Defaults: DQ_FMTS
#                                nvfp4, DQ_KZ 0,1,2,4, DQ_TEST_SECS 150, DQ_SECS 150
#   scripts/gpu_bench.sh dqablate  issue 10, session 65: what each part of the dq kernel costs. One build per
#                                QERL_DQ_ABLATE value (DQABL, default 0 1 2 3 4: 1 no dequantization, 2 no MMAs, 4 no
#                                barrier before the MMAs; timing only), all at once with the default extension's; the bench
#                                (NVFP4, 7B, both ops, DQABL_M default 2048, kz 1) per value into $OUT/abl/<v>; then the
#                                wgmma GEMM's sweep against dequantize + cuBLAS on the kernels' layout at large M
#                                (cuda_gemm_bench --prev-layout kernel, DQABL_SWEEP_M default 512,1024,2048, no table
#                                installed; $OUT/abl/sweep; DQABL_SWEEP_SECS=0: neither it nor the default build);
#                                $OUT/abl.tgz holds it all; ~6 min (~2 min without the sweep)
#   scripts/gpu_bench.sh dqdecode  issue 10, session 65: the dq kernel's two decodes (QERL_DQ_DECODE=exact, mma), each
#                                built (at once, QERL_CUDA_GEMV=0), its GPU tests ($OUT/tests_dq_<decode>.txt) and the
#                                bench (DQDEC_FMTS nvfp4,mxfp4, both ops, M 512,2048, kz 0,1,2; no table) into
#                                $OUT/dec_<decode>; ~3 min
#                                DQDEC_AHEAD=1: the default extension's build beside the dq builds, and `ahead`'s bench
#                                before the decodes' (a cut call keeps it)
#   scripts/gpu_bench.sh dqws    issue 10, session 66: the dq kernel's main loops (QERL_DQ_LOOP ws / plain) x decodes,
#                                DQWS_BUILDS "loop:decode ..." (default ws:mma ws:exact plain:mma), built at once
#                                (QERL_CUDA_GEMV=0); per build its GPU tests ($OUT/tests_dq_<loop>_<decode>.txt, -x)
#                                and the bench (DQWS_FMTS nvfp4, DQWS_M 512,2048, kz 0,1,2) into $OUT/ws_<loop>_<decode>;
#                                $OUT/ws.tgz holds it all; ~4 min
#   scripts/gpu_bench.sh dqstages issue 10, session 67: the plain dq loop's copy depth (QERL_DQ_STAGES, mma decode),
#                                DQST_BUILDS "stages:ablate[:loop] ..." (default 4:0:ws 4:0 6:0 5:0 4:3 6:3 4:1:ws 4:2:ws
#                                4:3:ws; ablate 3 = the staging skeleton alone; the ws ones time the warp-specialized
#                                loop and its parts), built at once; the GPU tests of each unablated build ($OUT/tests_st_*)
#                                and the bench (DQST_M 512,2048, kz 0,1,2; ablated builds kz 1) into $OUT/st_<s>_<a>[_ws];
#                                $OUT/st.tgz holds it all; ~7 min
#   scripts/gpu_bench.sh dqncu   issue 10, session 67: Nsight Compute on the dq GEMM (mma decode, DQNCU_LOOPS "plain ws")
#                                and cuBLAS on the 7B gate shape at M 2048, fwd and bwd (benchmarks.dq_ncu, config 256,1):
#                                $OUT/prof/ncu_dq_<loop>.txt, its throughput / pipe / stall lines in the log; ~4 min cold
#   scripts/gpu_bench.sh kz68    issue 10, session 68: the mma.sync GEMM's K split across CTAs (QERL_GEMM_KZ=1, its own
#                                build, beside the default one): its GPU tests ($OUT/tests_kz.txt), then
#                                benchmarks.wave_balance: the 7B gate shape's config (4, 2, 2, 2) at M 32 over 132-396
#                                row blocks and q / o's (4, 2, 1, 8) over 112-264, each at kz 1 / 2 / 4 (does the time
#                                follow the busiest SM?), and the 7B products at their picks at M 17-64 with kz 1-4
#                                ($OUT/kz/wave_balance_<gpu>.csv) beside the default build's kz 1 ($OUT/kz_default:
#                                the KZ build's registers differ); $OUT/kz.tgz; ~6 min cold (KZ_SWEEPS=0: the products
#                                only, no row-block sweeps)
#   scripts/gpu_bench.sh kzab    issue 10, session 69: why the QERL_GEMM_KZ=1 build's kernels ran 1.4-2.3x slower than
#                                the default build's even unsplit (kz 1; results/speed/raw/h100_s69_kz): both builds,
#                                the 7B products at M 32 at kz 1 (the KZ build also at kz 2 and 4) in alternating
#                                processes (default KZ default KZ:
#                                $OUT/kzab/<build>_<pass>/, the lines in the log, with the GPU's clocks, throttle
#                                reasons and power sampled meanwhile), then Nsight Compute on one launch of
#                                each (benchmarks.wave_balance --products --eager; the KZ build at kz 1 and 2):
#                                $OUT/prof/ncu_kz<build>.txt.gz, their duration / occupancy / stall lines in the log;
#                                ~5 min cold (KZAB_NCU=0: no Nsight Compute, ~3 min)
#   scripts/gpu_bench.sh dqvar   issue 10, session 72: the CUDA dequantization (the large-M and backward path's rebuild
#                                of Ŵ, 2.15 TB/s) in build variants against the library's kernel: 16-byte stores only,
#                                whole 128-byte lines per store, the evict-first hint, 8 chunks a warp, 4 warps a CTA,
#                                persistent warps loading their next task early, rows staged in shared memory and
#                                written by bulk copies (benchmarks.dequant_variants: bits
#                                against the Triton kernel, 7B linears as CUDA graphs, DQVAR_PASSES interleaved passes)
#                                into $OUT/dqvar; no extension build (nvcc per variant, seconds); ~1-2 min
#   scripts/gpu_bench.sh next72  issue 10 after session 72, one call (~7 min cold): the default and QERL_WGMMA_STSM=1
#                                builds at once while `dqvar` runs, the STSM GPU tests ($OUT/tests_stsm.txt), the tuned
#                                wgmma products at M ${ABK_M:-64,128,256,512} without LoRA (ABK_LORA) in STSM 0 1 1 0
#                                order ($OUT/abk_*, $OUT/ab.md); $OUT/next72.tgz rewritten after each phase. `kzab`
#                                (KZAB_NCU=0, ~3 min) is the next call
#   scripts/gpu_bench.sh ahead   issue 10, session 66: a 7B layer's 7 linears at large M as one chain, BF16 cuBLAS vs the
#                                library's path vs dequantize + cuBLAS with the next weight rebuilt on a side stream
#                                (benchmarks.dequant_ahead_bench; AHEAD_FMTS nvfp4,mxfp4, AHEAD_M 512,1024,2048, both
#                                ops, AHEAD_ROUNDS 2, AHEAD_SECS 240) into $OUT/ahead and $OUT/ahead.tgz; ~4 min cold
#   scripts/gpu_bench.sh dqup    issue 10: one GRPO micro-batch's log-prob pass and forward + backward (qerl.bench update, 7B,
#                                DQUP_MICRO=2 completions of 64 + 1024 tokens, GC on) with the in-loop dequantizing GEMM
#                                for both products and without (QERL_DQ_GEMM=0 / all / all / 0, one process each,
#                                DQUP_FMTS=nvfp4,bf16; $OUT/dq_<value>_<pass>); ~5 min with the builds
# An offline host takes extra wheels from .whl (built by the device README's recipe / gpu-wheels.sh).
set -uo pipefail
OUT=${OUT:-results/speed}; mkdir -p "$OUT"; LOG="$OUT/log.txt"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1 QERL_REWARD_WORKERS=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG"
# no build runs when a call starts: a lock left by one killed in an earlier call on this (still warm) machine would
# make every load of that build wait forever (session 50 lost a call to one)
find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/qerl_kernels}" -maxdepth 2 -name lock -type f -print -delete >> "$LOG" 2>/dev/null
B="python3 -m qerl.bench"
build() {  # the extension build for QERL_WGMMA_PIPE=$1 (a separate build per value: the flag is part of its name)
  QERL_WGMMA_PIPE=$1 python3 -c "from qerl.kernels import cuda_fp4 as c; print('pipe $1 build', c.available(), c.build_error())" >> "$LOG" 2>&1
}
dq_build() {  # the dq extension's build for the caller's QERL_DQ_* switches (each its own build), labelled $1 in the log
  python3 -c "from qerl.kernels import cuda_dq as d; print('dq build ${1:-}', d.available(), d._STATE.get('error'))" \
    >> "$LOG" 2>&1
}
both_pipes() {  # both builds at once (waiting on the PID only: never a bare wait), then the wgmma GPU tests with each
  build 1 &
  local p1=$!
  build 2
  wait $p1
  for v in 1 2; do
    QERL_WGMMA_PIPE=$v timeout 150 python3 -m pytest -q -m gpu tests/test_cuda_fp4.py -k wgmma 2>&1 | tail -3 >> "$LOG"
  done
}
builds_at_once() {  # SETTING ...: one extension build per argument, all at once ("-": the default build; NAME=VALUE:
  local pids="" v p pipe=${QERL_WGMMA_PIPE:-2}  # the build that switch selects; the caller's pipe), waiting on their
  for v in "$@"; do  # PIDs only (never a bare wait)
    if [ "$v" = - ]; then build "$pipe" & else ( export "$v"; build "$pipe" ) & fi
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
}
kz_products() {  # SECONDS LABEL DIR KZS: benchmarks.wave_balance --products at M ${KZ_M} and kz KZS on the caller's
  # build (QERL_GEMM_KZ), its CSV under $OUT/DIR, its result lines in the log prefixed by LABEL; the GPU's SM / memory
  # clocks, throttle reasons, temperature and power sampled every 200 ms meanwhile ($OUT/DIR/gpu_state.csv; their
  # range in the log: an order effect between processes, a clock or power state, shows up there)
  mkdir -p "$OUT/$3"
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw \
    --format=csv,noheader,nounits -lms 200 > "$OUT/$3/gpu_state.csv" 2>&1 &
  local smi=$!
  timeout "$1" python3 -m benchmarks.wave_balance --products --m "$KZ_M" --kz "$4" --out "$OUT/$3" 2>&1 \
    | grep "kz\]\|Error" | sed "s/^/$2/" >> "$LOG"
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  gpu_state_range "$OUT/$3/gpu_state.csv" "$2" >> "$LOG"
}
kzab_passes() {  # session 69's question: the default build's products at M ${KZ_M:-32} and kz 1 against the KZ build's
  # (kz 1, 2, 4), alternating processes (default KZ default KZ: $OUT/kzab/kz<build>_<pass>), clocks sampled meanwhile
  KZ_M=${KZ_M:-32}
  local run b p
  for run in 0:1 1:1 0:2 1:2; do
    b=${run%%:*} p=${run##*:}
    QERL_GEMM_KZ=$b kz_products 90 "KZ=$b pass $p: " "kzab/kz${b}_$p" "$([ "$b" = 1 ] && echo 1,2,4 || echo 1)"
  done
}
next72_tar() {  # what next72 has so far, in one archive (rewritten after each phase: a call cut short keeps it)
  tar czf "$OUT/next72.tgz" -C "$OUT" $(cd "$OUT" && ls -d dqvar abk_* ab.md tests_stsm.txt log.txt 2>/dev/null)
}
dqvar_run() {  # benchmarks.dequant_variants (DQVAR_VARIANTS, DQVAR_PASSES) into $OUT/dqvar, its table in the log
  timeout "${DQVAR_SECS:-300}" python3 -m benchmarks.dequant_variants --passes "${DQVAR_PASSES:-5}" \
    ${DQVAR_VARIANTS:+--variants "$DQVAR_VARIANTS"} --out "$OUT/dqvar" 2>&1 | grep -v Warn >> "$LOG"
  cat "$OUT/dqvar/dequant_variants.md" >> "$LOG" 2>/dev/null
}
gpu_state_range() {  # CSV LABEL: one line, the SM and memory clocks' (MHz), temperature's and power's min-max over the
  # samples of `nvidia-smi --query-gpu=clocks.sm,clocks.mem,clocks_throttle_reasons.active,temperature.gpu,power.draw`
  # and the throttle-reason masks seen
  awk -F', *' -v label="$2" 'NF >= 5 && $1 ~ /^[0-9]/ {
      n++; for (i = 1; i <= 5; i++) if (i != 3) { if (n == 1 || $i < lo[i]) lo[i] = $i; if (n == 1 || $i > hi[i]) hi[i] = $i }
      seen[$3] = 1 }
    END { if (!n) { print "gpu state " label ": no samples"; exit }
      r = ""; for (k in seen) r = r " " k
      printf "gpu state %s%d samples: SM %d-%d MHz, memory %d-%d MHz, %d-%d C, %.0f-%.0f W, throttle reasons%s\n",
        label, n, lo[1], hi[1], lo[2], hi[2], lo[4], hi[4], lo[5], hi[5], r }' "$1"
}
lora_builds() {  # the default build (the wgmma LoRA variants' PDL waits) and QERL_WGMMA_LORA=1's (without), at once
  builds_at_once - QERL_WGMMA_LORA=1
}
lora_a_sweep() {  # benchmarks.lora_a_bench --quick over 7B's four x·Aᵀ products at 64-256 tokens ($OUT/lora_a)
  mkdir -p "$OUT/lora_a"
  timeout 130 python3 -m benchmarks.lora_a_bench --models 7b --m 64,128,256 --quick --out "$OUT/lora_a" 2>&1 \
    | grep -v Warn > "$OUT/lora_a/log.txt"
}
ahead_bench() {  # benchmarks.dequant_ahead_bench (7B; AHEAD_FMTS, AHEAD_M, AHEAD_ROUNDS) into $OUT/ahead, tarred
  timeout "${AHEAD_SECS:-240}" python3 -m benchmarks.dequant_ahead_bench --models 7b --fmts "${AHEAD_FMTS:-nvfp4,mxfp4}" \
    --m "${AHEAD_M:-512,1024,2048}" --rounds "${AHEAD_ROUNDS:-2}" --out "$OUT/ahead" 2>&1 | grep "^|\|rror" >> "$LOG"
  tar czf "$OUT/ahead.tgz" -C "$OUT" ahead
}
gpu_tests() {  # NAME SECONDS PYTEST-ARGS...: the GPU tests' tail in $OUT/tests_NAME.txt, their summary in the log
  local name=$1 secs=$2
  shift 2
  timeout "$secs" python3 -m pytest -q -m gpu "$@" -rf --tb=short 2>&1 | tail -30 > "$OUT/tests_$name.txt"
  tail -3 "$OUT/tests_$name.txt" >> "$LOG"
}
bf16_tests() {  # the BF16 GEMV's GPU tests, the FP4 GEMV's and the fused decode's (SKIP_TESTS=1 skips)
  [ -n "${SKIP_TESTS:-}" ] && return
  timeout 240 python3 -m pytest -q -m gpu tests/test_cuda_fp4.py tests/test_fused_decode.py \
    -k "bf16 or gemv or teacher" -rf --tb=short 2>&1 | tail -60 > "$OUT/tests_bf16.txt"
  tail -3 "$OUT/tests_bf16.txt" >> "$LOG"
}
peak() {  # SECONDS ARGS...: benchmarks.wgmma_peak ARGS into $OUT/peak, its result lines in the log
  local secs=$1
  shift
  timeout "$secs" python3 -m benchmarks.wgmma_peak "$@" --out "$OUT/peak" 2>&1 | grep "peak\]\|Error" >> "$LOG"
}
kernel_ab() {  # SWITCH PREFIX RUNS TESTED TESTS: the builds of RUNS' values ("VALUE:PASS ..." in the order run) at
  # once, the GPU tests -k TESTS over tests/test_cuda_fp4.py on each build in TESTED ($OUT/tests_PREFIX_VALUE.txt; none
  # when TESTS is empty), then each 7B product at its tuned config with a rank-32 LoRA term (benchmarks.wgmma_profile
  # --configs tuned --lora 32 --m ${ABK_M:-64,128,256}) once per run ($OUT/PREFIX_VALUE_PASS), and the gains against
  # the first run's value ($OUT/ab.md)
  local sw=$1 prefix=$2 runs=$3 tested=$4 tests=$5 v run pass
  # shellcheck disable=SC2046  # one word per build
  builds_at_once $(for r in $runs; do echo "$sw=${r%%:*}"; done | sort -u)
  if [ -n "$tests" ]; then
    for v in $tested; do
      (export "$sw=$v"; gpu_tests "${prefix}_$v" 300 tests/test_cuda_fp4.py -k "$tests")
    done
  fi
  ab_runs "$sw" "$prefix" "$runs" 60 "prof\]" python3 -m benchmarks.wgmma_profile --configs tuned \
    --lora "${ABK_LORA:-32}" --m "${ABK_M:-64,128,256}"
  python3 -m benchmarks.ab_compare "$OUT" --prefix "$prefix" --base "${runs%%:*}" --md "$OUT/ab.md" >> "$LOG" 2>&1
}
ab_runs() {  # SWITCH PREFIX RUNS SECONDS PATTERN CMD...: CMD once per run of RUNS ("VALUE:PASS ..." in the order run)
  # under SWITCH=VALUE, with --out $OUT/PREFIX_VALUE_PASS; the log keeps its output lines matching PATTERN
  local sw=$1 prefix=$2 runs=$3 secs=$4 pat=$5 run v pass
  shift 5
  for run in $runs; do
    IFS=: read -r v pass <<< "$run"
    (export "$sw=$v"; timeout "$secs" "$@" --out "$OUT/${prefix}_${v}_$pass" 2>&1 | grep "$pat" >> "$LOG")
  done
}
case "${1:-core}" in
core)
  python3 -m pytest -q -m gpu tests/test_gpu.py tests/test_fused_decode.py tests/test_kernels.py tests/test_cuda_fp4.py 2>&1 | tail -4 >> "$LOG"
  $B memory --models 7b --formats bf16,nf4,mxfp4,nvfp4 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG"
  $B rollout --models 7b --formats nvfp4,bf16,mxfp4,nf4 --batch 8,2 --decode fused,unfused --out "$OUT" 2>&1 | grep -v Warn >> "$LOG"
  $B profile --models 7b --formats nvfp4,bf16 --batch 8 --decode fused,unfused --out "$OUT" 2>&1 | grep -v Warn >> "$LOG"
  python3 -m benchmarks.cuda_bench --out "$OUT" 2>&1 | grep -v Warn >> "$LOG" ;;
step)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  $B step --models 7b --formats nvfp4,bf16,mxfp4,nf4 --batch 8 --gc both --steps 2 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG"
  $B step --models 32b --formats nvfp4,bf16 --batch 8 --gc on --steps 2 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG" ;;
large)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # 32B BF16 does not load on 80 GB without it
  $B rollout --models 14b,32b --formats nvfp4,bf16,mxfp4,nf4 --batch 8,2 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG" ;;
small)
  $B rollout --models 3b --formats nvfp4,bf16,mxfp4,nf4 --batch 8,2 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG"
  $B rollout --models 7b --formats nvfp4,bf16 --batch 2 --ranks 16,64 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG" ;;
gemm)
  python3 -m pytest -q -m gpu tests/test_cuda_fp4.py 2>&1 | tail -4 >> "$LOG"
  python3 -m benchmarks.cuda_gemm_bench --out "$OUT" --write-table 2>&1 | grep -v Warn >> "$LOG"
  $B rollout --models 7b --formats nvfp4,bf16 --batch 16,32,64,128,256 --prompt 256 --new 512 --out "$OUT" 2>&1 \
    | grep -v Warn >> "$LOG" ;;
pipe)
  both_pipes
  for v in 1a 2 1b; do
    QERL_WGMMA_PIPE=${v:0:1} python3 -m benchmarks.cuda_gemm_bench --models 7b --no-sweep --out "$OUT/pipe$v" 2>&1 \
      | grep -v Warn >> "$LOG"
  done
  QERL_WGMMA_PIPE=2 python3 -m benchmarks.cuda_gemm_bench --models 7b --out "$OUT/pipe2s" 2>&1 | grep -v Warn >> "$LOG" ;;
prof)
  both_pipes
  for v in 1 2; do
    QERL_WGMMA_PIPE=$v timeout 240 python3 -m benchmarks.cuda_gemm_bench --models 7b --write-table --out "$OUT/sweep$v" \
      2>&1 | grep -v Warn >> "$LOG"
  done
  QERL_WGMMA_PIPE=2 timeout 120 python3 -m benchmarks.wgmma_profile --m 64,128,256 --out "$OUT/prof" 2>&1 \
    | grep -v Warn >> "$LOG" ;;
tune)
  build 2
  [ "${SKIP_TESTS:-0}" = 1 ] || timeout 240 python3 -m pytest -q -m gpu tests/test_cuda_fp4.py 2>&1 | tail -4 >> "$LOG"
  timeout 240 python3 -m benchmarks.cuda_gemm_bench --models 7b --write-table --out "$OUT/sweep" 2>&1 | grep -v Warn >> "$LOG"
  [ "${SKIP_PROF:-0}" = 1 ] || timeout 90 python3 -m benchmarks.wgmma_profile --m 64,128,256 --out "$OUT/prof" 2>&1 \
    | grep -v Warn >> "$LOG" ;;
roll)
  for v in ${ROLLS:-nvfp4:0 nvfp4:1 bf16:0}; do
    IFS=: read -r f l <<< "$v"
    QERL_WGMMA_LORA=$l $B rollout --models 7b --formats $f --batch 16,64,128,256 --prompt 256 --new 512 \
      --out "$OUT/roll_${f}_l${l}" 2>&1 | grep -v Warn >> "$LOG"
  done
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  QERL_WGMMA_LORA=${GRPO_LORA:-0} $B step --models 7b --formats "${FORMATS:-nvfp4,bf16}" --batch 128 --group 8 \
    --micro 16 --new 1024 --gc on --steps 2 --out "$OUT/grpo" 2>&1 | grep -v Warn >> "$LOG" ;;
ncu)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/prof"
  build 2
  QERL_WGMMA_PIPE=2 timeout 300 "$NCU" --clock-control none --kernel-name regex:fp4_wgmma_kernel --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats --section InstructionStats --section SchedulerStats --section SourceCounters \
    --print-details all python3 -m benchmarks.wgmma_profile --ncu --shapes 37888x3584 --m 128 \
    --configs "${NCU_CONFIGS:-16,0,2,2 16,0,2,1}" > "$OUT/prof/ncu_gateup_m128.txt" 2>&1
  grep -E "fp4_wgmma_kernel|Throughput|Duration|Stall|stall|Eligible|Issued Warp" "$OUT/prof/ncu_gateup_m128.txt" \
    | head -120 >> "$LOG" ;;
abroll)
  for v in nvfp4:1:0 nvfp4:2:0 nvfp4:1:1 bf16:1:0; do
    IFS=: read -r f p l <<< "$v"
    QERL_WGMMA_PIPE=$p QERL_WGMMA_LORA=$l $B rollout --models 7b --formats $f --batch 16,64,128,256 --prompt 256 \
      --new 512 --out "$OUT/roll_${f}_p${p}_l${l}" 2>&1 | grep -v Warn >> "$LOG"
  done ;;
decode)
  python3 -m pytest -q -m gpu tests/test_cuda_fp4.py tests/test_fused_decode.py 2>&1 | tail -4 >> "$LOG"
  $B rollout --models "${MODELS:-7b}" --formats nvfp4,mxfp4 --batch 8,2 --decode fused,fused-split-lora --out "$OUT" \
    2>&1 | grep -v Warn >> "$LOG"
  $B rollout --models "${MODELS:-7b}" --formats bf16 --batch 8,2 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG"
  $B profile --models "${MODELS:-7b}" --formats nvfp4,bf16 --batch 8 --decode fused,fused-split-lora --out "$OUT" \
    2>&1 | grep -v Warn >> "$LOG" ;;
update)
  python3 -m pytest -q -m gpu tests/test_train_fused.py tests/test_cuda_fp4.py -k "fused or dequant or relaid" 2>&1 | tail -4 >> "$LOG"
  python3 -m benchmarks.dequant_bench --models 7b --out "$OUT" 2>&1 | grep -v Warn >> "$LOG"
  U="python3 -m qerl.bench update --models 7b --micro 16 --prompt 64 --new 1024 --gc on --repeats 2"
  $U --formats nvfp4,bf16 --out "$OUT" 2>&1 | grep "micro\|   [a-z]" >> "$LOG"
  QERL_FUSED_TRAIN=0 $U --formats bf16 --out "$OUT" 2>&1 | grep "micro\|   [a-z]" >> "$LOG" ;;
attn)
  build 2 &
  bp=$!
  QERL_ATTN=cuda python3 -c "from qerl.kernels import cuda_attn as c, fused; import torch; q = torch.zeros(1, 28, 128, dtype=torch.bfloat16, device='cuda'); k = torch.zeros(1, 4, 16, 128, dtype=torch.bfloat16, device='cuda'); print('attn build', c.usable(q, k, k, torch.zeros(1, 16, device='cuda')), c._STATE.get('error'))" >> "$LOG" 2>&1
  wait $bp
  [ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -m gpu tests/test_fused_decode.py -rf --tb=short 2>&1 \
    | tail -80 > "$OUT/tests_fused_decode.txt"
  tail -4 "$OUT/tests_fused_decode.txt" >> "$LOG"
  mkdir -p "$OUT/attn"
  [ -n "${SKIP_SWEEP:-}" ] || timeout 200 python3 -m benchmarks.attn_bench --models 7b,32b --batch ${ATTN_BATCH:-8,32,64,128,256} \
    --kv ${ATTN_KV:-256,1024} --targets ${ATTN_TARGETS:-132,264} --cuda-configs ${ATTN_CONFIGS:-2,3} \
    --out "$OUT/attn" 2>&1 | grep -v Warn > "$OUT/attn/log.txt"
  for f in ${FORMATS:-nvfp4 bf16}; do  # 16 = warm-up; each decode twice, alternating
    $B rollout --models 7b --formats $f --batch 16,64,128,256 --prompt 256 --new 512 \
      --decode fused-triton-attn,fused,fused-triton-attn,fused --out "$OUT/roll_big" 2>&1 | grep -v Warn >> "$LOG"
  done
  $B rollout --models 7b --formats nvfp4 --batch 8,2 --decode fused,fused --out "$OUT/roll_b8" 2>&1 \
    | grep -v Warn >> "$LOG" ;;
bf16)
  build 2
  bf16_tests
  # the tuner's best launch configurations for the BF16 products, installed (the tree's table; copied to $OUT/tune)
  timeout 150 python3 -m benchmarks.gemv_tune --models 7b --fmts bf16 --m 2,8 --ranks 32 --out "$OUT/tune" \
    --write-table 2>&1 | grep -v Warn >> "$LOG"
  cp qerl/kernels/tuned/cuda_gemv_*.json "$OUT/tune/" 2>/dev/null
  # 256 + 512, one process per batch: cuBLAS, the GEMV (tuned table), by the heuristic, under PDL; twice, alternating
  for b in 8 2; do
    timeout 150 $B rollout --models 7b --formats bf16 --batch $b --prompt 256 --new 512 --decode \
      fused-cublas-bf16,fused,fused-heuristic-gemv,fused-bf16-pdl,fused-cublas-bf16,fused,fused-heuristic-gemv,fused-bf16-pdl \
      --out "$OUT/roll_ab" 2>&1 | grep -v Warn >> "$LOG"
  done
  timeout 100 $B rollout --models 7b --formats bf16 --batch 8,2 --out "$OUT/roll_b8" 2>&1 | grep -v Warn >> "$LOG"
  timeout 100 python3 -m benchmarks.cuda_bench --models 7b --m 1,8 --fmts "" --out "$OUT/bench" 2>&1 \
    | grep -v Warn | tail -24 >> "$LOG" ;;
bf16pdl)
  build 2
  bf16_tests
  # PDL for the BF16 GEMV by batch (256 + 512; cuBLAS first as the warm-up, then never / always / auto alternating)
  for b in ${PDL_BATCHES:-1 2 4}; do
    timeout 120 $B rollout --models 7b --formats bf16 --batch $b --prompt 256 --new 512 --decode \
      fused-cublas-bf16,fused-bf16-no-pdl,fused-bf16-pdl,fused,fused-bf16-no-pdl,fused-bf16-pdl,fused \
      --out "$OUT/roll_pdl" 2>&1 | grep -v Warn >> "$LOG"
  done
  mkdir -p "$OUT/prof"
  timeout 150 $B profile --models 7b --formats bf16,nvfp4 --batch 8 --out "$OUT/prof" 2>&1 | grep -v Warn \
    > "$OUT/prof/log.txt"
  timeout 100 $B rollout --models 7b --formats bf16 --batch 8,2 --out "$OUT/roll_b8" 2>&1 | grep -v Warn >> "$LOG" ;;
bf16tune)  # another GPU: the tuner for the BF16 products (the rule's pick against the best; installs the table),
           # then 7B rollouts with cuBLAS, the table and the rule alternating (256 + 512)
  build 2
  timeout 150 python3 -m benchmarks.gemv_tune --models 7b --fmts bf16 --m 2,8 --ranks 32 --out "$OUT/tune" \
    --write-table 2>&1 | grep -v Warn >> "$LOG"
  cp qerl/kernels/tuned/cuda_gemv_*.json "$OUT/tune/" 2>/dev/null
  for b in 8 2; do
    timeout 120 $B rollout --models 7b --formats bf16 --batch $b --prompt 256 --new 512 --decode \
      fused-cublas-bf16,fused,fused-heuristic-gemv,fused-cublas-bf16,fused,fused-heuristic-gemv \
      --out "$OUT/roll_ab" 2>&1 | grep -v Warn >> "$LOG"
  done ;;
loraa)  # issue 10 / 13: the LoRA term at 17-64 sequences: session 35's cuBLAS x·Aᵀ + addmm, the default (Triton
        # x·Aᵀ, the mma.sync GEMM's LoRA epilogue), the GEMM under PDL overlapping the x·Aᵀ kernel
  build 2
  timeout 200 python3 -m pytest -q -m gpu tests/test_fused_decode.py tests/test_cuda_fp4.py \
    -k "fused_kernels_bf16 or teacher or gemm_lora or pdl_decode or (gemm and every_config)" -rf --tb=short 2>&1 \
    | tail -20 > "$OUT/tests_loraa.txt"
  tail -3 "$OUT/tests_loraa.txt" >> "$LOG"
  mkdir -p "$OUT/prof"
  timeout 150 $B profile --models 7b --formats nvfp4 --batch 32 --decode fused,fused-gemm-lora-pdl \
    --out "$OUT/prof" 2>&1 | grep -v Warn > "$OUT/prof/log.txt"
  # 256 + 512, one process, batch 16 first (the process's first run reads low), the three modes alternating twice
  m="fused-cublas-lora,fused,fused-gemm-lora-pdl"
  timeout 240 $B rollout --models 7b --formats nvfp4 --batch 16,32,64 --prompt 256 --new 512 --decode "$m,$m" \
    --out "$OUT/roll_loraa" 2>&1 | grep -v Warn >> "$LOG" ;;
wgpdl)  # issue 10: the wgmma GEMM's LoRA epilogue under PDL (QERL_WGMMA_LORA=pdl: its own build) and x·Aᵀ by Triton
        # up to 256 tokens (QERL_LORA_A_MAX_M=256) against the default, at 64-256 sequences
  lora_builds
  gpu_tests wgpdl 180 tests/test_fused_decode.py tests/test_cuda_fp4.py -k "wgmma_gemm_lora or pdl_decode or fused_kernels_bf16"
  # 256 + 512, one process, batch 16 first (the process's first run reads low), the four modes alternating twice
  # (a profile at 128 sequences, if wanted: $B profile --batch 128 --decode fused,fused-wgmma-lora-pdl-a-256)
  m="fused-s36,fused-lora-a-256,fused-wgmma-lora-pdl,fused-wgmma-lora-pdl-a-256"
  timeout 270 $B rollout --models 7b --formats nvfp4 --batch 16,64,128,256 --prompt 256 --new 512 --decode "$m,$m" \
    --out "$OUT/roll_wgpdl" 2>&1 | grep -v Warn >> "$LOG" ;;
cmp)  # issue 10: NVFP4 vs BF16-LoRA rollouts with the defaults (session 36's settings beside them), the GRPO step
  lora_builds
  [ -n "${SKIP_TESTS:-}" ] || gpu_tests cmp 150 tests/test_fused_decode.py tests/test_cuda_fp4.py -k "pdl_decode or teacher or lora_a"
  timeout 240 $B rollout --models 7b --formats nvfp4,bf16 --batch 16,32,64,128,256 --prompt 256 --new 512 \
    --decode fused,fused-s36 --out "$OUT/roll_cmp" 2>&1 | grep -v Warn >> "$LOG"
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  timeout 200 $B step --models 7b --formats nvfp4,bf16 --batch 128 --group 8 --micro 16 --new 1024 --gc on \
    --steps 2 --out "$OUT/grpo" 2>&1 | grep -v Warn >> "$LOG" ;;
prof128)  # issue 10: the decode step's kernels at 128 / 256 sequences with the defaults, NVFP4 and BF16-LoRA
  lora_builds
  gpu_tests prof128 200 tests/test_cuda_fp4.py -k "gemm_lora or graph_replay or model_shapes_and_graphs"
  timeout 240 $B profile --models 7b --formats nvfp4,bf16 --batch 128,256 --decode fused --out "$OUT/prof" 2>&1 \
    | grep -v Warn >> "$LOG" ;;
perm)  # issue 10: the wgmma GEMM's permuted tokens written by the launch before it (norm / SwiGLU / attention)
        # against session 37's permute launch (fused-s37), at 64-256 sequences
  lora_builds
  gpu_tests perm 200 tests/test_fused_decode.py tests/test_cuda_fp4.py -k "permuted or decode_attention_matches or \
gemm_lora_pdl_decode or graph_sampler_matches or mma_gemm_lora"
  # 256 + 512, one process, batch 16 first (the process's first run reads low), the two modes alternating twice
  timeout 200 $B rollout --models 7b --formats nvfp4 --batch 16,64,128,256 --prompt 256 --new 512 \
    --decode fused-s37,fused,fused-s37,fused --out "$OUT/roll_perm" 2>&1 | grep -v Warn >> "$LOG"
  [ -n "${LORA_A:-}" ] && lora_a_sweep ;;
cmp38)  # issue 10 after session 38's call 2: the permuted-input GPU test, the x·Aᵀ sweep (quick), NVFP4 vs BF16-LoRA
         # rollouts with the defaults (one pass, one process)
  build 2
  gpu_tests cmp38 120 tests/test_fused_decode.py -k "permuted_inputs"
  lora_a_sweep
  timeout 200 $B rollout --models 7b --formats nvfp4,bf16 --batch 16,32,64,128,256 --prompt 256 --new 512 \
    --out "$OUT/roll_cmp" 2>&1 | grep -v Warn >> "$LOG" ;;
next38)  # issue 10 after session 38: its two unmeasured opt-ins, x·Aᵀ under PDL itself (fused-lora-a-pdl) and the
         # producers' permuted copy stored in 16-byte units (fused-vec-perm): their GPU tests (NEXT38=roll: the A/B)
  if [ "${NEXT38:-tests}" = tests ]; then
    lora_builds
    gpu_tests next38 420 tests/test_fused_decode.py -k "permuted_inputs or gemm_lora_pdl_decode"
  else
    build 2
    # 256 + 512, one process, batch 16 first (the process's first run reads low), the four modes twice, the second
    # pass in reverse order (A B C D D C B A: the order effect of sessions 37-38, ~2.5%, cancels in the mean)
    m="fused,fused-vec-perm,fused-lora-a-pdl,fused-s38-next"
    r="fused-s38-next,fused-lora-a-pdl,fused-vec-perm,fused"
    timeout 450 $B rollout --models 7b --formats nvfp4 --batch 16,32,64,128,256 --prompt 256 --new 512 \
      --decode "$m,$r" --out "$OUT/roll_next38" 2>&1 | grep -v Warn >> "$LOG"
  fi ;;
tableab)  # session 52: 7B NVFP4 rollouts with the installed GEMM table against an older one (TABLE_OLD, a file), one
  # process per table in the order new, old, new, old ($OUT/roll_tab_{new,old}{1,2}); the tree's table is restored
  : "${TABLE_OLD:?set TABLE_OLD to the older table (a JSON file)}"
  build 2
  T=$(python3 -c "import torch; from qerl.kernels import cuda_fp4 as c; print(c._table_path(torch.cuda.get_device_name(0)))")
  cp "$T" /tmp/table_new.json
  for run in new1 old1 new2 old2; do
    if [ "${run%?}" = new ]; then cp /tmp/table_new.json "$T"; else cp "$TABLE_OLD" "$T"; fi
    timeout 150 $B rollout --models 7b --formats nvfp4 --batch 16,64,128,256 --prompt 256 --new 512 --decode fused \
      --out "$OUT/roll_tab_$run" 2>&1 | grep -v Warn >> "$LOG"
  done
  cp /tmp/table_new.json "$T" ;;
cmp39)  # issue 10 after session 39's call 2: NVFP4 vs BF16-LoRA with x·Aᵀ under PDL itself (the new default)
  build 2
  if [ "${CMP39:-roll}" = roll ]; then
    timeout 450 $B rollout --models 7b --formats nvfp4,bf16 --batch 16,32,64,128,256 --prompt 256 --new 512 \
      --decode fused,fused --out "$OUT/roll_cmp" 2>&1 | grep -v Warn >> "$LOG"
  else
    timeout 300 $B profile --models 7b --formats nvfp4,bf16 --batch 128 --decode fused --out "$OUT/prof" 2>&1 \
      | grep -v Warn >> "$LOG"
  fi ;;
waves)  # issue 10, session 40: the wgmma GEMM's per-instruction stalls and its waves with cold and warm caches
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/prof"
  build 2
  P="python3 -m benchmarks.wgmma_profile --ncu --m 128 --configs 16,0,2,2"
  QERL_WGMMA_PIPE=2 timeout 150 "$NCU" --clock-control none --kernel-name regex:fp4_wgmma_kernel --section SourceCounters \
    --section WarpStateStats --import-source no -f -o "$OUT/prof/src_gateup_m128" $P --shapes 37888x3584 >> "$LOG" 2>&1
  "$NCU" -i "$OUT/prof/src_gateup_m128.ncu-rep" --page source --print-source sass --csv > "$OUT/prof/src_sass.csv" \
    2>> "$LOG" || "$NCU" -i "$OUT/prof/src_gateup_m128.ncu-rep" --page source --csv > "$OUT/prof/src_sass.csv" 2>> "$LOG"
  head -c 600 "$OUT/prof/src_sass.csv" >> "$LOG"
  for cc in all none; do
    QERL_WGMMA_PIPE=2 timeout 120 "$NCU" --clock-control none --cache-control $cc --kernel-name regex:fp4_wgmma_kernel \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
      $P --shapes 8448x3584,16896x3584,37888x3584 > "$OUT/prof/waves_$( [ $cc = all ] && echo cold || echo warm ).txt" 2>&1
  done
  grep -E "fp4_wgmma_kernel|Duration|DRAM Throughput|Compute \(SM\) Throughput|Waves Per SM" "$OUT"/prof/waves_*.txt \
    >> "$LOG" ;;
desc40)  # issue 10, session 40: the descriptor halves against the code before, kernel-level, A B B A
  OUT=$(cd "$OUT" && pwd); LOG="$OUT/log.txt"; OLD=/root/desc40_old
  rm -rf "$OLD"; mkdir -p "$OLD"; cp -r qerl benchmarks "$OLD/"
  for f in fp4_wgmma_gemm.cu fp4_wgmma_ops.cuh; do
    git show "${DESC40_BASE:-f6974de}:qerl/kernels/csrc/$f" > "$OLD/qerl/kernels/csrc/$f" 2>> "$LOG"
  done
  grep -c "uint64_t desc)" "$OLD/qerl/kernels/csrc/fp4_wgmma_ops.cuh" >> "$LOG"  # 5: the old wrappers
  (cd "$OLD" && PYTHONPATH="$OLD:$PYTHONPATH" build 2) &
  p1=$!
  build 2
  wait $p1
  gpu_tests desc40 200 tests/test_cuda_fp4.py -k wgmma
  W="python3 -m benchmarks.wgmma_profile --configs tuned --m 64,128,256"
  for run in old:1 new:1 new:2 old:2; do
    IFS=: read -r tree pass <<< "$run"
    if [ "$tree" = old ]; then
      (cd "$OLD" && PYTHONPATH="$OLD:$PYTHONPATH" timeout 90 $W --out "$OUT/desc_${tree}_$pass" 2>&1 \
        | grep "prof\]" >> "$LOG")
    else
      timeout 90 $W --out "$OUT/desc_${tree}_$pass" 2>&1 | grep "prof\]" >> "$LOG"
    fi
  done ;;
ablate40)  # issue 10, session 40: the wgmma main loop's parts, each left out in a timing-only build
  pids=()
  V=${ABLATE40_V:-1 3 4 7 8}
  for v in $V; do
    timeout 300 python3 -m benchmarks.wgmma_ablate --build-only $v >> "$LOG" 2>&1 &
    pids+=($!)
  done
  build 2
  for p in "${pids[@]}"; do wait "$p"; done
  timeout 200 python3 -m benchmarks.wgmma_ablate --variants "0,${V// /,}" --m 64,128,256 --out "$OUT/ablate" 2>&1 \
    | grep "ablate\]\|wrote\|Error" >> "$LOG" ;;
dqvar)  # issue 10, session 72: the CUDA dequantization's build variants (see the header)
  dqvar_run ;;
next72)  # issue 10 after session 72: its two experiments in one call (see the header)
  builds_at_once - QERL_WGMMA_STSM=1 &  # the two extension builds while the variants (nvcc alone) run
  bpid=$!
  dqvar_run
  next72_tar
  wait "$bpid"
  (export QERL_WGMMA_STSM=1; gpu_tests stsm 200 tests/test_cuda_fp4.py -k stsm)
  next72_tar
  ab_runs QERL_WGMMA_STSM abk "0:1 1:1 1:2 0:2" 60 "prof\]" python3 -m benchmarks.wgmma_profile --configs tuned \
    --lora "${ABK_LORA:-0}" --m "${ABK_M:-64,128,256,512}"
  python3 -m benchmarks.ab_compare "$OUT" --prefix abk --base 0 --md "$OUT/ab.md" >> "$LOG" 2>&1
  next72_tar ;;
kzab)  # issue 10, session 69: the KZ build's unsplit kernels against the default's (see the header)
  builds_at_once - QERL_GEMM_KZ=1
  kzab_passes
  if [ "${KZAB_NCU:-1}" = 1 ]; then  # KZAB_NCU=0: the timed passes only (a short call)
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    mkdir -p "$OUT/prof"
    for b in 0 1; do
      QERL_GEMM_KZ=$b timeout "${NCU_SECS:-150}" "$NCU" --clock-control none --kernel-name regex:fp4_gemm_kernel \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section InstructionStats --print-details all python3 -m benchmarks.wave_balance \
        --products --eager --m "$KZ_M" --kz "$([ $b = 1 ] && echo 1,2 || echo 1)" > "$OUT/prof/ncu_kz$b.txt" 2>&1
      grep -E "kz-eager|fp4_gemm_kernel|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Shared Memory Config|Dynamic Shared|Static Shared|Executed Instructions  |Issued Warp|Stall|Block Limit" \
        "$OUT/prof/ncu_kz$b.txt" | sed "s/^/ncu KZ=$b: /" | head -150 >> "$LOG"
      gzip -f "$OUT/prof/ncu_kz$b.txt"
    done
  fi
  tar czf "$OUT/kzab.tgz" -C "$OUT" $(cd "$OUT" && ls -d kzab prof log.txt 2>/dev/null) ;;
kz68)  # issue 10, session 68: the mma.sync GEMM's K split across CTAs (see the header)
  builds_at_once - QERL_GEMM_KZ=1
  (export QERL_GEMM_KZ=1; gpu_tests kz 200 tests/test_cuda_fp4.py -k "${KZ_TESTS:-kz_splits or gemm_every_config}")
  KZ_M=${KZ_M:-17,32,48,64}
  QERL_GEMM_KZ=0 kz_products 90 "default build: " kz_default 1
  export QERL_GEMM_KZ=1
  if [ "${KZ_SWEEPS:-1}" = 1 ]; then  # KZ_SWEEPS=0: the products only (a short call)
    timeout 100 python3 -m benchmarks.wave_balance --kz 1,2,4 --ctas 132,264,296,330,396 2>&1 \
      | grep "balance\]\|Error" >> "$LOG"
    timeout 60 python3 -m benchmarks.wave_balance --config 4,2,1,8 --kz 1,2,3 --ctas 112,132,224,264 2>&1 \
      | grep "balance\]\|Error" >> "$LOG"
  fi
  kz_products "${KZ_SECS:-200}" "" kz 1,2,3,4
  tar czf "$OUT/kz.tgz" -C "$OUT" $(cd "$OUT" && ls -d kz kz_default tests_kz.txt log.txt 2>/dev/null) ;;
abk)  # a kernel-level A/B of one wgmma build switch (see the header)
  SW=${ABK_SWITCH:-}
  case "$SW" in
    QERL_WGMMA_TMA|QERL_WGMMA_LORA|QERL_WGMMA_STSM) ;;
    *) echo "abk: ABK_SWITCH='$SW'; valid: QERL_WGMMA_TMA, QERL_WGMMA_LORA, QERL_WGMMA_STSM" | tee -a "$LOG" >&2
       exit 2 ;;
  esac
  RUNS=${ABK_RUNS:-0:1 1:1 1:2 0:2}
  BASE=${RUNS%%:*}
  # the GPU tests on every build but the baseline (or on ABK_TESTED's)
  kernel_ab "$SW" abk "$RUNS" \
    "${ABK_TESTED:-$(for r in $RUNS; do v=${r%%:*}; [ "$v" = "$BASE" ] || echo "$v"; done | sort -u)}" "${ABK_TESTS:-}" ;;
lora42)  # issue 10 / 11: the decode step with no adapters (rank 0) beside rank 32, both formats
  build 2
  if [ "${LORA42:-roll}" = roll ]; then
    timeout 500 $B rollout --models 7b --formats nvfp4,bf16 --batch 16,64,128,256 --ranks 0,32 --prompt 256 --new 512 \
      --out "$OUT/roll_lora" 2>&1 | grep -v Warn >> "$LOG"
  else
    timeout 400 $B profile --models 7b --formats nvfp4,bf16 --batch 128 --ranks 0,32 --decode fused --out "$OUT/prof" \
      2>&1 | grep -v Warn >> "$LOG"
  fi ;;
bf16sec)  # issue 11: the BF16 GEMV's sector-wide loads (the default) against session 34's pair loads (see the header)
  builds_at_once QERL_BF16_LOADS=pair QERL_BF16_LOADS=sector
  if [ -z "${SKIP_TESTS:-}" ]; then
    (export QERL_BF16_LOADS=sector; gpu_tests bf16 170 tests/test_cuda_fp4.py tests/test_fused_decode.py -k bf16)
  fi
  for run in pair:1 sector:1 sector:2 pair:2; do
    IFS=: read -r v pass <<< "$run"
    (export QERL_BF16_LOADS=$v; timeout 90 python3 -m benchmarks.cuda_bench --models 7b --m 1,8 --fmts "" \
      --out "$OUT/bench_${v}_$pass" 2>&1 | grep -v Warn | tail -8 >> "$LOG")
  done
  for b in 8 2; do
    timeout 120 $B rollout --models 7b --formats bf16 --batch $b --prompt 256 --new 512 \
      --decode fused-bf16-pair,fused,fused,fused-bf16-pair --out "$OUT/roll_sec" 2>&1 | grep -v Warn >> "$LOG"
  done ;;
next43)  # issue 11 after session 43 (see the header)
  mkdir -p "$OUT/hbm"
  timeout 150 python3 -m benchmarks.hbm_pattern_bench --shapes 7b-gate_up,7b-down,7b-qkv \
    --patterns fp4,bf16-pair,bf16-sector --loads 2,4 --splits 1,2 --out "$OUT/hbm" 2>&1 | grep -v Warn | tail -40 >> "$LOG"
  build 2
  timeout 150 $B rollout --models 7b --formats bf16 --batch 8 --prompt 256 --new 512 \
    --decode fused,fused-bf16-pdl,fused-bf16-pdl,fused --out "$OUT/roll_pdl" 2>&1 | grep -v Warn >> "$LOG" ;;
lora44)  # issue 11: what each part of the decode GEMV's LoRA costs (see the header)
  build 2 &
  pids=$!
  ABLATE=${ABLATE:-1,2,3,4}
  for v in ${ABLATE//,/ }; do
    python3 -c "from benchmarks import wgmma_ablate as wa; wa.module($v, 'QFP4_LORA_ABLATE'); print('lora ablate $v built')" \
      >> "$LOG" 2>&1 &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
  for pass in 1 2; do
    timeout 150 python3 -m benchmarks.lora_gemv_bench --models 7b --m 8,2 --fmts nvfp4 --pdl --ablate "$ABLATE" \
      --out "$OUT/lora_$pass" 2>&1 | grep -v Warn | grep -v "^|" | tail -40 >> "$LOG"
  done ;;
wgpeak)  # issue 10: the wgmma MMA schedule alone against the GEMM (see the header)
  build 2
  peak 200
  timeout 100 python3 -m benchmarks.wgmma_profile --configs tuned --m 64,128,256 --out "$OUT/prof" 2>&1 \
    | grep "prof\]" >> "$LOG" ;;
kfix)  # issue 10: the wgmma GEMM's per-CTA fixed cost (see the header)
  build 2
  for m in 0 32; do
    timeout 150 python3 -m benchmarks.wgmma_profile --configs 16,0,2,2 --m 128 --lora $m --out "$OUT/prof$m" \
      --shapes 16896x896,16896x1792,16896x3584,16896x7168,16896x14336,37888x3584 2>&1 | grep "prof\]" >> "$LOG"
  done
  for it in 28 56 112 224 4096; do
    peak 100 --n 128 --ops rs --wgs 4 --depth 1 --iters "$it" --tag "_i$it"
  done
  peak 100 --n 128 --ops rs --wgs 4 --depth 1 --iters 28 --grid 296 --tag _g296 ;;
dec49)  # issue 10: the MMA schedule with the GEMM's decode (see the header)
  peak 200 --n 128,256 --ops rs,rsdec --wgs 2,4 --depth 1 --tag _dec
  peak 100 --n 128 --ops rs,rsdec --wgs 4 --depth 1 --iters 28 --grid 296 --tag _dec_g296 ;;
tail)  # issue 10: the last partial wave's tiles split along K (see the header)
  builds_at_once - QERL_WGMMA_TAIL=0
  gpu_tests tail 300 tests/test_cuda_fp4.py -k tail_split
  if [ "${TAIL:-kernel}" = kernel ]; then
    for pass in 1 2; do
      timeout 150 python3 -m benchmarks.wgmma_profile --configs tail --lora 32 --m "${TAIL_M:-64,128,256}" \
        --out "$OUT/tail_$pass" 2>&1 | grep "prof\]" >> "$LOG"
    done
  else
    timeout 420 $B rollout --models 7b --formats nvfp4 --batch 16,64,128,256 --prompt 256 --new 512 \
      --decode fused-no-tail,fused,fused,fused-no-tail --out "$OUT/roll_tail" 2>&1 | grep -v Warn >> "$LOG"
  fi ;;
regress)  # every GPU test in parts (see the header)
  part=${PART:-all}
  case "$part" in
    all) set -- tests ;;
    1) set -- tests/test_cuda_fp4.py -k "not wgmma" ;;
    2) set -- tests/test_cuda_fp4.py -k wgmma ;;
    3) set -- tests --ignore=tests/test_cuda_fp4.py ;;
    *) echo "gpu_bench.sh regress: PART=$part is not a part; choose all, 1, 2 or 3" >&2; exit 2 ;;
  esac
  res="$OUT/tests_regress_$part.txt"
  # the builds the wgmma tests compare against, all at once first (inside the tests they would compile one by one)
  case "$part" in all|2) builds_at_once - QERL_WGMMA_TMA=0 QERL_WGMMA_TAIL=0 ;; esac
  timeout "${SECS:-560}" python3 -m pytest -v -m gpu "$@" -rfE --tb=short -p no:cacheprovider > "$res" 2>&1
  grep -cE " PASSED| FAILED| ERROR| SKIPPED" "$res" | sed 's/^/tests finished: /' >> "$LOG"
  grep -E " FAILED| ERROR|^=+ .*(passed|failed|error)" "$res" >> "$LOG" ;;
layers)  # issue 10's per-layer targets at the current code (see the header)
  build 2
  timeout "${SECS:-400}" python3 -m benchmarks.kernel_bench --models 7b --fmts bf16,nvfp4,mxfp4 --layout kernel \
    --m "${LAYERS_M:-17,32,64,128,256,512,1024,2048,4096}" --out "$OUT/layers" 2>&1 | grep "\[bench\]" >> "$LOG" ;;
slices)  # issue 10, large M: dequantize + cuBLAS in slices (see the header)
  build 2
  gpu_tests slices 240 tests/test_cuda_fp4.py -k "column_slices or row_slices or dequantize"
  timeout "${SLICES_SECS:-240}" python3 -m benchmarks.dequant_slices_bench --write-table --out "$OUT/slices" \
    --models "${SLICES_MODELS:-7b}" --fmts "${SLICES_FMTS:-nvfp4,mxfp4}" --ops "${SLICES_OPS:-fwd,bwd}" 2>&1 \
    | grep "installed\|^|" >> "$LOG"
  for v in 1:1 0:1 0:2 1:2; do
    IFS=: read -r s p <<< "$v"
    QERL_DEQUANT_SLICES=$s timeout 120 python3 -m benchmarks.kernel_bench --models "${SLICES_MODELS:-7b}" \
      --fmts "bf16,${SLICES_FMTS:-nvfp4,mxfp4}" --layout kernel \
      --m "${SLICES_M:-512,1024,2048,4096}" --out "$OUT/layers_s${s}_$p" 2>&1 | grep "\[bench\]" | sed "s/^/s$s p$p /" >> "$LOG"
  done ;;
dq|dqlean)  # issue 10: the in-loop dequantizing GEMM, both products (see the header)
  if [ "${1:-}" = dqlean ]; then
    export QERL_CUDA_GEMV=0 DQ_FMTS=${DQ_FMTS:-nvfp4} DQ_KZ=${DQ_KZ:-0,1,2,4} DQ_TEST_SECS=${DQ_TEST_SECS:-150} \
      DQ_SECS=${DQ_SECS:-150}
    bpid=
  else
    build 2 &
    bpid=$!
  fi
  dq_build
  [ -n "$bpid" ] && wait "$bpid"
  if [ -z "${SKIP_TESTS:-}" ]; then
    gpu_tests dq "${DQ_TEST_SECS:-240}" tests/test_cuda_dq.py
    if grep -q "failed\|error" "$OUT/tests_dq.txt"; then  # where the wrong outputs land ($OUT/dq_probe.txt)
      timeout 60 python3 -m benchmarks.dq_probe --out "$OUT/dq_probe.txt" > /dev/null 2>&1
    fi
  fi
  timeout "${DQ_SECS:-300}" python3 -m benchmarks.dq_gemm_bench --models 7b --fmts "${DQ_FMTS:-nvfp4,mxfp4}" \
    --ops "${DQ_OPS:-bwd,fwd}" --m "${DQ_M:-512,2048}" --kz "${DQ_KZ:-0,1,2,3,4,6,8}" --out "$OUT/dq" --write-table 2>&1 \
    | grep "^|\|Error\|wrong\|dq\] the\|installed" >> "$LOG" ;;
dqdecode)  # issue 10, session 65: the dq kernel's exact and mma decodes (see the header)
  pids=
  if [ -n "${DQDEC_AHEAD:-}" ]; then build 2 & pids=$!; fi
  for d in exact mma; do
    QERL_CUDA_GEMV=0 QERL_DQ_DECODE=$d dq_build "$d" &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
  [ -n "${DQDEC_AHEAD:-}" ] && ahead_bench
  for d in exact mma; do
    QERL_CUDA_GEMV=0 QERL_DQ_DECODE=$d timeout "${DQDEC_TEST_SECS:-100}" python3 -m pytest -q -m gpu \
      tests/test_cuda_dq.py > "$OUT/tests_dq_$d.txt" 2>&1
    tail -2 "$OUT/tests_dq_$d.txt" | sed "s/^/$d: /" >> "$LOG"
    QERL_CUDA_GEMV=0 QERL_DQ_DECODE=$d timeout "${DQDEC_SECS:-100}" python3 -m benchmarks.dq_gemm_bench --models 7b \
      --fmts "${DQDEC_FMTS:-nvfp4,mxfp4}" --ops bwd,fwd --m 512,2048 --kz 0,1,2 --out "$OUT/dec_$d" 2>&1 \
      | grep "^|\|Error\|dq\] the" | sed "s/^/$d: /" >> "$LOG"
  done ;;
dqws)  # issue 10, session 66: the dq kernel's warp-specialized main loop against the plain one (see the header)
  pids=
  for v in ${DQWS_BUILDS:-ws:mma ws:exact plain:mma}; do
    QERL_CUDA_GEMV=0 QERL_DQ_LOOP=${v%%:*} QERL_DQ_DECODE=${v##*:} dq_build "$v" &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
  for v in ${DQWS_BUILDS:-ws:mma ws:exact plain:mma}; do
    n=${v/:/_}
    QERL_CUDA_GEMV=0 QERL_DQ_LOOP=${v%%:*} QERL_DQ_DECODE=${v##*:} timeout "${DQWS_TEST_SECS:-100}" python3 -m pytest \
      -q -m gpu tests/test_cuda_dq.py -x > "$OUT/tests_dq_$n.txt" 2>&1
    tail -2 "$OUT/tests_dq_$n.txt" | sed "s/^/$v: /" >> "$LOG"
    QERL_CUDA_GEMV=0 QERL_DQ_LOOP=${v%%:*} QERL_DQ_DECODE=${v##*:} timeout "${DQWS_SECS:-100}" python3 -m \
      benchmarks.dq_gemm_bench --models 7b --fmts "${DQWS_FMTS:-nvfp4}" --ops bwd,fwd --m "${DQWS_M:-512,2048}" \
      --kz 0,1,2 --out "$OUT/ws_$n" 2>&1 | grep "^|\|Error\|dq\] the" | sed "s/^/$v: /" >> "$LOG"
  done
  tar czf "$OUT/ws.tgz" -C "$OUT" $(cd "$OUT" && ls -d ws_* tests_dq_*) ;;
dqstages)  # issue 10, session 67: the plain dq loop's copy depth (see the header)
  specs=${DQST_BUILDS:-4:0:ws 4:0 6:0 5:0 4:3 6:3 4:1:ws 4:2:ws 4:3:ws}
  st_env() {  # the switches of build spec $1 = stages:ablate[:loop], mma decode
    local r=${1#*:}
    local l=plain
    [ "$r" = "${r#*:}" ] || l=${r#*:}
    echo "QERL_CUDA_GEMV=0 QERL_DQ_DECODE=mma QERL_DQ_STAGES=${1%%:*} QERL_DQ_ABLATE=${r%%:*} QERL_DQ_LOOP=$l"
  }
  pids=
  for v in $specs; do
    (export $(st_env "$v"); dq_build "$v") &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
  for v in $specs; do
    n=${v//:/_}
    kz=0,1,2
    r=${v#*:}
    if [ "${r%%:*}" = 0 ]; then
      env $(st_env "$v") timeout "${DQST_TEST_SECS:-100}" python3 -m pytest -q -m gpu tests/test_cuda_dq.py -x \
        > "$OUT/tests_st_$n.txt" 2>&1
      tail -2 "$OUT/tests_st_$n.txt" | sed "s/^/$v: /" >> "$LOG"
    else
      kz=1
    fi
    env $(st_env "$v") timeout "${DQST_SECS:-100}" python3 -m benchmarks.dq_gemm_bench --models 7b \
      --fmts "${DQST_FMTS:-nvfp4}" --ops bwd,fwd --m "${DQST_M:-512,2048}" --kz $kz --out "$OUT/st_$n" 2>&1 \
      | grep "^|\|Error\|dq\] the" | sed "s/^/$v: /" >> "$LOG"
  done
  tar czf "$OUT/st.tgz" -C "$OUT" $(cd "$OUT" && ls -d st_* tests_st_*) ;;
dqncu)  # issue 10, session 67: Nsight Compute on the dq GEMM beside cuBLAS (see the header)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/prof"
  pids=
  for l in ${DQNCU_LOOPS:-plain ws}; do
    QERL_CUDA_GEMV=0 QERL_DQ_DECODE=mma QERL_DQ_LOOP=$l dq_build "$l" &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
  for l in ${DQNCU_LOOPS:-plain ws}; do
    QERL_CUDA_GEMV=0 QERL_DQ_DECODE=mma QERL_DQ_LOOP=$l timeout "${DQNCU_SECS:-200}" "$NCU" --clock-control none \
      --kernel-name regex:'gemm|nvjet|dq_ws|xmma' --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section SchedulerStats --print-details all python3 -m benchmarks.dq_ncu ${DQNCU_ARGS:-} \
      > "$OUT/prof/ncu_dq_$l.txt" 2>&1
    grep -E "^  [a-zA-Z_0-9]+.*\(|dq_ncu|Throughput|Duration|Shared|Pipe|pipe|Stall|stall|Eligible|Issued Warp|Registers|Bank" \
      "$OUT/prof/ncu_dq_$l.txt" | cut -c1-160 | head -150 | sed "s/^/$l: /" >> "$LOG"
  done ;;
ahead)  # issue 10, session 66: the next weight's rebuild under this GEMM at large M (see the header)
  build 2
  ahead_bench ;;
dqablate)  # issue 10, session 65: the dq kernel's parts, then the wgmma GEMM at large M (see the header)
  pids=
  if [ "${DQABL_SWEEP_SECS:-200}" != 0 ]; then build 2 & pids=$!; fi
  for v in ${DQABL:-0 1 2 3 4}; do
    QERL_CUDA_GEMV=0 QERL_DQ_ABLATE=$v dq_build "$v" &
    pids="$pids $!"
  done
  for p in $pids; do wait "$p"; done
  for v in ${DQABL:-0 1 2 3 4}; do
    QERL_CUDA_GEMV=0 QERL_DQ_ABLATE=$v timeout 90 python3 -m benchmarks.dq_gemm_bench --models 7b --fmts nvfp4 \
      --ops bwd,fwd --m "${DQABL_M:-2048}" --kz 1 --out "$OUT/abl/$v" 2>&1 | grep "^|\|Error\|dq\]" >> "$LOG"
  done
  [ "${DQABL_SWEEP_SECS:-200}" = 0 ] || timeout "${DQABL_SWEEP_SECS:-200}" python3 -m benchmarks.cuda_gemm_bench \
    --models 7b --fmts nvfp4 --prev-layout kernel --sweep-m "${DQABL_SWEEP_M:-512,1024,2048}" \
    --m "${DQABL_SWEEP_M:-512,1024,2048}" --out "$OUT/abl/sweep" 2>&1 | grep -v Warn >> "$LOG"
  mkdir -p "$OUT/abl"
  tar czf "$OUT/abl.tgz" -C "$OUT" abl ;;
dqup)  # issue 10: the GRPO update with the in-loop dequantizing GEMM and without (see the header)
  build 2 &
  bpid=$!
  dq_build
  wait $bpid
  ab_runs QERL_DQ_GEMM dq "0:1 all:1 all:2 0:2" "${DQUP_SECS:-130}" micro python3 -m qerl.bench update \
    --models 7b --formats "${DQUP_FMTS:-nvfp4,bf16}" --micro "${DQUP_MICRO:-2}" --prompt 64 --new 1024 --gc on \
    --repeats 3 ;;
upslice)  # issue 10, session 55: the GRPO update where the slice tables apply (see the header)
  build 2
  ab_runs QERL_DEQUANT_SLICES up "1:1 0:1 0:2 1:2" "${UPSLICE_SECS:-130}" micro python3 -m qerl.bench update \
    --models 7b --formats "${UPSLICE_FMTS:-nvfp4,bf16}" --micro "${UPSLICE_MICRO:-2}" --prompt 64 --new 1024 --gc on \
    --repeats 3 ;;
row32)  # issue 11: the 32B NVFP4 batch-8 row and its profiles (see the header)
  build 2 &
  bpid=$!
  timeout "${ROW32_SECS:-280}" $B rollout --models 32b --formats nvfp4 --batch 8 --prompt 256 --new 2048 \
    --decode fused,fused --out "$OUT/roll32" 2>&1 | grep -v Warn >> "$LOG"
  wait "$bpid"
  ranks=${ROW32_RANKS:-32,0}
  for r in ${ranks//,/ }; do
    timeout 150 $B profile --models 32b --formats nvfp4 --batch 8 --ranks "$r" --decode fused --out "$OUT/prof32" 2>&1 \
      | grep -v "Warn\|_warn_once" >> "$LOG"
  done ;;
ends)  # issue 11, session 58: the step's opening and close in one launch each (see the header)
  build 2 &
  bpid=$!
  ab=fused-torch-ends,fused,fused,fused-torch-ends
  timeout "${ENDS_SECS:-200}" $B rollout --models 7b --formats nvfp4 --batch 8,2 --prompt 256 --new 2048 \
    --decode $ab --out "$OUT/roll_ends" 2>&1 | grep -v Warn >> "$LOG"
  wait "$bpid"
  gpu_tests ends 150 tests/test_fused_decode.py -k "step_ends or pdl_decode_is or graph_sampler or sample_race"
  timeout 90 $B profile --models 7b --formats nvfp4 --batch 8 --decode fused,fused-torch-ends --out "$OUT/prof" 2>&1 \
    | grep -v "Warn\|_warn_once" >> "$LOG"
  timeout "${ENDS_FMT_SECS:-200}" $B rollout --models 7b --formats mxfp4,bf16 --batch 8 --prompt 256 --new 2048 \
    --decode $ab --out "$OUT/roll_ends_fmt" 2>&1 | grep -v Warn >> "$LOG" ;;
rope)  # issue 11, session 59: RoPE + cache write inside the attention split kernel, and the buffer reuse (see the header)
  build 2 &
  bpid=$!
  ab=fused,fused-rope-in-split,fused-rope-in-split,fused
  timeout "${ROPE_SECS:-200}" $B rollout --models 7b --formats nvfp4 --batch 8,2 --prompt 256 --new 2048 \
    --decode $ab --out "$OUT/roll_rope" 2>&1 | grep -v Warn >> "$LOG"
  wait "$bpid"
  gpu_tests rope 200 tests/test_fused_decode.py \
    -k "${ROPE_TESTS:-rope_in_the_attention or graphs_replayed or graph_captures or step_ends or pdl_decode_is or graph_sampler}"
  timeout 90 $B profile --models 7b --formats nvfp4 --batch 8 --decode fused-rope-in-split,fused --out "$OUT/prof" 2>&1 \
    | grep -v "Warn\|_warn_once" >> "$LOG"
  [ -z "${SKIP_REUSE:-}" ] && timeout "${REUSE_SECS:-200}" $B reuse --models 7b --formats nvfp4 --batch 8 --group 8 \
    --prompt 512 --new 256 --steps 6 --passes 0,1,1,0 --out "$OUT/reuse" 2>&1 | grep -v Warn >> "$LOG" ;;
rope32)  # the same A/B at 32B and 14B, and for MXFP4 / BF16-LoRA at 7B (see the header)
  build 2 &
  bpid=$!
  ab=fused,fused-rope-in-split,fused-rope-in-split,fused
  timeout "${ROPE32_SECS:-300}" $B rollout --models 32b --formats nvfp4 --batch 8 --prompt 256 --new 2048 \
    --decode $ab --out "$OUT/roll_rope32" 2>&1 | grep -v Warn >> "$LOG"
  wait "$bpid"
  timeout "${ROPE14_SECS:-150}" $B rollout --models 14b --formats nvfp4 --batch 8 --prompt 256 --new 2048 \
    --decode $ab --out "$OUT/roll_rope14" 2>&1 | grep -v Warn >> "$LOG"
  timeout "${ROPE_FMT_SECS:-150}" $B rollout --models 7b --formats mxfp4,bf16 --batch 8 --prompt 256 --new 2048 \
    --decode $ab --out "$OUT/roll_rope_fmt" 2>&1 | grep -v Warn >> "$LOG" ;;
ncu32)  # issue 11, session 60: Nsight Compute on the 32B decode GEMV's small products (see the header)
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  mkdir -p "$OUT/prof"
  build 2
  timeout "${NCU_SECS:-400}" "$NCU" --clock-control none --kernel-name regex:fp4_gemv --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
    --section SchedulerStats --print-details all python3 -m benchmarks.lora_gemv_bench --ncu \
    --models "${NCU_MODELS:-32b}" --m "${NCU_M:-8}" --fmts nvfp4 --linears "${NCU_LINEARS:-q|k|v,o,gate|up}" \
    > "$OUT/prof/ncu_gemv.txt" 2>&1
  grep -E "fp4_gemv|\[ncu\]|Throughput|Duration|Stall|stall|Eligible|Issued Warp|Achieved Occupancy|Registers" \
    "$OUT/prof/ncu_gemv.txt" | head -200 >> "$LOG" ;;
tune32)  # issue 11, session 61: the 32B decode linears' tuned launch configurations in the rollout (see the header)
  build 2
  timeout "${TUNE32_SECS:-240}" python3 -m benchmarks.gemv_tune --models 32b --fmts nvfp4 --m 8 --ranks 32 \
    --out "$OUT/tune" --write-table 2>&1 | grep -v Warn >> "$LOG"
  cp qerl/kernels/tuned/cuda_gemv_*.json "$OUT/tune/" 2>/dev/null
  timeout "${TUNE32_ROLL_SECS:-300}" $B rollout --models 32b --formats nvfp4 --batch 8 --prompt 256 --new 2048 \
    --decode fused,fused-heuristic-gemv,fused-heuristic-gemv,fused --out "$OUT/roll_tune32" 2>&1 | grep -v Warn >> "$LOG" ;;
tune32ab)  # the installed table against the heuristic at 14B batch 8 and 32B batch 2 / 8 (see the header)
  build 2
  ab=fused,fused-heuristic-gemv,fused-heuristic-gemv,fused
  timeout "${TAB14_SECS:-150}" $B rollout --models 14b --formats nvfp4 --batch 8 --prompt 256 --new 2048 --decode $ab \
    --out "$OUT/roll_tab14" 2>&1 | grep -v Warn >> "$LOG"
  timeout "${TAB32_SECS:-330}" $B rollout --models 32b --formats nvfp4 --batch 2,8 --prompt 256 --new 2048 --decode $ab \
    --out "$OUT/roll_tab32" 2>&1 | grep -v Warn >> "$LOG" ;;
grpo)
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  $B step --models 7b --formats "${FORMATS:-nvfp4,bf16}" --batch 128 --group 8 --micro 16 --new 1024 --gc on \
    --steps 2 --out "$OUT" 2>&1 | grep -v Warn >> "$LOG" ;;
esac
tail -40 "$LOG"
