"""Fused kernels for the sampler's decode step: everything of a decoder layer that is not a weight matmul.

A decode step is memory- and launch-bound: unfused, one Qwen2 layer issues ~50 small kernels per token
(RMSNorm as 4-5 elementwise kernels, bias adds, RoPE as 3 per tensor, cache writes, 7 for attention,
SiLU and the product, residual adds), and under CUDA graphs each still costs a few µs. These four
functions cover all of it in 5 launches per layer (4 where the gate|up GEMV applies the SwiGLU itself,
``qerl.fastdecode.FusedLinear.silu_mul``):

* :func:`add_rms_norm`  ``h += delta`` (the residual) then ``x = RMSNorm(h)`` (HF Qwen2/Llama semantics);
* :func:`rope_qkv`      bias, rotary embedding of q and k, and the K/V cache write of one token, from the
                        fused ``[q | k | v]`` projection output;
* :func:`decode_attention`  softmax(q Kᵀ·scale + bias) V over the first S cache slots, GQA, split over
                        the keys (flash-decoding: partial max/sum/accumulator per split, then a combine); on CUDA
                        at large batches (>= 128 (row, KV head) pairs) :mod:`qerl.kernels.cuda_attn`'s kernel,
                        one launch without splits;
* :func:`silu_mul`      ``silu(gate) * up`` from the fused ``[gate | up]`` output;
* :func:`lora_a`        the LoRA down-projection ``x·Aᵀ`` (M <= 16 rows, rank R): one split-K launch whose last
                        CTA per rank block sums the partials (cuBLAS takes a GEMM plus a split-K reduce).
* :func:`sample_race`   the sampler's token draw from logits z (N, V) and exponential noise: the race
                        argmax_v softmax(z/T)_v / E_v, log softmax(z/T) of the drawn token and the entropy of
                        softmax(z/T), in two launches (per-chunk partials over V, then a per-row combine) instead
                        of ~15 (two full softmaxes among them, one CTA per row); it reads the lm_head's bf16
                        logits as float32 itself (no float32 copy);
* :func:`step_begin`    the step's opening in one launch: the new token's cache slot unmasked, its embedding row,
                        and each row's rotary cos / sin gathered from a table of every position (built once per
                        shape by the sampler) instead of HF's rotary embedding computed per step (~14 launches);
* :func:`sample_finish` the step's close in one launch: finished rows padded, column t of the outputs written, EOS,
                        t += 1 (~14 launches before; ``QERL_FUSED_STEP_ENDS=0`` keeps the torch ops of both ends).

With programmatic dependent launch (``qerl.kernels.pdl_enabled``, ``QERL_PDL``) the decode-step kernels are
launched so that each may start while its predecessor drains: their ``PDL`` variant first waits for the previous
grid (``griddepcontrol.wait``: everything it wrote is visible after it) and then lets the next one launch; nothing
is read or written before the wait, so a kernel's completion still implies its predecessors'.

Each has a pure-torch reference (``*_ref``, used on CPU and as the tests' reference) with the same rounding
points as the unfused modules (bf16 results rounded where the HF modules round them); the Triton versions
run on CUDA, or anywhere under ``TRITON_INTERPRET=1``. Attention differs from the unfused matmul path in one
place: the scores stay in fp32 (the unfused path rounds q·k to bf16 first).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from qerl.kernels.base import _counters, _interpret, _triton_ok, pdl_enabled
from qerl.kernels.fused_triton import HAS_TRITON, triton
from qerl.kernels.permuted import permuted_buffer, tag_permuted

if HAS_TRITON:
    from qerl.kernels.fused_triton import (
        _add_rms_norm_kernel,
        _attn_combine_kernel,
        _attn_split_kernel,
        _lora_a_kernel,
        _rope_attn_split_kernel,
        _rope_qkv_kernel,
        _sample_combine_kernel,
        _sample_finish_kernel,
        _sample_part_kernel,
        _silu_mul_kernel,
        _step_begin_kernel,
    )


# ------------------------------------------------------------------------------------------ references

def add_rms_norm_ref(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(h + delta, RMSNorm(h + delta)·w) with HF's rounding: normalise in fp32, round to h's dtype, multiply
    by the weight (fp32 master weights multiply in fp32 and round once). h, delta: (M, D); weight: (D,)."""
    if delta is not None:
        h = h + delta
    x = F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)
    y = weight * x if weight.dtype == h.dtype else (weight * x.float()).to(h.dtype)
    return h, y


def rope_qkv_ref(qkv, bias, cos, ssin, n_heads: int, n_kv: int, head_dim: int, kc, vc, slot):
    """Split the fused projection (M, (H+2Hkv)·d) into q, k, v, add the bias, rotate q and k
    (x·cos + roll(x, d/2)·ssin, ssin = [−sin₁, sin₂]), write k and v into cache slot ``slot`` (1,) of
    kc/vc (M, Hkv, S_max, d). Returns q (M, H, d)."""
    if bias is not None:
        qkv = qkv + bias
    m = qkv.shape[0]
    q, k, v = qkv.split((n_heads * head_dim, n_kv * head_dim, n_kv * head_dim), dim=-1)
    c, s = cos[:, None, :], ssin[:, None, :]

    def rot(x):
        return torch.addcmul(x * c, torch.roll(x, head_dim // 2, dims=-1), s)

    q = rot(q.reshape(m, n_heads, head_dim))
    kc.index_copy_(2, slot, rot(k.reshape(m, n_kv, head_dim))[:, :, None])
    vc.index_copy_(2, slot, v.reshape(m, n_kv, head_dim)[:, :, None])
    return q


def decode_attention_ref(q, kc, vc, bias, S: int, scale: float):
    """softmax(q·Kᵀ·scale + bias) V over cache slots [0, S). q (M, H, d); kc, vc (M, Hkv, S_max, d);
    bias (M, S_max) float32 (0 valid, −inf masked). Returns (M, H·d) in q's dtype."""
    m, H, d = q.shape
    hkv = kc.shape[1]
    qg = q.view(m, hkv, H // hkv, d).float()
    sc = torch.matmul(qg, kc[:, :, :S].float().transpose(-1, -2)) * scale + bias[:, None, None, :S]
    p = sc.softmax(-1)
    return torch.matmul(p.to(vc.dtype).float(), vc[:, :, :S].float()).to(q.dtype).reshape(m, H * d)


def sample_race_ref(z: torch.Tensor, temperature: float, noise: torch.Tensor):
    """(token (N,), log softmax(z/T)[token] (N,), entropy of softmax(z/T) (N,)) for logits z (N, V) (float32, or
    bf16 / fp16 upcast exactly first) and noise E (N, V) float32 ~ Exp(1): token = argmax_v softmax(z/T)_v / E_v (``qerl.rollout.sample_from_logits``'s race)."""
    z = z.float() / temperature
    logp = z.log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    tok = (z.softmax(-1) / noise).argmax(-1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1), ent


def step_begin_ref(tok, t, lp, prompt_len, emb, cos_tab, sin_tab, attn_bias):
    """The opening of a decode step: the slot of the token fed this step (sampled last step) is cache slot
    ``t - 1 + Lp``, unmasked in ``attn_bias`` (N, S_max) (in place); each row's position is ``prompt_len + t - 1``.
    Returns (h = emb[tok] (N, D), cos (N, d), ssin (N, d) = the rows of the position tables at those positions,
    slot (1,)). tok (N,), t (1,), lp (1,), prompt_len (N,) int64; emb (V, D); cos_tab / sin_tab (S_max, d)."""
    cur = t - 1
    slot = cur + lp
    attn_bias.index_fill_(1, slot, 0.0)
    pos = prompt_len + cur
    return emb.index_select(0, tok), cos_tab.index_select(0, pos), sin_tab.index_select(0, pos), slot


def sample_finish_ref(tok, lp, ent, finished, eos, pad_id: int, t, s_tok, out_tok, out_mask, out_logp, out_ent):
    """The close of a decode step, in place: rows already finished get ``pad_id`` (log-prob and entropy 0, mask
    False); the token goes to ``s_tok`` (N,) (the next step's input) and column t of out_* (N, T); a row drawing
    an id of ``eos`` (E,) is finished from now on; t += 1."""
    alive = ~finished
    tok = torch.where(alive, tok, torch.full_like(tok, pad_id))
    s_tok.copy_(tok)
    out_tok.index_copy_(1, t, tok[:, None])
    out_mask.index_copy_(1, t, alive[:, None])
    out_logp.index_copy_(1, t, torch.where(alive, lp, torch.zeros_like(lp))[:, None])
    out_ent.index_copy_(1, t, torch.where(alive, ent, torch.zeros_like(ent))[:, None])
    finished |= (tok[:, None] == eos[None, :]).any(-1)  # plain compare: graph-safe
    t += 1


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the fused (M, 2I) output, rounded like HF's MLP (silu result, then the product)."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


# ------------------------------------------------------------------------------------------ dispatch

def _pdl(t: torch.Tensor) -> dict:
    """The launch keywords of a decode-step kernel: its PDL variant launched with programmatic stream serialization
    where ``pdl_enabled``; nothing otherwise (the interpreter and older GPUs never see the option)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(t) else {}


def _unit_cols(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as the row-strided kernels read it: columns one element apart (rows may lie further apart)."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 permuted: bool = False):
    """``h += delta`` (in place) and ``RMSNorm(h)·w``. h: (M, D) contiguous; delta: (M, D) with unit column stride
    (its rows may lie further apart: a BF16 product's view, ``qerl.fastdecode.reserve_lora_rows``). Returns (h, x).
    ``permuted`` (D a multiple of 64): the launch also writes x in the wgmma GEMM's K permutation and tags x with it
    (``qerl.kernels.permuted.tag_permuted``), so the next linear's GEMM skips its permute launch; without the Triton kernel
    the copy is made by torch (the same values)."""
    if not _triton_ok(h):
        h, x = add_rms_norm_ref(h, delta, weight, eps)
        return h, (_tag_reference(x) if permuted else x)
    delta = _unit_cols(delta)
    m, d = h.shape
    x = torch.empty_like(h)
    xp = permuted_buffer(x, permuted)
    _add_rms_norm_kernel[(m,)](h, delta if delta is not None else h, weight, x, xp if xp is not None else x, d,
                               delta.stride(0) if delta is not None else d, float(eps),
                               HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(d), num_warps=4 if d <= 4096 else 8,
                               **_perm_kw(xp), **_pdl(h))
    return h, x


def rope_qkv(qkv, bias, cos, ssin, n_heads: int, n_kv: int, head_dim: int, kc, vc, slot):
    """Bias + RoPE of the fused q|k|v output (M, (H+2Hkv)·d); k and v go into cache slot ``slot`` of
    kc/vc (M, Hkv, S_max, d); returns q (M, H, d). cos/ssin: (M, d). qkv's rows may lie further apart than a row
    (unit column stride)."""
    if not _triton_ok(qkv):
        return rope_qkv_ref(qkv, bias, cos, ssin, n_heads, n_kv, head_dim, kc, vc, slot)
    qkv = _unit_cols(qkv)
    m = qkv.shape[0]
    q = torch.empty((m, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    _rope_qkv_kernel[(m, n_heads + 2 * n_kv)](
        qkv, bias if bias is not None else qkv, cos.contiguous(), ssin.contiguous(), q, kc, vc, slot, kc.shape[2],
        qkv.stride(0),
        H=n_heads, HKV=n_kv, D=head_dim, HAS_BIAS=bias is not None, num_warps=1, **_pdl(qkv))
    return q


# decode_attention's launch: split programs to aim for, keys per tile, warps, software-pipeline stages (0: Triton's
# default); benchmarks/attn_bench.py sweeps them. 132 (one wave of an H100) since session 33: 1-8% faster than 264 at
# batch 8-64 in two H100 runs (results/speed/raw/h100_s33_attn*), within 0.2 µs where slower
ATTN_TARGET_PROGRAMS = 132
ATTN_BS = 64
ATTN_WARPS = 4
ATTN_STAGES = 0


def attention_splits(rows: int, S: int, block: int | None = None, target_programs: int | None = None) -> tuple[int, int]:
    """(number of key splits, keys per split): enough programs (rows = M·Hkv of them per split; ``target_programs``,
    default :data:`ATTN_TARGET_PROGRAMS`) to fill about a wave of an H100's 132 SMs, each split a whole number of
    ``block``-key tiles (default :data:`ATTN_BS`)."""
    block = ATTN_BS if block is None else block
    target_programs = ATTN_TARGET_PROGRAMS if target_programs is None else target_programs
    tiles = -(-S // block)
    nsplit = max(1, min(tiles, -(-target_programs // max(rows, 1))))
    chunk = -(-tiles // nsplit) * block
    return -(-S // chunk), chunk


def decode_attention(q, kc, vc, bias, S: int, scale: float, slot: torch.Tensor | None = None,
                     permuted: bool = False):
    """Attention of one new token per row over cache slots [0, S): q (M, H, d), kc/vc (M, Hkv, S_max, d),
    bias (M, S_max) fp32 additive mask. Returns (M, H·d). On CUDA the split kernel is
    :mod:`qerl.kernels.cuda_attn`'s where it applies (``QERL_ATTN``), else Triton's; ``slot`` (1,) int64, the one
    cache slot the preceding launch (RoPE + cache write) may still be writing: with PDL the CUDA kernel requests
    every other key before it waits for that launch (None: nothing before the wait). ``permuted``: where the CUDA
    kernel runs, it also writes the output in the wgmma GEMM's K permutation (tagged, as :func:`add_rms_norm`'s)."""
    if not _triton_ok(q):
        return decode_attention_ref(q, kc, vc, bias, S, scale)
    m, H, d = q.shape
    hkv, s_max = kc.shape[1], kc.shape[2]
    interp, pdl = _interpret(), _pdl(q)
    if not interp and q.is_cuda:
        from qerl.kernels import cuda_attn
        if cuda_attn.usable(q, kc, vc, bias):
            return cuda_attn.attend(q.contiguous(), kc, vc, bias, S, scale, slot, bool(pdl), permuted=permuted)
    return _split_attention(_attn_split_kernel, (q.contiguous(), kc, vc, bias), (), m, H, hkv, d, S, s_max, scale,
                            q.dtype, q.device, pdl)


def _split_attention(kernel, head, tail, m: int, heads: int, hkv: int, d: int, S: int, s_max: int, scale: float, dtype,
                     device, pdl: dict, **const) -> torch.Tensor:
    """A split kernel (``kernel``: its pointer arguments ``head``, the partials, S, S_max, CHUNK, NSPLIT, scale, then
    ``tail`` and the constexprs; ``const``: its own) over (row, KV head) x key splits, then the combine: (m, H·d)."""
    g = heads // hkv
    nsplit, chunk = attention_splits(m * hkv, S)
    cut = m * heads * nsplit
    part = torch.empty((cut * (d + 2),), dtype=torch.float32, device=device)
    mb, lb, acc = part[:cut], part[cut:2 * cut], part[2 * cut:]
    kernel[(m * hkv, nsplit)](*head, mb, lb, acc, S, s_max, chunk, nsplit, float(scale), *tail, HKV=hkv, G=g,
                              GP=max(16, triton.next_power_of_2(g)), D=d, BS=ATTN_BS, DOT_F32=_interpret(),
                              num_warps=ATTN_WARPS, **({"num_stages": ATTN_STAGES} if ATTN_STAGES else {}), **const,
                              **pdl)
    o = torch.empty((m, heads * d), dtype=dtype, device=device)
    _attn_combine_kernel[(m * heads,)](mb, lb, acc, o, nsplit, D=d, SP=max(2, triton.next_power_of_2(nsplit)), num_warps=4,
                                   **pdl)
    return o


def env_flag(name: str, default: str) -> bool:
    """A 0 / 1 switch from the environment (``default`` when unset); any other value is refused by name."""
    v = os.environ.get(name, default)
    if v not in ("0", "1"):
        raise ValueError(f"{name} must be one of ['0', '1'], got {v!r}")
    return v == "1"


def fused_rope_attention() -> bool:
    """``QERL_FUSED_ROPE_ATTN`` (default 0): 1 puts the fused step's bias + RoPE + cache write into the Triton
    attention split kernel where that kernel is the decode attention (batches below
    :data:`qerl.kernels.cuda_attn.MIN_ROWS` (row, KV head) pairs, or ``QERL_ATTN=triton``): :func:`rope_attention`,
    one launch a layer fewer, ``qerl.bench`` decode mode ``fused-rope-in-split``. 0 keeps them a launch of their own
    (:func:`rope_qkv`). Measured on an H100 (session 60, ``results/speed/raw/h100_s60_rope*``), the work the fold
    adds costs more than the launch it saves: every split rotates its KV group's q rows again (7B batch 8: 333 µs of
    split kernel a step against 265 + 50 µs for the two launches; 2588 against 2620 tokens/s; 32B 736 against 739),
    so 1 is an opt-in for same-run comparisons. Read when a step is traced (captured)."""
    return env_flag("QERL_FUSED_ROPE_ATTN", "0")


def rope_attention(qkv, bias, cos, ssin, n_heads: int, n_kv: int, head_dim: int, kc, vc, attn_bias, S: int,
                   scale: float, slot: torch.Tensor, permuted: bool = False) -> torch.Tensor:
    """:func:`rope_qkv` then :func:`decode_attention` (same arguments; returns the attention output (M, H·d)): in one
    launch of the split kernel plus the combine where the Triton split kernel is the attention that runs and
    :func:`fused_rope_attention` is on (the same values: q and the new k rounded as :func:`rope_qkv` rounds them, the
    new token's K and V taken into its split's tiles from registers and written into cache slot ``slot``); else the
    two functions (the CUDA attention at large batches, the CPU, ``QERL_FUSED_ROPE_ATTN=0``, the default)."""
    m = qkv.shape[0]
    if _triton_ok(qkv) and fused_rope_attention() and head_dim == triton.next_power_of_2(head_dim):
        from qerl.kernels import cuda_attn
        triton_attn = _interpret() or not qkv.is_cuda or cuda_attn.triton_by_rule(m * n_kv)
        if triton_attn and kc.is_contiguous() and vc.is_contiguous() and attn_bias.is_contiguous():
            qkv = _unit_cols(qkv)
            return _split_attention(
                _rope_attn_split_kernel,
                (qkv, bias if bias is not None else qkv, cos.contiguous(), ssin.contiguous(), kc, vc, slot, attn_bias),
                (qkv.stride(0),), m, n_heads, n_kv, head_dim, S, kc.shape[2], scale, qkv.dtype, qkv.device, _pdl(qkv),
                H=n_heads, HAS_BIAS=bias is not None)
    q = rope_qkv(qkv, bias, cos, ssin, n_heads, n_kv, head_dim, kc, vc, slot)
    return decode_attention(q, kc, vc, attn_bias, S, scale, slot, permuted=permuted)


def lora_a_splits(r: int, k: int, br: int = 16, bk: int = 128, target: int = 96, cap: int = 16) -> tuple[int, int]:
    """(K splits, K per split) for ``lora_a``: about ``target`` CTAs over the R/br rank blocks, each split
    a whole number of ``bk`` tiles, at most ``cap`` splits (16 for ``lora_a``)."""
    tiles = -(-k // bk)
    split = max(1, min(cap, tiles, -(-target // -(-r // br))))
    per = -(-tiles // split) * bk
    return -(-k // per), per


def lora_a_config(m: int, r: int, k: int) -> tuple[int, int, int]:
    """(token rows per program BM, K splits, K per split) of :func:`lora_a`'s Triton launch for x (M, K) · Aᵀ (R, K):
    one tile of M up to 64 rows (16 / 32 / 64), tiles of 64 above; about 96 CTAs in all (at least 16 per M tile)."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    return (bm, *lora_a_splits(r, k, target=max(16, 96 // -(-m // bm))))


LORA_A_MAX_M = ("16", "32", "64", "128", "256")


def lora_a_max_m() -> int:
    """Largest M that :func:`lora_a` runs in its Triton kernel (tiles of 64 token rows above 64):
    ``QERL_LORA_A_MAX_M`` = 256 (default since session 37), 128, 64, 32 or 16 (decode size); above it cuBLAS's split-K
    GEMM plus a reduce launch. x·Aᵀ of the LoRA terms outside a GEMV launch and the GEMMs' t; with the GEMMs' PDL
    modes their main loops overlap its launch. Measured on an H100 (7B NVFP4 rollouts, 256 + 512, alternating in one
    process): 64 against 16, with the addmm after the GEMM, 5927 / 5914 vs 5682 / 5781 tokens/s at 32 sequences,
    8930 / 8912 vs 8705 / 8880 at 64 (`results/speed/raw/h100_s36_loraa`); 256 against 64 with the wgmma GEMM under
    PDL, 12583 / 12585 vs 12065 / 12078 at 128 sequences, 14945 / 14960 vs 14728 / 14692 at 256, equal at 64
    (`results/speed/raw/h100_s37_wgpdl`)."""
    v = os.environ.get("QERL_LORA_A_MAX_M", "256")
    if v not in LORA_A_MAX_M:
        raise ValueError(f"QERL_LORA_A_MAX_M={v!r}: choose one of {', '.join(LORA_A_MAX_M)}")
    return int(v)


def lora_a_pdl() -> bool:
    """``QERL_LORA_A_PDL``: "1" (default) launches :func:`lora_a` with ``trigger`` under programmatic dependent launch
    too, so it starts while x's producer drains (it waits for it first, then lets the GEMM launch: everything that
    GEMM's main loop reads before its own wait is written by then); "0" (decode mode ``fused-s38``) launches it
    plainly after the producer. Measured on an H200 (7B NVFP4 rollouts, 256 + 512, the two settings in one process,
    the second pass in reverse order): +3.3 / +2.3 / +1.7 % at 64 / 128 / 256 sequences on the pass that favours
    "0", +5.7 / +4.4 / +1.3 % on the other; -0.6 / -0.4 % at 16 / 32 on the first (the other pass's 16 was the
    process's warm-up) (`results/speed/raw/h200_s39_next38`)."""
    v = os.environ.get("QERL_LORA_A_PDL", "1")
    if v not in ("0", "1"):
        raise ValueError(f"QERL_LORA_A_PDL={v!r}: choose 1 (on) or 0 (off)")
    return v == "1"


def lora_a(x: torch.Tensor, a: torch.Tensor, trigger: bool = False) -> torch.Tensor:
    """x (M, K) · Aᵀ (A: (R, K)) -> (M, R) in x's dtype, on CUDA for M <= :func:`lora_a_max_m` by one Triton
    launch (split over K with an in-kernel reduction); F.linear elsewhere. ``trigger`` (sm_90): the launch lets a
    next kernel launched under programmatic dependent launch start at once (``cuda_fp4.gemm(..., pdl=True)``; its
    main loop then overlaps this one, and it waits for t before reading it); with :func:`lora_a_pdl` it is itself
    launched under PDL, waiting for its predecessor before it lets that kernel launch."""
    m, k = x.shape
    if m > 16 and m > lora_a_max_m() or not _triton_ok(x) or x.stride(1) != 1 or not a.is_contiguous() \
            or a.dtype != x.dtype:
        return F.linear(x, a)
    r = a.shape[0]
    bm, split, per = lora_a_config(m, r, k)
    mtiles = -(-m // bm)
    out = torch.empty((m, r), dtype=x.dtype, device=x.device)
    nrb = -(-r // 16)
    ws = torch.empty((split, m, r), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = _counters(x.device) if split > 1 else out
    interp = _interpret()
    trig = trigger and pdl_enabled(x)
    wait = trig and lora_a_pdl()
    _lora_a_kernel[(nrb, split, mtiles)](x, a, out, ws, cnt, m, r, k, x.stride(0), per, BM=bm, BR=16, BK=128,
                                         SPLIT=split, FENCE=x.is_cuda and not interp, DOT_F32=interp,
                                         TRIGGER=trig, MTILES=mtiles > 1, WAIT=wait, num_warps=4,
                                         **({"launch_pdl": True} if wait else {}))
    return out


def silu_mul(gu: torch.Tensor, permuted: bool = False) -> torch.Tensor:
    """silu(gate)·up from the fused (M, 2I) gate|up output (rows may lie further apart). Returns (M, I).
    ``permuted``: also the output in the wgmma GEMM's K permutation, as :func:`add_rms_norm`'s."""
    if not _triton_ok(gu):
        out = silu_mul_ref(gu)
        return _tag_reference(out) if permuted else out
    gu = _unit_cols(gu)
    m, i2 = gu.shape
    i = i2 // 2
    out = torch.empty((m, i), dtype=gu.dtype, device=gu.device)
    op = permuted_buffer(out, permuted)
    block = 1024
    _silu_mul_kernel[(m, -(-i // block))](gu, out, op if op is not None else out, i, gu.stride(0), BLOCK=block,
                                          num_warps=4, **_perm_kw(op), **_pdl(gu))
    return out


PERMUTE_STORES = ("scatter", "vector")


def permute_store() -> str:
    """``QERL_PERMUTE_STORE``: how :func:`add_rms_norm` / :func:`silu_mul` write the permuted copy: ``scatter``
    (default, measured in session 38: each element at its permuted offset, 2-byte stores) or ``vector`` (the block
    permuted in registers, then stored contiguously; the same values, not yet measured on a GPU)."""
    v = os.environ.get("QERL_PERMUTE_STORE", "scatter")
    if v not in PERMUTE_STORES:
        raise ValueError(f"QERL_PERMUTE_STORE={v!r}; valid: {', '.join(PERMUTE_STORES)}")
    return v


def _perm_kw(xp: torch.Tensor | None) -> dict:
    """The launch keywords of a producer kernel for its permuted copy ``xp`` (None: none written)."""
    return {"PERM": xp is not None, "VEC": xp is not None and permute_store() == "vector"}


def _tag_reference(x: torch.Tensor) -> torch.Tensor:
    """x tagged with its permuted copy made by torch (the reference paths: CPU, no Triton)."""
    if x.shape[-1] % 64 == 0:
        from qerl.kernels.cuda_fp4 import permute_x_reference
        tag_permuted(x, permute_x_reference(x).contiguous())
    return x


SAMPLE_BLOCK = 4096  # vocabulary entries per program of sample_race's first pass


_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sample_race(z: torch.Tensor, temperature: float, noise: torch.Tensor):
    """:func:`sample_race_ref` in two launches on CUDA (or the Triton interpreter); the reference elsewhere or for
    inputs other than contiguous (N, V) logits (float32, or bf16 / fp16, read as float32: the lm_head's output needs
    no float32 copy) and float32 noise. The race compares x − log E (x = z/T) instead of softmax(x)/E: the
    same order, so the same token but where two candidates tie to float32 rounding."""
    if (not _triton_ok(z) or z.dtype not in _LOGIT_DTYPES or noise.dtype != torch.float32 or z.dim() != 2
            or noise.shape != z.shape or not z.is_contiguous() or not noise.is_contiguous() or temperature <= 0):
        return sample_race_ref(z, temperature, noise)
    n, v = z.shape
    chunks = -(-v // SAMPLE_BLOCK)
    ws = torch.empty((n, chunks, 4), dtype=torch.float32, device=z.device)
    idx = torch.empty((n, chunks), dtype=torch.int32, device=z.device)
    tok = torch.empty(n, dtype=torch.int64, device=z.device)
    lp = torch.empty(n, dtype=torch.float32, device=z.device)
    ent = torch.empty(n, dtype=torch.float32, device=z.device)
    _sample_part_kernel[(n, chunks)](z, noise, ws, idx, v, float(temperature), chunks, BLOCK=SAMPLE_BLOCK,
                                     num_warps=8)
    _sample_combine_kernel[(n,)](z, ws, idx, tok, lp, ent, v, float(temperature), chunks,
                                 SB=max(16, triton.next_power_of_2(chunks)), num_warps=1)
    return tok, lp, ent


def fused_step_ends() -> bool:
    """``QERL_FUSED_STEP_ENDS`` (default 1): the fused decode step opens with :func:`step_begin` and closes with
    :func:`sample_finish` (one launch each), and samples from the lm_head's bf16 logits; 0: session 57's torch ops
    (the slot and position arithmetic, the embedding, the rotary tables per step, a float32 copy of the logits, the
    bookkeeping after the draw: ~30 launches), for same-run comparisons (``qerl.bench`` decode mode
    ``fused-torch-ends``). Read when a step is traced (captured)."""
    return env_flag("QERL_FUSED_STEP_ENDS", "1")


def step_begin(tok, t, lp, prompt_len, emb, cos_tab, sin_tab, attn_bias):
    """:func:`step_begin_ref` in one launch on CUDA (or the Triton interpreter); the reference elsewhere or for
    non-contiguous tables."""
    n, (d, hd) = tok.shape[0], (emb.shape[1], cos_tab.shape[1])
    if (not _triton_ok(emb) or not all(x.is_contiguous() for x in (emb, cos_tab, sin_tab, attn_bias))
            or cos_tab.dtype != sin_tab.dtype):
        return step_begin_ref(tok, t, lp, prompt_len, emb, cos_tab, sin_tab, attn_bias)
    h = torch.empty((n, d), dtype=emb.dtype, device=emb.device)
    cos = torch.empty((n, hd), dtype=cos_tab.dtype, device=emb.device)
    ssin = torch.empty_like(cos)
    slot = torch.empty(1, dtype=torch.int64, device=emb.device)
    _step_begin_kernel[(n,)](tok, t, lp, prompt_len, emb, cos_tab, sin_tab, attn_bias, h, cos, ssin, slot, d,
                             attn_bias.shape[1], hd, BLOCK=min(2048, triton.next_power_of_2(d)),
                             HB=triton.next_power_of_2(hd), num_warps=4)
    return h, cos, ssin, slot


def sample_finish(tok, lp, ent, finished, eos, pad_id: int, t, s_tok, out_tok, out_mask, out_logp, out_ent) -> None:
    """:func:`sample_finish_ref` in one launch on CUDA (or the Triton interpreter); the reference elsewhere."""
    outs = (s_tok, out_tok, out_mask, out_logp, out_ent)
    if (not _triton_ok(tok) or eos.dtype != torch.int64
            or not all(x.is_contiguous() for x in outs + (tok, lp, ent, finished, eos))):
        return sample_finish_ref(tok, lp, ent, finished, eos, pad_id, t, *outs)
    n, e = tok.shape[0], eos.shape[0]
    _sample_finish_kernel[(1,)](tok, lp, ent, finished, eos, t, s_tok, out_tok, out_mask, out_logp, out_ent, n,
                                out_tok.shape[1], e, int(pad_id), NB=max(16, triton.next_power_of_2(n)),
                                EB=max(2, triton.next_power_of_2(e)), num_warps=4)
