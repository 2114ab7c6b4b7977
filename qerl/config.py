"""Typed, validated configuration. The only module that imports hydra / omegaconf.

``load_config(["quant=nvfp4", "aqn=paper", "train.steps=50"])`` composes ``qerl/conf/train.yaml`` with Hydra's
compose API (no working-directory change, no output folders), turns it into frozen dataclasses, and validates
every value once. Anything unknown fails at once with a message that names it and lists the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "quant", "lora", "algo", "aqn", "data", "rollout", "scale")


class ConfigError(ValueError):
    """A bad configuration key or value."""


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check(name: str, value, valid) -> None:
    valid = list(valid)
    if value not in valid:
        hint = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {valid}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else ""))


@dataclass(frozen=True)
class ModelCfg:
    source: str = "toy:smoke"
    tokenizer: str | None = None
    dtype: str = "auto"
    attn_implementation: str = "sdpa"


@dataclass(frozen=True)
class QuantCfg:
    format: str = "bf16"
    scale_rule: str | None = None


@dataclass(frozen=True)
class LoraCfg:
    enabled: bool = True
    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    train_norms: bool = False


@dataclass(frozen=True)
class AlgoCfg:
    name: str = "grpo"
    group_size: int = 8
    ppo_epochs: int = 4
    minibatches: int = 1
    clip_low: float = 0.2
    clip_high: float = 0.28
    loss_agg: str = "seq_mean"
    adv_std_norm: bool = True
    adv_eps: float = 1e-4
    kl_coef: float = 0.0
    dynamic_sampling: bool = False
    max_refills: int = 0
    mask_truncated: bool = True
    tis_cap: float | None = None

    @property
    def updates_per_rollout(self) -> int:
        return self.ppo_epochs * self.minibatches


@dataclass(frozen=True)
class AqnCfg:
    enabled: bool = False
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    stages: int = 10
    schedule: str = "exponential"
    mode: str = "paper"
    draw: str = "per_rollout"
    include_final_norm: bool = False


@dataclass(frozen=True)
class DataCfg:
    train: str = "toy"
    source: str = "local"
    train_size: int | None = None     # keep the first n training problems (after a seeded shuffle); None: all
    levels: tuple[int, ...] | None = None
    prompt: str = "plain"
    rewards: tuple[str, ...] = ("accuracy",)
    reward_weights: tuple[float, ...] = (1.0,)
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128


@dataclass(frozen=True)
class RolloutCfg:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    cuda_graphs: Any = "auto"
    prompt_batch: int = 0


@dataclass(frozen=True)
class TrainLoopCfg:
    steps: int = 20
    batch_size: int = 32
    micro_batch: int = 8
    gradient_checkpointing: bool = False
    save_every: int = 10
    keep_checkpoints: int = 2
    eval_every: int = 0
    progress: bool = True


@dataclass(frozen=True)
class OptimCfg:
    name: str = "adamw8bit"
    lr: float = 1e-5
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8
    warmup_ratio: float = 0.1
    schedule: str = "cosine"
    max_grad_norm: float = 0.2


@dataclass(frozen=True)
class EvalCfg:
    sets: tuple[str, ...] = ("toy",)
    n_samples: int = 4
    limit: int | None = 64
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens: int = 4096
    batch_prompts: int = 16


@dataclass(frozen=True)
class TrainConfig:
    model: ModelCfg = field(default_factory=ModelCfg)
    quant: QuantCfg = field(default_factory=QuantCfg)
    lora: LoraCfg = field(default_factory=LoraCfg)
    algo: AlgoCfg = field(default_factory=AlgoCfg)
    aqn: AqnCfg = field(default_factory=AqnCfg)
    data: DataCfg = field(default_factory=DataCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    train: TrainLoopCfg = field(default_factory=TrainLoopCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    experiment: str = "default"
    run_name: str | None = None
    out_dir: str = "results"
    seed: int = 0
    device: str = "auto"
    scale: str = "smoke"            # the chosen scale group (recorded in every result)
    choices: dict = field(default_factory=dict)  # group -> chosen option
    tags: dict = field(default_factory=dict)     # free-form labels set by experiments (table, row, paper model)

    # ------------------------------------------------------------------------------------ derived
    @property
    def batch_prompts(self) -> int:
        return self.train.batch_size // self.algo.group_size

    @property
    def full_finetune(self) -> bool:
        return not self.lora.enabled

    def default_run_name(self) -> str:
        lora = "full" if self.full_finetune else f"lora{self.lora.rank}" + ("ln" if self.lora.train_norms else "")
        aqn = f"aqn-{self.aqn.schedule[:3]}-{self.aqn.mode}" if self.aqn.enabled else "noaqn"
        return f"{self.quant.format}-{lora}-{aqn}-{self.algo.name}-{self.data.train}-s{self.seed}"

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.experiment / (self.run_name or self.default_run_name())

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(_plain(self.to_dict()), sort_keys=False)


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


_FREE = {"tags", "choices"}  # plain dicts, not dataclasses


def _build(cls, data: dict, where: str):
    """Instantiate a dataclass from a plain dict; unknown keys are errors."""
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {[f'{where}.{k}' if where else k for k in unknown]}; "
                          f"valid keys{' of ' + where if where else ''}: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        sub = names[k].default_factory if names[k].default_factory is not dataclasses.MISSING else None
        if k in _FREE:
            v = dict(v or {})
        elif sub is not None and dataclasses.is_dataclass(sub) and isinstance(v, dict):
            v = _build(sub, v, f"{where}.{k}" if where else k)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check every value against the registries of the modules that own them."""
    from qerl import aqn, data, rewards
    from qerl.algos import AGGREGATIONS
    from qerl.lora import DEFAULT_TARGETS
    from qerl.quant import FORMATS

    _check("quant.format", cfg.quant.format, FORMATS)
    if cfg.quant.scale_rule is not None:
        from qerl.quant.mxfp4 import SCALE_RULES

        if cfg.quant.format != "mxfp4":
            raise ConfigError(f"quant.scale_rule applies to mxfp4 only (quant.format={cfg.quant.format!r})")
        _check("quant.scale_rule", cfg.quant.scale_rule, SCALE_RULES)
    _check("model.dtype", cfg.model.dtype, ["auto", "bfloat16", "float16", "float32"])
    _check("algo.loss_agg", cfg.algo.loss_agg, AGGREGATIONS)
    _check("aqn.schedule", cfg.aqn.schedule, aqn.SCHEDULES)
    _check("aqn.mode", cfg.aqn.mode, aqn.SIGMA_MODES)
    _check("aqn.draw", cfg.aqn.draw, aqn.DRAW_MODES)
    _check("data.train", cfg.data.train, [k for k in data.DATASETS if "train" in data.SPLITS[k]])
    _check("data.source", cfg.data.source, data.SOURCES[cfg.data.train])
    _check("data.prompt", cfg.data.prompt, data.PROMPTS)
    for r in cfg.data.rewards:
        _check("data.rewards[]", r, rewards.REWARDS)
    for s in cfg.eval.sets:
        _check("eval.sets[]", s, [k for k in data.DATASETS if "test" in data.SPLITS[k]])
    _check("optim.name", cfg.optim.name, ["adamw8bit", "adamw"])
    _check("optim.schedule", cfg.optim.schedule, ["cosine", "constant", "linear"])
    _check("rollout.cuda_graphs", cfg.rollout.cuda_graphs, ["auto", True, False])
    for t in cfg.lora.targets:
        _check("lora.targets[]", t, DEFAULT_TARGETS)
    if len(cfg.data.reward_weights) != len(cfg.data.rewards):
        raise ConfigError(f"data.reward_weights has {len(cfg.data.reward_weights)} entries for "
                          f"{len(cfg.data.rewards)} rewards {list(cfg.data.rewards)}")
    if cfg.full_finetune and cfg.quant.format != "bf16":
        raise ConfigError(f"lora=none (full fine-tuning) trains dense BF16 weights; quant.format must be 'bf16', "
                          f"got {cfg.quant.format!r}")
    if cfg.full_finetune and cfg.lora.train_norms:
        raise ConfigError("lora.train_norms needs a LoRA run (full fine-tuning trains every weight anyway)")
    positive = {"algo.group_size": cfg.algo.group_size, "algo.ppo_epochs": cfg.algo.ppo_epochs,
                "algo.minibatches": cfg.algo.minibatches, "train.steps": cfg.train.steps,
                "train.batch_size": cfg.train.batch_size, "train.micro_batch": cfg.train.micro_batch,
                "data.max_new_tokens": cfg.data.max_new_tokens, "eval.n_samples": cfg.eval.n_samples,
                "aqn.stages": cfg.aqn.stages}
    for k, v in positive.items():
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"{k} must be a positive integer, got {v!r}")
    if cfg.lora.enabled and cfg.lora.rank < 1:
        raise ConfigError(f"lora.rank must be >= 1 when lora.enabled, got {cfg.lora.rank}")
    if cfg.train.batch_size % cfg.algo.group_size:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be a multiple of "
                          f"algo.group_size={cfg.algo.group_size} (it counts completions)")
    if cfg.batch_prompts % cfg.algo.minibatches:
        raise ConfigError(f"the {cfg.batch_prompts} prompts of a step cannot be split into "
                          f"algo.minibatches={cfg.algo.minibatches} equal minibatches")
    if cfg.aqn.enabled:
        aqn.sigma_at(1, cfg.train.steps, cfg.aqn.sigma_start, cfg.aqn.sigma_end, cfg.aqn.stages,
                     cfg.aqn.schedule, cfg.aqn.mode)  # raises on bad sigma / stage arguments
    if not 0 <= cfg.optim.warmup_ratio < 1:
        raise ConfigError(f"optim.warmup_ratio must be in [0, 1), got {cfg.optim.warmup_ratio}")
    for k in ("clip_low", "clip_high"):
        if not 0 <= getattr(cfg.algo, k) < 1:
            raise ConfigError(f"algo.{k} must be in [0, 1), got {getattr(cfg.algo, k)}")
    if cfg.rollout.temperature <= 0 or not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"rollout needs temperature > 0 and 0 < top_p <= 1, got "
                          f"{cfg.rollout.temperature}, {cfg.rollout.top_p}")
    return cfg


def _split_overrides(overrides: Sequence[str]) -> None:
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not of the form key=value")
        if "." not in key and key in GROUPS:
            _check(key, o.split("=", 1)[1], _choices(key))


def compose(overrides: Sequence[str] = (), config_name: str = "train"):
    """The raw composed OmegaConf config (for tools that want to inspect it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    _split_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name, overrides=list(overrides), return_hydra_config=True)
    except (ConfigAttributeError, ConfigKeyError) as e:
        raise ConfigError(f"unknown configuration key: {e}") from None
    except Exception as e:  # hydra's own errors (missing group option, override grammar)
        raise ConfigError(str(e).strip()) from None


def load_config(overrides: Sequence[str] = ()) -> TrainConfig:
    """Compose, convert and validate: the single entry from command-line overrides to a ``TrainConfig``."""
    from omegaconf import OmegaConf, open_dict

    raw = compose(overrides)
    choices = {g: str(raw.hydra.runtime.choices.get(g)) for g in GROUPS}
    with open_dict(raw):
        del raw["hydra"]
    data = OmegaConf.to_container(raw, resolve=True)
    data.pop("defaults", None)
    data["scale"] = choices["scale"]
    data["choices"] = choices
    return validate(_build(TrainConfig, data, ""))


def from_dict(data: dict) -> TrainConfig:
    """Rebuild a ``TrainConfig`` from ``to_dict()`` output (e.g. a run's config.yaml)."""
    return validate(_build(TrainConfig, dict(data), ""))
