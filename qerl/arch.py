"""Names of the Qwen2/Llama decoder modules qerl works on: one definition each, imported by the modules that need
them (config validation, LoRA, AQN, loading, fused decode). Pure Python: importing it costs nothing."""

from __future__ import annotations

#: The seven projections QeRL adapts (paper Sec. 4.1; official `target_modules`).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The per-block RMSNorms the official scripts train with ``--ln True`` (and that AQN perturbs).
BLOCK_NORMS = ("input_layernorm", "post_attention_layernorm")
#: Linears that share one input (vLLM and llm-compressor fuse them): group -> (parent module, members).
#: NVFP4 gives each group one global scale; fused decode runs each as one matmul.
FUSED_GROUPS = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "gate_up": ("mlp", ("gate_proj", "up_proj"))}
