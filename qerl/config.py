"""Typed, validated configuration. The only module that imports hydra / omegaconf.

``load_config(["quant=nvfp4", "aqn=paper", "train.steps=50"])`` composes ``qerl/conf/train.yaml`` with Hydra's
compose API (no working-directory change, no output folders), turns it into frozen dataclasses, and validates
every value once. Anything unknown fails at once with a message that names it and lists the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin, get_type_hints

from qerl.arch import DEFAULT_TARGETS
from qerl.errors import UserError

CONF_DIR = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "quant", "lora", "algo", "aqn", "data", "rollout", "scale")


class ConfigError(UserError):
    """A bad configuration key or value (a ``UserError``: entry points print it as one line)."""


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _check(name: str, value, valid, extra: str = "") -> None:
    valid = list(valid)
    if value not in valid:
        hint = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {valid}{extra}"
                          + (f" (did you mean {hint[0]!r}?)" if hint else ""))


# ------------------------------------------------------------------------------------------------ field constraints
@dataclass(frozen=True)
class Range:
    """A closed, open or half-open interval of valid numbers (None: unbounded). NaN and ±inf are never valid."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def holds(self, v: float) -> bool:
        if not math.isfinite(v):
            return False
        above = self.lo is None or (v > self.lo if self.lo_open else v >= self.lo)
        below = self.hi is None or (v < self.hi if self.hi_open else v <= self.hi)
        return above and below

    def __str__(self) -> str:
        if self.lo is None and self.hi is None:
            return "a finite number"
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def num(default, lo=None, hi=None, *, lo_open=False, hi_open=False, why: str = ""):
    """A numeric field (or a tuple of numbers, or an optional number) whose values must lie in the range;
    ``why`` is appended to the error to say what the knob does."""
    return field(default=default, metadata={"range": Range(lo, hi, lo_open, hi_open), "why": why})


def one_of(*choices):
    """A field whose value is one of a fixed set, the first being the default (sets owned by other modules, e.g.
    the quant formats, are checked in ``validate`` against those modules' registries)."""
    return field(default=choices[0], metadata={"choices": choices})


POSITIVE = dict(lo=0, lo_open=True)      # > 0
UNIT = dict(lo=0, hi=1, hi_open=True)    # [0, 1)
DEVICES = ("auto", "cpu", "cuda", "cuda:N")
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")  # transformers' names


@dataclass(frozen=True)
class ModelCfg:
    source: str = "toy:smoke"
    tokenizer: str | None = None
    dtype: str = one_of("auto", "bfloat16", "float16", "float32")
    attn_implementation: str = one_of(*ATTENTION)


@dataclass(frozen=True)
class QuantCfg:
    format: str = "bf16"
    options: dict = field(default_factory=dict)  # the format's constructor arguments (mxfp4: scale_rule), set in
                                                 # its YAML; checked against the format by ``validate``
    layout: str = "auto"  # how an NVFP4/MXFP4 base is held: compressed (the checkpoint's tensors, plus the CUDA
                          # kernels' copy where they run), kernel (only the kernels' copy; qerl/kernels/relaid.py) or
                          # auto (kernel where the CUDA FP4 kernels run, else compressed)


@dataclass(frozen=True)
class LoraCfg:
    enabled: bool = True
    rank: int = num(32, 0)
    alpha: float = num(32.0, 0)
    dropout: float = num(0.0, **UNIT)
    targets: tuple[str, ...] = DEFAULT_TARGETS
    train_norms: bool = False


@dataclass(frozen=True)
class AlgoCfg:
    name: str = "grpo"
    group_size: int = num(8, 2, why="completions per prompt; a lone completion's group-relative advantage "
                                    "is always 0, and its group std is undefined")
    ppo_epochs: int = num(4, 1)
    minibatches: int = num(1, 1)
    clip_low: float = num(0.2, **UNIT)
    clip_high: float = num(0.28, **UNIT)
    loss_agg: str = "seq_mean"
    adv_std_norm: bool = True
    adv_eps: float = num(1e-4, **POSITIVE, why="added to the group std; 0 makes a uniform group's advantage 0/0")
    kl_coef: float = num(0.0, 0)
    dynamic_sampling: bool = False
    max_refills: int = num(0, 0)
    mask_truncated: bool = True
    tis_cap: float | None = num(None, **POSITIVE)

    @property
    def updates_per_rollout(self) -> int:
        return self.ppo_epochs * self.minibatches


@dataclass(frozen=True)
class AqnCfg:
    enabled: bool = False
    sigma_start: float = num(1e-2, **POSITIVE)
    sigma_end: float = num(5e-4, **POSITIVE)
    stages: int = num(10, 2)
    schedule: str = "exponential"
    mode: str = "paper"
    draw: str = "per_rollout"
    include_final_norm: bool = False


@dataclass(frozen=True)
class DataCfg:
    train: str = "toy"
    source: str = "local"
    path: str | None = None           # data.train=jsonl: the user's JSON-lines file (see qerl.data.load_jsonl)
    train_size: int | None = num(None, 1, why="keep the first n training problems; null keeps all")
    levels: tuple[int, ...] | None = None
    prompt: str = "plain"
    rewards: tuple[str, ...] = ("accuracy",)
    reward_weights: tuple[float, ...] = num((1.0,))
    max_prompt_tokens: int = num(256, 1)
    max_new_tokens: int = num(128, 1)

    def load_options(self) -> dict:
        """Keyword options of ``qerl.data.load_dataset`` / ``data_provenance`` for the training set."""
        return {**({"levels": tuple(self.levels)} if self.levels else {}),
                **({"path": self.path} if self.path is not None else {})}


@dataclass(frozen=True)
class RolloutCfg:
    temperature: float = num(1.0, **POSITIVE, why="RL samples the policy; greedy rollouts make every "
                                                  "completion of a group the same")
    top_p: float = num(1.0, 0, 1, lo_open=True)
    top_k: int = num(0, 0, why="0 turns top-k off")
    cuda_graphs: Any = one_of("auto", True, False)
    prompt_batch: int = num(0, 0, why="0 prefills all of a step's prompts together")
    # batch: one sampling stream per rollout batch (per rank under torchrun) and AQN noise per rank; group: one stream
    # per group, seeded by its index in the step, and one AQN draw shared by all ranks, so a run samples the same
    # completions whatever the number of ranks (and whatever rollout.prompt_batch)
    seed_scope: str = one_of("batch", "group")


@dataclass(frozen=True)
class TrainLoopCfg:
    steps: int = num(20, 1)
    batch_size: int = num(32, 1)
    micro_batch: int = num(8, 1)
    gradient_checkpointing: bool = False
    save_every: int = num(10, 0, why="0 saves only at the end")
    keep_checkpoints: int = num(2, 0, why="0 keeps every checkpoint")
    eval_every: int = num(0, 0, why="0 evaluates only at the end")
    progress: bool = True
    log_samples: bool = False  # samples.jsonl: per step, every group's prompt id, completions, rewards, advantages
    max_nonfinite_steps: int = num(5, 0, why="a run stops after this many steps in a row whose every update had a "
                                               "NaN/inf gradient (those updates are skipped); 0 never stops")


@dataclass(frozen=True)
class OptimCfg:
    name: str = one_of("adamw8bit", "adamw")
    lr: float = num(1e-5, **POSITIVE)
    weight_decay: float = num(0.1, 0)
    betas: tuple[float, float] = num((0.9, 0.99), **UNIT, why="Adam's moment decay rates")
    eps: float = num(1e-8, **POSITIVE)
    warmup_ratio: float = num(0.1, **UNIT)
    schedule: str = one_of("cosine", "constant", "linear")
    max_grad_norm: float = num(0.2, **POSITIVE, why="the gradient-norm clip limit; a negative one would turn "
                                                   "descent into ascent")


@dataclass(frozen=True)
class DistCfg:
    """torch.distributed settings of a torchrun launch (unused by a one-process run)."""

    backend: str = one_of("auto", "nccl", "gloo")  # auto: nccl on CUDA, gloo on the CPU
    timeout_s: float = num(300.0, **POSITIVE, why="how long a collective waits for a dead or hung rank")
    fsdp: bool = False  # full fine-tuning: FSDP2 shards gradients and optimizer state over the ranks (qerl.dist)


@dataclass(frozen=True)
class EvalCfg:
    sets: tuple[str, ...] = ("toy",)
    n_samples: int = num(4, 1)
    limit: int | None = num(64, 1, why="problems per set; null evaluates all")
    temperature: float = num(0.6, 0, why="0 decodes greedily")
    top_p: float = num(0.95, 0, 1, lo_open=True)
    max_new_tokens: int = num(4096, 1)
    batch_prompts: int = num(16, 1)


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
    dist: DistCfg = field(default_factory=DistCfg)
    experiment: str = "default"
    run_name: str | None = None
    out_dir: str = "results"
    seed: int = num(0, 0)
    device: str = "auto"            # auto | cpu | cuda | cuda:N
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
        train = self.data.train + (f"-{Path(self.data.path).stem}" if self.data.path else "")  # two files, two runs
        return f"{self.quant.format}-{lora}-{aqn}-{self.algo.name}-{train}-s{self.seed}"

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


_FREE = {"tags", "choices", "options"}  # plain dicts, not dataclasses


def _section(name: str):
    """The dataclass a field of ``TrainConfig`` holds (``TrainConfig.train`` -> ``TrainLoopCfg``), else None."""
    f = {f.name: f for f in fields(TrainConfig)}.get(name)
    sub = f.default_factory if f is not None and f.default_factory is not dataclasses.MISSING else None
    return sub if sub is not None and dataclasses.is_dataclass(sub) else None


def _build(cls, data: dict, where: str):
    """Instantiate a dataclass from a plain dict; unknown keys are errors."""
    names = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {[f'{where}.{k}' if where else k for k in unknown]}; "
                          f"valid keys{' of ' + where if where else ''}: {sorted(names)}")
    kwargs = {}
    for k, v in data.items():
        sub = _section(k) if cls is TrainConfig else None
        if k in _FREE:
            v = dict(v or {})
        elif sub is not None:
            if not isinstance(v, dict):
                raise ConfigError(f"{k}={v!r} is a section, not a value; valid keys of {k}: "
                                  f"{sorted(f.name for f in fields(sub))}")
            v = _build(sub, v, k)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


# ------------------------------------------------------------------------------------------------ validation
def _type_name(tp) -> str:
    if get_origin(tp) in (Union, UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if get_origin(tp) is tuple:
        args = get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
        return f"a list of {len(args)} {_type_name(args[0]).removeprefix('a ')}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping",
            type(None): "null"}.get(tp, str(tp))


def _is(value, tp) -> bool:
    """Does ``value`` (as OmegaConf hands it over: lists already made tuples) have the annotated type ``tp``?"""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return True
    if origin in (Union, UnionType):
        return any(_is(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_is(v, args[0]) for v in value)
        return len(value) == len(args) and all(_is(v, a) for v, a in zip(value, args, strict=True))
    if tp is float:  # an integer is a number; a bool is not (YAML `true` must not pass for 1.0)
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp)


def _show(value) -> str:
    return repr(list(value)) if isinstance(value, tuple) else repr(value)


def _check_fields(obj, where: str = "") -> None:
    """Every field of ``obj`` (recursively): its annotated type, then its declared choices or range."""
    hints = get_type_hints(type(obj))
    for f in fields(obj):
        key, value = f"{where}.{f.name}" if where else f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check_fields(value, key)
            continue
        if not _is(value, hints[f.name]):
            raise ConfigError(f"{key}={_show(value)} is not valid: it must be {_type_name(hints[f.name])}")
        if "choices" in f.metadata:
            _check(key, value, f.metadata["choices"])
        rng = f.metadata.get("range")
        numbers = value if isinstance(value, tuple) else (value,)
        if rng is not None and not all(x is None or rng.holds(x) for x in numbers):
            why = f.metadata.get("why")
            raise ConfigError(f"{key}={_show(value)} is out of range: "
                              f"{'each value ' if isinstance(value, tuple) else ''}must be {rng}"
                              + (f" ({why})" if why else ""))


def _check_data(cfg: TrainConfig, data, read_files: bool) -> None:
    """The training and evaluation sets: names, sources, levels, and (``read_files``) user files, read and checked
    row by row now, so a bad row fails before any run directory or model exists."""
    d = cfg.data
    _check("data.train", d.train, [k for k in data.DATASETS if "train" in data.SPLITS[k]],
           " (a file of your own: data=jsonl data.path=<file>)" if ":" in d.train else "")
    _check("data.source", d.source, data.SOURCES[d.train])
    if (d.train == "jsonl") != (d.path is not None):
        raise ConfigError("data.train=jsonl needs data.path=<file>" if d.path is None else
                          f"data.path={d.path!r} applies to data.train=jsonl only (data.train={d.train!r})")
    levels = data.valid_levels(d.train)
    if d.levels is not None and (levels is None or not d.levels or not set(d.levels) <= set(levels)):
        raise ConfigError(f"data.levels={_show(d.levels)} is not valid for data.train={d.train!r}: "
                          + (f"choose a non-empty subset of {list(levels)}" if levels else
                             "this dataset has no levels; set data.levels=null"
                             + (" (or use the preset: data=jsonl data.path=<file>)" if d.train == "jsonl" else "")))
    for s in cfg.eval.sets:
        name = data.dataset_name(s)
        _check("eval.sets[]", name, [k for k in data.DATASETS if "test" in data.SPLITS[k]],
               " (a file of your own: jsonl:<file>)")
        if name != "toy" and d.source not in data.SOURCES[name]:
            raise ConfigError(f"eval.sets has {s!r}, which has no source {d.source!r} (data.source applies to the "
                              f"eval sets too); its sources: {list(data.SOURCES[name])}")
    files = ([("data.path", f"jsonl:{d.path}")] if d.path is not None else []) + \
        [("eval.sets", s) for s in cfg.eval.sets if data.dataset_name(s) == "jsonl"]
    for key, spec in files if read_files else ():
        try:
            data.check_dataset(spec)
        except UserError as e:
            raise ConfigError(f"{key}: {e}") from None


def validate(cfg: TrainConfig, read_files: bool = True) -> TrainConfig:
    """Check every value: types and ranges declared on the fields, registries of the modules that own them,
    and the constraints between values. Raises ``ConfigError`` naming the key, the value and what is valid.
    ``read_files``: also read every row of the user's data files (``data.path``, ``jsonl:<file>`` eval sets)."""
    from qerl import aqn, data, quant, rewards
    from qerl.algos import AGGREGATIONS

    _check_fields(cfg)
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", cfg.device):
        _check("device", cfg.device, DEVICES)
    _check("quant.format", cfg.quant.format, quant.FORMATS)
    try:
        quant.build(cfg.quant.format, cfg.quant.options)  # the format's constructor checks its own options
    except UserError as e:
        raise ConfigError(f"quant.options={cfg.quant.options!r}: {e}") from None
    _check("quant.layout", cfg.quant.layout, quant.base.LAYOUTS)
    if cfg.quant.layout == "kernel" and cfg.quant.format not in quant.base.KERNEL_LAYOUT_FORMATS:
        raise ConfigError(f"quant.layout='kernel' holds an FP4 base in the CUDA kernels' layout; quant.format must "
                          f"be 'nvfp4' or 'mxfp4', got {cfg.quant.format!r} (use quant.layout=compressed)")
    _check("algo.loss_agg", cfg.algo.loss_agg, AGGREGATIONS)
    _check("aqn.schedule", cfg.aqn.schedule, aqn.SCHEDULES)
    _check("aqn.mode", cfg.aqn.mode, aqn.SIGMA_MODES)
    _check("aqn.draw", cfg.aqn.draw, aqn.DRAW_MODES)
    _check("data.prompt", cfg.data.prompt, data.PROMPTS)
    if not cfg.data.rewards:
        raise ConfigError(f"data.rewards is empty; choose one or more of {sorted(rewards.REWARDS)}")
    for r in cfg.data.rewards:
        _check("data.rewards[]", r, rewards.REWARDS)
    for t in cfg.lora.targets:
        _check("lora.targets[]", t, DEFAULT_TARGETS)
    _check_data(cfg, data, read_files)
    if len(cfg.data.reward_weights) != len(cfg.data.rewards):
        raise ConfigError(f"data.reward_weights has {len(cfg.data.reward_weights)} entries for "
                          f"{len(cfg.data.rewards)} rewards {list(cfg.data.rewards)}")
    if cfg.full_finetune and cfg.quant.format != "bf16":
        raise ConfigError(f"lora=none (full fine-tuning) trains dense BF16 weights; quant.format must be 'bf16', "
                          f"got {cfg.quant.format!r}")
    if cfg.full_finetune and cfg.lora.train_norms:
        raise ConfigError("lora.train_norms needs a LoRA run (full fine-tuning trains every weight anyway)")
    if cfg.dist.fsdp:
        if not cfg.full_finetune:
            raise ConfigError("dist.fsdp=true shards a full fine-tuning run (lora=none); a LoRA run all-reduces only "
                              "its adapter, which needs no sharding: set dist.fsdp=false")
        if cfg.optim.name != "adamw":
            raise ConfigError(f"dist.fsdp=true needs optim.name=adamw (torch's AdamW works on sharded DTensor "
                              f"parameters; bitsandbytes' 8-bit AdamW does not), got optim.name={cfg.optim.name!r}")
        if cfg.aqn.enabled:
            raise ConfigError("dist.fsdp=true with AQN is not supported (AQN perturbs RMSNorm weights that FSDP keeps "
                              "sharded); AQN is a QeRL (quantized LoRA) technique: set aqn=none")
    if cfg.lora.enabled:
        if cfg.lora.rank < 1 or cfg.lora.alpha <= 0 or not cfg.lora.targets:
            raise ConfigError(f"a LoRA run (lora.enabled=true) needs lora.rank >= 1, lora.alpha > 0 and at least one "
                              f"of lora.targets; got rank={cfg.lora.rank}, alpha={cfg.lora.alpha}, "
                              f"targets={list(cfg.lora.targets)} (lora=none trains without an adapter)")
    if cfg.train.batch_size % cfg.algo.group_size:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be a multiple of "
                          f"algo.group_size={cfg.algo.group_size} (it counts completions)")
    if cfg.batch_prompts % cfg.algo.minibatches:
        raise ConfigError(f"the {cfg.batch_prompts} prompts of a step cannot be split into "
                          f"algo.minibatches={cfg.algo.minibatches} equal minibatches")
    if cfg.aqn.sigma_start < cfg.aqn.sigma_end:
        raise ConfigError(f"aqn.sigma_start={cfg.aqn.sigma_start!r} < aqn.sigma_end={cfg.aqn.sigma_end!r}: the noise "
                          f"would rise during training; AQN decays it, so sigma_start must be >= sigma_end")
    if cfg.aqn.enabled:
        try:  # the stage arithmetic needs enough steps per stage (and K >= 3 in official mode)
            aqn.sigma_at(1, cfg.train.steps, cfg.aqn.sigma_start, cfg.aqn.sigma_end, cfg.aqn.stages,
                         cfg.aqn.schedule, cfg.aqn.mode)
        except ValueError as e:
            raise ConfigError(f"aqn (stages={cfg.aqn.stages}, mode={cfg.aqn.mode!r}, train.steps={cfg.train.steps}): "
                              f"{e}") from None
    if cfg.eval.temperature == 0 and cfg.eval.n_samples != 1:
        raise ConfigError(f"eval.temperature=0 decodes greedily, so the eval.n_samples={cfg.eval.n_samples} samples "
                          f"of a problem would all be the same; set eval.n_samples=1")
    return cfg


def _absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """User data files as absolute paths, so the recorded config still finds them from another directory."""
    from qerl import data

    path = str(Path(cfg.data.path).expanduser().resolve()) if cfg.data.path else cfg.data.path
    sets = tuple(data.absolute_spec(s) for s in cfg.eval.sets)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=path),
                               eval=dataclasses.replace(cfg.eval, sets=sets))


# ------------------------------------------------------------------------------------------------ composition
def _check_key(key: str) -> None:
    """An override's dotted key names a field of the schema (else: the valid keys of its section)."""
    parts = key.split(".")
    cls, where = TrainConfig, ""
    for i, part in enumerate(parts):
        names = [f.name for f in fields(cls)]
        if part not in names:
            hint = difflib.get_close_matches(part, names, n=1)
            raise ConfigError(f"unknown key {key!r}; valid keys of {where or 'the configuration'}: {sorted(names)}"
                              + (f" (did you mean {'.'.join(parts[:i] + hint)!r}?)" if hint else ""))
        sub = _section(part) if cls is TrainConfig else None
        if part in _FREE or (sub is None and i == len(parts) - 1):
            return
        if sub is None:
            raise ConfigError(f"{'.'.join(parts[:i + 1])} is a value, not a section (in override key {key!r})")
        cls, where = sub, part


def _split_overrides(overrides: Sequence[str]) -> None:
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} is not of the form key=value")
        key, value = o.split("=", 1)
        if key.startswith(("+", "~", "hydra.")) or "/" in key or "@" in key:
            continue  # additions (checked against the schema after composition), deletions, Hydra's own keys
        if key in GROUPS:
            _check(key, value, _choices(key))
        else:
            _check_key(key)


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
    return _absolute_paths(validate(_build(TrainConfig, data, "")))


def from_dict(data: dict, read_files: bool = False) -> TrainConfig:
    """Rebuild a ``TrainConfig`` from ``to_dict()`` output (e.g. a run's config.yaml). The user's data files are
    not read unless asked: re-evaluating a run must not need its training file (callers check what they load)."""
    return validate(_build(TrainConfig, _upgrade(dict(data)), ""), read_files)


def _upgrade(data: dict) -> dict:
    """A config written before formats took their options as a mapping: ``quant.scale_rule`` (null or an mxfp4
    rule) becomes ``quant.options.scale_rule``, so older run directories still load."""
    q = data.get("quant")
    if isinstance(q, dict) and "scale_rule" in q:
        q = dict(q)
        rule = q.pop("scale_rule")
        q["options"] = dict(q.get("options") or {}, **({"scale_rule": rule} if rule is not None else {}))
        data["quant"] = q
    return data
