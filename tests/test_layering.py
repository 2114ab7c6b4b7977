"""The dependency rules of shared/DESIGN.md, checked: static analysis of every import statement (module level and
inside functions: a lazy import is still a dependency), plus fresh interpreters that import the modules and look at
what got loaded.

* the leaves (``qerl/quant qerl/kernels algos aqn rewards data toy``) import no ``config``, ``train`` or hydra;
* ``paper_figures/`` imports no torch (it reads results/ and plots);
* no import cycles inside ``qerl/`` (``from pkg import submodule`` is an edge to the submodule; a package's own
  ``__init__`` importing its submodules is how packages work, not a cycle);
* validating a config imports neither ``qerl.lora`` nor the kernels (nor Triton);
* paper_figures' torch-free copy of the format colours equals what the formats say.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEAVES = ("qerl.quant", "qerl.kernels", "qerl.algos", "qerl.aqn", "qerl.rewards", "qerl.data", "qerl.toy")
FORBIDDEN_IN_LEAVES = ("qerl.config", "qerl.train", "hydra", "omegaconf")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(top: str) -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / top).rglob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """Absolute names of everything ``path`` imports (a from-import of a submodule names the submodule)."""
    name = _module_name(path)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out.update(subs if len(subs) == len(node.names) else [mod, *subs])
    return out


def _graph(top: str) -> dict[str, set[str]]:
    mods = _modules(top)
    known = set(mods)
    return {m: {i for i in _imports(p, known) if i in known and i != m and not m.startswith(i + ".")}
            for m, p in mods.items()}


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_leaves_import_no_config_train_or_hydra():
    mods = _modules("qerl")
    known = set(mods)
    bad = {m: sorted(i for i in _imports(p, known) if _in(i, FORBIDDEN_IN_LEAVES))
           for m, p in mods.items() if _in(m, LEAVES)}
    assert not {m: v for m, v in bad.items() if v}


def test_paper_figures_import_no_torch_statically():
    mods = _modules("paper_figures")
    bad = {m: sorted(i for i in _imports(p, set()) if _in(i, ("torch", "qerl.quant", "qerl.kernels")))
           for m, p in mods.items()}
    assert not {m: v for m, v in bad.items() if v}


def test_no_import_cycles_inside_qerl():
    g = _graph("qerl")
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in g[v]:
                cycles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
    assert "qerl.train" not in g["qerl.evaluate"] and "qerl.evaluate" in g["qerl.train"]


def _loaded_after(code: str) -> set[str]:
    """Module names loaded by a fresh interpreter after running ``code`` (from the repo root)."""
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys, json; print(json.dumps(sorted(sys.modules)))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.slow
def test_fresh_imports_keep_the_layers():
    leaves = _loaded_after("import " + ", ".join(LEAVES))
    assert not {m for m in leaves if _in(m, FORBIDDEN_IN_LEAVES)}
    figures = _loaded_after("import " + ", ".join(sorted(_modules("paper_figures"))))
    assert "torch" not in figures
    cfg = _loaded_after("from qerl.config import load_config\nload_config(['quant=int4'])")
    assert not {m for m in cfg if _in(m, ("qerl.lora", "qerl.kernels", "triton", "qerl.train"))}


def test_paper_figures_colours_are_the_formats_colours():
    from paper_figures.style import FORMAT_COLORS, FORMAT_ORDER
    from qerl.quant import FORMATS

    for f in FORMATS.values():
        assert FORMAT_COLORS.get(f.label) == f.color, (f.name, f.label)
        assert f.label in FORMAT_ORDER
    assert len({f.color for f in FORMATS.values()}) == len(FORMATS)
