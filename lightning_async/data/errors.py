"""Exceptions of the data layer: each names the problem and the fix.

They subclass the builtin a caller would expect (``ValueError`` for a bad setting or unusable
data, ``FileNotFoundError`` for a missing path), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class DataConfigError(ValueError):
    """A data setting is invalid (unknown name, missing companion argument, out of range)."""


class DataFileNotFoundError(DataConfigError, FileNotFoundError):
    """A path, directory or glob given to the data module matches no file."""


class EmptyCorpusError(DataConfigError):
    """The corpus (or one split of it) produced no tokens."""


class NotEnoughDataError(DataConfigError):
    """A split has fewer tokens than one window, or fewer windows than one batch."""


def choices(names) -> str:
    """``'a', 'b', 'c'`` for an error message."""
    return ", ".join(repr(n) for n in names)
