"""Environment variables set for the duration of a block: what processes started inside it inherit."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Mapping


@contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` inside the block (ranks and workers spawned there inherit them);
    every variable is as it was once the block ends, unset ones unset again."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
