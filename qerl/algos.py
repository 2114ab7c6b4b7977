"""The RL math of qerl: pure tensor functions (QERL.md §3.1, §6).

Shapes: N = B*G completions (B prompts, G samples each), T = completion length (padded), V = vocabulary.
Nothing here touches a model, an optimizer or a config; `train.py` wires these together.

Conventions shared with TRL 0.21 (the trainer the official QeRL code runs on):
- advantages use the *unbiased* group std (`Tensor.std`, correction 1) plus eps = 1e-4;
- the importance ratio is per token, ρ = exp(logp − old_logp);
- KL is the k3 estimator exp(ref − logp) − (ref − logp) − 1;
- masked batch means divide by `mask.sum().clamp(min=1)`.
Every stats dict holds detached 0-d float32 tensors (no host sync here; call `.item()` when logging).
"""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------------------------------
# small utilities


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ x over positions where mask is set; masked positions contribute 0 even when x is inf/NaN there."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Σ(x·m) / max(Σm, 1) (TRL's masked batch mean); over everything when dim is None."""
    m = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    denom = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, mask, dim) / denom.clamp(min=1.0)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """max of x over the masked positions; 0 when the mask is empty."""
    mask = mask.bool()
    if not bool(mask.any()):
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return x[mask].max()


# ---------------------------------------------------------------------------------------------------------------------
# advantages


def group_advantages(rewards: torch.Tensor, G: int, std_norm: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Group-relative advantages (GRPO, QERL.md §3.1): A_i = (r_i − mean(r_1..r_G)) / (std(r_1..r_G) + eps).

    rewards: (B*G,), consecutive blocks of G belong to one prompt. std is the *unbiased* sample std, exactly as
    TRL 0.21 (`rewards.view(-1, G).std(dim=1)`, `scale_rewards=True`, eps 1e-4). `std_norm=False` gives
    A_i = r_i − mean (Dr. GRPO; TRL `scale_rewards=False`). Returns (B*G,) in the rewards' dtype.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B*G,), got shape {tuple(rewards.shape)}")
    if G < 1 or rewards.numel() % G != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of G={G}")
    if std_norm and G < 2:
        raise ValueError("std_norm=True needs G >= 2 (the group std of one sample is undefined)")
    r = rewards if rewards.is_floating_point() else rewards.float()
    grouped = r.view(-1, G)  # (B, G)
    adv = grouped - grouped.mean(dim=1, keepdim=True)  # (B, G)
    if std_norm:
        adv = adv / (grouped.std(dim=1, keepdim=True) + eps)
    return adv.reshape(-1)  # (B*G,)


# ---------------------------------------------------------------------------------------------------------------------
# dynamic sampling (DAPO) and masks


def dynamic_sampling_filter(rewards: torch.Tensor, G: int) -> torch.Tensor:
    """DAPO dynamic sampling: keep a group unless all G of its rewards are equal (then every A_i = 0 and it carries
    no gradient). rewards: (B*G,) -> keep: (B,) bool."""
    if rewards.dim() != 1 or G < 1 or rewards.numel() % G != 0:
        raise ValueError(
            f"rewards must be 1-D with a multiple of G={G} entries, got shape {tuple(rewards.shape)}"
        )
    grouped = rewards.view(-1, G)  # (B, G)
    return grouped.amax(dim=1) != grouped.amin(dim=1)  # (B,)


def select_groups(keep: torch.Tensor, need: int) -> tuple[torch.Tensor, int]:
    """Refill helper for dynamic sampling: the first `need` kept groups, in order.

    keep: (B,) bool from `dynamic_sampling_filter`. Returns (idx (k,) long, short) with k = min(need, #kept) and
    short = need − k, the number of groups still to sample (DAPO keeps sampling batches until short == 0 and then
    truncates to the target). Use `group_rows(idx, G)` for the matching completion rows.
    """
    if need < 0:
        raise ValueError(f"need must be >= 0, got {need}")
    idx = torch.nonzero(keep.bool(), as_tuple=False).flatten()[:need]  # (k,)
    return idx, need - int(idx.numel())


def group_rows(group_idx: torch.Tensor, G: int) -> torch.Tensor:
    """Row indices (k*G,) of the completions of groups `group_idx` (k,), rows laid out as (B*G,)."""
    offs = torch.arange(G, device=group_idx.device)
    return (group_idx.long()[:, None] * G + offs[None, :]).reshape(-1)


def truncation_mask(
    completion_mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool = True
) -> torch.Tensor:
    """Zero the whole mask row of completions that hit the length limit without EOS (official scripts'
    `mask_truncated_completions=True`, QERL.md §6). completion_mask (N, T), truncated (N,) bool -> (N, T), same dtype."""
    if not mask_truncated:
        return completion_mask
    keep = (~truncated.bool()).to(completion_mask.dtype)  # (N,)
    return completion_mask * keep[:, None]


# ---------------------------------------------------------------------------------------------------------------------
# per-token log-probs and entropy, chunked


def _blocks(N: int, T: int, chunk: int):
    """Yield (row slice, col slice) covering an (N, T) grid with at most `chunk` positions per block (views only)."""
    if T <= chunk:
        rows = max(1, chunk // max(T, 1))
        for r0 in range(0, N, rows):
            yield slice(r0, min(N, r0 + rows)), slice(0, T)
    else:
        for r in range(N):
            for t0 in range(0, T, chunk):
                yield slice(r, r + 1), slice(t0, min(T, t0 + chunk))


class _ChunkedLogProb(torch.autograd.Function):
    """logp = z[tok] − logsumexp(z), z = logits/τ in float32, one block at a time. The backward recomputes softmax per
    block, so neither pass keeps an (N, T, V) float32 tensor; only the logits (their own dtype) and lse (N, T) stay."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk, with_entropy):
        N, T, _ = logits.shape
        logp = torch.empty(N, T, dtype=torch.float32, device=logits.device)  # (N, T)
        lse = torch.empty_like(logp)  # (N, T)
        ent = torch.empty_like(logp) if with_entropy else None  # (N, T)
        for rs, ts in _blocks(N, T, chunk):
            z = logits[rs, ts].float() / temperature  # (n, t, V)
            lse_b = torch.logsumexp(z, dim=-1)  # (n, t)
            lse[rs, ts] = lse_b
            logp[rs, ts] = z.gather(-1, tokens[rs, ts].unsqueeze(-1)).squeeze(-1) - lse_b
            if with_entropy:
                logq = z - lse_b.unsqueeze(-1)  # (n, t, V) log-softmax
                p = logq.exp()
                # H = −Σ p log p; p = 0 terms (−inf logits) contribute 0
                ent[rs, ts] = -torch.where(p > 0, p * logq, torch.zeros((), device=p.device)).sum(-1)
        ctx.save_for_backward(logits, tokens, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        if with_entropy:
            ctx.mark_non_differentiable(ent)
            return logp, ent
        return logp, torch.empty(0, device=logits.device)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        logits, tokens, lse = ctx.saved_tensors
        N, T, _ = logits.shape
        grad = torch.empty_like(logits)  # (N, T, V), logits' dtype
        for rs, ts in _blocks(N, T, ctx.chunk):
            g = g_logp[rs, ts].float().unsqueeze(-1)  # (n, t, 1)
            p = (logits[rs, ts].float() / ctx.temperature - lse[rs, ts].unsqueeze(-1)).exp()  # (n, t, V)
            gl = -p * g  # d logp / d z = onehot − p
            gl.scatter_add_(-1, tokens[rs, ts].unsqueeze(-1), g)
            grad[rs, ts] = (gl / ctx.temperature).to(grad.dtype)
        return grad, None, None, None, None


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs log π(o_t | q, o_<t) and the entropy of the full next-token distribution.

    logits: (N, T, V), already aligned so logits[:, t] predicts tokens[:, t]; tokens: (N, T) long.
    z = logits / temperature (TRL divides by the sampling temperature); logp = z[o_t] − logsumexp(z);
    H = −Σ_{v∈V} π(v) log π(v) (QERL.md §6, the paper's "sampling entropy"), computed under no grad like TRL's
    `entropy_from_logits` (it never enters the loss). Both (N, T) float32; entropy is None if with_entropy=False.
    Computed in blocks of at most `chunk` positions (default ≈ 2^26 / V, i.e. ~256 MB of float32 per temporary),
    so the (N, T, V) float32 softmax is never materialised; gradients flow to logits through logp only.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"need logits (N, T, V) and tokens (N, T), got {tuple(logits.shape)}, {tuple(tokens.shape)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk is None:
        chunk = max(1, (1 << 26) // logits.shape[-1])
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    logp, ent = _ChunkedLogProb.apply(
        logits, tokens.long(), float(temperature), int(chunk), bool(with_entropy)
    )
    return logp, (ent if with_entropy else None)


# ---------------------------------------------------------------------------------------------------------------------
# policy loss


def _agg_token_mean(per_token, mask, max_len):
    # DAPO token-level loss (the DAPO paper's, TRL "dapo"): Σ_{i,t} ℓ_{i,t} / Σ_i |o_i| over the whole optimizer
    # minibatch. Over one call that is this call's tokens; train.py weights each micro-batch by its share of the
    # minibatch's tokens, so the accumulated gradient is the minibatch token mean. TRL "bnpo" is not this: it takes
    # each micro-batch's own token mean and averages those, which differs under gradient accumulation.
    return masked_sum(per_token, mask) / mask.sum().clamp(min=1).to(per_token.dtype)


def _agg_seq_mean(per_token, mask, max_len):
    # GRPO (Eq. 3): (1/N) Σ_i (1/|o_i|) Σ_t ℓ_{i,t}; fully masked rows count in N with 0 loss, as TRL "grpo"
    per_seq = masked_sum(per_token, mask, dim=1) / mask.sum(dim=1).clamp(min=1).to(per_token.dtype)  # (N,)
    return per_seq.mean()


def _agg_seq_sum_norm(per_token, mask, max_len):
    # Dr. GRPO (TRL "dr_grpo"): Σ_{i,t} ℓ_{i,t} / (N · L_max) with L_max the generation budget (max_new_tokens), a
    # constant: no length bias, and the loss scale does not follow the longest completion of the step.
    return masked_sum(per_token, mask) / (per_token.shape[0] * max_len)


AGGREGATIONS = {"token_mean": _agg_token_mean, "seq_mean": _agg_seq_mean, "seq_sum_norm": _agg_seq_sum_norm}


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ ‖ π_ref) on samples of π_θ (TRL): exp(ref − logp) − (ref − logp) − 1 ≥ 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    agg: str = "token_mean",
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    behav_logp: torch.Tensor | None = None,
    tis_cap: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss of GRPO/DAPO (QERL.md §3.1, Eq. 3–4), to be minimised.

    Per token: ρ = exp(logp − old_logp), ℓ = −min(ρ·A, clip(ρ, 1 − clip_low, 1 + clip_high)·A) [+ kl_coef·k3].
    logp (N, T) carries the gradient; old_logp (N, T) is π_θold (None: logp.detach(), i.e. on-policy, ρ = 1 but
    the gradient is A·∇logp, as TRL); adv (N,) or (N, T); mask (N, T) bool/0-1.
    agg: "token_mean" (DAPO token-level, Σℓ / #tokens: TRL "dapo" once train.py weights micro-batches by tokens),
    "seq_mean" (GRPO, mean over sequences of the per-sequence token mean), "seq_sum_norm" (Dr. GRPO, Σℓ / (N·max_len)
    with max_len the constant generation budget, max_new_tokens; required, and at least T).
    Truncated IS (rollout/training mismatch fix): with behav_logp (N, T), the sampler's log-probs, the policy term
    is multiplied per token by w = min(exp(old_logp − behav_logp), tis_cap), detached; the KL term is not weighted.
    Stats (detached 0-d, token means over the mask): clip_low_frac (ρ < 1−clip_low with A < 0), clip_high_frac
    (ρ > 1+clip_high with A > 0), clip_frac (their union: TRL's "region" ratio), ratio_mean, ratio_max,
    pg_loss; kl (when ref_logp is given); tis_weight_mean, tis_capped_frac (with behav_logp).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; valid: {sorted(AGGREGATIONS)}")
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"need logp and mask of shape (N, T), got {tuple(logp.shape)}, {tuple(mask.shape)}")
    if clip_low < 0 or clip_low >= 1 or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if kl_coef != 0.0 and ref_logp is None:
        raise ValueError("kl_coef != 0 needs ref_logp")
    if agg == "seq_sum_norm" and (max_len is None or max_len < logp.shape[1]):
        raise ValueError(f"seq_sum_norm (Dr. GRPO) divides by the generation budget max_len (max_new_tokens), which "
                         f"must be given and at least the completion width T={logp.shape[1]}; got max_len={max_len}")
    if behav_logp is not None and (tis_cap is None or not tis_cap > 0):
        raise ValueError(f"truncated IS needs tis_cap > 0 (float('inf') for no cap), got {tis_cap}")
    m = mask.bool()  # (N, T)
    if old_logp is None:
        old_logp = logp.detach()
    A = adv.unsqueeze(1) if adv.dim() == 1 else adv  # (N, 1) or (N, T)
    A = A.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # masked positions get log-ratio 0, so padding can never send inf/NaN into the gradient
    ratio = torch.exp(torch.where(m, logp - old_logp, zero))  # (N, T)
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * A, clipped * A)  # (N, T)
    stats: dict[str, torch.Tensor] = {}
    if behav_logp is not None:
        w_raw = torch.exp(torch.where(m, old_logp.detach() - behav_logp, zero))  # (N, T)
        w = w_raw.clamp(max=tis_cap).detach()
        per_token = per_token * w
        stats["tis_weight_mean"] = masked_mean(w, m)
        stats["tis_capped_frac"] = masked_mean((w_raw > tis_cap).float(), m)
    stats["pg_loss"] = AGGREGATIONS[agg](per_token, m, max_len).detach()
    if ref_logp is not None:
        kl = k3_kl(logp, torch.where(m, ref_logp, logp.detach()))  # (N, T)
        stats["kl"] = masked_mean(kl.detach(), m)
        if kl_coef != 0.0:
            per_token = per_token + kl_coef * kl
    loss = AGGREGATIONS[agg](per_token, m, max_len)
    with torch.no_grad():
        low = (ratio < 1 - clip_low) & (A < 0)  # (N, T)
        high = (ratio > 1 + clip_high) & (A > 0)
        stats["clip_low_frac"] = masked_mean(low.float(), m)
        stats["clip_high_frac"] = masked_mean(high.float(), m)
        stats["clip_frac"] = masked_mean((low | high).float(), m)
        stats["ratio_mean"] = masked_mean(ratio.float(), m)
        stats["ratio_max"] = masked_max(ratio.float(), m)
    return loss, {k: v.detach().float() for k, v in stats.items()}


# How a step's policy_loss stats, one dict per micro-batch (and per update), become one logged value. Every stat
# not named here is a token mean over the mask, so it is weighted by the micro-batch's token count: the logged value
# is the token mean over all the tokens the updates saw, whatever the micro-batch split. pg_loss is weighted like the
# loss in backward (train.py's token share for token_mean, row share for seq_mean / seq_sum_norm), so it is the
# minibatch objective that was optimised, averaged over the updates. ratio_max is a max.
STAT_MERGE = {"pg_loss": "loss_weight", "ratio_max": "max"}


def merge_loss_stats(parts: list[tuple[dict[str, torch.Tensor], torch.Tensor | float, torch.Tensor | float]]
                     ) -> dict[str, float]:
    """Combine per-micro-batch policy_loss stats: parts = [(stats, n_tokens, loss_weight), ...] -> {name: float}.

    n_tokens is the micro-batch's mask sum, loss_weight the factor its loss got in backward (see STAT_MERGE).
    A weight total of 0 (no tokens at all) gives 0.0. One host sync per stat.
    """
    if not parts:
        return {}
    dev = next(iter(parts[0][0].values())).device

    def col(xs) -> torch.Tensor:  # (M,) float64 on the stats' device
        return torch.stack([torch.as_tensor(x, dtype=torch.float64, device=dev) for x in xs])

    tokens, weights = col(t for _, t, _ in parts), col(w for _, _, w in parts)
    tiny = torch.finfo(torch.float64).tiny
    out = {}
    for k in parts[0][0]:
        v = col(st[k] for st, _, _ in parts)  # (M,)
        how = STAT_MERGE.get(k, "tokens")
        if how == "max":
            out[k] = v.max().item()
        else:
            w = weights if how == "loss_weight" else tokens
            out[k] = ((v * w).sum() / w.sum().clamp(min=tiny)).item()
    return out


# ---------------------------------------------------------------------------------------------------------------------
# sampler vs trainer


_MISMATCH = {  # per-token functions of d = log π_sampler − log π_trainer whose token means mismatch_stats logs
    "abs_diff_mean": lambda d: d.abs(),
    "kl_k1": lambda d: d,
    "kl_k2": lambda d: 0.5 * d * d,
    "kl_k3": lambda d: torch.expm1(-d) + d,
    "ratio_mean": lambda d: torch.exp(-d),
}


def mismatch_parts(
    sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The sums behind ``mismatch_stats``: ({name: Σ f(d) over the mask}, token count, max |d|), all 0-d float32;
    data-parallel ranks add the sums and counts (and take the max) before dividing."""
    m = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=sampler_logp.device)
    d = torch.where(m, sampler_logp.detach().float() - trainer_logp.detach().float(), zero)  # (N, T)
    sums = {k: masked_sum(f(d), m) for k, f in _MISMATCH.items()}
    return sums, m.to(torch.float32).sum(), masked_max(d.abs(), m)


def mismatch_stats(
    sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs (quantized/noisy rollout) are from the trainer's on the sampled tokens.

    d = log π_sampler − log π_trainer per token, tokens drawn from the sampler, so KL(π_sampler ‖ π_trainer) ≈
    k1 = E[d], k2 = E[d²/2], k3 = E[exp(−d) − 1 + d] (k3 ≥ 0 per token). Also abs_diff_mean = E|d|,
    abs_diff_max = max|d| and ratio_mean = E[π_trainer/π_sampler] (≈ 1 when both agree). Token means over mask;
    all (N, T) inputs; values are detached 0-d float32 tensors.
    """
    sums, count, dmax = mismatch_parts(sampler_logp, trainer_logp, mask)
    out = {k: v / count.clamp(min=1.0) for k, v in sums.items()}  # masked_mean's Σ / max(Σm, 1)
    return {"abs_diff_mean": out["abs_diff_mean"], "abs_diff_max": dmax,
            **{k: out[k] for k in ("kl_k1", "kl_k2", "kl_k3", "ratio_mean")}}


def entropy_mean(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logged entropy: mask-weighted token mean of per-token entropies (N, T), as TRL logs `entropy`."""
    return masked_mean(entropy.detach().float(), mask)
