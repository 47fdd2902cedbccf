"""The sections of ``python -m kvcache bench`` and how they register themselves.

A section module declares one :class:`Section` -- its name, its options with their defaults
and ``--quick`` defaults, its task count, its work, its report and its JSON -- and passes it to
:func:`register` when it is imported.  :func:`sections` imports every module of this package
once, so adding a section is adding one module; the command line, the progress bar, the report
and the JSON file are built from what is registered (``cli``, ``report``).

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..modes import KvMode
from .geometry import GEOMETRY_ALIASES, GEOMETRIES, mode_name
from .timing import Bandwidth

if TYPE_CHECKING:
    from .._progress import ProgressBar

Result = dict[str, Any]   # what a section's work returns: its JSON object (rows and the rest)


@dataclass
class Context:
    """What every section of one run shares: the run-wide options and the bandwidth probe."""

    quick: bool
    threads: list[int]
    seed: int
    bandwidth_bytes: int
    bandwidth: Bandwidth = field(default_factory=dict)    # measured before the first section
                                                          # that asks for it (Section.bandwidth)


class Values:
    """One section's option values, by option name (``values.contexts``)."""

    def __init__(self, items: Mapping[str, Any]) -> None:
        self._items = dict(items)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_items"][name]
        except KeyError:
            raise AttributeError(f"no option {name!r}") from None

    def __repr__(self) -> str:
        return f"Values({self._items!r})"

    def record(self) -> dict[str, Any]:
        """The values, as the JSON file keeps them."""
        return dict(self._items)


@dataclass(frozen=True)
class Option:
    """One option of a section, ``--<section>-<name>`` on the command line.

    ``parse`` converts one word (raising ``argparse.ArgumentTypeError`` with the reason); None
    makes a switch (``--<section>-<name>`` / ``--no-<section>-<name>``).  ``many``: a list
    (several words or comma lists, duplicates dropped).  ``quick``: the default under
    ``--quick`` (None: ``default``).  ``old``: spellings of an earlier release, accepted with a
    warning (for a switch, the one that turns it off)."""

    name: str
    help: str
    default: Any
    parse: Callable[[str], Any] | None = None
    quick: Any = None
    many: bool = False
    old: tuple[str, ...] = ()
    metavar: str = "V"

    def default_for(self, quick: bool) -> Any:
        """The value when the option is not given."""
        return self.quick if quick and self.quick is not None else self.default


@dataclass(frozen=True)
class Section:
    """One section of the benchmark.

    ``tasks(ctx, values)``: progress-bar steps of ``run``; ``run(ctx, values, bar)``: the
    measurements, a JSON-ready dict (``to_json`` adds to it, e.g. summaries); ``report(ctx,
    values, result)``: the printed text ("" prints nothing); ``plot(ctx, result, path)``: a
    chart for ``--plot``.  ``order`` places the section in the run and the report; ``default``
    False runs it only when ``--sections`` names it; ``bandwidth``: it reads
    ``ctx.bandwidth``."""

    name: str
    help: str
    order: int
    tasks: Callable[[Context, Values], int]
    run: Callable[[Context, Values, ProgressBar], Result]
    report: Callable[[Context, Values, Result], str]
    options: tuple[Option, ...] = ()
    default: bool = True
    bandwidth: bool = False
    to_json: Callable[[Result], Result] | None = None
    plot: Callable[[Context, Result, str], None] | None = None

    def flag(self, option: Option) -> str:
        """The command-line spelling of ``option``."""
        return f"--{self.name}-{option.name.replace('_', '-')}"

    def values(self, quick: bool, given: Mapping[str, Any] | None = None) -> Values:
        """The section's values: those in ``given`` (None: not given), else the defaults."""
        given = given or {}
        return Values({o.name: o.default_for(quick) if given.get(o.name) is None
                       else given[o.name] for o in self.options})


#: Every registered section by name (a section module adds its own when imported).
REGISTRY: dict[str, Section] = {}


def register(section: Section) -> Section:
    """Add ``section`` to :data:`REGISTRY`; returns it."""
    if section.name in REGISTRY:
        raise ValueError(f"section {section.name!r} is registered twice")
    REGISTRY[section.name] = section
    return section


@functools.cache
def _discover() -> None:
    """Import every module of this package (each section module registers its section)."""
    package = importlib.import_module(__package__ or "kvcache.bench")
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def sections() -> list[Section]:
    """The registered sections, in their order."""
    _discover()
    return sorted(REGISTRY.values(), key=lambda s: (s.order, s.name))


# ------------------------------------------------------------------ parsers of option words
def parse_context(text: str) -> int:
    """'1k' -> 1024, '32K' -> 32768, '5000' -> 5000 (at least 1)."""
    return _context(text, 1)


def parse_context_or_zero(text: str) -> int:
    """A context as :func:`parse_context` reads it, or 0 (which leaves something out)."""
    return _context(text, 0)


def _context(text: str, least: int) -> int:
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or Nk (e.g. 4096, 4k), got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"expected a context >= {least}, got {text!r}")
    return value


def at_least(least: int) -> Callable[[str], int]:
    """A parser of integers ``>= least``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value
    return parse


def one_of(*choices: str) -> Callable[[str], str]:
    """A parser of one of ``choices`` (any case)."""
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(choices)}, got {text!r}")
        return text.lower()
    return parse


def parse_geometry(text: str) -> str:
    """A geometry key of :data:`GEOMETRIES`, by key or alias (llama, qwen)."""
    key = GEOMETRY_ALIASES.get(text.lower(), text.lower())
    if key not in GEOMETRIES:
        raise argparse.ArgumentTypeError(
            f"unknown geometry {text!r}; choose from {', '.join(GEOMETRIES)} (or llama, qwen)")
    return key


def parse_mode(text: str) -> str:
    """A KV mode by any name :meth:`KvMode.parse` accepts, as its short name (f32, q8, ...).
    The benchmark measures the default int8 scheme, so a name that asks for another one
    (``q8:cmf``) is refused rather than measured as ``q8``."""
    try:
        mode = KvMode.parse(text, "mode")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    name = mode_name(mode)
    if mode != KvMode.parse(name, "mode"):
        raise argparse.ArgumentTypeError(
            f"mode: the benchmark measures the default int8 scheme; got {text!r} (use {name!r})")
    return name
