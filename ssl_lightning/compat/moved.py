"""Modules that moved keep their old import path for one release: the old module re-exports the
new one and, when first imported, warns with a ``FutureWarning`` naming the new path."""

from __future__ import annotations

import warnings


def warn_moved(old: str, new: str) -> None:
    """Warn that module ``old`` (an old import path, or a ``class_path`` an older config holds)
    is now ``new``."""
    warnings.warn(f"{old} has moved to {new}; import from there (the old path will be removed "
                  "in the next release).", FutureWarning, stacklevel=3)
