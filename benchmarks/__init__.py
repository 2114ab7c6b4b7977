"""Developer tools for the kernels, outside the runtime package: per-layer benchmark and tuner
(``python -m benchmarks.kernel_bench [--tune]``, which writes the table in ``qerl/kernels/tuned_h100.py``), the CUDA
GEMV benchmark (``benchmarks.cuda_bench``), the SASS report (``benchmarks.sass``) and the measurements (NOTES.md)."""
