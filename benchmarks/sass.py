"""Compile kernel configurations for sm_90 ahead of time (no GPU needed) and report their resources.

    python -m benchmarks.sass [--fmt nvfp4] [--configs KEY,KEY,...] [--asm 1] [--dump DIR]

For each configuration: registers, spill stores/loads, stack, shared memory, and an instruction histogram of
the SASS (matrix instructions HGMMA/HMMA, global loads by width, shared-memory traffic, conversions). Uses
the ptxas/cuobjdump/nvdisasm bundled with Triton, so it runs on a CPU host; numbers come from the compiler,
timings only from the GPU (bench.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qerl.kernels import fp4_triton as K
from qerl.kernels.configs import KernelConfig

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_INT_ARGS = ("M", "N", "K", "stride_xm", "stride_om", "PER", "NITER")


def compile_config(cfg: KernelConfig, fmt_id: int = 0, asm: bool = True, masked: bool = False,
                   capability: int = 90):
    """triton.compile one configuration of the fused kernels for ``sm_<capability>``; returns the CompiledKernel."""
    fn = K._qgemv_kernel if cfg.kernel == "gemv" else K._qmm_dot_kernel
    sig = {"x_ptr": "*bf16", "wq_ptr": "*u8", "sc_ptr": "*i32" if (cfg.sc32 or cfg.mode == 3) else "*u8", "gs_ptr": "*fp32", "out_ptr": "*bf16",
           "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    sig.update({a: "i32" for a in _INT_ARGS})
    const = dict(FMT=fmt_id, G=16 if fmt_id == 0 else 32, USE_ASM=asm, HAS_G=fmt_id == 0,
                 OUT_C=K.ASM_OUT_SCALE if asm else 1.0, BN=cfg.bn, BK=cfg.bk, SPLIT_K=cfg.split_k,
                 MASKED=masked, FENCE=True, MODE=cfg.mode, SC32=cfg.sc32 or cfg.mode == 3)
    if cfg.kernel != "gemv":
        const.update(BM=cfg.bm, SWAP=cfg.swap, JOIN=cfg.join, DOT_F32=False,
                     PREFETCH=cfg.prefetch and not cfg.sc32 and cfg.mode != 3)
    for c in const:
        sig[c] = "constexpr"
    names = fn.arg_names
    # pointers 16-byte aligned, K/N/strides multiples of 16 (as the JIT specializes them for our shapes)
    aligned = ["x_ptr", "wq_ptr", "sc_ptr", "gs_ptr", "out_ptr", "ws_ptr", "cnt_ptr", "N", "K",
               "stride_xm", "stride_om"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs)
    opts = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    if cfg.maxnreg:
        opts["maxnreg"] = cfg.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=opts)


def report(ck) -> dict:
    """Resource usage and SASS instruction histogram of a compiled kernel."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-res-usage", path],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(_BIN, "nvdisasm"), "-hex", path] if False else
                              [os.path.join(_BIN, "nvdisasm"), path], capture_output=True, text=True).stdout
    out = {}
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    if m:
        out.update(reg=int(m.group(1)), stack=int(m.group(2)), shared=int(m.group(3)))
    ops = collections.Counter()
    for line in sass.splitlines():
        mm = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if mm:
            ops[mm.group(2)] += 1
    out["n_instr"] = sum(ops.values())
    out["loop"] = loop_body(sass)
    out["spill"] = ops.get("STL", 0) + sum(v for k, v in ops.items() if k.startswith("STL."))
    out["ops"] = ops
    out["sass"] = sass
    return out


def loop_body(sass: str) -> collections.Counter:
    """Instruction histogram of the largest loop (the K loop): from a backward branch's target to the branch."""
    lines = sass.splitlines()
    addr_of, pending, ins = {}, None, []
    for line in lines:
        lab = re.match(r"^\s*\.(L_x_\d+):", line)
        if lab:
            pending = lab.group(1)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            a = int(m.group(1), 16)
            ins.append((a, m.group(2)))
            if pending:
                addr_of[pending], pending = a, None
    best: list = []
    for a, text in ins:
        br = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        if br and addr_of.get(br.group(1), a + 1) < a:
            body = [t for x, t in ins if addr_of[br.group(1)] <= x <= a]
            best = body if len(body) > len(best) else best
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0] for t in best)


def summarize(ops: collections.Counter) -> str:
    """One line: the instruction families that matter for these kernels."""
    fam = collections.Counter()
    for op, n in ops.items():
        base = op.split(".")[0]
        if base in ("HGMMA", "HMMA"):
            fam[base] += n
        elif base in ("LDG", "LDS", "STS", "LDSM", "STG", "LDGSTS", "UTMALDG", "SHFL", "BAR", "PRMT", "LOP3",
                      "SHF", "IMAD", "FMUL", "FFMA", "HMUL2", "HFMA2", "F2F", "F2FP", "STL", "LDL", "I2F"):
            key = op if base in ("LDG", "LDS", "STS") else base
            fam[key] += n
    return " ".join(f"{k}:{v}" for k, v in sorted(fam.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fmt", default="nvfp4", choices=["nvfp4", "mxfp4"])
    ap.add_argument("--configs", default="dot_m16_n64_k256_s1_swap_w4_st3")
    ap.add_argument("--asm", type=int, default=1)
    ap.add_argument("--dump", default="")
    a = ap.parse_args(argv)
    for key in a.configs.split(","):
        cfg = KernelConfig.parse(key)
        try:
            r = report(compile_config(cfg, 0 if a.fmt == "nvfp4" else 1, bool(a.asm)))
        except Exception as e:  # a configuration the compiler rejects (e.g. too much shared memory)
            print(f"{key}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        print(f"{key}: reg={r.get('reg')} stack={r.get('stack')} shared={r.get('shared')} "
              f"loop={sum(r['loop'].values())} {summarize(r['loop'])}")
        if a.dump:
            os.makedirs(a.dump, exist_ok=True)
            with open(os.path.join(a.dump, key + ".sass"), "w") as f:
                f.write(r["sass"])


if __name__ == "__main__":
    main()
