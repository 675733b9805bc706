"""The one error type of the load generator: a run that cannot start or cannot go on."""

from __future__ import annotations


class LoadError(RuntimeError):
    """A load run cannot proceed (target unreachable, no model, openai missing...).

    Its message is one line, fit to print as is after ``shadow load: error:``.
    """
