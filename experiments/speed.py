"""Speed and memory (paper Tables 3, 5-8, Fig. 1/11): measure on a GPU, then render ours beside the paper's.

    python -m experiments.speed --run core|step|large|small   # on a CUDA host: the benchmark stages (qerl.bench)
    python -m experiments.speed                               # anywhere: render results/speed/speed.md from CSVs
    python -m experiments.speed --merge OUT --name h100_run5  # keep a GPU session's CSVs under raw/ and merge
    python -m experiments.speed --run scaling                 # on a multi-GPU host: data-parallel steps, 1/2/4 GPUs

Rendering reads only ``results/speed/{memory,rollout,step,scaling,update,dequant}.csv`` (written by ``qerl.bench`` and
``benchmarks.dequant_bench``), raw runs named in the text, and the paper's
numbers (``paper_figures/paper/*.csv``); ratios are always ours against our own BF16-LoRA in the same run
(same git SHA and device), never against the paper's. Paper numbers come from vLLM 0.10.1 (Marlin FP4 kernel);
ours from qerl's own sampler and Triton kernels.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pandas as pd

from experiments.speed_tables import (
    _devices,
    _floor,
    _ident,
    _raw_md,
    _raw_rollouts,
    batch_rollout_table,
    curves_table,
    dequant_table,
    layout_table,
    memory_table,
    rank_table,
    reuse_table,
    rollout_table,
    scaling_table,
    slices_ab_table,
    step_ab_table,
    step_table,
    update_table,
)
from experiments.speed_targets import (
    TARGET_RUNS,
    _last_pass,
    _limits_or_none,
    missed_targets_table,
    target_rows,
    targets_table,
)
from qerl.bench_common import IDENT as BENCH_IDENT
from qerl.bench_common import SCALING_IDENT, UPDATE_IDENT

STAGES = {
    "core": [["memory", "--models", "7b", "--formats", "bf16,nf4,mxfp4,nvfp4"],
             ["rollout", "--models", "7b", "--formats", "nvfp4,bf16,mxfp4,nf4", "--batch", "8,2"],
             ["rollout", "--models", "7b", "--formats", "nvfp4,bf16,mxfp4,nf4", "--batch", "8,2", "--decode", "unfused"],
             ["profile", "--models", "7b", "--formats", "nvfp4,bf16", "--batch", "8", "--decode", "fused,unfused"]],
    "step": [["step", "--models", "7b", "--formats", "nvfp4,bf16,mxfp4,nf4", "--batch", "8", "--gc", "both"],
             ["step", "--models", "32b", "--formats", "nvfp4,bf16", "--batch", "8", "--gc", "on"]],
    "large": [["rollout", "--models", "14b,32b", "--formats", "nvfp4,bf16,mxfp4,nf4", "--batch", "8,2"]],
    # issue 13: the same global batch (128 completions = 16 prompts x G 8, 1024 new tokens) on 1, 2 and 4 GPUs
    "scaling": [["scaling", "--models", "7b", "--formats", "nvfp4,bf16", "--nproc", "1,2,4", "--batch", "128",
                 "--group", "8", "--micro", "8", "--new", "1024", "--gc", "on", "--steps", "3"]],
    "small": [["rollout", "--models", "3b", "--formats", "nvfp4,bf16,mxfp4,nf4", "--batch", "8,2"],
              ["rollout", "--models", "7b", "--formats", "nvfp4,bf16", "--batch", "2", "--ranks", "16,64"]],
}
# 32B BF16 (65 GB of weights) loads on an 80 GB GPU only with expandable segments (fragmentation otherwise)
STAGE_ENV = {"step": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
             "large": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}
def render(root: Path) -> str:
    env = ""
    for p in sorted((root / "raw").glob("*/env.json")):
        env = p.read_text()
        break
    dev = _devices(root) or ("NVIDIA H100 80GB HBM3" if "H100" in env else "see raw/*/env.json")
    layers = (root / "layers_h100.md").read_text() if (root / "layers_h100.md").exists() else "_no layer table_\n"
    cuda = (root / "cuda_fp4_h100.md").read_text() if (root / "cuda_fp4_h100.md").exists() else "_no CUDA GEMV table_\n"
    gemm = (root / "cuda_gemm_h100.md").read_text() if (root / "cuda_gemm_h100.md").exists() else "_no CUDA GEMM table_\n"
    lora_gemv = ((root / "lora_gemv_h100.md").read_text().split("\n", 1)[1] if (root / "lora_gemv_h100.md").exists()
                 else "_no LoRA GEMV table_\n")
    md = f"""# Speed and memory (ours beside the paper's)

Device: {dev}. Torch 2.11 (CUDA 13), triton 3.6. Shape presets with random weights (exact Qwen2.5-*-Instruct
shapes), LoRA rank 32 on all seven projections, prompt 256 tokens, 2048 new tokens with `ignore_eos`, one sampler
per model (static KV cache, CUDA graphs, unmerged LoRA). Ratios are ours vs our own BF16-LoRA (and QLoRA) measured
in the same run; paper columns are vLLM 0.10.1 on one H100 (Tables 3, 5-8) and are never mixed into ours.
Raw logs, per-run CSVs and env.json: `results/speed/raw/`.

## Model size (Table 3)
{memory_table(root)}
## Where issues 10 and 11's H100 targets stand
Each target beside the H100 measurement that judges it and the run that made it. The layer rows (forward and
backward) come from session 68's layer table at the current code with the installed GEMM and slice tables
(`raw/h100_s68_layers`: three passes, one process each, on one H100; each layer's µs is the mean of the passes). A
ratio within ~2-3% of its bound is within the spread between passes and machines: session 55's run on another H100
(`raw/h100_s55_tune/layers`, `raw/h100_s55_slices/layers_s1_2`) met M = 64 (1.627×) and the NVFP4 backward at 2048
(0.960×) that this run misses by 0.5-1%, with BF16 cuBLAS 2-4% slower there.

{targets_table(root, *TARGET_RUNS)}
### The targets not met: by how much, and what limits each
The gap is the measured value against the bound (a ratio's shortfall is negative). What limits each target is the
analysis in `results/speed/target_limits.toml`, with the measurements behind it (raw runs; the sessions of
`benchmarks/NOTES.md`).

{missed_targets_table(target_rows(root, *TARGET_RUNS), _limits_or_none(root))}
## Rollout throughput (Tables 5-8, Fig. 1)
The current sampler: fused decode step (`qerl.kernels.fused`, q|k|v and gate|up as one matmul each) and, for
NVFP4/MXFP4 at decode size, the CUDA mma GEMV (`qerl.kernels.cuda_fp4`). † = ratio against a row of another run
(32B BF16 needed `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` to load next to nothing else on 80 GB).
{rollout_table(root, decode="fused")}
### Issue 11's rows against the memory floor (`python -m benchmarks.decode_floor`)
What a step must read at least (the linears in the format's storage, LoRA, lm_head, the KV cache at the mean length),
the bandwidth each target asks for, and the tokens/s the measured copy bandwidth and the spec peak allow; the best
rollout measured so far on that GPU model beside it (any build).

{_floor(root, "H100")}
{_floor(root, "H200")}
### The fused decode step against the unfused one (7B, one run, before the CUDA GEMV; Triton FP4 kernels)
{rollout_table(root / "raw" / "h100_run5", decode=None)}
### Base + LoRA in one CUDA launch against LoRA as its own launches (7B, one run each, best of 2)
`fused-split-lora` is the decode step with x·Aᵀ and the B product as 2 extra launches per linear
(`QERL_CUDA_LORA=0`); `fused` runs them inside the FP4 GEMV launch. Split mode first in each process. Its ×LoRA
column has no BF16 row in these runs. Session 22's build (launch configurations sized for the LoRA variant's own
occupancy, output CTAs summing the LoRA parts; session 24 moved the LoRA term's loads into the warps that use it,
measured per launch in `benchmarks/NOTES.md` session 9):
{_raw_rollouts(root, "h100_s22_lora_b8", "h100_s22_lora_b2")}
BF16-LoRA (session 28, `raw/h100_s28_bf16rows`, one process, split first, second round; 256 + 512 tokens): `fused`
keeps the cast LoRA A in spare rows after each product's weight, so x·Wᵀ and x·Aᵀ are one cuBLAS GEMM
(`qerl.fastdecode.reserve_lora_rows`); `fused-split-lora` runs x·Aᵀ as its own launch (`QERL_LORA_ROWS=0`):
{_raw_rollouts(root, "h100_s28_bf16rows")}
Session 21's first version (`raw/h100_s21_lora_ab`: NVFP4 2078 vs 1936, MXFP4 2109 vs 1972 at batch 8): its gate|up
launch ran in two waves (the LoRA variant fitted one CTA per SM fewer than the configuration assumed). Per linear
(`python -m benchmarks.lora_gemv_bench`; plain GEMV / LoRA in the launch / LoRA as its own launches):
{lora_gemv}
### Programmatic dependent launch across the decode step (one run each, best of 2, no-PDL first)
`fused-pdl`: every kernel of the step's layers (the fused Triton kernels and the CUDA FP4 GEMV) launched with
programmatic dependent launch (`QERL_PDL=1`, the default since session 23): each starts while its predecessor
drains and waits for it before reading; the GEMV loads its first weight batch and prefetches the next 8 chunks into
L2 before that wait. `fused-no-pdl`: the same kernels launched one after the other. The same tokens either way
(`tests/test_fused_decode.py::test_gpu_pdl_decode_is_bit_identical`).
{_raw_rollouts(root, "h100_s23_pdl_7b", "h100_s23_pdl_32b")}
### The decode step's opening and close in one launch each (session 58; old / new / new / old in one process)
`fused`: the step opens with one launch (the new token's cache slot unmasked, its embedding row, each row's rotary
cos / sin read from a table of every position made once per shape: `qerl.kernels.fused.step_begin`) and closes with
one (the bookkeeping after the draw: padding finished rows, the output columns, EOS, t + 1: `sample_finish`), and the
draw reads the lm_head's bf16 logits (no float32 copy). `fused-torch-ends` (`QERL_FUSED_STEP_ENDS=0`): session 57's
~30 torch launches for the same work. 7B batch 8 step at KV 1024: 2899 vs 2972 µs, 259 vs 289 launches
(`raw/h100_s58_ends/profile.csv`). The same tokens and stops; log-probs and entropies agree to float32 rounding
(`tests/test_fused_decode.py::test_gpu_fused_step_ends_are_bit_identical`). Both modes warm the prefill first
(`Sampler.precapture`: session 55's one-pass rows, `h100_s55_decode`, carried a first 7B batch-8 prefill of 0.29 s in
their tokens/s; the prefills here took 0.07-0.16 s).
{_raw_rollouts(root, "h100_s58_ends", "h100_s58_ends_fmt", "h100_s58_32b_ab")}
### Bias + RoPE + cache write inside the attention split kernel (session 59's opt-in; measured in session 60)
`fused-rope-in-split` (`QERL_FUSED_ROPE_ATTN=1`): where the decode attention is the Triton split kernel (below 128
(row, KV head) pairs: 7B up to batch 31, 32B up to 15), each split rotates its KV group's q rows from the q|k|v
projection's output itself, and the split that holds the new token's slot rotates its k, takes k and v into its tiles
from registers and writes both into the cache (`qerl.kernels.fused.rope_attention`): one launch a layer fewer.
`fused-rope-split` (`QERL_FUSED_ROPE_ATTN=0`, the default again since session 60): bias + RoPE + cache write a launch
of their own, session 58's step. The same cache bit for bit and the same tokens
(`tests/test_fused_decode.py::test_gpu_rope_in_the_attention_split_kernel_changes_nothing`). One H100, code 6f689ec,
old / new / new / old in one process per model (the rows were measured as `fused`, session 59's default, and
renamed when the default went back; `raw/h100_s60_rope/README.md`):
{_raw_rollouts(root, "h100_s60_rope", "h100_s60_rope32", "h100_s60_rope14", "h100_s60_rope_fmt")}
Not supported: the launch it saves costs less than the work it adds. Every split rotates its group's q rows again (7B
batch 8 at KV 1024: the split kernel 333 µs a step against 265 µs + 50 µs for the two launches;
`raw/h100_s60_rope/profile.csv`), so the step ran 1.2% slower at 7B batch 8 (2588 vs 2620 tok/s), 1.2% at batch 2,
1.0% / 1.5% for MXFP4 / BF16-LoRA, 0.4-0.5% at 14B and 32B. One process per model, two passes per mode, no
interval: at 14B and 32B the difference is within the passes' own spread (~0.4%), so only its sign repeats there; at
7B it repeated on a second machine (`raw/h100_s60_default`: 2624 / 2624 vs 2658).
### The sampler's buffers across prompt lengths (`python -m qerl.bench reuse`; built in session 59, measured in 60)
A training run's batches differ in padded prompt length (a multiple of 64 under CUDA graphs). Since session 58 the
sampler keeps its KV cache and captured graphs for any batch whose prompts are no longer than those they were made
for; before (`QERL_SAMPLER_REUSE=0`), every new length re-allocated the cache and re-captured every graph. GSM8K train
prompts (Table 1's template) through the shape preset's tokenizer (not Qwen's: its prompts run 121-407 tokens, median
197), the same draws in every pass, one fresh sampler a pass, one H100 (code 6f689ec):
{reuse_table(root, "h100_s60_reuse")}
At Table 1's cap (256 prompt tokens: `raw/h100_s59_call1`) every step's padded length was the cap and both rules
built the buffers once. These rollouts ran before session 60's fix of the capture's warm-up draw
(`Sampler._run_step`): the reused sampler's tokens differed from a fresh one's (not its speed).
### The 14B / 32B small products' launch configurations from the tuner (session 61)
`benchmarks.gemv_tune` on the 32B decode linears at M = 8, LoRA rank 32 (`raw/h100_s61_tune32`): q|k|v and o run
fastest with 5 splits and batches of 2 chunks, `(5, 1, 2, 1)`, against the rule's `(5, 1, 4, 1)` / `(6, 1, 4, 1)`:
12.14 vs 13.17 µs and 10.07 vs 11.07 µs a launch; gate|up and down kept the rule's pick. 14B has the same two shapes
(hidden 5120, 40 / 8 heads), so the H100 table (`qerl/kernels/tuned/cuda_gemv_nvidia_h100_80gb_hbm3.json`, shipped
since session 61) serves both at M = 1-8. `fused` = the table, `fused-heuristic-gemv` = the rule, A B B A in one
process per model, code 2272ef5 (call 4 on one machine, call 5 on another):
{_raw_rollouts(root, "h100_s61_tune32", "h100_s61_tab32", "h100_s61_tab14")}
The table was ahead or level in 8 of 8 pairs: 32B batch 8 +0.8 / +1.2% (call 4) and +0.6 / +0.5% (call 5), batch 2
+1.7 / +1.1%, 14B batch 8 +0.0 / +2.9%. One process per model and call, two passes per mode: no interval; the 14B
pairs spread more than their difference. Session 25's table for 7B / 14B (other entries) lost in the rollout, so none
shipped then. Tried before it this session and refuted: a deeper L2 prefetch of the GEMV's weights before its wait (16
chunks a strip instead of 8: 32B batch 8 717.7 / 717.3 vs 735.7 / 739.2 tok/s; `raw/h100_s61_pf`, the code at
5572829). Nsight Compute on the 32B small products (`raw/h100_s61_ncu32`): q|k|v ran at 42% of DRAM peak with 26% of
the warps resident (register-bound at 89 registers, 0.85 waves), two thirds of a warp's cycles between instructions
stalled on global loads (long scoreboard). The 32B batch-8 step at KV 1024 with the table and with the rule
(`raw/h100_s61_prof32`, code 6b7b16b): 10293 vs 10389 µs, q|k|v + o 25.4 vs ~26.9 µs a layer; the rest unchanged
(gate|up 68.7 µs a layer, down 35.9, attention 18.2, lm_head 542 µs a step, add + RMSNorm 334, RoPE 125).
Session 62 tried two L2 hints on the large products (`raw/h100_s62_l2`, code e28c15f, a build each, removed after):
the `.L2::256B` fetch-size hint on the weight and scale loads (32B gate|up with LoRA 66.4 µs against 65.8 / 65.6
without) and a rolling L2 prefetch 4 / 8 chunks ahead in the main loop (75.2 / 77.0 µs; down 37.2 / 37.8 against 33.3
/ 33.2). The plain gate|up runs at 2.57 TB/s there; more requests for the same bytes only slowed it.
### Throughput per LoRA rank (Table 9, Fig. 11)
{rank_table(root)}
Earlier builds (unfused decode, Triton FP4 GEMV only) are kept in `raw/h100_run1`–`h100_run4`: 7B batch 8 NVFP4
827 / BF16 739 tok/s, 14B 470 / 409, 32B 284 / 225.

## One resident layout (issue 10, item 3): the base only in the CUDA kernels' layout
`quant.layout=kernel` holds an NVFP4/MXFP4 base only in the CUDA kernels' re-laid-out layout (`qerl.kernels.relaid`)
instead of the compressed-tensors tensors plus the kernels' second copy; `auto`, the default since session 27, picks it
wherever the CUDA FP4 kernels run. Each kernel-layout row beside the compressed-layout row of the same configuration,
measured in the same session on the same machine (`scripts/layout_gpu.sh`; `raw/h100_s27_layout/`, whose
`ab/ab_order.txt` gives every run of the batch-8 A/B in order, including session 25's build):
{layout_table(root)}
## One GRPO step end to end (Table 3; rollout + log-probs + update)
The step benchmark runs `qerl.train` on the shape preset with the toy task's prompts (~60 tokens, not 256) and
2048 new tokens per completion (random weights never stop early, unlike the paper's first 30 steps).
{step_table(root)}
The realistic step (7B, 16 prompts × G 8, micro 16, 1024 new, GC) with session 37's defaults (`raw/h100_s37_cmp/`,
098d2c0; both formats in one process, BF16-LoRA first, two steps each; one run): NVFP4 27.47 s vs BF16-LoRA 28.43 s
(rollout 8.88 vs 10.00 s, log-probs 4.89 vs 4.86, update 13.70 vs 13.57); the NVFP4 step alone in the call before
(`grpo/`): 27.21 s (rollout 8.96). Session 32's pair (`raw/h100_s32_grpo`): 28.28 vs 28.28 s. On an H200 (session
39, 9e7b0b3, `raw/h200_s39_grpo/`, the same design, one run): NVFP4 24.83 s vs BF16-LoRA 24.41 s, 0.98× (rollout 7.94
vs 7.67, log-probs 4.48 vs 4.44, update 12.42 vs 12.30): the H200's bandwidth speeds BF16's decode more than NVFP4's.
Session 48 on an H200 (98600f9, `raw/h200_s48_grpo/README.md`, two processes in reversed format order): NVFP4 24.58 /
24.59 s vs BF16-LoRA 24.44 / 24.56 s, 0.994× / 0.999× (rollout 1.00× / 1.02×, update 0.99×).
Session 51 on an H200 (919885a: the tail split, `raw/h200_s51_grpo/README.md`, the same two orders in two calls on one
machine): NVFP4 24.05 / 24.07 s vs BF16-LoRA 24.44 / 24.32 s, **1.016× / 1.010×** (rollout 7.20 / 7.20 s vs 7.73 /
7.65 s: 1.07× / 1.06×; log-probs 0.99×, update 0.99×); NVFP4's rollout 0.5 s shorter than session 48's. MXFP4 23.61 s
(1.03× against the BF16-LoRA mean; its update 12.00 s) and NF4 35.91 s (0.68×), one pass, a third call.
Session 53 on an H200 (08ad229: the installed table of session 52, `raw/h200_s53_grpo/README.md`, one process, NVFP4
first): NVFP4 24.88 s vs BF16-LoRA 25.19 s, **1.012×** (rollout 7.68 vs 8.11 s: 1.06×; log-probs 1.00×, update
0.99×). Both formats ran 3-6% slower than on session 51's machine (the same kernels but for the table); the ratio held.
Session 55 on an **H100** (098199f with the re-swept H100 GEMM table, `raw/h100_s55_grpo/README.md`, two processes
on one machine, NVFP4 first then BF16-LoRA first): NVFP4 26.57 / 26.70 s vs BF16-LoRA 28.05 / 28.37 s, **1.056× /
1.062×**. Rollout 8.25 / 8.37 s vs 9.88 / 10.19 s: 1.20× / 1.22×. Log-probs 0.99× / 0.99×, update 0.99× / 0.99×.
Session 37's H100 pair above was 27.47 vs 28.43 s (1.035×).
### The training kernels of session 29, same machine (7B, 16 prompts × G 8, micro 16, 1024 new, GC; one H100)
`raw/h100_s29e` (build 20aa705: RMSNorm and SiLU·up fused forward and backward, `qerl.kernels.train_fused`; the
kernel layout's dense weight by the CUDA kernel, `csrc/fp4_dequant.cu`; LoRA as one addmm) against
`raw/h100_s29f_unfused` (the same build with `QERL_FUSED_TRAIN=0 QERL_CUDA_DEQUANT=0`: Hugging Face's RMSNorm and
SwiGLU ops and the Triton dequantization; the addmm is in both), one measured step each after a warm-up step:
{step_ab_table(root, "h100_s29e", "h100_s29f_unfused", "fused")}
### Where a GRPO micro-batch's GPU time goes (`python -m qerl.bench update`)
One micro-batch of the realistic step (16 completions of 64 + 1024 tokens, GC, r32) through the training forward:
the log-prob pass (no grad) and forward + backward, timed (mean of 2 after a warm-up), then profiled (kernel time by
category; "other" holds the fused kernels in the runs made before their names were grouped: h200_s29c's norm and
SiLU·up, h100_s29h's RoPE, 39 ms). Runs in order: `h100_s29a`
(before: HF ops, Triton dequantization, LoRA as F.linear + scale + add), `h100_s29b` (CUDA dequantization, LoRA
addmm), `h200_s29c` (an H200: fused RMSNorm and SiLU·up on and off, same process order), `h100_s29g` (the
dequantization's whole-sector stores), `h100_s29h` (+ fused RoPE).
{update_table(root)}
## Data-parallel GRPO steps on several GPUs (issue 13; `python -m experiments.speed --run scaling`)
The same global batch on 1, 2 and 4 GPUs of one host: 128 completions per step (16 prompts × G 8, whole groups per
rank), 1024 new tokens, micro-batches of 8, gradient checkpointing, GRPO, LoRA rank 32, `torchrun` with NCCL
(NVLink multicast off). Times are the slowest rank's (each phase's own slowest rank, so on several GPUs the phases
may add up to a little more than the step), averaged over the steps after the first (CUDA-graph capture);
"all-reduce" is the LoRA gradient exchange inside the update, timed between device synchronisations. Efficiency =
tokens/s per GPU ÷ the one-GPU row's tokens/s (the same configuration in the same session; † = another session);
"×" columns are each phase's speed-up over one GPU (ideal = the number of GPUs).
{scaling_table(root)}
### Reward curves on 1 vs N GPUs (issue 13; `python -m paper_figures.scaling_curves`)
A short evidence run (one arm at the shared rate, the same seeds and global batch) on one GPU and data-parallel
on N. Effect = N GPUs − 1 GPU, Welch 95% interval over seeds; a metric matches when the interval contains 0 and the
effect is within the seed-to-seed sd, differs when the interval excludes 0 (details, per-step bands and hardware:
`scaling_curves_<scale>.md`; figure: `results/figures/scaling_curves_<scale>.png`).
{curves_table(root)}
## Decoder linears at decode size: the CUDA mma GEMV (`python -m benchmarks.cuda_bench`)
The decode path of the rollouts above (M <= 16). BF16, Triton and CUDA columns come from one run.
{cuda}
## Decoder linears at GRPO batch sizes (M > 16): the CUDA GEMMs (`python -m benchmarks.cuda_gemm_bench`)
Issue 10. The same re-laid-out weights as the GEMV: the mma.sync kernel (tokens staged in shared memory) and, on
sm_90, the wgmma kernel (weights as the register operand, permuted tokens read by the tensor cores); the tuned table
takes the faster per shape and M; `prev` is the path without them. The H100 table below is session 66's sweep (9d2955c;
`raw/h100_s66_tune/README.md`): `prev` now on the kernels' layout, the one training holds (dequantize + cuBLAS at
every M; session 55's `prev` was the compressed-tensors layout's Triton GEMM, hence its 0.7-0.95× at M <= 64). The NVFP4
layer (`qmm`) took 128 / 185 / 277 / 446 µs at M = 64 / 128 / 256 / 512 (session 55: 131 / 186 / 279 / 445; session
32: 135 / 204 / 313 / 497), 61 of the 72 table entries unchanged:
{gemm}
### The layer against its roofline (`python -m benchmarks.decode_floor`, session 43)
Above M ≈ 96 the FP4 linears are bound by the tensor cores, so the ratio the floors allow falls to 1.0 by M = 256
(H200) / 384 (H100); the FP4 GEMM runs at 0.2-0.5 of its floor, cuBLAS at 0.6-0.75 of BF16's.

{_floor(root, "H100", "layer_roofline_table")}
{_floor(root, "H200", "layer_roofline_table")}
### The dense weight for large M (prefill, the update) from the kernel layout (`python -m benchmarks.dequant_bench`)
What dequantize + cuBLAS pays per call at M > the tuned crossover: the Triton kernel (per element gathers) against the
CUDA kernel (`csrc/fp4_dequant.cu`, the GEMV's bit decode), same bits, same run; TB/s = packed bytes read + BF16
bytes written per second:
{dequant_table(root)}
### The 7B layer at large M on the H200 at the current code, and dequantize + cuBLAS in slices (session 54)
Issue 10's per-layer targets beyond decode: `python -m benchmarks.kernel_bench --models 7b --fmts bf16,nvfp4,mxfp4
--layout kernel` (`scripts/gpu_bench.sh layers`; the default resident layout, the dispatcher's path at each M; forward,
and the backward `grad_input = g·Ŵ` from M = 512), before the slice table (`raw/h200_s54_layers`, d16574d):
{_raw_md(root, "h200_s54_layers", "layers_h200.md")}
Above M = 512 the FP4 linears rebuild Ŵ in BF16 and call cuBLAS. Since session 54 they may do it in slices of Ŵ:
the forward by rows, the backward by columns (the CUDA dequantization reads a column slice's strips where they lie).
Each slice's product is one cuBLAS call writing its columns of the output. Where a slice is worth it is measured per
device (`python -m benchmarks.dequant_slices_bench --write-table`, `qerl/kernels/tuned/dequant_slices_<gpu>.json`),
and the H200's table slices only the products whose cuBLAS shape is slow: a 3584-wide output over a long
contraction (the forward's down_proj, the backward's gate/up and q/o), at M = 2048-4096. BF16 cuBLAS runs the same
FLOPs 7-11% slower in that orientation. The gain does not come from L2: the slices are 2048 × 18944 bf16 (78 MB),
larger than the L2. The table was chosen in one run (call 4) and checked in another (call 5): the same layers, with
the table and without, one process each in the order 1, 0, 0, 1 (`raw/h200_s54_slices/README.md`; random weights,
seeds 1000 + linear index, medians of graph replays over weight copies larger than L2). Call 5 ran call
4's table as the sweep wrote it, which also sliced a few products at M = 8192-16384; those rows lost 0.5-3% below, so
the installed table is the same sweep re-read with no slices above M = 4096 (at 16384 it runs the "whole weight"
column; at 1024-4096 it is the table measured here):

{slices_ab_table(root, "h200_s54_slices/call5")}
### The same on the H100 (session 55)
The per-layer table at session 55's code with the new GEMM table installed and no slice table yet
(`raw/h100_s55_tune/layers`, 098199f + that table; on the H100 the large-M forward then slices Ŵ by the Triton-era
table's `cublas_chN` rows, the backward rebuilds the whole weight):
{_raw_md(root, "h100_s55_tune/layers", "layers_h100.md")}
The H100's slice sweep (`raw/h100_s55_slices/slices`, both formats, M 512-4096) and its table checked against the rule
without a table, one process each in the order 1, 0, 0, 1 (`raw/h100_s55_slices/README.md`). "Without" is that rule,
not the whole weight, for the forward. The backward gained in all 8 rows at M 2048-4096 (+2.1…+6.0%, both formats).
The forward did not beat the Triton-era rows: NVFP4 -2.6…-4.0% at 2048-4096 in both passes, MXFP4 -0.4…+2.2%. The FP4
rows moved at most 3.5% between passes, BF16's up to 10% between these processes (so the vs-BF16 columns carry that
noise). So the installed H100 table covers the backward alone (`"ops":
["bwd"]`; `--table-from ... --ops bwd`, the same picks), and the forward keeps the Triton-era rule:

{slices_ab_table(root, "h100_s55_slices")}
### Rollouts at GRPO batch sizes (7B, prompt 256, 512 new tokens; `python -m qerl.bench rollout --batch 16,32,64,128,256`)
How far each format is from what the GPU allows (`python -m benchmarks.decode_floor`, session 43): at 128 sequences
NVFP4's linears are bound by the tensor cores, not by bytes, so the ratio the floors allow shrinks with the batch,
to about 1.0 at 256 on the H200.

{_floor(root, "H100", "roofline_table")}
{_floor(root, "H200", "roofline_table")}
Session 55 (H100, 098199f with session 55's re-swept H100 GEMM table, `raw/h100_s55_cmp/README.md`: the command of
session 39, `scripts/gpu_bench.sh cmp39`, one process, each setting twice back to back, the second pass shown).
The H100's rows before this were session 38's (below: 1.59 / 1.32 / 1.12 / 0.94× at 32-256 sequences, one pass).
NVFP4 now 1.59 / 1.43 / 1.17 / 1.00× BF16-LoRA by tokens/s (pass 1: 1.62 / 1.42 / 1.16 / 1.00). By decode rate it is
1.66 / 1.53 / 1.22 / 1.00× (pass 2). NVFP4's tokens/s rose 9.6 / 6.1 / 6.8% at 64 / 128 / 256 over session 38's;
BF16-LoRA's rose 0.8-1.3%. These runs cannot split that gain between the new table and the kernel changes of sessions
39-53, which the H100 had not run before (TMA staging, the tail splits, descriptor halves):
{batch_rollout_table(root, "h100_s55_cmp")}
Session 53 (08ad229, H200, `raw/h200_s53_cmp/README.md`: the same command with the installed table, session 52's
sweep re-read without tail splits below one wave): decode-rate ratios 1.41 / 1.27 / 1.04 / 0.95× at 32 / 64 / 128 /
256 sequences (pass 2), within 0.01 of session 52's. The installed table against session 42's in one call
(`raw/h200_s53_tableab/README.md`): +1.3% at 64 sequences, +0.1% at 128, -0.1% at 256 (noise floor ~0.5%):
{batch_rollout_table(root, "h200_s53_cmp")}
Session 52 (4a50a54, H200, `raw/h200_s52_cmp/README.md`: the same command with the GEMM table re-swept by a tuner
that times tail splits where they fill a partial wave): decode-rate ratios 1.38 / 1.27 / 1.035 / 0.95× at 32 / 64 /
128 / 256 sequences (pass 2). This machine ran BF16-LoRA 0.7-3.1% slower than session 51's; the table's own effect,
both tables in one call (`raw/h200_s52_tableab/README.md`), was +1.1% at 64 sequences, -0.1% at 128, -0.3% at 256.
The installed table is this one re-read under a stricter candidate rule (857f844), whose rollouts were not run:
{batch_rollout_table(root, "h200_s52_cmp")}
Session 51 (919885a, H200, `raw/h200_s51_cmp/README.md`: the same command with the tail split, session 50's
default, and session 51's pick of its splits): decode-rate ratios 1.40 / 1.25 / 1.02 / 0.94× at 32 / 64 / 128 / 256
sequences (pass 2; session 48: 1.40 / 1.23 / 1.00 / 0.93), by tokens/s 1.36 / 1.21 / 1.02 / 0.96. NVFP4's decode rate
rose 0.7-1.1% at 64, 1.5-1.6% at 128 and 1.2% at 256 over session 48's; BF16-LoRA's moved -0.4…+0.1%:
{batch_rollout_table(root, "h200_s51_cmp")}
Session 48 (98600f9, H200, `raw/h200_s48_cmp/README.md`: the same command, the default kernels' machine code
unchanged since session 42): decode-rate ratios 1.40 / 1.23 / 1.00 / 0.93× at 32 / 64 / 128 / 256 sequences, by
tokens/s 1.36 / 1.19 / 1.00 / 0.94 (session 42's below within ±0.01):
{batch_rollout_table(root, "h200_s48_cmp")}
Session 42 (a1f5756, **on an H200** — the only kind lent since session 39, so these rows do not compare with the
H100 rows: BF16's decode gains more from the H200's 4.8 TB/s than NVFP4's does; since session 39 NVFP4 gained session
40's descriptor halves, session 41's TMA staging and this session's re-swept H200 table; `raw/h200_s42_cmp/`, the same
command as session 39's below, one process, each setting twice back to back, the second pass shown; the first in the
CSV). Ratios 1.36 / 1.20 / 1.01 / 0.94× at 32-256 sequences (session 39: 1.37 / 1.19 / 0.99 / 0.91). The 128-sequence
graph step (`raw/h200_s42_prof128/`): NVFP4 7557 µs vs BF16-LoRA 7582; wgmma GEMMs 4298 µs vs cuBLAS 4387:
{batch_rollout_table(root, "h200_s42_cmp")}
Session 39 (9e7b0b3, H200; the x·Aᵀ launch before a wgmma GEMM is itself launched under PDL, `QERL_LORA_A_PDL=1`;
`raw/h200_s39_cmp/`):
{batch_rollout_table(root, "h200_s39_cmp")}
That change against session 38's plain launch, with the other opt-in of session 38 (`fused-vec-perm`: the producers'
permuted copy in 16-byte stores, not adopted) and both, at 16-256 sequences in one process, the second pass in reverse
order (H200, 0546422; `raw/h200_s39_next38/README.md`). Where the 128-sequence step goes on the H200
(`raw/h200_s39_prof128/`, KV 1024): NVFP4 graph step 7951 µs vs BF16-LoRA 7794; the wgmma GEMMs take 4541 µs, cuBLAS's
BF16 GEMMs ~4450:
{_raw_rollouts(root, "h200_s39_next38/roll_next38")}
Session 51 (H200, 919885a; `raw/h200_s51_*/README.md`): the split CTAs launched first (`QERL_WGMMA_TAIL=first`)
refuted: gate|up +0.3…+0.6% (mean of two passes) against the default, inside the +0.6…+1.5% the untouched products
drifted in the same runs; removed. The dispatcher's pick fixed: it took kt = wave // rest, so the 64-token gate|up
config (two CTAs an SM: a wave of 264) split 4 ways, measured 1-4% slower than 2 ways; now kt = SMs // rest (kt 2
there: 61.6 against the grid config's 63.4 µs). At 512 and 1024 tokens the pick is the fastest of the grid config and
kt 2-4 for all four 7B products (gate|up 512 -3.7%, q|k|v 1024 -17.5%, the rest unsplit); MXFP4 the same at 64-512.
Every GPU test passed on the default (114; 3 skipped need two GPUs). The 128-sequence graph step
(`raw/h200_s51_prof128/README.md`): NVFP4 7466 µs vs BF16-LoRA 7588; the wgmma GEMMs 4053 µs (session 42: 4298) vs
cuBLAS 4393. Not measured on an H100.
Session 50 (H200, 5d33040-cd9d57a; `raw/h200_s50_*/README.md`): session 49's last hypothesis refuted: the tensor
copies 3 chunks ahead (`la3`) 0.3-1.7% slower, 4 ahead with 5 stages (`la4`) 4-10% slower; removed. An ncu wave and
source profile of the TMA kernel (gate|up at 128 tokens) showed the last partial wave costing a whole wave (296 CTAs
on 132 SMs: 3 x 26.2 µs). New default `QERL_WGMMA_TAIL=1`: the tiles up to the last whole wave run whole and the
last wave's tiles split kt ways along K (`cuda_fp4.wgmma_tail_pick`). With a rank-32 LoRA, gate|up ran 8.8-9.0%
faster at 128 tokens, 10.5-10.8% at 256 and 2.8-3.5% at 64 (kt 2; but the dispatcher picked kt 4 there until
session 51, above). 7B NVFP4 rollouts gained +1.6 / +2.8% at 128 sequences
and +1.2 / +1.6% at 256, inconclusive at 64 (+3.1 / -0.8%). Two passes each. The GPU regression on the new default
was cut short: 31 tests passed before a killed build's lock stalled it (fixed). Built, not run: the split CTAs
launched first (`QERL_WGMMA_TAIL=first`). Not measured on an H100.
Session 49 (H200, c256f9f-963b57f; `raw/h200_s49_*/README.md`): where the wgmma GEMM's 128-token time goes. Its MMA
schedule alone (no loads, no decode) reaches 94-98% of the 989 TFLOPS peak; over one wave the main loop costs 0.805
µs a chunk against 0.577 for its MMAs alone (72%), and the per-launch / per-CTA costs ~2 µs. Not the cause, each
measured: the bytes staged (a 256-row variant staging 40% fewer runs at the same ~640 TFLOPS), the weights' HBM latency
(an L2 prefetch ahead of the copies: 5-14% slower), the producer's wait (refilling after its own MMAs: 1-5% slower),
the decode's instructions (the GEMM's decode with nothing to wait for: 0.957 of peak). Left: the copies' latency
against a lookahead of 2 chunks (`QERL_WGMMA_TMA=la3` / `la4`, 3 / 4 chunks ahead, built, not run on a GPU). No
default changed.
Session 48 (H200, 98600f9; `raw/h200_s48_regress/README.md`): the wgmma and GEMV opt-ins measured and not adopted in
sessions 39-46 were removed (`QERL_WGMMA_LORA=pdl-tail`, `QERL_WGMMA_SPLIT_EPI`, `QERL_WGMMA_TMA=all|bar|all-bar|tok|
all-tok`, `QERL_WGMMA_OCC=2`, `QERL_LORA_SKEW`; code at b686701). The default kernels' machine code is unchanged (eight
builds compared function by function on the CPU), and every GPU test passed (112; 3 skipped need two GPUs), now in ~7
minutes of device time from a cold machine. A timing-only ablation (`raw/h200_s48_ablate/README.md`): the MMAs with A from
shared memory gain what dropping the decode gains (gate|up at 128 tokens 0.881 vs 0.868 of 80.4 µs, both 0.878): the
decode costs its latency, and decoding into shared memory could gain at most ~12% of that kernel.
Session 47 (H200, afd9e45; `raw/h200_s47_l2long/README.md`): the L2 prefetch at the issue's 256 + 2048, 7B NVFP4
batch 8: 32 MB −0.8…−0.5%, gate|up only −1.1…−0.7%, 48 MB −1.5…−1.4% against three default passes (3085-3089 tok/s);
the side branch alone +16 µs a step. Refuted and removed (code at a88f678). The session's first call found every
decode-GEMV LoRA launch failing since fb46e12 (the binding's workspace check); fixed in afd9e45, then 37 + 20 GPU tests
passed in full runs (teacher forcing of every format among them), and 35 + ~25 more before the calls' limits.
Session 46 (H200, d463cbe-5b79085; `raw/h200_s46_*/README.md`): with t ready at a GEMV launch's start (timing-only
ablation 10) the 7B layer at M = 8 is only 3.0-4.6 µs faster than the default's ~65 µs, so computing t in the kernel
before each GEMV was not built; split 0 of each LoRA launch a batch lighter (`QERL_LORA_SKEW=1`): +0.1…+1.0%,
inconclusive. An L2 prefetch of the layer's o and gate|up weights while attention runs (`QERL_L2_PREFETCH`, new): in
the decode chain 3-7% slower (the attention waited for it); on a side stream NVFP4 batch 8 +2.4% at 32 MB (two passes
against three), BF16-LoRA −0.9%, the KV-1024 profile's step +1.1% with gate|up 2.4 µs a layer faster: inconclusive,
an opt-in. The refuted `QERL_LORA_POLL` and `QERL_LORA_A_L2` builds were removed (code at 6624238).
Session 45 (H200, d0c4381-3fd5721; `raw/h200_s45_*/README.md`): two ways of taking the wait's round trips off the
decode GEMV's LoRA term, both bit-identical and both slower, neither adopted: the output warps' early read of the
LoRA count (`QERL_LORA_POLL=early`: 7B decode rate −0.3…−1.3%) and t stored with the launch's tag, no fence and no
acquire (`QERL_LORA_POLL=tag`: NVFP4 / MXFP4 −22…−24% re-loading until the tags arrive, −7…−9% waiting on the count
between loads; BF16-LoRA +2.6% / −1.6%). The LoRA term in a warp of its own per output CTA (b10098f, reverted): NVFP4
−22%, BF16-LoRA −3.8%.
Session 44 (H200, 10881e2-abf399d; `raw/h200_s44_*/README.md`): the 256-thread 128-token wgmma variants at two CTAs
an SM (`QERL_WGMMA_OCC=2`) tie the picks on gate|up (91.9 vs 91.6 µs at 128 tokens) and lose elsewhere: not adopted.
At batch 8 the LoRA costs the 7B NVFP4 decode step 10.6% (graph step 2302 µs without adapters vs 2545 with rank 32;
BF16-LoRA 4791 vs 5021), ~9.5 µs a layer inside the GEMV launches; timing-only builds put ~10 of a layer's 12.4 µs in
the output warps' LoRA term (~5 of it waiting for the LoRA CTAs); an L2 prefetch of A before the PDL wait changes
nothing (`QERL_LORA_A_L2=1`, ±0.2%).
Session 43 (H200, 5a31c93; `raw/h200_s43_lora/README.md`): what the LoRA term costs, as a bound on fusing it further:
the policy without adapters (`--ranks 0`) decodes only 3.0 / 1.9 / 1.8% faster than with rank 32 for NVFP4 at 64 /
128 / 256 sequences (the 128-sequence graph step 7510 vs 7650 µs), BF16-LoRA 9.1 / 7.9 / 5.8% (7185 vs 7737 µs):
NVFP4's LoRA path is already the cheaper one, and without adapters NVFP4 vs BF16 is 1.17 / 0.97 / 0.91×, so the base
linears decide the ratio at 128+. Session 42's token-only TMA experiment (`QERL_WGMMA_TMA=tok|all-tok`,
`raw/h200_s43_tok/README.md`): the 64-token variants still lose 1.9-6.3% with one tensor copy a chunk (the hypothesis
refuted), `tok` at 128 within the noise: not adopted. The BF16 decode GEMV's sector-wide loads
(`QERL_BF16_LOADS=sector`, the default since, a02b4c4 against session 34's `pair` loads; `raw/h200_s43_bf16sec/README.md`): per 7B layer
+2.6 / +7.5% at M = 8 (cuBLAS in the same runs −2.5…+1.0%), decode rate +3.6% at batch 8 and +2.0-2.2% at batch 2
in both passes (BF16-LoRA, 256 + 512, pair / sector / sector / pair in one process per batch: 1554 / 1610 / 1609 / 1553
decode tok/s at batch 8).
Session 42 (H200, e369fa3): the experiments on session 41's TMA staging (next paragraph), kernel-level (`raw/h200_s42_tma/README.md`): a
stage freed by the group barrier instead of the "empty" mbarrier (`QERL_WGMMA_TMA=bar`) is within ~1% of the default
(o at 256 tokens +3%); TMA in the 32/64-token variants too (`all`, `all-bar`) still loses 2.5-7% there, with or
without that mbarrier. None adopted. The H200 GEMM table re-swept with TMA the default (`raw/h200_s42_tune/README.md`):
no pick of the fused 7B products at 64 or 128 tokens changed; gate|up at 256 +1.9%, at 512 +11%.
Session 41 (H200, 39f519d): the wgmma grid variants of 128+ tokens a CTA stage each chunk by three tensor copies (TMA,
the copy engine doing the 128-byte swizzle) completing on an mbarrier, and free a stage on another, instead of every
thread's cp.async and a group barrier per chunk; bit-identical output; **the default** (`QERL_WGMMA_TMA=1`;
`fused-no-tma` = session 40's kernel). Per product at the tuned 128/256-token configs +2.9…+8.8%; rollouts below,
`fused` here = cp.async, `fused-tma` = the new default (A B B A, one process): decode rate +2.5% at 128, +2.9% at 256,
−0.2% at 64 where no kernel changed (`raw/h200_s41_tma/README.md`; the same path at 32/64-token tiles was 3-8% slower,
so they keep cp.async):
{_raw_rollouts(root, "h200_s41_tma/call3/roll_tma")}
Session 40 (H200, f6974de): session 39's tail launch (`fused-wgmma-tail`: the wgmma launch's last, partial wave of row
blocks as a second launch with K split across CTAs) against the default, then in reverse order; GPU tests passed,
gate|up at 128 tokens 1.068× faster alone, the rollouts within the order effect, not adopted
(`raw/h200_s40_tail/README.md`; why: `raw/h200_s40_waves/README.md`, a CTA's time is set inside its SM, not by
memory). Then the MMA descriptor as two 32-bit halves (64c300e): per product +0.7…+5.1%, per layer at 128 tokens −0.8%
(`raw/h200_s40_desc/README.md`, kernel-level, not re-run end to end). What the wgmma main loop's parts cost, from
timing-only builds that leave each out (`raw/h200_s40_ablate/README.md`): copies and decode ~20% at 128-256 tokens,
31-36% at 64; the MMA schedule, per-CTA fixed cost and last wave the rest. Both split-K groups finishing half of
the tile each (`QERL_WGMMA_SPLIT_EPI=1`, bit-identical): 1.4-1.9% slower where it runs, not adopted
(`raw/h200_s40_split/README.md`):
{_raw_rollouts(root, "h200_s40_tail/roll_tail")}
Session 38 (561d7b8, H100: the RMSNorm, SwiGLU and CUDA attention launches also write their output in the wgmma GEMM's
K permutation, so the decode step's four permute launches per layer are gone, `QERL_FUSED_PERMUTE=1`; `raw/h100_s38_cmp/`,
one run, both formats in one process, one pass — a one-pass difference below ~3% is noise):
{batch_rollout_table(root, "h100_s38_cmp")}
That change against session 37's step (`fused-s37`, the GEMM's own permute launch), alternating twice in one process
(NVFP4, 6d3a5c5; both passes, `raw/h100_s38_perm/README.md`): +2.6 / +3.3 / +1.8% at 64 / 128 / 256 on
the second pass, +5.7 / +5.0 / +2.2% on the first, where `fused-s37` ran first; +2.4% at 16, where nothing changed,
is this design's order effect. Where the 128-sequence step goes now (`raw/h100_s38_cmp/prof_call4/`, KV 1024): NVFP4
graph step 8990 µs (9355 before) vs BF16-LoRA 10146; what NVFP4 pays and BF16 does not: x·Aᵀ, 112 launches, 811 µs
(`benchmarks.lora_a_bench`: ~6 µs a launch for every launch configuration and for cuBLAS alike, `raw/h100_s38_cmp/lora_a/`):
{_raw_rollouts(root, "h100_s38_perm/roll_perm")}
Session 37 (098d2c0: x·Aᵀ by the Triton kernel up to 256 tokens, and the wgmma GEMM, which serves most 7B
products at 64-256 tokens, launched under PDL after it so that its main loop overlaps that launch, `QERL_WGMMA_LORA=pdl
QERL_LORA_A_MAX_M=256`; `raw/h100_s37_cmp/`, one run, both formats in one process, the default and session 36's
settings alternating once per batch — with the same settings at 32 the second of the pair read 2-4% higher, so a
one-pass difference below that is noise):
{batch_rollout_table(root, "h100_s37_cmp")}
The four settings at 64-256 sequences alternating twice in one process (NVFP4, 822e14c; the second pass; both in
`raw/h100_s37_wgpdl/README.md`): `fused` = session 36's default (the wgmma epilogue without PDL, x·Aᵀ by cuBLAS above
64 tokens), `fused-lora-a-256` = x·Aᵀ by Triton up to 256, `fused-wgmma-lora-pdl` = the wgmma GEMM under PDL (x·Aᵀ by
Triton up to 64), `fused-wgmma-lora-pdl-a-256` = both (the default since 098d2c0):
{_raw_rollouts(root, "h100_s37_wgpdl/roll_wgpdl")}
Session 36 (c364dc4: the LoRA term at 17-32 tokens in the mma.sync GEMM's epilogue, its x·Aᵀ by one Triton launch
that the GEMM's main loop overlaps under PDL; `raw/h100_s36_cmp/`, one run, both formats in one process, 256 not run;
the same-process A/B of the LoRA paths below and in `raw/h100_s36_pdl/README.md`):
{batch_rollout_table(root, "h100_s36_cmp")}
The LoRA term at 16-64 sequences, three paths alternating in one process (NVFP4; the second of two passes, the first in
the README; `fused` = 84d081f's default, the epilogue without PDL; `fused-gemm-lora-pdl` = the default since;
`fused-cublas-lora` = session 35's x·Aᵀ by cuBLAS and an addmm):
{_raw_rollouts(root, "h100_s36_pdl/roll_loraa")}
Session 32 (build 3cc6ac2: the wgmma GEMM with two chunks of MMAs in flight, the re-swept table; `raw/h100_s32/roll/`,
one run, one process per format, the LoRA term still by an addmm after the GEMM). With the LoRA term in the GEMM's
epilogue (the default since 498df2f), the same run's log: NVFP4 8573 / 11660 / 14369 tok/s at 64 / 128 / 256 sequences
= **1.18× / 1.02× / 0.90×** BF16-LoRA; a second run (`raw/h100_s32/roll2/`, NVFP4 only) 8562 / 11640 / 14311 with it
and 8353 / 11252 / 13977 without:
{batch_rollout_table(root, "h100_s32/roll")}
Session 30 (the wgmma GEMM with the first wgmma table, commit 35381f5; `raw/h100_s30_step/`, one run, one process
per format; the 32-sequence NVFP4 row was the first run on a fresh machine, which reads low; a second run at 64 and
128, `raw/h100_s30_splitk/rollout_first_in_process.csv`, NVFP4 first: 8203 / 9075 vs 7156 / 11124):
{batch_rollout_table(root, "h100_s30_step")}
Session 20 (GEMM g6 with the fused q|k|v and gate|up shapes tuned, commit 45292f0; `raw/h100_s20_rollout3/`, one
run; the first such run, `raw/h100_s20_g6/`, NVFP4 and BF16 only, gave 1.42× / 1.17× / 0.95× / 0.80×):
{batch_rollout_table(root, "h100_s20_rollout3")}
Before (session 19, GEMM g2, untuned fused shapes; `raw/h100_s19_rollout/`):
{batch_rollout_table(root)}
## Decoder linears per layer, all M (Triton kernels; `python -m benchmarks.kernel_bench`, before the CUDA GEMV)
{layers}
"""
    return md


#: a merged row replaces an older one with the same values of these (qerl.bench's identities, every benchmark's)
IDENT = tuple(dict.fromkeys(BENCH_IDENT + SCALING_IDENT))
#: files merged with their own identities: every run's update profile is kept (the run is part of it: a code change
#: between two runs is no column), a dequantization row replaces the same linear's on the same device
MERGE_IDENT = {"update.csv": (*UPDATE_IDENT, "run"),
               "dequant.csv": ("bench", "model", "fmt", "linear", "n", "k", "backend", "device")}


def merge_run(src: Path, root: Path, name: str, sha: str | None = None) -> list[str]:
    """Keep a benchmark session's output (``qerl.bench --out src``: CSVs, env.json, logs) as ``raw/<name>/``
    and merge its rows into ``root``'s top-level CSVs; a row replaces an older one with the same identity
    (model, weights, batch, rank, GC, lengths, decode step). ``sha``: the commit the session ran (the
    device's copy of the tree may carry an older ``.git``). Returns the CSVs merged."""
    import shutil

    src, root = Path(src), Path(root)
    if not src.is_dir():
        raise FileNotFoundError(f"no benchmark output folder {src}")
    dst = root / "raw" / name
    dst.mkdir(parents=True, exist_ok=True)
    merged = []
    for f in sorted(src.rglob("*")):
        if f.is_file() and f.suffix in (".csv", ".json", ".log", ".txt", ".md") and \
                f.resolve() != (dst / f.name).resolve():  # src may already be raw/<name>
            shutil.copy2(f, dst / f.name)
    for f in sorted(dst.glob("*.csv")):
        if f.name not in ("memory.csv", "rollout.csv", "step.csv", "scaling.csv", *MERGE_IDENT):
            continue
        new = pd.read_csv(f)
        new["run"] = name
        if sha:
            new["git_sha"] = sha
        if f.name == "rollout.csv" and "decode" in new:
            new["decode"] = new["decode"].fillna("unfused")
        new.to_csv(f, index=False)
        # an H200's row does not replace an H100's: both are kept (scaling: 2 H200s, 4 H100s)
        ident = MERGE_IDENT.get(f.name, (*IDENT, "device"))
        if "pass" in new:  # an A/B repeated in one process: raw/<name> keeps every pass, the top level the last
            new = _last_pass(new, [k for k in ident if k in new.columns and k != "pass"]).drop(columns=["pass"])
        top = root / f.name
        old = pd.read_csv(top) if top.exists() else pd.DataFrame()
        if f.name == "rollout.csv" and len(old):
            old["decode"] = old["decode"].fillna("unfused") if "decode" in old else "unfused"
        for df in (old, new):  # rows from before the kernels' layout existed held the compressed-tensors one
            if len(df):
                df["layout"] = df["layout"].fillna("compressed") if "layout" in df else "compressed"
        keys = [k for k in ident if k in new.columns and k in old.columns]
        if len(old) and keys:
            ids = set(_ident(new, keys))
            old = old[[i not in ids for i in _ident(old, keys)]]
        out = pd.concat([old, new], ignore_index=True)
        from qerl.results import atomic_write_text

        atomic_write_text(top, out.to_csv(index=False))
        merged.append(str(top))
    return merged


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", choices=sorted(STAGES), nargs="*", default=[])
    ap.add_argument("--root", default="results/speed")
    ap.add_argument("--merge", default="", help="a benchmark output folder to keep under raw/ and merge")
    ap.add_argument("--name", default="", help="with --merge: its name under raw/ (e.g. h100_run5)")
    ap.add_argument("--sha", default="", help="with --merge: the commit the session ran")
    a = ap.parse_args(argv)
    root = Path(a.root)
    if a.merge:
        if not a.name:
            ap.error("--merge needs --name")
        print("merged:", merge_run(Path(a.merge), root, a.name, a.sha or None))
    for stage in a.run:
        import os

        env = dict(os.environ, **STAGE_ENV.get(stage, {}))
        for args in STAGES[stage]:
            subprocess.run([sys.executable, "-m", "qerl.bench", *args, "--out", str(root)], check=False, env=env)
        if stage == "core":  # the decode-size kernels: BF16 vs Triton vs the CUDA mma GEMV, one run
            subprocess.run([sys.executable, "-m", "benchmarks.cuda_bench", "--out", str(root)], check=False, env=env)
    md = render(root)
    from qerl.results import atomic_write_text

    atomic_write_text(root / "speed.md", md)
    print(md)


if __name__ == "__main__":
    main()
