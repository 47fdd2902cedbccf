"""Deprecated names: one warning text and one module ``__getattr__`` body for every old name.

Every old name the package still answers to (one release, listed in CHANGELOG.md under
"Deprecated") warns with ``"<old> is deprecated; use <new>"``, a :class:`DeprecationWarning`
attributed to the caller's line.  The test suite turns exactly these warnings into errors
(``pyproject.toml``), so no internal use of an old name goes unnoticed.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping

__all__ = ["warn", "moved", "module_getattr"]


def warn(old: str, new: str, stacklevel: int = 2) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``.

    ``stacklevel`` counts from the caller of this function: 2 (the default) names the line
    that called the function which calls :func:`warn`."""
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning,
                  stacklevel=stacklevel + 1)


def moved(module: str, table: Mapping[str, str], name: str) -> object:
    """The object an old name of ``module`` stands for, with a warning (a PEP 562
    ``__getattr__`` body).

    ``table`` maps each old name to its new home, ``"package.module.attribute"``.  Any other
    name raises AttributeError, as a module without ``__getattr__`` would."""
    new = table.get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    home, _, attr = new.rpartition(".")
    value: object = getattr(importlib.import_module(home), attr)
    warn(f"{module}.{name}", new, stacklevel=3)     # the line that read module.name
    return value


def module_getattr(module: str, table: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` that answers the old names in ``table`` (see :func:`moved`).

    Bind it under ``if not TYPE_CHECKING:``: a type checker that saw a module ``__getattr__``
    would accept any attribute of the module, typos included."""
    def __getattr__(name: str) -> object:
        return moved(module, table, name)
    return __getattr__
