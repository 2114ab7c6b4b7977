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

from qerl.kernels import _counters, _interpret, _triton_ok, pdl_enabled, permuted_buffer, tag_permuted

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the host
    triton, tl, HAS_TRITON = None, None, False

NEG = -1.0e30  # finite "minus infinity" for masked scores (an all-masked split stays NaN-free)


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


# ------------------------------------------------------------------------------------------ Triton

if HAS_TRITON:
    from qerl.kernels.fp4_triton import _epilogue

    _NEG = tl.constexpr(NEG)

    @triton.jit
    def _lora_a_kernel(x_ptr, a_ptr, out_ptr, ws_ptr, cnt_ptr, M, R, K, stride_xm, PER,
                       BM: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
                       FENCE: tl.constexpr, DOT_F32: tl.constexpr, TRIGGER: tl.constexpr = False,
                       MTILES: tl.constexpr = False, WAIT: tl.constexpr = False):
        if WAIT:  # launched under PDL itself: the kernel before (x's producer) has finished after this
            gdc_wait()
        if TRIGGER:  # a dependent launched under PDL (the GEMM with t in its epilogue) may start now
            gdc_launch_dependents()
        rb = tl.program_id(0)
        sp = tl.program_id(1)
        if MTILES:  # tiles of BM token rows along grid axis 2 (above 64 tokens)
            mt = tl.program_id(2)
            rows = mt * BM + tl.arange(0, BM)
            tile = mt * tl.num_programs(0) + rb
        else:
            rows = tl.arange(0, BM)
            tile = rb
        rr = rb * BR + tl.arange(0, BR)
        rmask = rr < R
        acc = tl.zeros([BM, BR], tl.float32)
        k_lo = sp * PER
        k_hi = tl.minimum(k_lo + PER, K)
        for k0 in range(k_lo, k_hi, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < k_hi
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=(rows < M)[:, None] & km[None, :],
                         other=0.0)
            at = tl.load(a_ptr + rr[:, None] * K + kk[None, :], mask=rmask[:, None] & km[None, :], other=0.0)
            if DOT_F32:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            acc += tl.dot(xt, tl.trans(at))
        # the FP4 GEMM's epilogue: cast and store, or (split-K) the last split of this rank block sums them
        _epilogue(acc, out_ptr, ws_ptr, cnt_ptr, out_ptr, rows, rr, M, R, R, tile, sp,
                  SPLIT_K=SPLIT, HAS_G=False, OUT_C=1.0, FENCE=FENCE)

    @triton.jit
    def _pdl_enter(PDL: tl.constexpr):
        # a decode-step kernel's first statement: under programmatic dependent launch, wait for the previous grid (all
        # it wrote is visible after this), then let the next one launch; nothing when PDL is off
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _wgmma_perm(offs):
        # where column k of a row lands in the wgmma GEMM's K permutation (cuda_fp4.permute_x_reference): inside
        # each chunk of 64, k = 16 i + 2 u + e goes to 8 u + 2 i + e
        r = offs % 64
        return offs - r + ((r // 2) % 8) * 8 + (r // 16) * 2 + r % 2

    @triton.jit
    def _store_permuted(p_ptr, offs, y, msk, BLOCK: tl.constexpr, VEC: tl.constexpr):
        # y (BLOCK values at offs, whole 64-chunks) stored in the wgmma GEMM's K permutation: element by element at
        # the permuted offsets, or (VEC) permuted in registers and stored contiguously (vectorizable stores)
        if VEC:
            yp = tl.reshape(tl.permute(tl.reshape(y, (BLOCK // 64, 4, 8, 2)), (0, 2, 1, 3)), (BLOCK,))
            tl.store(p_ptr + offs, yp, mask=msk)
        else:
            tl.store(p_ptr + _wgmma_perm(offs), y, mask=msk)

    @triton.jit
    def _add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, x_ptr, xp_ptr, D, stride_d, eps, HAS_DELTA: tl.constexpr,
                             BLOCK: tl.constexpr, PDL: tl.constexpr = False, PERM: tl.constexpr = False,
                             VEC: tl.constexpr = False):
        _pdl_enter(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        msk = offs < D
        h = tl.load(h_ptr + row * D + offs, mask=msk, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * stride_d + offs, mask=msk, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * D + offs, h, mask=msk)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / D
        xn = (hf * (1.0 / tl.sqrt(var + eps))).to(x_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=msk, other=0.0).to(tl.float32)
        y = (w * xn.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * D + offs, y, mask=msk)
        if PERM:  # also the copy the wgmma GEMM reads (D a multiple of 64)
            _store_permuted(xp_ptr + row * D, offs, y, msk, BLOCK, VEC)

    @triton.jit
    def _rope_vals(row_ptr, b_ptr, off, roff, c, s, msk, HAS_BIAS: tl.constexpr, ROT: tl.constexpr):
        # the fused q|k|v output at row_ptr + off (+ its bias), rotated (ROT: x·cos + roll(x, d/2)·ssin, with roff the
        # rolled offsets and c, s float32 cos / ssin broadcastable to off), rounded where the unfused modules round
        x = tl.load(row_ptr + off, mask=msk, other=0.0)
        if HAS_BIAS:
            x = (x.to(tl.float32) + tl.load(b_ptr + off, mask=msk, other=0.0).to(tl.float32)).to(row_ptr.dtype.element_ty)
        if ROT:
            xr = tl.load(row_ptr + roff, mask=msk, other=0.0)
            if HAS_BIAS:
                xr = (xr.to(tl.float32) + tl.load(b_ptr + roff, mask=msk, other=0.0).to(tl.float32)).to(
                    row_ptr.dtype.element_ty)
            t = (x.to(tl.float32) * c).to(row_ptr.dtype.element_ty).to(tl.float32)
            x = (t + xr.to(tl.float32) * s).to(row_ptr.dtype.element_ty)
        return x

    @triton.jit
    def _rope_qkv_kernel(qkv_ptr, b_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr, S_MAX, stride_qkv,
                         H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_BIAS: tl.constexpr,
                         PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        row = tl.program_id(0)
        j = tl.program_id(1)  # head: [0, H) q, [H, H+HKV) k, [H+HKV, H+2HKV) v
        offs = tl.arange(0, D)
        roll = (offs + D // 2) % D  # roll(x, d/2)[i] = x[(i - d/2) mod d] = x[(i + d/2) mod d]
        c = tl.load(cos_ptr + row * D + offs).to(tl.float32)
        s = tl.load(sin_ptr + row * D + offs).to(tl.float32)
        x = _rope_vals(qkv_ptr + row * stride_qkv, b_ptr, j * D + offs, j * D + roll, c, s, offs < D, HAS_BIAS,
                       j < H + HKV)
        slot = tl.load(slot_ptr)
        if j < H:
            tl.store(q_ptr + (row * H + j) * D + offs, x)
        elif j < H + HKV:
            tl.store(kc_ptr + ((row * HKV + (j - H)) * S_MAX + slot) * D + offs, x)
        else:
            tl.store(vc_ptr + ((row * HKV + (j - H - HKV)) * S_MAX + slot) * D + offs, x)

    @triton.jit
    def _attn_tiles(q, k_ptr, v_ptr, b_ptr, row, base, start, stop, S_MAX, scale, kn, vn, slot,
                    GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, DOT_F32: tl.constexpr, NEW: tl.constexpr):
        # online softmax over cache slots [start, stop) of one (row, KV head) (K / V rows at base + slot): the (GP,)
        # running max and sum and the (GP, D) accumulator. NEW: slot `slot`'s K and V rows are kn / vn (this
        # launch's own, not yet in the cache) instead of what the cache holds there
        dm = tl.arange(0, D)
        m_i = tl.full([GP], _NEG, tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for s0 in range(start, stop, BS):
            offs = s0 + tl.arange(0, BS)
            smask = offs < stop
            kb = tl.load(k_ptr + (base + offs)[:, None] * D + dm[None, :], mask=smask[:, None], other=0.0)
            vb = tl.load(v_ptr + (base + offs)[:, None] * D + dm[None, :], mask=smask[:, None], other=0.0)
            if NEW:
                fresh = (offs == slot)[:, None]
                kb = tl.where(fresh, kn[None, :], kb)
                vb = tl.where(fresh, vn[None, :], vb)
            if DOT_F32:
                kb = kb.to(tl.float32)
                vb = vb.to(tl.float32)
            bias = tl.load(b_ptr + row * S_MAX + offs, mask=smask, other=_NEG)
            sc = tl.dot(q, tl.trans(kb)) * scale + bias[None, :]  # (GP, BS) fp32
            sc = tl.maximum(sc, _NEG)
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                pv = tl.dot(p.to(v_ptr.dtype.element_ty).to(tl.float32), vb)
            else:
                pv = tl.dot(p.to(v_ptr.dtype.element_ty), vb)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _attn_split_store(m_ptr, l_ptr, acc_ptr, pid, sp, NSPLIT, m_i, l_i, acc, G: tl.constexpr, GP: tl.constexpr,
                          D: tl.constexpr):
        gi = tl.arange(0, GP)
        gmask = gi < G
        out = (pid * G + gi) * NSPLIT + sp  # (row, head, split)
        tl.store(m_ptr + out, m_i, mask=gmask)
        tl.store(l_ptr + out, l_i, mask=gmask)
        tl.store(acc_ptr + out[:, None] * D + tl.arange(0, D)[None, :], acc, mask=gmask[:, None])

    @triton.jit
    def _attn_split_kernel(q_ptr, k_ptr, v_ptr, b_ptr, m_ptr, l_ptr, acc_ptr, S, S_MAX, CHUNK, NSPLIT, scale,
                           HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                           BS: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        pid = tl.program_id(0)  # row * HKV + kv head
        sp = tl.program_id(1)  # split of the keys
        gi = tl.arange(0, GP)
        dm = tl.arange(0, D)
        q = tl.load(q_ptr + (pid * G + gi)[:, None] * D + dm[None, :], mask=(gi < G)[:, None], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        start = sp * CHUNK
        m_i, l_i, acc = _attn_tiles(q, k_ptr, v_ptr, b_ptr, pid // HKV, pid.to(tl.int64) * S_MAX, start,
                                    tl.minimum(start + CHUNK, S), S_MAX, scale, q, q, 0, GP, D, BS, DOT_F32, False)
        _attn_split_store(m_ptr, l_ptr, acc_ptr, pid, sp, NSPLIT, m_i, l_i, acc, G, GP, D)

    @triton.jit
    def _rope_attn_split_kernel(qkv_ptr, qb_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, slot_ptr, b_ptr, m_ptr, l_ptr,
                                acc_ptr, S, S_MAX, CHUNK, NSPLIT, scale, stride_qkv, H: tl.constexpr,
                                HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                BS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
                                PDL: tl.constexpr = False):
        # _rope_qkv_kernel and _attn_split_kernel in one launch: each split rotates its KV group's q rows from the
        # fused q|k|v output itself; the split holding the new token's slot rotates its k, takes it and v into its
        # tiles from registers, and writes both into the cache (the one program of the (row, KV head) to read or
        # write that slot)
        _pdl_enter(PDL)
        pid = tl.program_id(0)  # row * HKV + kv head
        sp = tl.program_id(1)  # split of the keys
        row, kvh = pid // HKV, pid % HKV
        gi = tl.arange(0, GP)
        dm = tl.arange(0, D)
        roll = (dm + D // 2) % D
        c = tl.load(cos_ptr + row * D + dm).to(tl.float32)
        s = tl.load(sin_ptr + row * D + dm).to(tl.float32)
        src = qkv_ptr + row * stride_qkv
        head = (kvh * G + gi)[:, None] * D
        q = _rope_vals(src, qb_ptr, head + dm[None, :], head + roll[None, :], c[None, :], s[None, :],
                       (gi < G)[:, None], HAS_BIAS, True)
        if DOT_F32:
            q = q.to(tl.float32)
        slot = tl.load(slot_ptr)
        start = sp * CHUNK
        stop = tl.minimum(start + CHUNK, S)
        base = pid.to(tl.int64) * S_MAX
        mine = (slot >= start) & (slot < stop)
        kn = _rope_vals(src, qb_ptr, (H + kvh) * D + dm, (H + kvh) * D + roll, c, s, mine & (dm < D), HAS_BIAS, True)
        vn = _rope_vals(src, qb_ptr, (H + HKV + kvh) * D + dm, dm, c, s, mine & (dm < D), HAS_BIAS, False)
        m_i, l_i, acc = _attn_tiles(q, k_ptr, v_ptr, b_ptr, row, base, start, stop, S_MAX, scale, kn, vn, slot,
                                    GP, D, BS, DOT_F32, True)
        if mine:
            tl.store(k_ptr + (base + slot) * D + dm, kn)
            tl.store(v_ptr + (base + slot) * D + dm, vn)
        _attn_split_store(m_ptr, l_ptr, acc_ptr, pid, sp, NSPLIT, m_i, l_i, acc, G, GP, D)

    @triton.jit
    def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, NSPLIT, D: tl.constexpr, SP: tl.constexpr,
                             PDL: tl.constexpr = False):
        _pdl_enter(PDL)
        rh = tl.program_id(0)  # row * H + head
        sp = tl.arange(0, SP)
        smask = sp < NSPLIT
        dm = tl.arange(0, D)
        m = tl.load(m_ptr + rh * NSPLIT + sp, mask=smask, other=_NEG)
        l_ = tl.load(l_ptr + rh * NSPLIT + sp, mask=smask, other=0.0)
        a = tl.load(acc_ptr + (rh * NSPLIT + sp)[:, None] * D + dm[None, :], mask=smask[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))
        w = tl.where(smask, w, 0.0)
        o = tl.sum(a * w[:, None], axis=0) / tl.sum(l_ * w, axis=0)
        tl.store(o_ptr + rh * D + dm, o.to(o_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, o_ptr, op_ptr, NI, stride_gu, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                         PERM: tl.constexpr = False, VEC: tl.constexpr = False):
        _pdl_enter(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        msk = offs < NI
        g = tl.load(gu_ptr + row * stride_gu + offs, mask=msk, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * stride_gu + NI + offs, mask=msk, other=0.0)
        a = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty).to(tl.float32)
        y = (a * u.to(tl.float32)).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + row * NI + offs, y, mask=msk)
        if PERM:  # also the copy the wgmma GEMM reads (NI and BLOCK multiples of 64)
            _store_permuted(op_ptr + row * NI, offs, y, msk, BLOCK, VEC)


    @triton.jit
    def _sample_part_kernel(z_ptr, e_ptr, ws_ptr, idx_ptr, V, temp, S, BLOCK: tl.constexpr):
        # one chunk of one row: max m, sum of exp(x - m), sum of exp(x - m)·x, and the race's best x - log E
        row, c = tl.program_id(0), tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        msk = offs < V
        x = tl.load(z_ptr + row * V + offs, mask=msk, other=float("-inf")).to(tl.float32) / temp
        e = tl.load(e_ptr + row * V + offs, mask=msk, other=1.0)
        m = tl.max(x, 0)
        p = tl.where(x > float("-inf"), tl.exp(x - m), 0.0)
        s = tl.sum(p, 0)
        t = tl.sum(tl.where(p > 0, p * x, 0.0), 0)
        r = tl.where(msk, x - tl.log(e), float("-inf"))
        best = tl.max(r, 0)
        arg = tl.min(tl.where(r == best, offs, V), 0)  # the first index reaching the best
        base = ws_ptr + (row * S + c) * 4
        tl.store(base, m)
        tl.store(base + 1, s)
        tl.store(base + 2, t)
        tl.store(base + 3, best)
        tl.store(idx_ptr + row * S + c, arg)

    @triton.jit
    def _sample_combine_kernel(z_ptr, ws_ptr, idx_ptr, tok_ptr, lp_ptr, ent_ptr, V, temp, S, SB: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, SB)
        cm = c < S
        base = ws_ptr + (row * S + c) * 4
        m = tl.load(base, mask=cm, other=float("-inf"))
        s = tl.load(base + 1, mask=cm, other=0.0)
        t = tl.load(base + 2, mask=cm, other=0.0)
        best = tl.load(base + 3, mask=cm, other=float("-inf"))
        mx = tl.max(m, 0)
        w = tl.where(m > float("-inf"), tl.exp(m - mx), 0.0)
        zs = tl.sum(s * w, 0)
        ts = tl.sum(t * w, 0)
        log_z = mx + tl.log(zs)
        b = tl.max(best, 0)
        ci = tl.min(tl.where(best == b, c, SB), 0)  # the first chunk reaching the best: the lowest index
        tok = tl.load(idx_ptr + row * S + ci)
        xt = tl.load(z_ptr + row * V + tok).to(tl.float32) / temp
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, xt - log_z)
        tl.store(ent_ptr + row, log_z - ts / zs)

    @triton.jit
    def _step_begin_kernel(tok_ptr, t_ptr, lp_ptr, plen_ptr, emb_ptr, cos_tab_ptr, sin_tab_ptr, bias_ptr, h_ptr,
                           cos_ptr, sin_ptr, slot_ptr, D, S_MAX, HD, BLOCK: tl.constexpr, HB: tl.constexpr):
        # one program per row: unmask the new slot, gather the embedding row and the position-table rows
        row = tl.program_id(0)
        cur = tl.load(t_ptr) - 1
        slot = cur + tl.load(lp_ptr)
        tl.store(bias_ptr + row * S_MAX + slot, 0.0)
        if row == 0:
            tl.store(slot_ptr, slot)
        pos = tl.load(plen_ptr + row) + cur
        src = emb_ptr + tl.load(tok_ptr + row) * D
        for k in range(0, D, BLOCK):
            offs = k + tl.arange(0, BLOCK)
            msk = offs < D
            tl.store(h_ptr + row * D + offs, tl.load(src + offs, mask=msk), mask=msk)
        offs = tl.arange(0, HB)
        msk = offs < HD
        tl.store(cos_ptr + row * HD + offs, tl.load(cos_tab_ptr + pos * HD + offs, mask=msk), mask=msk)
        tl.store(sin_ptr + row * HD + offs, tl.load(sin_tab_ptr + pos * HD + offs, mask=msk), mask=msk)

    @triton.jit
    def _sample_finish_kernel(tok_ptr, lp_ptr, ent_ptr, fin_ptr, eos_ptr, t_ptr, stok_ptr, otok_ptr, omask_ptr,
                              olp_ptr, oent_ptr, N, T, E, PAD, NB: tl.constexpr, EB: tl.constexpr):
        # one program for all rows, so that t is read before it is advanced
        r = tl.arange(0, NB)
        rm = r < N
        t = tl.load(t_ptr)
        fin = tl.load(fin_ptr + r, mask=rm, other=1) != 0
        alive = fin == 0
        tok = tl.where(alive, tl.load(tok_ptr + r, mask=rm, other=0), PAD)
        tl.store(stok_ptr + r, tok, mask=rm)
        tl.store(otok_ptr + r * T + t, tok, mask=rm)
        tl.store(omask_ptr + r * T + t, alive, mask=rm)
        tl.store(olp_ptr + r * T + t, tl.where(alive, tl.load(lp_ptr + r, mask=rm, other=0.0), 0.0), mask=rm)
        tl.store(oent_ptr + r * T + t, tl.where(alive, tl.load(ent_ptr + r, mask=rm, other=0.0), 0.0), mask=rm)
        e = tl.arange(0, EB)
        eos = tl.load(eos_ptr + e, mask=e < E, other=-1)
        hit = tl.max((tok[:, None] == eos[None, :]).to(tl.int32), axis=1) > 0  # ids are >= 0: -1 never hits
        tl.store(fin_ptr + r, fin | hit, mask=rm)
        tl.store(t_ptr, t + 1)


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
    (``qerl.kernels.tag_permuted``), so the next linear's GEMM skips its permute launch; without the Triton kernel
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
