"""KvMode: the storage precision of a layer's K and V rows (``docs/numerics.md``, int8 storage).

Two int8 schemes (:data:`SCHEMES`):

* ``"rows"`` (the default): every K row in groups of 16 channels with one float32 scale per
  group, every V row with one scale; nothing depends on how many rows existed when, so a row's
  bytes depend only on its own values and rollback/replay is exact at every position;
* ``"cmf"`` (the legacy scheme, what kvcache stored before the choice existed): K in groups of
  32 channels over a per-channel column field frozen once 64 positions are held
  (:mod:`kvcache.quant`).

Names (``parse``, ``from_env``, the CLI): "f32" ("float32"), "q8", "q8k", "q8v" (scheme
"rows") and "q8:cmf", "q8k:cmf", "q8v:cmf" (scheme "cmf"); "q8:rows" and friends also parse.
"""

from __future__ import annotations

import os

__all__ = ["KvMode", "SCHEMES", "DEFAULT_SCHEME", "MODE_NAMES"]

_ENV = "KVCACHE_KV"
SCHEMES = ("rows", "cmf")
"""The int8 storage schemes, the default first."""
DEFAULT_SCHEME = "rows"
MODE_NAMES = ("f32", "q8", "q8k", "q8v", "q8:cmf", "q8k:cmf", "q8v:cmf")
"""The names :meth:`KvMode.parse` documents (it also takes "float32" and "<q8 name>:rows")."""
_NAMES_TEXT = ", ".join(repr(n) for n in MODE_NAMES)
_COMPONENTS = {"q8": (True, True), "q8_2f": (True, True), "q8k": (True, False),
               "q8v": (False, True)}


class KvMode:
    """Storage precision of a cache: plain float32 rows, or int8 rows for K and/or V.

    Use the constructors, not the class: ``KvMode.F32``, ``KvMode.Q8(k=True, v=True)``,
    ``KvMode.from_env()``.  Modes are immutable, hashable and equal by value.

    Attributes
    ----------
    quant_k, quant_v : bool
        Whether K (resp. V) rows are stored as int8.
    scheme : str
        The int8 scheme, "rows" or "cmf" (module docstring); an F32 mode reports "" (it
        stores no int8 rows, and is one mode whatever scheme is asked for).
    """

    __slots__ = ("_quant_k", "_quant_v", "_scheme")
    _quant_k: bool
    _quant_v: bool
    _scheme: str

    F32: KvMode  # set below

    def __init__(self, quant_k: bool = False, quant_v: bool = False,
                 scheme: str = DEFAULT_SCHEME) -> None:
        scheme = _check_scheme(scheme)
        q = bool(quant_k) or bool(quant_v)
        object.__setattr__(self, "_quant_k", bool(quant_k))
        object.__setattr__(self, "_quant_v", bool(quant_v))
        object.__setattr__(self, "_scheme", scheme if q else "")

    @classmethod
    def Q8(cls, k: bool = True, v: bool = True, scheme: str = DEFAULT_SCHEME) -> KvMode:
        """int8 storage for K (``k``) and/or V (``v``); at least one must be set.

        ``scheme``: "rows" (default: per-row scales only, exact rollback at every position) or
        "cmf" (the legacy column-freeze scheme); ValueError for another value."""
        scheme = _check_scheme(scheme)
        if not (k or v):
            raise ValueError("KvMode.Q8 needs k or v set: Q8(k=False, v=False) stores nothing as "
                             "int8; use KvMode.F32")
        return cls(bool(k), bool(v), scheme)

    @classmethod
    def from_env(cls) -> KvMode:
        """Read ``KVCACHE_KV``: "f32" (default when unset or empty), "q8", "q8k", "q8v" (scheme
        "rows"), "q8:cmf", "q8k:cmf" or "q8v:cmf" (scheme "cmf")."""
        raw = os.environ.get(_ENV, "")
        mode = cls._named(raw)
        if mode is None:
            raise ValueError(f"{_ENV} must be one of {_NAMES_TEXT}, got {raw!r}")
        return mode

    @classmethod
    def parse(cls, value: object, name: str = "mode") -> KvMode:
        """``value`` itself when it is a KvMode, else the mode a name stands for: "f32"
        ("float32"), "q8" (int8 K and V), "q8k" (int8 K), "q8v" (int8 V), each in scheme
        "rows"; with the suffix ":cmf" (e.g. "q8:cmf") in the legacy scheme "cmf" (":rows" is
        also accepted); case-insensitive.

        ValueError for another name, TypeError for another type, both naming ``name``."""
        if isinstance(value, KvMode):
            return value
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a KvMode or a mode name, got "
                            f"{type(value).__name__}")
        mode = cls._named(value) if value.strip() else None
        if mode is None:
            raise ValueError(f"{name}: expected one of {_NAMES_TEXT} (or a KvMode), got "
                             f"{value!r}")
        return mode

    @classmethod
    def _named(cls, text: str) -> KvMode | None:
        """The mode named by ``text`` (the one table of names; "" is f32), or None."""
        val = text.strip().lower()
        if val in ("", "f32", "float32"):
            return cls.F32
        base, sep, scheme = val.partition(":")
        parts = _COMPONENTS.get(base.strip())
        scheme = scheme.strip() if sep else DEFAULT_SCHEME
        if parts is None or scheme not in SCHEMES:
            return None
        return cls.Q8(parts[0], parts[1], scheme)

    @property
    def quant_k(self) -> bool:
        return self._quant_k

    @property
    def quant_v(self) -> bool:
        return self._quant_v

    @property
    def scheme(self) -> str:
        """The int8 scheme: "rows" or "cmf" in q8 modes, "" for F32 (module docstring)."""
        return self._scheme

    @property
    def is_f32(self) -> bool:
        return not (self._quant_k or self._quant_v)

    @property
    def freezes_columns(self) -> bool:
        """Whether a cache in this mode freezes a column field (q8 in scheme "cmf")."""
        return self._scheme == "cmf"

    @property
    def name(self) -> str:
        """The name :meth:`parse` maps to this mode: "f32", "q8", "q8k", "q8v", or one of
        those with ":cmf"."""
        if self.is_f32:
            return "f32"
        base = "q8" if self._quant_k and self._quant_v else ("q8k" if self._quant_k else "q8v")
        return base if self._scheme == DEFAULT_SCHEME else f"{base}:{self._scheme}"

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KvMode is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvMode):
            return NotImplemented
        return ((self._quant_k, self._quant_v, self._scheme)
                == (other._quant_k, other._quant_v, other._scheme))

    def __hash__(self) -> int:
        return hash(("KvMode", self._quant_k, self._quant_v, self._scheme))

    def __repr__(self) -> str:
        if self.is_f32:
            return "KvMode.F32"
        extra = "" if self._scheme == DEFAULT_SCHEME else f", scheme={self._scheme!r}"
        return f"KvMode.Q8(k={self._quant_k}, v={self._quant_v}{extra})"

    def __reduce__(self) -> tuple[type[KvMode], tuple[bool, bool, str]]:
        return (KvMode, (self._quant_k, self._quant_v, self._scheme or DEFAULT_SCHEME))


def _check_scheme(scheme: object) -> str:
    """``scheme`` when it is one of :data:`SCHEMES`, else ValueError (TypeError for a
    non-string) naming it."""
    if not isinstance(scheme, str):
        raise TypeError(f"scheme: expected one of {', '.join(map(repr, SCHEMES))}, got "
                        f"{type(scheme).__name__}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme: expected one of {', '.join(map(repr, SCHEMES))}, got "
                         f"{scheme!r}")
    return scheme


KvMode.F32 = KvMode(False, False)
