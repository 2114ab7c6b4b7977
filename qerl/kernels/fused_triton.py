"""The Triton kernels of :mod:`qerl.kernels.fused` (the sampler's decode-step kernels: add + RMSNorm, RoPE and the
KV write, split attention and its combine, SiLU·up, x·Aᵀ, the token draw, the step's two ends). Their launches,
the PDL keywords and the pure-torch references are in :mod:`qerl.kernels.fused`, which imports them from here;
with no Triton on the host ``HAS_TRITON`` is False and nothing else is defined.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the host
    triton, tl, HAS_TRITON = None, None, False

NEG = -1.0e30  # finite "minus infinity" for masked scores (an all-masked split stays NaN-free)

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
