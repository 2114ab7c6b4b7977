"""Errors that are the user's to fix (a bad config value, a missing or corrupt file, a bad storage URL).

Raise ``UserError`` with a message that names the bad value (or file) and, where there is a set of valid choices,
lists them. Entry points (``qerl.train``, ``qerl.evaluate``, ``sweeps.aqn``, ``paper_figures``) print such an error
as one line and exit with status 2 instead of a traceback; anything else is a bug and keeps its traceback.
It subclasses ``ValueError`` so callers that catch bad values keep working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input; its message is the whole explanation (no traceback is shown)."""


class TrainingDiverged(RuntimeError):
    """A run whose gradients stayed NaN/inf for ``train.max_nonfinite_steps`` steps in a row (its finished steps are
    logged; the weights are those before the first skipped update)."""


def cli_main(fn, argv: list[str] | None = None) -> None:
    """Run an entry point's ``fn(argv)`` and exit with its status (``None`` counts as 0); a ``UserError`` is printed
    as one line, ``<module>: error: <message>``, to stderr, and the exit status is 2 (no traceback).

    Use it as ``if __name__ == "__main__": cli_main(main)``.
    """
    import sys

    try:
        status = fn(argv)
    except UserError as e:
        print(f"{_prog(fn)}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    sys.exit(0 if status is None else status)


def _prog(fn) -> str:
    """The entry point's module as the user typed it (``python -m sweeps.aqn`` runs it as ``__main__``)."""
    import sys

    name = getattr(fn, "__module__", None) or "qerl"
    if name == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        name = spec.name if spec is not None else "qerl"
    return name.removesuffix(".__main__")
