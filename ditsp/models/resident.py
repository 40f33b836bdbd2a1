"""The one model cache of a rank's process: the model it holds, built on first use.

A rank keeps one model at a time (a model is most of its memory): asking for
another key drops the one it holds before building the next. Both the
`ditsp run` job's DiT (:class:`ditsp.models.seedvr2.job.forward.Engine`) and a restoration's DiT + VAE +
text (:func:`ditsp.models.seedvr2.weights.load`) live here, under keys that
say which they are.
"""

from __future__ import annotations

from typing import Callable, Hashable

_HELD: dict = {}  # at most one entry: key -> the model


def get(key: Hashable, build: Callable[[], object]):
    """The model under ``key``, built by ``build()`` when another one (or none) is held."""
    if key not in _HELD:
        _HELD.clear()  # one model per rank: drop the old one before building the next
        _HELD[key] = build()
    return _HELD[key]


def peek(key: Hashable):
    """The model under ``key`` if held, else None (nothing is built)."""
    return _HELD.get(key)


def put(key: Hashable, model) -> None:
    """Hold ``model`` (built elsewhere, e.g. weights received from a peer rank) under ``key``."""
    _HELD.clear()
    _HELD[key] = model
