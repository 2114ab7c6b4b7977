"""Adaptive Quantization Noise (AQN): the σ schedule and noise in the per-block RMSNorm weights (QERL.md §3.5).

The paper (Sec. 3.3, Eq. 7–12) adds channel-wise Gaussian noise Z ∈ R^d, Z ~ N(0, σ²I), to the RMSNorm weight w
that feeds the quantized linears: RMSNorm_noise(x) = (w + Z) ⊙ x / √(mean(x²) + δ), which equals row-wise
multiplicative noise (Z/w + 1) on Ŵ of q/k/v (through `input_layernorm`) and of gate/up (through
`post_attention_layernorm`). The noise is for the rollout policy only (Algorithm 1, line 9); training
log-probs come from the clean weights. σ decays over K stages, stage 0 noise-free.

Two draw frequencies:
- `per_forward`: a fresh Z for every forward call of each norm (the paper: "resampled for each forward pass");
  it uses forward pre-hooks, so it needs eager module calls (a captured CUDA graph would replay one draw).
- `per_rollout`: one Z for the whole `with` block. Entering the block once per training step, around all the
  rollouts of that step, is exactly what the official code does (one draw per step at weight sync, shared by
  all G samples of every prompt) — there is no separate "official" draw mode.
Official-code differences kept out on purpose: it adds a bf16-rounded Z to bf16 weights in place and never
subtracts it (its block norms are overwritten by the trained copies each step, its final norm would accumulate
a random walk); here Z is drawn in fp32, w + Z is rounded once to the weight dtype and the clean weights are
copied back bit-exactly on exit. `include_final_norm=True` also perturbs `model.norm`, as the official code
would, but without the accumulation.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from qerl.arch import BLOCK_NORMS  # the per-block norms AQN perturbs (also read as aqn.BLOCK_NORMS)

# ---------------------------------------------------------------------------------------------------------------------
# schedules


def _exponential(u: float, s: float, e: float) -> float:
    # Eq. 8: σ_start·(σ_end/σ_start)^u
    return s * (e / s) ** u


def _linear(u: float, s: float, e: float) -> float:
    return s + (e - s) * u


def _cosine(u: float, s: float, e: float) -> float:
    # half-cosine annealing: flat near both ends, fastest in the middle
    return e + (s - e) * 0.5 * (1.0 + math.cos(math.pi * u))


def _logarithmic(u: float, s: float, e: float) -> float:
    # σ follows a logarithm of the stage: s + (e − s)·log10(1 + 9u); drops fast early, flattens late
    return s + (e - s) * math.log10(1.0 + 9.0 * u)


#: shape functions f(u, σ_start, σ_end) with u ∈ [0, 1]: f(0) = σ_start, f(1) = σ_end, monotone in between.
#: The paper names linear/cosine/logarithmic decays (Fig. 9/15) but gives no formula for them; these are ours.
SCHEDULES = {"exponential": _exponential, "linear": _linear, "cosine": _cosine, "logarithmic": _logarithmic}
SIGMA_MODES = ("paper", "official")
DRAW_MODES = ("per_rollout", "per_forward")


def _check_choice(value: str, valid: Iterable[str], what: str) -> None:
    if value not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {sorted(valid)}")


def stage_at(step: int, total_steps: int, stages: int = 10, mode: str = "paper") -> int:
    """The AQN stage k ∈ {0, …, K−1} of 1-based optimizer step `step` out of M = `total_steps`; k = 0 is noise-free.

    paper (Algorithm 1): k = ⌊(step − 1) / ⌊M/K⌋⌋, clamped to K − 1 (the last M mod K steps stay in stage K − 1).
    official (`noise_scheduler.get_sigma_by_step`): k = ⌊step / (M/K)⌋ (float interval size), clamped to K − 1;
    stage 0 is then steps 1 … ⌈M/K⌉ − 1, one step shorter than in paper mode when K divides M.
    """
    _check_choice(mode, SIGMA_MODES, "sigma mode")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < (2 if mode == "paper" else 3):
        raise ValueError(
            f"stages must be an int >= {2 if mode == 'paper' else 3} in {mode} mode, got {stages!r}"
        )
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps must be a positive int, got {total_steps!r}")
    if not isinstance(step, int) or not 1 <= step <= total_steps:
        raise ValueError(f"step must be an int in [1, total_steps={total_steps}] (1-based), got {step!r}")
    if mode == "paper":
        per_stage = total_steps // stages
        if per_stage < 1:
            raise ValueError(f"paper mode needs total_steps >= stages, got {total_steps} < {stages}")
        k = (step - 1) // per_stage
    else:
        k = int(step // (total_steps / stages))
    return min(k, stages - 1)


def sigma_at(
    step: int,
    total_steps: int,
    sigma_start: float,
    sigma_end: float,
    stages: int = 10,
    schedule: str = "exponential",
    mode: str = "paper",
) -> float:
    """σ of the AQN noise at 1-based optimizer step `step` of `total_steps` (pure). Stage k from `stage_at`; σ = 0 at k = 0.

    paper (Eq. 8, Algorithm 1): σ = f((k − 1)/(K − 1)), with f = SCHEDULES[schedule]; exponential f gives
      σ_start·(σ_end/σ_start)^((k−1)/(K−1)). k never exceeds K − 1, so the last stage gets u = (K−2)/(K−1) < 1:
      σ_end itself is never applied (e.g. K = 10, 1e-2 → 5e-4 ends at 1e-2·0.05^(8/9) ≈ 6.98e-4).
    official (NVlabs/QeRL `noise_scheduler.py`): sigma_trend = σ_start·(σ_end/σ_start)^(arange(K−1)/(K−2)),
      stage k ≥ 1 uses sigma_trend[k − 1], i.e. u = (k − 1)/(K − 2): stage 1 is σ_start, stage K − 1 is exactly
      σ_end (1e-2 → 1e-4, K = 10: 0, 1e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1e-4).
    Other schedules replace the exponential f with the same u: linear σ_s + (σ_e − σ_s)u, cosine
    σ_e + (σ_s − σ_e)(1 + cos πu)/2, logarithmic σ_s + (σ_e − σ_s)·log10(1 + 9u).
    """
    _check_choice(schedule, SCHEDULES, "noise schedule")
    for name, v in (("sigma_start", sigma_start), ("sigma_end", sigma_end)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name} must be a finite float > 0, got {v!r}")
    k = stage_at(step, total_steps, stages, mode)
    if k == 0:
        return 0.0
    u = (k - 1) / (stages - 1) if mode == "paper" else (k - 1) / (stages - 2)
    return float(SCHEDULES[schedule](u, float(sigma_start), float(sigma_end)))


# ---------------------------------------------------------------------------------------------------------------------
# targets

def _is_rmsnorm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return "rmsnorm" in type(module).__name__.lower() and isinstance(w, nn.Parameter) and w.dim() == 1


def _find_norm_modules(model: nn.Module, include_final_norm: bool = False) -> list[tuple[str, nn.Module]]:
    """(module path, module) of each AQN target norm. A module qualifies if its class name contains "RMSNorm", it
    has a 1-D `weight` Parameter, and its path has a component `input_layernorm`/`post_attention_layernorm`
    (or, with include_final_norm, a component `norm` outside `layers`). Matching by path component and class
    name, not isinstance, also finds norms inside wrappers: PEFT's `ModulesToSaveWrapper` holds two copies
    (`original_module`, `modules_to_save.<adapter>`), and both are returned since either may run."""
    out, seen = [], set()
    for name, mod in model.named_modules():
        if not _is_rmsnorm(mod) or id(mod.weight) in seen:
            continue
        parts = name.split(".")
        block = any(p in BLOCK_NORMS for p in parts)
        final = include_final_norm and "norm" in parts and "layers" not in parts
        if block or final:
            seen.add(id(mod.weight))
            out.append((name, mod))
    if not out:
        raise ValueError(
            f"no AQN target found in {type(model).__name__}: looked for RMSNorm-like modules (class name contains "
            f"'RMSNorm', 1-D weight) under {list(BLOCK_NORMS)}"
            + (" or the final 'norm'" if include_final_norm else "")
        )
    return out


def find_noise_targets(model: nn.Module, include_final_norm: bool = False) -> list[tuple[str, nn.Parameter]]:
    """The per-block RMSNorm weights AQN perturbs: `input_layernorm` (feeds q/k/v) and `post_attention_layernorm`
    (feeds gate/up) of every decoder layer, optionally the final `model.norm`. Returns [(parameter name, weight)]
    in model order; raises ValueError if none is found."""
    return [(f"{n}.weight", m.weight) for n, m in _find_norm_modules(model, include_final_norm)]


# ---------------------------------------------------------------------------------------------------------------------
# noise


class AQNPrecisionWarning(UserWarning):
    """σ is below the resolution of the norm weights' dtype: most of the noise rounds away."""


def resolution(dtype: torch.dtype, magnitude: float) -> float:
    """Spacing between adjacent values of a float `dtype` at |x| = magnitude: eps·2^⌊log2|x|⌋ (bf16 at 1.0: 2^-7)."""
    fi = torch.finfo(dtype)
    m = max(abs(float(magnitude)), fi.tiny)
    return fi.eps * 2.0 ** math.floor(math.log2(m))


class NoiseInjector:
    """Context manager: channel-wise Gaussian noise on RMSNorm weights, clean weights restored exactly on exit.

    Eq. 10: w ← w + Z, Z ~ N(0, σ²) drawn in float32 per element of each weight (d channels), rounded once to the
    weight's dtype. On enter the clean weights are cloned; on exit (also after an exception) they are copied back,
    so the result is bit-identical (no subtraction). σ = 0 is a no-op. See the module docstring for `mode`.
    After use: `sigma`, `mode`, `n_draws` (draws per target), `rounded_frac` ({dtype name: fraction of noise
    elements that rounded away, i.e. w + Z == w in the weight dtype}). On enter, if σ is below half the dtype
    spacing at the median |w| of the targets of that dtype, one `AQNPrecisionWarning` is issued.
    """

    def __init__(
        self,
        targets: list[tuple[str, nn.Module | nn.Parameter]],
        sigma: float,
        generator: torch.Generator | None = None,
        mode: str = "per_rollout",
    ):
        _check_choice(mode, DRAW_MODES, "noise draw mode")
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"sigma must be a finite float >= 0, got {sigma!r}")
        self.params: list[tuple[str, nn.Parameter]] = []
        self.modules: list[nn.Module | None] = []
        for name, t in targets:
            if isinstance(t, nn.Module):
                self.params.append((name, t.weight))
                self.modules.append(t)
            elif isinstance(t, torch.Tensor):
                self.params.append((name, t))
                self.modules.append(None)
            else:
                raise TypeError(f"target {name!r} must be a module or a parameter, got {type(t).__name__}")
        if mode == "per_forward" and any(m is None for m in self.modules):
            raise ValueError(
                "mode='per_forward' needs the norm modules (pass the model), not bare parameters"
            )
        self.sigma, self.mode, self.generator = float(sigma), mode, generator
        self._draws = [0] * len(self.params)
        self._clean: list[torch.Tensor] | None = None
        self._hooks: list = []
        self._rounded: dict[str, tuple] = {}

    @property
    def n_draws(self) -> int:
        """Noise draws so far for the most-drawn target (1 per block in per_rollout, 1 per forward call)."""
        return max(self._draws, default=0)

    @property
    def rounded_frac(self) -> dict[str, float]:
        return {k: (float(c) / n if n else 0.0) for k, (c, n) in self._rounded.items()}

    def _draw(self, i: int) -> None:
        """w_i ← round_dtype(clean_i + Z), Z ~ N(0, σ²) in float32."""
        p, clean = self.params[i][1], self._clean[i]
        dev = self.generator.device if self.generator is not None else p.device
        z = torch.randn(p.shape, generator=self.generator, dtype=torch.float32, device=dev).to(
            p.device
        )  # (d,)
        noisy = (clean.float() + z * self.sigma).to(p.dtype)  # (d,)
        with torch.no_grad():
            p.copy_(noisy)
        # counts stay on the device: no host sync per draw (per_forward draws on every decode step)
        key = str(p.dtype).removeprefix("torch.")
        c, n = self._rounded.get(key, (0, 0))
        self._rounded[key] = (c + (noisy == clean).sum(), n + noisy.numel())
        self._draws[i] += 1

    def _check_resolution(self) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for c in self._clean:
            by_dtype.setdefault(c.dtype, []).append(c.detach().abs().flatten().float())
        msgs = []
        for dt, parts in by_dtype.items():
            mags = torch.cat(parts)
            mags = mags[mags > 0]
            if mags.numel() == 0:
                continue
            mag = float(mags.median())
            spacing = resolution(dt, mag)
            if self.sigma < spacing / 2:
                msgs.append(f"{str(dt).removeprefix('torch.')} spacing {spacing:.3g} at median |w| {mag:.3g}")
        if msgs:
            warnings.warn(
                f"AQN sigma={self.sigma:.3g} is below half the weight resolution ({'; '.join(msgs)}): "
                "most noise draws round away. Keep the noised norms in float32 or use a larger sigma.",
                AQNPrecisionWarning,
                stacklevel=3,
            )

    def __enter__(self) -> NoiseInjector:
        if self._clean is not None:
            raise RuntimeError("NoiseInjector is not re-entrant")
        if self.sigma == 0.0:
            self._clean = []
            return self
        with torch.no_grad():
            self._clean = [p.detach().clone() for _, p in self.params]
        self._check_resolution()
        try:
            if self.mode == "per_rollout":
                for i in range(len(self.params)):
                    self._draw(i)
            else:
                for i, mod in enumerate(self.modules):
                    self._hooks.append(mod.register_forward_pre_hook(self._make_hook(i)))
        except BaseException:
            self._restore()
            raise
        return self

    def _make_hook(self, i: int):
        def hook(module, args):
            self._draw(i)

        return hook

    def _restore(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._clean:
            with torch.no_grad():
                for (_, p), c in zip(self.params, self._clean, strict=True):
                    p.copy_(c)
        self._clean = None

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._restore()
        return False


def noise(
    model_or_targets: nn.Module | list[tuple[str, nn.Module | nn.Parameter]],
    sigma: float,
    generator: torch.Generator | None = None,
    mode: str = "per_rollout",
    include_final_norm: bool = False,
) -> NoiseInjector:
    """`with aqn.noise(policy, sigma_at(step, ...)):` rollout with noisy per-block RMSNorm weights (Eq. 10).

    model_or_targets: a model (targets from `find_noise_targets`, plus the final norm if include_final_norm) or an
    explicit [(name, module or parameter)] list. Returns the `NoiseInjector` (σ applied, draws, rounded fraction).
    """
    if isinstance(model_or_targets, nn.Module):
        targets = _find_norm_modules(model_or_targets, include_final_norm)
    else:
        targets = list(model_or_targets)
    return NoiseInjector(targets, sigma, generator=generator, mode=mode)
