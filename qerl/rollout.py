"""The sampler: G completions per prompt from the policy's own parameter tensors.

There is no second copy of the model and nothing to synchronise: the sampler calls the policy's modules
(``QuantLoRALinear`` with unmerged LoRA, the RMSNorms AQN perturbs, the rotary embedding) through its own
decode loop, gpt-fast style:

* one prefill per prompt; its K/V are written into the rows of all G samples of the group (prefix shared);
* a static KV cache (N = B·G rows × prompt + max_new_tokens slots), so every decode step has fixed shapes;
* on CUDA each decode step is captured once into a CUDA graph per KV-length bucket and replayed; a capture takes
  no draws from the sampling generators, so a seed gives the eager step's tokens whichever graphs a sampler already
  holds (``tests/test_fused_decode.py::test_gpu_graph_captures_take_no_draws``);
* the fused decode step (``fused``, on by default on CUDA): q|k|v and gate|up as one packed matmul each
  (``qerl.fastdecode``), and norm + residual, bias + RoPE + cache write, attention, SiLU·up as single
  kernels (``qerl.kernels.fused``): ~19 launches per layer instead of ~50;
* for every generated token: its sampling log-prob log softmax(z/T)[y] and the entropy of softmax(z/T)
  (over the full vocabulary, before top-k/top-p truncation — the paper's "sampling entropy", Sec. 3.2).

Works for Qwen2 and Llama decoder layouts (``model.model.layers[i].self_attn.{q,k,v,o}_proj`` …).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from qerl.devices import autocast_for
from qerl.fastdecode import build_decode_plan, permuted_input
from qerl.kernels import fused as fk
from qerl.lora import lora_inference_cache


def seed_for(*parts) -> int:
    """A stable 63-bit seed from any parts (independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


@dataclass
class Rollout:
    """A batch of N = B·G completions; rows i·G … i·G+G−1 belong to prompt i."""

    prompt_ids: torch.Tensor        # (N, Lp) left-padded
    prompt_mask: torch.Tensor       # (N, Lp) bool
    completion_ids: torch.Tensor    # (N, Tc) pad after EOS
    completion_mask: torch.Tensor   # (N, Tc) bool, generated tokens through the first EOS
    logp: torch.Tensor              # (N, Tc) sampling log-probs, 0 outside the mask
    entropy: torch.Tensor           # (N, Tc) sampling entropy, 0 outside the mask
    truncated: torch.Tensor         # (N,) bool: hit max_new_tokens without EOS
    texts: list[str]
    group_size: int
    stats: dict = field(default_factory=dict)

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(1)

    def select_groups(self, keep: torch.Tensor) -> Rollout:
        """The sub-batch of the groups where ``keep`` (B,) is true."""
        rows = keep.repeat_interleave(self.group_size)
        idx = rows.nonzero().squeeze(1)
        t = lambda x: x.index_select(0, idx.to(x.device))  # noqa: E731
        return Rollout(t(self.prompt_ids), t(self.prompt_mask), t(self.completion_ids), t(self.completion_mask),
                       t(self.logp), t(self.entropy), t(self.truncated), [self.texts[i] for i in idx.tolist()],
                       self.group_size, dict(self.stats))

    @staticmethod
    def cat(parts: list[Rollout], pad_id: int) -> Rollout:
        """Concatenate rollouts along the batch (padding prompts on the left, completions on the right)."""
        if len(parts) == 1:
            return parts[0]
        lp = max(p.prompt_ids.shape[1] for p in parts)
        tc = max(p.completion_ids.shape[1] for p in parts)

        def left(x, val):
            return F.pad(x, (lp - x.shape[1], 0), value=val)

        def right(x, val):
            return F.pad(x, (0, tc - x.shape[1]), value=val)

        stats = {k: sum(p.stats.get(k, 0) for p in parts) for k in parts[0].stats}
        return Rollout(torch.cat([left(p.prompt_ids, pad_id) for p in parts]),
                       torch.cat([left(p.prompt_mask, False) for p in parts]),
                       torch.cat([right(p.completion_ids, pad_id) for p in parts]),
                       torch.cat([right(p.completion_mask, False) for p in parts]),
                       torch.cat([right(p.logp, 0.0) for p in parts]),
                       torch.cat([right(p.entropy, 0.0) for p in parts]),
                       torch.cat([p.truncated for p in parts]), sum((p.texts for p in parts), []),
                       parts[0].group_size, stats)


def _rope(x, cos, ssin):
    """HF's rotate-half RoPE, x·cos + rotate_half(x)·sin, with rotate_half(x)·sin = roll(x, d/2)·[−sin₁, sin₂].
    x: (N, H, L, d); cos, ssin: (N, L, d)."""
    return torch.addcmul(x * cos.unsqueeze(1), torch.roll(x, x.shape[-1] // 2, dims=-1), ssin.unsqueeze(1))


def filter_logits(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits outside the top-k and the top-p nucleus with -inf. z: (N, V) float32."""
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sz, idx = torch.sort(z, dim=-1, descending=True)
        cum = sz.softmax(-1).cumsum(-1)
        drop = (cum - sz.softmax(-1)) >= top_p      # keep the smallest prefix whose mass reaches top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return z


def sample_from_logits(z: torch.Tensor, temperature: float, top_k: int, top_p: float,
                       gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row from softmax(z/T) restricted to top-k / top-p. z: (N, V) float32 (or bf16 / fp16 logits,
    upcast exactly: the same draws).

    Returns (token (N,), log softmax(z/T)[token] (N,), entropy of softmax(z/T) (N,)). Sampling is the
    exponential race argmax_v p_v / E_v, E_v ~ Exp(1), which draws v with probability p_v and, unlike
    ``torch.multinomial``, needs no host synchronisation (so it can live inside a CUDA graph).
    ``temperature=0`` is greedy decoding, the T -> 0 limit: the argmax, with log-prob 0 and entropy 0.
    ``gen`` may be a list of generators, one per equal block of rows (per-group seeding).
    """
    filtered = bool(top_k) or top_p < 1.0
    fused = temperature > 0 and not filtered and z.is_cuda and os.environ.get("QERL_FUSED_SAMPLE", "1") != "0"
    if not fused:  # the kernels read bf16 logits as float32 themselves; everything else computes in float32
        z = z.float()
    if temperature == 0:
        tok = z.argmax(-1)
        zero = torch.zeros(z.shape[0], dtype=z.dtype, device=z.device)
        return tok, zero, zero.clone()
    if not fused:
        z = z / temperature
        logp_all = z.log_softmax(-1)
        ent = -(logp_all.exp() * logp_all).sum(-1)                                      # (N,)
    zf = filter_logits(z, top_k, top_p) if filtered else z
    if isinstance(gen, (list, tuple)):  # one generator per block of rows (a group): its draws do not depend on
        n = zf.shape[0] // len(gen)     # the other rows of the batch
        noise = torch.cat([torch.empty((n, zf.shape[1]), dtype=torch.float32, device=zf.device).exponential_(generator=g)
                           for g in gen])
    else:
        noise = torch.empty(zf.shape, dtype=torch.float32, device=zf.device).exponential_(generator=gen)
    if fused:  # the same noise, race, log-prob and entropy in two launches (qerl.kernels.fused.sample_race)
        return fk.sample_race(z, temperature, noise)
    tok = (zf.softmax(-1) / noise).argmax(-1)
    return tok, logp_all.gather(1, tok[:, None]).squeeze(1), ent


def state_reuse() -> bool:
    """``QERL_SAMPLER_REUSE`` (default 1): a batch whose padded prompts are no longer than those the sampler's buffers
    were made for reuses its cache and graphs (:meth:`Sampler._state`); 0: session 57's rule, new buffers and graphs
    whenever the padded prompt length changes, for same-run comparisons (``python -m qerl.bench reuse``)."""
    return fk.env_flag("QERL_SAMPLER_REUSE", "1")


class Sampler:
    """Generates completions with the policy's own modules. See the module docstring."""

    def __init__(self, model: nn.Module, tokenizer, max_prompt_tokens: int = 1024, cuda_graphs: bool | str = "auto",
                 stop_check_every: int = 8, kv_bucket: int = 256, fused: bool | str = "auto"):
        if fused not in ("auto", True, False):
            raise ValueError(f"fused must be one of ['auto', True, False], got {fused!r}")
        self.model, self.tok = model, tokenizer
        self.fused = fused
        self._plan = None
        self.max_prompt_tokens = max_prompt_tokens
        cfg = model.config
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.device = model.get_input_embeddings().weight.device
        self.use_graphs = (self.device.type == "cuda") if cuda_graphs == "auto" else bool(cuda_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=true needs the policy on a CUDA device")
        self.stop_check_every = stop_check_every if self.device.type == "cuda" else 1
        self.kv_bucket = kv_bucket
        # On CUDA, prompts are left-padded to a multiple of 64 so that captured graphs are reused across steps.
        self.prompt_pad_multiple = 64 if self.use_graphs else 1
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        eos = {tokenizer.eos_token_id} | set(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
        for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = tokenizer.convert_tokens_to_ids(t) if t in tokenizer.get_vocab() else None
            if tid is not None:
                eos.add(tid)
        self.eos_ids = torch.tensor(sorted(e for e in eos if e is not None), device=self.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._graphs: dict = {}
        self._static = None

    # ------------------------------------------------------------------------------------------ model parts
    @property
    def _layers(self):
        return self.model.model.layers

    def _act_dtype(self) -> torch.dtype:
        w = self.model.get_input_embeddings().weight
        return torch.bfloat16 if (w.dtype == torch.float32 and self.device.type == "cuda") else w.dtype

    def _autocast(self):
        # full fine-tuning keeps fp32 masters. cache_enabled=False: with the cast cache on, a CUDA graph captured
        # after the warm-up step reuses the warm-up's bf16 weight copies instead of capturing the casts, and replays
        # read those copies' memory after the autocast context has freed it (the H100 bf16-full runs sampled
        # 2-token garbage on most steps). PyTorch's CUDA-graph notes require cache_enabled=False under capture.
        return autocast_for(self.model, self.device, cache_enabled=False)

    def _norm(self, mod, h):
        """RMSNorm of the policy's module, fused (F.rms_norm) when nothing hooks it (AQN per_forward does)."""
        if mod._forward_pre_hooks or mod._forward_hooks:
            return mod(h)
        return fk.add_rms_norm_ref(h, None, *self._norm_args(mod))[1]

    @staticmethod
    def _norm_args(mod):
        """(weight, eps) of an HF RMSNorm (``variance_epsilon``) or ``MasterRMSNorm``/torch's (``eps``)."""
        return mod.weight, getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))

    def _qkv(self, attn, h, rope):  # h: (N, L, D), rope: (cos, signed sin) (N, L, d)
        n, L, _ = h.shape
        q = attn.q_proj(h).view(n, L, self.n_heads, self.head_dim).transpose(1, 2)   # (N, H, L, d)
        k = attn.k_proj(h).view(n, L, self.n_kv, self.head_dim).transpose(1, 2)      # (N, Hkv, L, d)
        v = attn.v_proj(h).view(n, L, self.n_kv, self.head_dim).transpose(1, 2)
        return _rope(q, *rope), _rope(k, *rope), v

    def _rope_tables(self, h, pos):
        """cos and the signed sin of HF's rotary embedding, computed once per forward (not once per layer)."""
        cos, sin = self.model.model.rotary_emb(h, pos)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def _logits(self, h):  # (N, D) -> (N, V) float32
        return self.model.lm_head(self.model.model.norm(h)).float()

    # ------------------------------------------------------------------------------------------ prefill
    def _prefill(self, ids, mask, group_size, kc, vc):
        """Run the prompts (B, Lp) once; write their K/V into all G rows of each group. Returns last logits (B, V)."""
        B, Lp = ids.shape
        pos = (mask.long().cumsum(1) - 1).clamp(min=0)
        h = self.model.get_input_embeddings()(ids)
        causal = torch.ones(Lp, Lp, dtype=torch.bool, device=ids.device).tril()
        am = (causal[None] & mask[:, None, :])[:, None]                   # (B, 1, Lp, Lp)
        am = am | torch.eye(Lp, dtype=torch.bool, device=ids.device)[None, None]  # pad rows attend to self
        rep = self.n_heads // self.n_kv
        rope = self._rope_tables(h, pos)
        for i, layer in enumerate(self._layers):
            a = layer.self_attn
            q, k, v = self._qkv(a, self._norm(layer.input_layernorm, h), rope)
            kc[i][:, :, :Lp] = k.repeat_interleave(group_size, 0)
            vc[i][:, :, :Lp] = v.repeat_interleave(group_size, 0)
            o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                               attn_mask=am, scale=a.scaling)
            h = h + a.o_proj(o.transpose(1, 2).reshape(B, Lp, -1))
            h = h + layer.mlp(self._norm(layer.post_attention_layernorm, h))
        return self._logits(h[:, -1])

    # ------------------------------------------------------------------------------------------ decode
    @staticmethod
    def _open_slot(s):
        """The cache slot (1,) of the token fed this step (sampled last step), unmasked for attention, and
        each row's position (N, 1)."""
        cur = s["t"] - 1
        slot = cur + s["Lp"]
        s["attn_bias"].index_fill_(1, slot, 0.0)
        return slot, (s["prompt_len"] + cur).unsqueeze(1)

    def _decode_step(self, s, S: int):
        """One token for all N rows, reading only the first S cache slots. Everything lives in ``s`` (static)."""
        if s["plan"] is not None:
            return self._decode_step_fused(s, S)
        slot, pos = self._open_slot(s)
        h = self.model.get_input_embeddings()(s["tok"].unsqueeze(1))  # (N, 1, D)
        n = h.shape[0]
        g = self.n_heads // self.n_kv
        bias = s["attn_bias"][:, None, None, :S]                   # (N, 1, 1, S): 0 valid, -inf not
        rope = self._rope_tables(h, pos)
        for i, layer in enumerate(self._layers):
            a = layer.self_attn
            q, k, v = self._qkv(a, self._norm(layer.input_layernorm, h), rope)
            s["kc"][i].index_copy_(2, slot, k.to(s["kc"][i].dtype))  # fp32 under autocast (full FT)
            s["vc"][i].index_copy_(2, slot, v.to(s["vc"][i].dtype))
            kk, vv = s["kc"][i][:, :, :S], s["vc"][i][:, :, :S]    # (N, Hkv, S, d)
            qg = q.view(n, self.n_kv, g, self.head_dim)            # (N, Hkv, g, d)
            sc = torch.matmul(qg, kk.transpose(-1, -2))           # (N, Hkv, g, S)
            sc = sc.float() * a.scaling + bias
            o = torch.matmul(sc.softmax(-1).to(vv.dtype), vv).reshape(n, 1, -1)   # (N, 1, H*d)
            h = h + a.o_proj(o)
            h = h + layer.mlp(self._norm(layer.post_attention_layernorm, h))
        self._sample_into(s, self._logits(h[:, 0]))

    def _decode_step_fused(self, s, S: int):
        """The same step with fused projections and kernels (see the module docstring): per layer
        add+norm, q|k|v (+LoRA), bias+RoPE+cache write and attention (:func:`qerl.kernels.fused.rope_attention`:
        3 launches; 2 with the opt-in ``QERL_FUSED_ROPE_ATTN=1`` where the Triton split kernel runs), o_proj (+LoRA), add+norm,
        gate|up (+LoRA, and SiLU·up in its epilogue where the FP4 GEMV runs it; else a launch of its own),
        down_proj (+LoRA)."""
        ends = s["rope"] is not None and fk.fused_step_ends()
        if ends:  # slot, embedding and the position tables' rows in one launch
            h, cos, ssin, slot = fk.step_begin(s["tok"], s["t"], s["Lp"], s["prompt_len"],
                                               self.model.get_input_embeddings().weight, *s["rope"], s["attn_bias"])
            n = h.shape[0]
        else:
            slot, pos = self._open_slot(s)
            h = self.model.get_input_embeddings()(s["tok"])            # (N, D)
            n = h.shape[0]
            cos, ssin = self._rope_tables(h[:, None], pos)             # (N, 1, d)
            cos, ssin = cos.reshape(n, -1), ssin.reshape(n, -1)
        layers, dt = self._layers, h.dtype
        # inputs of the linears whose GEMM reads them in its own K order are written in it by their producer too
        perm = [(permuted_input(e["qkv"], n, dt), permuted_input(e["gate_up"], n, dt),
                 permuted_input(layer.mlp.down_proj, n, dt), permuted_input(layer.self_attn.o_proj, n, dt))
                for e, layer in zip(s["plan"], layers, strict=True)]
        h, x = fk.add_rms_norm(h, None, *self._norm_args(layers[0].input_layernorm), permuted=perm[0][0])
        for i, layer in enumerate(layers):
            p, a = s["plan"][i], layer.self_attn
            o = fk.rope_attention(p["qkv"](x), p["qkv"].pending_bias, cos, ssin, self.n_heads, self.n_kv,
                                  self.head_dim, s["kc"][i], s["vc"][i], s["attn_bias"], S, a.scaling, slot,
                                  permuted=perm[i][3])  # (N, H*d)
            h, x = fk.add_rms_norm(h, a.o_proj(o), *self._norm_args(layer.post_attention_layernorm),
                                   permuted=perm[i][1])
            d = layer.mlp.down_proj(p["gate_up"].silu_mul(x, permuted=perm[i][2]))
            last = i + 1 == len(layers)
            nxt = self.model.model.norm if last else layers[i + 1].input_layernorm
            h, x = fk.add_rms_norm(h, d, *self._norm_args(nxt), permuted=not last and perm[i + 1][0])
        z = self.model.lm_head(x)
        self._sample_into(s, z if ends else z.float())  # the sampling kernels read bf16 logits as float32

    def _rope_table(self, s_max: int):
        """(cos, ssin) of every position [0, s_max) (s_max, d), for the fused step to gather its rows from instead of
        computing them each step: the same values (HF's rotary embedding is elementwise in the position). None where
        the step cannot use it: a rotary embedding that rescales with the sequence length (``dynamic``,
        ``longrope``), or an input embedding other than a plain ``nn.Embedding`` (hooked, max_norm)."""
        rot, emb = self.model.model.rotary_emb, self.model.get_input_embeddings()
        if (getattr(rot, "rope_type", "default") in ("dynamic", "longrope") or type(emb) is not nn.Embedding
                or emb.max_norm is not None or emb._forward_hooks or emb._forward_pre_hooks):
            return None
        x = torch.zeros(1, 1, 1, dtype=emb.weight.dtype, device=emb.weight.device)
        cos, ssin = self._rope_tables(x, torch.arange(s_max, device=x.device)[None])  # (1, s_max, d)
        return cos[0].contiguous(), ssin[0].contiguous()

    def _decode_plan(self):
        """The fused-projection plan for this rollout (LoRA and biases refreshed in place), or None for the
        unfused step: ``fused=False``, on CPU under ``auto``, when a norm is hooked (AQN per_forward), under
        autocast (full fine-tuning), or for a model the plan does not cover."""
        want = (self.device.type == "cuda") if self.fused == "auto" else bool(self.fused)
        norms = [m for layer in self._layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        if (not want or any(m._forward_pre_hooks or m._forward_hooks for m in norms)
                or self.model.get_input_embeddings().weight.dtype != self._act_dtype()):
            return None
        if self._plan is None or (self._plan and any(f.stale() for e in self._plan for f in e.values())):
            if self._plan is not None:
                self._static = None  # graphs captured against the old weight addresses
            self._plan = build_decode_plan(self.model) or False
        if not self._plan:
            return None
        for e in self._plan:
            for f in e.values():
                f.refresh(self._act_dtype())
        return self._plan

    def _sample_into(self, s, z):
        """Sample the next token from logits z (N, V); record log-prob and entropy at column t."""
        tok, lp, ent = sample_from_logits(z, s["temperature"], s["top_k"], s["top_p"], s["gens"] or s["gen"])
        finish = fk.sample_finish if fk.fused_step_ends() else fk.sample_finish_ref  # one launch / ~14
        finish(tok, lp, ent, s["finished"], s["eos"], self.pad_id, s["t"], s["tok"], s["out_tok"], s["out_mask"],
               s["out_logp"], s["out_ent"])

    def _bucket(self, S_needed: int, S_max: int) -> int:
        return min(S_max, int(math.ceil(S_needed / self.kv_bucket)) * self.kv_bucket)

    def _run_step(self, s, S: int):
        if not self.use_graphs:
            return self._decode_step(s, S)
        graphs = s["graphs"]
        if S not in graphs:
            tensors = {k: v for k, v in s.items() if isinstance(v, torch.Tensor)}
            backup = {k: v.clone() for k, v in tensors.items()}
            # the warm-up draws its tokens from the sampling generators: without their states put back, every draw
            # after a capture would come from further along the stream than a run without that capture draws it
            # (so tokens would depend on which graphs a sampler happened to hold already; H100, session 60)
            gens = s["gens"] or [s["gen"]]
            rng = [gen.get_state() for gen in gens]

            def restore():  # the buffers and the generators as they were before the warm-up
                for k, v in backup.items():
                    tensors[k].copy_(v)
                for gen, st in zip(gens, rng, strict=True):
                    gen.set_state(st)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the capture (lazy init, Triton autotuning)
                self._decode_step(s, S)
            torch.cuda.current_stream().wait_stream(side)
            restore()
            g = torch.cuda.CUDAGraph()
            for gen in gens:
                g.register_generator_state(gen)
            try:
                with torch.cuda.graph(g, pool=s["pool"]):
                    self._decode_step(s, S)
            except Exception as e:  # a kernel that cannot be captured (e.g. a library syncing): decode eagerly
                import warnings

                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); decoding without graphs",
                              stacklevel=2)
                torch.cuda.synchronize()
                self.use_graphs = False
                restore()
                return self._decode_step(s, S)
            graphs[S] = g
        graphs[S].replay()

    def _state(self, N: int, Lp: int, max_new: int, temperature: float, top_p: float, top_k: int,
               ignore_eos: bool = False, plan=None, groups: int = 0) -> dict:
        """Static buffers for one shape; kept across calls so captured CUDA graphs are replayed, not re-captured.
        ``groups`` > 0: one sampling generator per group (``gens``) instead of one for the batch (``gen``).
        The prompt length is data, not shape: a call whose (padded) prompts are no longer than those the buffers were
        made for reuses them and their graphs (its ``Lp`` goes into ``s["Lp"]``; its attention reads the slots it
        would read in a fresh cache), so a training run whose prompt lengths vary from step to step re-allocates and
        re-captures only when a batch's prompts are longer than every one before (``stats["state_built"]``), and
        captures one graph more for each new last KV bucket (Lp + max_new)."""
        key = (N, max_new, float(temperature), float(top_p), int(top_k), bool(ignore_eos), plan is not None, groups)
        if self._static is not None and self._static["key"] == key and (
                self._static["Lp_alloc"] >= Lp if state_reuse() else self._static["Lp_alloc"] == Lp):
            self._static["Lp"].fill_(Lp)
            return self._static
        self._static = None  # free the old cache and graphs first
        dev, dt, S_max = self.device, self._act_dtype(), Lp + max_new
        shape = (N, self.n_kv, S_max, self.head_dim)
        self._static = dict(
            key=key, Lp_alloc=Lp, plan=plan, graphs={},
            pool=torch.cuda.graph_pool_handle() if self.use_graphs else None,
            kc=[torch.zeros(shape, dtype=dt, device=dev) for _ in self._layers],
            vc=[torch.zeros(shape, dtype=dt, device=dev) for _ in self._layers],
            gen=torch.Generator(device=dev), gens=[torch.Generator(device=dev) for _ in range(groups)],
            temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
            eos=self.eos_ids if not ignore_eos else torch.full((1,), -1, dtype=torch.long, device=dev),
            Lp=torch.tensor([Lp], device=dev), t=torch.zeros(1, dtype=torch.long, device=dev),
            prompt_len=torch.zeros(N, dtype=torch.long, device=dev), tok=torch.zeros(N, dtype=torch.long, device=dev),
            attn_bias=torch.full((N, S_max), float("-inf"), device=dev),
            finished=torch.zeros(N, dtype=torch.bool, device=dev),
            out_tok=torch.zeros((N, max_new), dtype=torch.long, device=dev),
            out_mask=torch.zeros((N, max_new), dtype=torch.bool, device=dev),
            out_logp=torch.zeros((N, max_new), device=dev), out_ent=torch.zeros((N, max_new), device=dev),
            rope=self._rope_table(S_max) if plan is not None else None,
        )
        return self._static

    @torch.no_grad()
    def precapture(self, n_prompts: int, prompt_len: int, group_size: int = 1, max_new_tokens: int = 128,
                   temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, ignore_eos: bool = False) -> int:
        """Warm this shape up ahead of time, so that a timed :meth:`generate` of ``n_prompts`` prompts of
        ``prompt_len`` tokens runs as every later call does (benchmarks keep one-time costs out of the timed region):
        one prefill of that shape and the draw after it (their first run pays Triton compiles and autotuning, cuBLAS
        heuristics and workspace allocations: on an H100 the first 7B batch-8 prefill took 0.29 s, later ones
        0.07-0.09 s, session 58), then, with CUDA graphs, the capture of the decode graph of every KV bucket.
        Returns the number of graphs (0 without)."""
        Lp = int(math.ceil(min(prompt_len, self.max_prompt_tokens) / self.prompt_pad_multiple)) * self.prompt_pad_multiple
        N = n_prompts * group_size
        with self._autocast(), lora_inference_cache(self.model, self._act_dtype()):
            s = self._state(N, Lp, max_new_tokens, temperature, top_p, top_k, ignore_eos, self._decode_plan())
            S_max = Lp + max_new_tokens
            ids = torch.full((n_prompts, Lp), self.pad_id, dtype=torch.long, device=self.device)
            logits = self._prefill(ids, torch.ones_like(ids, dtype=torch.bool), group_size, s["kc"], s["vc"])
            self._sample_into(s, logits.repeat_interleave(group_size, 0))  # its kernels' float32-logit variants
            if self.use_graphs:
                s["t"].fill_(1)
                s["attn_bias"][:, :Lp] = 0.0
                for S in sorted({self._bucket(Lp + k, S_max) for k in range(1, max_new_tokens)}):
                    self._run_step(s, S)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # nothing of the warm-up left queued for the timed call to wait for
        return len(s["graphs"])

    def release(self) -> None:
        """Free the KV cache and captured graphs (e.g. before the training forward needs the memory)."""
        self._static = None

    # ------------------------------------------------------------------------------------------ public
    def encode(self, prompts: list[str] | list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Left-pad prompts to (B, Lp); prompts longer than ``max_prompt_tokens`` keep their last tokens."""
        # verbose=False: the tokenizer would warn about its model_max_length ("indexing errors"), but the cut to
        # max_prompt_tokens happens right here and is counted (stats["prompts_truncated"]); callers report it
        ids = [self.tok(p, add_special_tokens=False, verbose=False)["input_ids"] if isinstance(p, str) else list(p)
               for p in prompts]
        cut = sum(len(x) > self.max_prompt_tokens for x in ids)
        ids = [x[-self.max_prompt_tokens:] for x in ids]
        Lp = max(len(x) for x in ids)
        Lp = int(math.ceil(Lp / self.prompt_pad_multiple)) * self.prompt_pad_multiple  # fewer distinct shapes
        t = torch.full((len(ids), Lp), self.pad_id, dtype=torch.long)
        m = torch.zeros((len(ids), Lp), dtype=torch.bool)
        for i, x in enumerate(ids):
            t[i, Lp - len(x):] = torch.tensor(x, dtype=torch.long)
            m[i, Lp - len(x):] = True
        return t.to(self.device), m.to(self.device), cut

    @torch.no_grad()
    def generate(self, prompts, group_size: int = 1, max_new_tokens: int = 128, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, prompt_batch: int = 0,
                 ignore_eos: bool = False) -> Rollout:
        """G = ``group_size`` samples for each prompt (strings, or token-id lists already chat-formatted).

        ``seed``: one int seeds the batch's sampling stream; a list of ints (one per prompt) seeds each group's own
        stream, so a group's completions do not depend on the other prompts of the batch (or its split).
        ``ignore_eos`` (benchmarks): every row runs to ``max_new_tokens`` (vLLM's ``ignore_eos``)."""
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        per_group = isinstance(seed, (list, tuple))
        if per_group and len(seed) != len(prompts):
            raise ValueError(f"seed is a list of {len(seed)} per-group seeds for {len(prompts)} prompts")
        if prompt_batch and len(prompts) > prompt_batch:
            parts = [self.generate(prompts[i:i + prompt_batch], group_size, max_new_tokens, temperature, top_p, top_k,
                                   seed[i:i + prompt_batch] if per_group else None if seed is None else seed + i, 0,
                                   ignore_eos)
                     for i in range(0, len(prompts), prompt_batch)]
            return Rollout.cat(parts, self.pad_id)
        was_training = self.model.training
        self.model.eval()
        try:
            with self._autocast(), lora_inference_cache(self.model, self._act_dtype()):
                return self._generate(prompts, group_size, max_new_tokens, temperature, top_p, top_k, seed,
                                      ignore_eos)
        finally:
            self.model.train(was_training)

    def _generate(self, prompts, G, max_new, temperature, top_p, top_k, seed, ignore_eos=False) -> Rollout:
        t0 = time.perf_counter()
        ids, mask, cut = self.encode(prompts)
        B, Lp = ids.shape
        N = B * G
        per_group = isinstance(seed, (list, tuple))
        before = self._static
        s = self._state(N, Lp, max_new, temperature, top_p, top_k, ignore_eos, self._decode_plan(),
                        B if per_group else 0)
        built = s is not before  # new buffers (and graphs to capture), not the last call's
        # the attention reads the slots a fresh sampler's would (S_max here, not the reused cache's length): the same
        # results whatever came before; a new last bucket (Lp + max_new) is one more graph, captured once
        S_max = Lp + max_new
        if per_group:
            for g, sd in zip(s["gens"], seed, strict=True):
                g.manual_seed(int(sd))
        else:
            s["gen"].manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        rep_mask = mask.repeat_interleave(G, 0)
        s["t"].zero_()
        s["prompt_len"].copy_(rep_mask.sum(1))
        s["attn_bias"].fill_(float("-inf"))
        s["attn_bias"][:, :Lp].masked_fill_(rep_mask, 0.0)
        s["finished"].zero_()
        s["out_tok"].fill_(self.pad_id)
        s["out_mask"].zero_()
        s["out_logp"].zero_()
        s["out_ent"].zero_()
        logits = self._prefill(ids, mask, G, s["kc"], s["vc"]).repeat_interleave(G, 0)
        self._sample_into(s, logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        steps = 1
        while steps < max_new:
            if steps % self.stop_check_every == 0 and bool(s["finished"].all()):
                break
            self._run_step(s, self._bucket(Lp + steps, S_max))
            steps += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        out_mask = s["out_mask"][:, :steps].clone()
        comp = s["out_tok"][:, :steps].clone()
        rows = [row[m].tolist() for row, m in zip(comp.cpu(), out_mask.cpu(), strict=True)]
        texts = self.tok.batch_decode(rows, skip_special_tokens=True)
        n_tok = int(out_mask.sum())
        stats = dict(prefill_s=t1 - t0, decode_s=t2 - t1, rollout_s=t2 - t0, generated_tokens=n_tok,
                     decode_steps=steps, prompts_truncated=cut, rows=N, graphs=len(s["graphs"]), state_built=built,
                     fused_decode=s["plan"] is not None)
        return Rollout(ids.repeat_interleave(G, 0), rep_mask, comp, out_mask, s["out_logp"][:, :steps].clone(),
                       s["out_ent"][:, :steps].clone(), ~s["finished"].clone(), texts, G, stats)
