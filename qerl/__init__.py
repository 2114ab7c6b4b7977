"""qerl: a reproduction and ablation harness for QeRL (arXiv 2510.11696).

Quantized base weights (NVFP4, MXFP4, NF4, or BF16) + LoRA, trained with GRPO/DAPO, with
Adaptive Quantization Noise (AQN) in the RMSNorm weights. See README.md and DESIGN.md.
"""

__version__ = "0.1.0"

import logging as _logging

# bitsandbytes >= 0.50 tries, on AVX512-BF16 CPUs, to fetch an optional CPU kernel from the Hugging Face hub at
# import and logs a warning when it cannot (always, offline). qerl never uses that kernel: keep the log quiet.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
