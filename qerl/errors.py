"""Errors that are the user's to fix (a bad config value, a missing or corrupt file, a bad storage URL).

Raise ``UserError`` with a message that names the bad value (or file) and, where there is a set of valid choices,
lists them. Entry points (``qerl.train``, ``qerl.evaluate``, ``sweeps.aqn``, ``paper_figures``) print such an error
as one line and exit with status 2 instead of a traceback; anything else is a bug and keeps its traceback.
It subclasses ``ValueError`` so callers that catch bad values keep working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input; its message is the whole explanation (no traceback is shown)."""
