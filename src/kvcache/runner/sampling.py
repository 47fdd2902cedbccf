"""Choosing the next token from a position's logits: greedy, or temperature with a top-p nucleus."""

from __future__ import annotations

import numpy as np

from .._validate import FloatArrayLike

__all__ = ["sample"]


def sample(logits: FloatArrayLike, temperature: float = 0.0, top_p: float = 1.0,
           rng: np.random.Generator | None = None) -> int:
    """One token from ``logits`` (vocab,): greedy at temperature 0, else top-p sampling.

    Greedy ties go to the lowest id.  Otherwise the token is drawn from
    ``softmax(logits / temperature)`` restricted to the smallest set of most likely tokens whose
    mass reaches ``top_p``, renormalised; ``rng`` is a fresh ``default_rng()`` when None."""
    z64 = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        return int(np.argmax(z64))
    z = z64 / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass = np.cumsum(p[order])
    # the smallest set reaching top_p (of the mass as summed, which may end a hair below 1)
    keep = min(int(np.searchsorted(mass, top_p * mass[-1])) + 1, p.size)
    nucleus = order[:keep]
    q = p[nucleus] / p[nucleus].sum()
    rng = np.random.default_rng() if rng is None else rng
    return int(nucleus[rng.choice(keep, p=q)])
