"""qerl: a reproduction and ablation harness for QeRL (arXiv 2510.11696).

Quantized base weights (NVFP4, MXFP4, NF4, or BF16) + LoRA, trained with GRPO/DAPO, with
Adaptive Quantization Noise (AQN) in the RMSNorm weights. See README.md and DESIGN.md.
"""

__version__ = "0.1.0"
