"""compressed-tensors checkpoint I/O for whole models (what llm-compressor writes and vLLM serves).

A checkpoint is a Hugging Face model directory whose ``config.json`` carries a ``quantization_config``
block (:func:`quantization_config_for`) and whose safetensors hold, for every quantized Linear
``<prefix>``, the packed tensors of its format (``fmt.checkpoint.tensors``: ``weight_packed``, ``weight_scale``,
NVFP4's ``weight_global_scale``, INT4's ``weight_shape``) instead of ``<prefix>.weight``; everything else
(embeddings, norms, lm_head, biases) is dense. Which formats have a checkpoint scheme, and what it is, the formats
say (``qerl.quant.FORMATS[name].checkpoint``): NVFP4A16, MXFP4A16 and W4A16 today.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from qerl.errors import UserError
from qerl.quant import FORMATS, CheckpointScheme

# Tensor suffixes that belong to a quantized module (besides its dense bias): every registered scheme's, plus
# what other compressed-tensors schemes write (so an unsupported checkpoint still splits cleanly).
_OTHER_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "input_global_scale")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


def schemes() -> dict[str, CheckpointScheme]:
    """{format name: its compressed-tensors scheme} for every registered format that has one."""
    return {name: f.checkpoint for name, f in FORMATS.items() if f.checkpoint is not None}


def quant_suffixes() -> tuple[str, ...]:
    names = dict.fromkeys(_OTHER_SUFFIXES)
    for s in schemes().values():
        names.update(dict.fromkeys(s.tensors))
    return tuple(names)


def check_exportable(fmt: str) -> CheckpointScheme:
    """The scheme of format ``fmt``; a UserError names it and the formats that have one when it has none."""
    valid = sorted(schemes())
    if fmt not in valid:
        raise UserError(f"compressed-tensors export supports {valid}, not {fmt!r}")
    return FORMATS[fmt].checkpoint


def _ct_version() -> str:
    try:
        return metadata.version("compressed-tensors")
    except metadata.PackageNotFoundError:
        return "0.20.0"


def quantization_config_for(fmt: str, ignore: list[str] | None = None, targets: list[str] | None = None) -> dict:
    """The ``quantization_config`` block compressed-tensors 0.20 writes for a model in format ``fmt``."""
    scheme = check_exportable(fmt)
    ignore = ["lm_head"] if ignore is None else list(ignore)
    targets = ["Linear"] if targets is None else list(targets)
    return {
        "config_groups": {
            "group_0": {
                "format": scheme.compression,
                "input_activations": None,
                "output_activations": None,
                "targets": targets,
                "weights": dict(scheme.weights),
            }
        },
        "format": scheme.compression,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "moe_sparsity_config": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": _ct_version(),
    }


def _as_dict(obj: Any) -> dict | None:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    raise TypeError(f"cannot read a quantization config of type {type(obj).__name__}")


def _describe(weights: Mapping, fmt: str | None, acts: Any) -> str:
    keys = ("num_bits", "type", "strategy", "group_size", "symmetric", "scale_dtype")
    desc = ", ".join(f"{k}={weights.get(k)!r}" for k in keys)
    return f"format={fmt!r}, weights({desc}), input_activations={'set' if acts else None}"


def _group_format(group: Mapping, default_format: str | None) -> str:
    weights = group.get("weights") or {}
    fmt = group.get("format") or default_format
    acts = group.get("input_activations")
    known = ", ".join(f"{s.preset} ({s.compression}, group {s.weights.get('group_size')}, "
                      f"{s.weights.get('strategy')})" for s in schemes().values())
    if acts:
        raise ValueError(
            f"unsupported compressed-tensors scheme ({_describe(weights, fmt, acts)}): it quantizes activations "
            f"too; qerl reads weight-only checkpoints: {known}"
        )
    for name, scheme in schemes().items():
        if scheme.matches(weights, fmt):
            return name
    raise ValueError(f"unsupported compressed-tensors scheme ({_describe(weights, fmt, acts)}); qerl reads {known}")


def detect_format(config: Mapping | Any) -> str | None:
    """The format name of a compressed-tensors config (e.g. 'nvfp4' for NVFP4A16), None for an unquantized one.

    ``config`` is a model's config dict (with a ``quantization_config`` key) or the quantization config
    itself. Any other quantization (another method, scheme, activation quantization, an uncompressed
    status) raises a ValueError naming it.
    """
    cfg = _as_dict(config)
    if cfg is None:
        return None
    qcfg = _as_dict(cfg["quantization_config"]) if "quantization_config" in cfg else cfg
    if qcfg is None:
        return None
    if "quant_method" not in qcfg and "config_groups" not in qcfg:
        return None  # a plain model config without quantization
    method = qcfg.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise ValueError(f"unsupported quantization method {method!r}; qerl reads compressed-tensors checkpoints")
    status = qcfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"compressed-tensors checkpoint has quantization_status={status!r}; qerl reads 'compressed' ones")
    groups = qcfg.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    found = {_group_format(g, qcfg.get("format")) for g in groups.values()}
    if len(found) != 1:
        raise ValueError(f"compressed-tensors checkpoint mixes formats {sorted(found)}; qerl reads one format per model")
    return found.pop()


def split_quantized_state_dict(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Group packed tensors by module: ({prefix: {"weight_packed": ..., "weight_scale": ...}}, other tensors).

    A module counts as quantized when it has ``<prefix>.weight_packed``; its bias stays in ``rest``.
    """
    prefixes = {k[: -len(".weight_packed")] for k in state_dict if k.endswith(".weight_packed")}
    suffixes = quant_suffixes()
    quant: dict[str, dict[str, torch.Tensor]] = {p: {} for p in prefixes}
    rest: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        prefix, _, suffix = key.rpartition(".")
        if prefix in quant and suffix in suffixes:
            quant[prefix][suffix] = t
        else:
            rest[key] = t
    return dict(sorted(quant.items())), rest


def _default_ignore(other: Mapping[str, torch.Tensor]) -> list[str]:
    """lm_head plus any other dense 2-D ``.weight`` that is not an embedding (an unquantized Linear)."""
    extra = sorted(
        k[: -len(".weight")] for k, t in other.items()
        if k.endswith(".weight") and t.dim() == 2 and "embed" not in k and k != "lm_head.weight"
    )
    return ["lm_head"] + extra


def _write_shards(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards, strict=True):
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
            "weight_map": {k: fname for fname, shard in zip(names, shards, strict=True) for k in sorted(shard)},
        }
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names


def save_compressed(directory: str | os.PathLike, model_config_dict: Mapping, quant_modules: Mapping[str, Mapping[str, torch.Tensor]],
                    other_tensors: Mapping[str, torch.Tensor], fmt: str, ignore: list[str] | None = None,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write a compressed-tensors checkpoint: safetensors shards (+ index) and config.json.

    ``quant_modules`` maps a module prefix (``model.layers.0.self_attn.q_proj``) to its packed tensors from
    ``FORMATS[fmt].quantize``; ``other_tensors`` are the dense ones (embeddings, norms, lm_head, biases).
    ``ignore`` defaults to lm_head plus any dense 2-D non-embedding weight in ``other_tensors``.
    """
    names = check_exportable(fmt).tensors
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for prefix, q in quant_modules.items():
        missing = [n for n in names if n not in q]
        if missing:
            raise ValueError(f"module {prefix!r} lacks {missing} for {fmt} (has {sorted(q)})")
        for name in names:
            tensors[f"{prefix}.{name}"] = q[name]
    for name, t in other_tensors.items():
        if name in tensors:
            raise ValueError(f"tensor {name!r} is both packed and dense")
        tensors[name] = t
    # fresh CPU tensors: packed buffers may be views into one shared buffer (qerl.fastdecode), which
    # safetensors refuses to write
    tensors = {k: torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()) for k, t in tensors.items()}
    for old in list(directory.glob("model*.safetensors")) + list(directory.glob("model.safetensors.index.json")):
        old.unlink()
    _write_shards(directory, tensors, max_shard_bytes)
    config = dict(model_config_dict)
    config["quantization_config"] = quantization_config_for(
        fmt, ignore=_default_ignore(other_tensors) if ignore is None else ignore
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


def load_safetensors_dir(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a directory's ``model.safetensors`` or its sharded ``model.safetensors.index.json``."""
    from safetensors.torch import load_file

    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {directory}")
    out: dict[str, torch.Tensor] = {}
    for fname in files:
        out.update(load_file(str(directory / fname)))
    return out
