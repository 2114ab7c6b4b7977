"""GGUF files (llama.cpp's format) read as ordinary Hugging Face Llama / Qwen2 checkpoints.

* config and tokenizer: transformers' public GGUF support, ``Auto*.from_pretrained(folder, gguf_file=name)``;
* tensors: one at a time, with the ``gguf`` package's reader, dequantizer and name table, and (for Llama, whose
  q/k rows llama.cpp permutes) un-permuted by the tensor processor transformers' own GGUF loader uses
  (``TENSOR_PROCESSORS``). ``load_policy`` wraps them in its streaming ``_Source``, so a GGUF model is quantized to
  the run's format as it streams in, exactly like a safetensors checkpoint, and the dequantized model never
  exists in memory at once.

Version notes (transformers 5.17 on the GPU host, 5.23 here; both checked):
* ``transformers.modeling_gguf_pytorch_utils`` is the same in both; ``tests/test_gguf.py`` compares our tensors
  with its whole-file ``load_gguf_checkpoint``, so a change on either side fails a test instead of loading wrong
  weights.
* We do not use ``AutoModelForCausalLM.from_pretrained(gguf_file=...)``: it requires ``accelerate``, and newer
  versions keep quantized GGUF blocks in their own modules (``GgufHfQuantizer``) where we need dense tensors.
  The config and tokenizer paths need no ``accelerate``.
* 5.17 builds a llama GGUF tokenizer with the wrong ``eos_token`` (``<|im_start|>`` for SmolLM2, whose file says
  ``<|im_end|>``), no pad token, and a decoder that drops a leading space; ``load_tokenizer`` sets bos/eos/pad/
  unk from the file's own token ids and a byte-level vocabulary's decoder to GPT-2's, so both versions give the
  same tokenizer (same ids, same decoded text).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from qerl.errors import UserError
from qerl.runfiles import sha256_file

ARCHITECTURES = ("llama", "qwen2")  # the module trees load_policy fills (LlamaForCausalLM, Qwen2ForCausalLM)
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # stored as they are: not a quantization
# tokenizer attribute -> the GGUF metadata key holding its token id
_SPECIAL_TOKEN_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                       "pad_token": "padding_token_id"}


def _stat_key(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return str(path.resolve()), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _reader_for(key: tuple[str, int, int]):
    from gguf import GGUFReader

    return GGUFReader(key[0])  # memory-mapped; parsing the metadata (a 49k-token vocabulary) takes seconds


def reader(path: Path):
    """The file's ``gguf.GGUFReader``, opened once per process (keyed on path, size and mtime)."""
    return _reader_for(_stat_key(Path(path)))


def _int_field(r, key: str) -> int | None:
    field = r.fields.get(key)
    return None if field is None else int(field.parts[field.data[0]][0])


def _str_field(r, key: str) -> str | None:
    field = r.fields.get(key)
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


# --------------------------------------------------------------------------------------------- cache
# Parsing a GGUF's metadata costs seconds (pure Python over a 49k-token vocabulary) and transformers' config and
# tokenizer readers each parse the file again. Their results are cached once per file (keyed on path, size and
# mtime) and per transformers version, as an ordinary config.json and tokenizer: a run then parses the file once.
def _cache_dir() -> Path:
    return Path(os.environ.get("QERL_CACHE", Path.home() / ".cache" / "qerl")) / "gguf"


def _entry(path: Path) -> Path:
    return _cache_dir() / hashlib.sha1(repr(_stat_key(Path(path))).encode()).hexdigest()[:20]


def _cached(target: Path, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write(tmp_dir)`` into a temporary directory and renamed into place (atomic, so
    concurrent runs never see a half-written entry; the loser of a race drops its copy)."""
    if target.exists():
        return target
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        os.rename(tmp, target)
    except OSError:
        if not target.exists():  # not a lost race: a real error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _converted(path: Path) -> Path:
    """A directory with the file's config.json and tokenizer, as this transformers version builds them."""
    import transformers

    def write(out: Path) -> None:
        _config_from_file(path).save_pretrained(out)
        _tokenizer_from_file(path).save_pretrained(out)

    return _cached(_entry(path) / f"transformers-{transformers.__version__}", write)


def _config_from_file(path: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)


def _tokenizer_from_file(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    r = reader(path)
    for attr, key in _SPECIAL_TOKEN_KEYS.items():  # the file's ids, not the converter's guess (see module doc)
        token_id = _int_field(r, f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= token_id < len(tok):
            setattr(tok, attr, tok.convert_ids_to_tokens(token_id))
    if _str_field(r, "tokenizer.ggml.model") == "gpt2":
        # Byte-level BPE decodes to its bytes exactly (GPT-2's decoder). transformers 5.17 gives a llama GGUF
        # sentencepiece's decoder steps, which drop a leading space (" 5" -> "5"); 5.23 does not.
        from tokenizers import decoders

        tok.backend_tokenizer.decoder = decoders.ByteLevel()
    return tok


# --------------------------------------------------------------------------------------------- loading
def load_config(path: Path):
    """The model's ``PretrainedConfig``, as transformers reads it from the GGUF metadata."""
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(str(_converted(path)))
    if config.model_type not in ARCHITECTURES:
        raise UserError(f"{path}: GGUF architecture {config.model_type!r} is not supported; "
                        f"load_policy reads {list(ARCHITECTURES)}")
    return config


def _hf_names(model: nn.Module, arch: str) -> dict[str, str]:
    """GGUF tensor name -> the model's state-dict name (``blk.0.attn_q.weight`` -> ``model.layers.0.self_attn.
    q_proj.weight``), by gguf's own table (the one llama.cpp's converter writes with). This is what transformers'
    ``get_gguf_hf_weights_map`` computes for Llama/Qwen2, which rebuilds the table for each of the ~400
    submodules (40 s here); one table does."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out = {}
    for hf_name in model.state_dict():  # meta tensors: no memory
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = table.get_name(module)
        if gguf_name is not None:
            out[f"{gguf_name}.{suffix}"] = hf_name
    return out


def tensor_source(path: Path, model: nn.Module) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """(HF tensor names, name -> fp32 tensor): the file's tensors, dequantized one at a time on request.

    ``model`` is the (meta-device) model being filled; its state-dict names are what the tensors are called.
    """
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    r = reader(path)
    arch = _str_field(r, "general.architecture")
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())  # llama: q/k un-permute
    to_hf = _hf_names(model, arch)
    tensors = {to_hf[t.name]: t for t in r.tensors if t.name in to_hf}  # unmapped ones (rope_freqs) are unused

    def get(name: str) -> torch.Tensor:
        t = tensors[name]
        w = dequantize(t.data, t.tensor_type)  # (out, in) for a linear: GGUF's shape is reversed, its rows are not
        w = processor.process(weights=w, name=t.name, tensor_key_mapping=to_hf, parsed_parameters={}).weights
        return torch.from_numpy(np.array(w, dtype=np.float32))  # a copy: the reader's memory map is read-only

    return set(tensors), get


def load_tokenizer(path: Path):
    """The tokenizer the GGUF metadata describes (vocabulary, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(_converted(Path(path))))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


# --------------------------------------------------------------------------------------------- provenance
def _describe(path: Path) -> dict:
    r = reader(path)
    types = collections.Counter(t.tensor_type.name for t in r.tensors)
    quantized = [k for k, _ in types.most_common() if k not in _FLOAT_TYPES]
    main = quantized[0] if quantized else types.most_common(1)[0][0]
    listing = ", ".join(f"{k} x{n}" for k, n in types.most_common())
    what = f"the dequantized {main} values" if quantized else f"the {main} values"
    return {
        "file": path.name, "path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": sha256_file(path),
        "architecture": _str_field(r, "general.architecture"), "name": _str_field(r, "general.name"),
        "weights_type": main, "tensor_types": dict(types.most_common()),
        "note": f"the 'BF16' weights of this model are {what} of {path.name} ({listing}), "
                f"not the original BF16 checkpoint",
    }


def provenance(path: Path) -> dict:
    """What the weights of a GGUF model are: file, sha256, tensor types, and a one-line note for every result.

    Cached on disk (``$QERL_CACHE/gguf``) by path, size and mtime: hashing and parsing happen once per file.
    """
    path = Path(path)

    def write(out: Path) -> None:
        (out / "provenance.json").write_text(json.dumps(_describe(path), indent=1))

    return json.loads((_cached(_entry(path) / "provenance", write) / "provenance.json").read_text())
