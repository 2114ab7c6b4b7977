"""One look for every figure: fixed colours per format, a fixed line style for AQN on/off, and a saver that writes
PNG + PDF + a ``.runs.txt`` provenance sidecar (house rule 7: a figure names the runs it came from)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import seaborn as sns
from matplotlib.figure import Figure

# One colour per base format; full fine-tuning (BF16 weights, no LoRA) gets its own. The formats own their label and
# colour (``qerl.quant.FORMATS[name].label / .color``); paper_figures imports no torch, so this is their copy, kept
# equal to the registry by tests/test_layering.py (a new format adds its line here).
FORMAT_COLORS = {"BF16": "#1f77b4", "NF4": "#ff7f0e", "MXFP4": "#9467bd", "NVFP4": "#2ca02c", "INT4": "#8c564b",
                 "Full": "#404040"}
# The paper's method names map onto formats: LoRA = BF16 base, QLoRA = NF4 base, QeRL = NVFP4 base (+AQN).
METHOD_FORMAT = {"LoRA": "BF16", "QLoRA": "NF4", "QeRL": "NVFP4", "Full": "Full"}
# AQN on/off: the same colour (the format), a different dash pattern.
AQN_DASHES = {"AQN off": "", "AQN on": (5, 2)}
AQN_LINESTYLE = {False: "-", True: "--"}
SCHEDULE_COLORS = {"exponential": "#d62728", "linear": "#1f77b4", "cosine": "#2ca02c", "logarithmic": "#9467bd",
                   "none": "#7f7f7f"}
FORMAT_ORDER = ["Full", "BF16", "NF4", "MXFP4", "NVFP4", "INT4"]


def format_color(weights: str | None, full: bool = False) -> str:
    """Colour of a series: ``Full`` for full fine-tuning, else its base format; grey when unknown."""
    if full:
        return FORMAT_COLORS["Full"]
    return FORMAT_COLORS.get(str(weights).upper(), "#7f7f7f")


def new_figure(nrows: int = 1, ncols: int = 1, width: float = 5.0, height: float = 3.4, sharey=True):
    """A Figure (no pyplot global state, no GUI backend) with a grid of axes, in the house theme."""
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey)
    return fig, axes


def save(fig: Figure, out_dir: str | Path, name: str, sources: Iterable[str], note: str = "") -> list[Path]:
    """Write ``<out_dir>/<name>.png``, ``.pdf`` and ``.runs.txt`` (one source per line). Returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf", out / f"{name}.runs.txt"]
    # no timestamps in the files, so regenerating unchanged results leaves committed figures byte-identical
    fig.savefig(paths[0], dpi=150, metadata={"Software": None})
    fig.savefig(paths[1], metadata={"CreationDate": None, "Producer": None})
    head = f"# {name}: sources of this figure" + (f" ({note})" if note else "") + "\n"
    paths[2].write_text(head + "".join(f"{s}\n" for s in sources))
    return paths
