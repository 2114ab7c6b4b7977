"""Static check of the sm_90a wgmma GEMM's machine code (``qerl/kernels/csrc/fp4_wgmma_gemm.cu``): inside the main
loop, no instruction may write a register that an in-flight warpgroup MMA still reads as its A operand.

    python -m benchmarks.wgmma_sass_check [--pipe 1,2] [--nvcc nvcc] [--define NAME=VALUE ...]

Why: ``wgmma.mma_async`` reads its register A operand after it has been issued, but ptxas treats the PTX value's
last use as the instruction itself and may give the physical registers to later instructions. Session 30's first
kernel (``wait_group 1`` with one register set) computed wrong rows that way on the GPU; this check finds that
version's hazards in its SASS (``tests/test_wgmma_sass_check.py`` plants it) without a GPU.

How: compile the file for sm_90a (``nvcc -cubin``, ``-DQFP4_WGMMA_PIPE=p``), disassemble it (``cuobjdump -sass``;
the copy bundled with Triton when none is on the PATH), and for every ``fp4_wgmma_kernel`` find each loop holding
``HGMMA`` instructions (a backward branch) and walk its body twice in address order, carrying the in-flight MMA
groups over the back edge: an ``HGMMA`` adds its A registers (4 from its second operand) to the open group, ``gsb0``
closes the group, ``WARPGROUP.DEPBAR.LE gsb0, N`` retires all but the newest N groups, and any other instruction
whose destination registers meet an in-flight group's is a hazard. Walking in address order treats both sides of a
branch inside the body as executed: conservative (it can report a write on a path that never runs with the MMA in
flight, never miss one on the straight path). ptxas's own serialization warning (C7513) is reported too.
Exit status 1 on any hazard or warning. The library's default build adds ``--pipe 2 --define QFP4_WGMMA_PDL=1 --define
QFP4_WGMMA_TMA=1 --define QFP4_WGMMA_TAIL=1`` (``tests/test_wgmma_sass_check.py`` checks both that build and the plain
one).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "qerl" / "kernels" / "csrc" / "fp4_wgmma_gemm.cu"
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRA = re.compile(r"\bBRA(?:\.U)?\s+(0x[0-9a-f]+)")
_HGMMA_A = re.compile(r"HGMMA\S*\s+R\d+,\s*R(\d+),")
_DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")
# opcodes whose first operand is not a register they write
_NO_DEST = ("ST", "BAR", "BRA", "HGMMA", "WARPGROUP", "DEPBAR", "LDGSTS", "MEMBAR", "EXIT", "RED", "FENCE", "NOP",
            "LDGDEPBAR", "CCTL", "ERRBAR", "WARPSYNC", "BSYNC", "BSSY", "RET", "CALL", "SYNCS", "UTMA", "ARRIVES")


def functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    """``cuobjdump -sass`` text -> {mangled name: [(address, instruction without predicate comments)]}."""
    out: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = _LINE.search(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return out


_PRED = re.compile(r"^@!?U?P[T0-9]+\s+")  # an instruction's predicate guard


def opcode(ins: str) -> str:
    """An instruction's opcode with its modifiers (``UTMALDG.2D``), its predicate guard (``@!P0``) left out."""
    parts = _PRED.sub("", ins).split()
    return parts[0] if parts else ""


def backward_spans(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(index of the target, index of the branch) of every branch back to an earlier instruction of the function."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    return [(index[int(m.group(1), 16)], i) for i, (a, t) in enumerate(ins)
            if (m := _BRA.search(t)) and int(m.group(1), 16) < a and int(m.group(1), 16) in index]


def main_loop(ins: list[tuple[int, str]], mmas: int = 8) -> list[str]:
    """The instructions of a wgmma kernel's main loop: the shortest backward span holding exactly ``mmas`` HGMMA
    (two chunks of four with two chunks a pass; the mbarrier waits' retry paths sit at the function's end and branch
    back into the loop, spanning more)."""
    spans = [[t for _, t in ins[lo:hi + 1]] for lo, hi in backward_spans(ins)]
    return min((sp for sp in spans if sum(opcode(t).startswith("HGMMA") for t in sp) == mmas), key=len)


def _dest_regs(ins: str) -> set[int]:
    """Registers an instruction writes (its first operand; .64/.WIDE/CS2R write 2, .128 write 4); none for stores,
    barriers, branches, MMAs and uniform-datapath instructions."""
    ins = _PRED.sub("", ins)
    op = opcode(ins)
    if not op or op.startswith(_NO_DEST) or op.startswith("U"):
        return set()
    m = re.match(r"R(\d+)", ins[len(op):].strip())
    if not m:
        return set()
    n = 4 if ".128" in op else 2 if (".64" in op or ".WIDE" in op or op.startswith("CS2R")) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + n))


def loop_hazards(ins: list[tuple[int, str]]) -> tuple[int, list[str]]:
    """(loops with MMAs found, hazards as text) of one function's instructions (see the module docstring)."""
    loops = [(lo, hi) for lo, hi in backward_spans(ins) if any("HGMMA" in ins[k][1] for k in range(lo, hi))]
    found = []
    for lo, hi in loops:
        groups: list[set[int]] = []
        open_group: set[int] = set()
        for rep in range(2):  # the second pass sees what the first left in flight over the back edge
            for a, t in ins[lo:hi + 1]:
                if "HGMMA" in t:
                    m = _HGMMA_A.search(t)
                    if m:
                        open_group |= set(range(int(m.group(1)), int(m.group(1)) + 4))
                    if "gsb0" in t:
                        groups.append(open_group)
                        open_group = set()
                    continue
                m = _DEPBAR.search(t)
                if m:
                    keep = int(m.group(1), 16)
                    groups = groups[len(groups) - keep:] if keep else []
                    continue
                hit = _dest_regs(t) & set().union(set(), *groups)
                if hit:
                    found.append(f"{a:#06x} (pass {rep + 1}): {t}  writes in-flight A registers {sorted(hit)}")
    return len(loops), found


def _tool(name: str) -> str | None:
    path = shutil.which(name)
    if path:
        return path
    try:
        import triton
        cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        return str(cand) if cand.exists() else None
    except ImportError:
        return None


def compile_sass(pipe: int = 1, source: str | None = None, defines: tuple[str, ...] = (), nvcc: str = "nvcc"
                 ) -> tuple[str, str]:
    """(SASS text, ptxas/nvcc messages) of the wgmma GEMM built for sm_90a; ``source`` replaces the file's text
    (the include directory stays the real one). The messages hold ptxas's resource lines (``-Xptxas -v``: registers
    and static shared memory per kernel, read by :func:`resources`). A build :func:`prebuild` started with the same
    arguments is waited on and handed over (once) instead of building again."""
    key = _build_key(pipe, source, defines, nvcc)
    return _collect(key) or _build(pipe, source, tuple(defines), nvcc, nice=False)


def _collect(key):
    """The result of the prebuild of ``key`` (handed over once), None where there is none to wait for. One still
    queued is cancelled (the caller runs it now, at its own priority); one running at nice 19 is moved back to nice
    0 where the OS allows it (the caller waits on it)."""
    fut = _PREBUILT.pop(key, None)
    if fut is None or fut.cancel():
        return None
    with _LOCK:
        proc = _RUNNING.get(key)
    if proc is not None:
        try:
            os.setpriority(os.PRIO_PGRP, proc.pid, 0)
        except OSError:  # lowering a nice value needs the privilege to (CAP_SYS_NICE): then it keeps 19
            pass
    return fut.result()


def _build_key(pipe: int, source: str | None, defines, nvcc: str) -> tuple:
    return (pipe, None if source is None else hashlib.sha256(source.encode()).hexdigest(), tuple(defines), nvcc)


def _build(pipe: int, source: str | None, defines: tuple[str, ...], nvcc: str, nice: bool,
           key: tuple | None = None) -> tuple[str, str]:
    nvcc_path, cuobjdump = _tool(nvcc), _tool("cuobjdump")
    if nvcc_path is None or cuobjdump is None:
        raise FileNotFoundError(f"needs nvcc ({nvcc_path}) and cuobjdump ({cuobjdump})")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.cu"
        src.write_text(SRC.read_text() if source is None else source)
        cubin = Path(tmp) / "k.cubin"
        cmd = [nvcc_path, "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", f"-I{SRC.parent}",
               "-Xptxas", "-v", f"-DQFP4_WGMMA_PIPE={pipe}", *[f"-D{d}" for d in defines], "-o", str(cubin), str(src)]
        rc, out, err = _run_low(cmd, nice, key)
        if rc:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}, exit {rc}):\n{err[-4000:]}")
        d = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True)
        return d.stdout, out + err


def _run_low(cmd: list[str], nice: bool, key: tuple | None = None) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``cmd``; ``nice`` (a prebuild's, ``key`` given): at nice 19, as the leader of
    its own process group, registered under ``key`` while it runs."""
    low = [shutil.which("nice"), "-n", "19"] if nice and shutil.which("nice") else []
    with _LOCK:
        if nice and _STOPPED:
            raise RuntimeError("prebuilds stopped")
        proc = subprocess.Popen([*low, *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=os.setpgrp if nice else None)
        # its own process group (stop_prebuilds kills cicc and ptxas with it) in this session: a new session
        # (setsid) would be a scheduler autogroup of its own, which Linux gives an equal share of the CPU
        # whatever its nice value (session 65's first version slowed the two-rank tests so)
        if nice:
            _RUNNING[key] = proc
    try:
        out, err = proc.communicate()
    finally:
        if nice:
            with _LOCK:
                _RUNNING.pop(key, None)
    return proc.returncode, out, err


class Command(tuple):
    """A prebuild entry that is a plain command (its argv), run by :func:`run_command` (e.g. a g++ syntax check)."""


def run_command(argv) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the command ``argv``: the one :func:`prebuild` started (``Command(argv)``),
    handed over once, else run now."""
    return _collect(("cmd", tuple(argv))) or _run_low(list(argv), nice=False)


# builds started ahead by prebuild(): {build key: future}, the pool running them and {build key: its live process}
# (each the leader of its process group)
_PREBUILT: dict[tuple, Future] = {}
_POOL: list[ThreadPoolExecutor] = []
_RUNNING: dict[tuple, subprocess.Popen] = {}
_LOCK = threading.Lock()
_STOPPED = False


def prebuild(builds, workers: int = 2, nvcc: str = "nvcc") -> int:
    """Start the :func:`compile_sass` builds ``builds`` ((pipe, source, defines) each, or a :class:`Command` for
    :func:`run_command`) in the background, in order, ``workers`` at once, at the lowest CPU priority (``nice -n 19``:
    they take only CPU time nothing else wants), so that the test suite's SASS checks find them built instead of
    building them one after another at its end.
    Builds already started, and any where nvcc or cuobjdump is missing, are left out; returns how many started."""
    global _STOPPED
    if _tool(nvcc) is None or _tool("cuobjdump") is None:
        return 0
    _STOPPED = False
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(workers, thread_name_prefix="sass-prebuild"))
    started = 0
    for b in builds:
        if isinstance(b, Command):
            key = ("cmd", tuple(b))
            args = (_run_low, list(b), True, key)
        else:
            pipe, source, defines = b
            key = _build_key(pipe, source, defines, nvcc)
            args = (_build, pipe, source, tuple(defines), nvcc, True, key)
        if key not in _PREBUILT:
            _PREBUILT[key] = _POOL[0].submit(*args)
            started += 1
    return started


def stop_prebuilds() -> None:
    """Drop the builds no one collected: the queued ones are cancelled and the running nvcc processes killed (a run
    that ends early does not wait minutes for builds it will not read)."""
    global _STOPPED
    with _LOCK:
        _STOPPED = True
        for proc in _RUNNING.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # already gone
                pass
    for pool in _POOL:
        pool.shutdown(wait=True, cancel_futures=True)
    _POOL.clear()
    _PREBUILT.clear()


# a kernel's "Used" line follows its "Compiling entry function" line; "Function properties for" also names the
# non-inlined device functions it calls, so it does not start a kernel
_ENTRY = re.compile(r"Compiling entry function '([\w$]+)'")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def resources(messages: str) -> dict[str, tuple[int, int]]:
    """{kernel: (registers a thread, static shared memory bytes)} from ptxas's ``-v`` lines in ``messages``."""
    out, name = {}, None
    for line in messages.splitlines():
        if m := _ENTRY.search(line):
            name = m.group(1)
        elif (m := _USED.search(line)) and name is not None:
            out[name] = (int(m.group(1)), int(m.group(2) or 0))
    return out


def sm90_ctas(threads: int, regs: int, smem: int) -> int:
    """CTAs of ``threads`` threads, ``regs`` registers a thread and ``smem`` bytes of shared memory (static +
    dynamic) resident at once on one sm_90 SM (H100, H200): 64 K registers given out per warp in units of 256,
    228 KB of shared memory with 1 KB reserved per CTA, 2048 threads, 32 CTAs -- what
    cudaOccupancyMaxActiveBlocksPerMultiprocessor answers there, computed without a GPU."""
    warps = -(-threads // 32)
    by_regs = 65536 // (warps * (-(-regs * 32 // 256) * 256))
    by_smem = 228 * 1024 // (smem + 1024)
    return min(by_regs, by_smem, 2048 // threads, 32)


def check(sass: str, messages: str = "") -> dict:
    """{'kernels': wgmma kernels checked, 'loops': loops with MMAs, 'hazards': [...], 'serialized': bool}."""
    kernels = loops = 0
    hazards = []
    for name, ins in functions(sass).items():
        if "fp4_wgmma_kernel" not in name:
            continue
        kernels += 1
        n, found = loop_hazards(ins)
        loops += n
        hazards += [f"{name}: {h}" for h in found]
    return {"kernels": kernels, "loops": loops, "hazards": hazards,
            "serialized": "C7513" in messages or "serialized" in messages}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipe", default="1,2", help="QFP4_WGMMA_PIPE values to build and check")
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument("--define", action="append", default=[], help="extra -D for nvcc (NAME=VALUE)")
    a = ap.parse_args(argv)
    bad = False
    for pipe in [int(p) for p in a.pipe.split(",")]:
        sass, msgs = compile_sass(pipe, defines=tuple(a.define), nvcc=a.nvcc)
        r = check(sass, msgs)
        print(f"pipe {pipe}: {r['kernels']} wgmma kernels, {r['loops']} MMA loops, {len(r['hazards'])} hazards, "
              f"ptxas serialized the MMAs: {r['serialized']}")
        for h in r["hazards"][:20]:
            print("  " + h)
        bad |= bool(r["hazards"]) or r["serialized"] or r["kernels"] == 0 or r["loops"] < r["kernels"]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
