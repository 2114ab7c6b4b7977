"""paper_figures: the paper's tables and figures regenerated from ``results/`` alone.

Plotting and tables only: imports ``qerl.results`` (no torch), pandas, matplotlib and seaborn. Run everything with
``python -m paper_figures [--root results] [--only fig4,table2] [--scale smoke]``.

* ``paper_figures.tables``: ``render_table1``, ``render_table2``, ``render_rows``, ``paper_table``;
* ``paper_figures.figures``: ``fig4``, ``fig5``, ``fig7``, ``fig8``, ``fig9``, ``fig10``, ``fig14``, ``fig15``,
  ``fig16``, ``fig17`` (training curves, σ schedules);
* ``paper_figures.speed``: ``speed_rollout`` (Fig. 1), ``speed_rank`` (Fig. 11), ``speed_layers``;
* ``paper_figures.style``: ``FORMAT_COLORS``, ``AQN_DASHES``, ``SCHEDULE_COLORS``;
* ``paper_figures/paper/*.csv``: the paper's numbers as printed (copied from the shared paper notes).
"""

from paper_figures.style import AQN_DASHES, FORMAT_COLORS, SCHEDULE_COLORS  # noqa: F401
from paper_figures.tables import paper_table, render_rows, render_table1, render_table2  # noqa: F401
