"""KvMode: the storage precision of a layer's K and V rows (``docs/numerics.md``, int8 storage)."""

from __future__ import annotations

import os

__all__ = ["KvMode"]

_ENV = "KVCACHE_KV"


class KvMode:
    """Storage precision of a cache: plain float32 rows, or int8 rows for K and/or V.

    Use the constructors, not the class: ``KvMode.F32``, ``KvMode.Q8(k=True, v=True)``,
    ``KvMode.from_env()``.  Modes are immutable, hashable and equal by value.

    Attributes
    ----------
    quant_k, quant_v : bool
        Whether K (resp. V) rows are stored as int8.
    """

    __slots__ = ("_quant_k", "_quant_v")
    _quant_k: bool
    _quant_v: bool

    F32: KvMode  # set below

    def __init__(self, quant_k: bool = False, quant_v: bool = False) -> None:
        object.__setattr__(self, "_quant_k", bool(quant_k))
        object.__setattr__(self, "_quant_v", bool(quant_v))

    @classmethod
    def Q8(cls, k: bool = True, v: bool = True) -> KvMode:
        """int8 storage for K (``k``) and/or V (``v``); at least one must be set."""
        if not (k or v):
            raise ValueError("KvMode.Q8 needs k or v set: Q8(k=False, v=False) stores nothing as "
                             "int8; use KvMode.F32")
        return cls(bool(k), bool(v))

    @classmethod
    def from_env(cls) -> KvMode:
        """Read ``KVCACHE_KV``: "f32" (default when unset or empty), "q8", "q8k" or "q8v"."""
        raw = os.environ.get(_ENV, "")
        mode = cls._named(raw)
        if mode is None:
            raise ValueError(f"{_ENV} must be one of 'f32', 'q8', 'q8k', 'q8v', got {raw!r}")
        return mode

    @classmethod
    def parse(cls, value: object, name: str = "mode") -> KvMode:
        """``value`` itself when it is a KvMode, else the mode a name stands for: "f32"
        ("float32"), "q8" (int8 K and V), "q8k" (int8 K), "q8v" (int8 V), case-insensitive.

        ValueError for another name, TypeError for another type, both naming ``name``."""
        if isinstance(value, KvMode):
            return value
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a KvMode or a mode name, got "
                            f"{type(value).__name__}")
        mode = cls._named(value) if value.strip() else None
        if mode is None:
            raise ValueError(f"{name}: expected 'f32', 'q8', 'q8k' or 'q8v' (or a KvMode), got "
                             f"{value!r}")
        return mode

    @classmethod
    def _named(cls, text: str) -> KvMode | None:
        """The mode named by ``text`` (the one table of names; "" is f32), or None."""
        val = text.strip().lower()
        if val in ("", "f32", "float32"):
            return cls.F32
        if val in ("q8", "q8_2f"):
            return cls.Q8(True, True)
        if val == "q8k":
            return cls.Q8(True, False)
        if val == "q8v":
            return cls.Q8(False, True)
        return None

    @property
    def quant_k(self) -> bool:
        return self._quant_k

    @property
    def quant_v(self) -> bool:
        return self._quant_v

    @property
    def is_f32(self) -> bool:
        return not (self._quant_k or self._quant_v)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("KvMode is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvMode):
            return NotImplemented
        return (self._quant_k, self._quant_v) == (other._quant_k, other._quant_v)

    def __hash__(self) -> int:
        return hash(("KvMode", self._quant_k, self._quant_v))

    def __repr__(self) -> str:
        if self.is_f32:
            return "KvMode.F32"
        return f"KvMode.Q8(k={self._quant_k}, v={self._quant_v})"

    def __reduce__(self) -> tuple[type[KvMode], tuple[bool, bool]]:
        return (KvMode, (self._quant_k, self._quant_v))


KvMode.F32 = KvMode(False, False)
