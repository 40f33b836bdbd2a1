"""The few ComfyUI services the nodes use, looked up when used (so the nodes import without ComfyUI).

- ``folder_paths``: the model folders the loader lists and resolves (DiT files in ``diffusion_models``,
  VAE files in ``vae``);
- ``comfy.utils.ProgressBar``: the node's progress bar;
- ``comfy.model_management``: its interrupt flag (read while a job runs; the job's own exception is
  raised once the ranks have stopped) and ``unload_all_models`` (ComfyUI's "unload models"), which
  also stops the ranks of every loaded model.

Without ComfyUI each degrades to nothing: no folders, no bar, never interrupted.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

DIT_FOLDER = "diffusion_models"
VAE_FOLDER = "vae"
log = logging.getLogger("ditsp.comfyui")
NONE = "(none)"  # the loader's choice for "no file": the model's shipped weights, or seeded random ones


def _module(name: str):
    try:
        return __import__(name, fromlist=["_"])
    except ImportError:
        return None


def model_files(folder: str) -> list[str]:
    """The files of one of ComfyUI's model folders, with :data:`NONE` first."""
    fp = _module("folder_paths")
    if fp is None:
        return [NONE]
    try:
        return [NONE] + sorted(fp.get_filename_list(folder))
    except KeyError:  # a ComfyUI without that folder kind
        return [NONE]


def model_path(folder: str, name: str | None) -> str | None:
    """The full path of ``name`` in ``folder`` (None for :data:`NONE`); ValueError (one line) if missing."""
    if not name or name == NONE:
        return None
    fp = _module("folder_paths")
    path = fp.get_full_path(folder, name) if fp is not None else None
    if not path:
        raise ValueError(f"{name}: not found in ComfyUI's {folder} folder")
    return path


def progress_bar(total: int):
    """ComfyUI's progress bar of the running node (None outside ComfyUI)."""
    utils = _module("comfy.utils")
    return utils.ProgressBar(total) if utils is not None else None


def interrupted() -> bool:
    """Whether ComfyUI was asked to stop the running prompt (the flag is left set: see raise_interrupt)."""
    mm = _module("comfy.model_management")
    return bool(mm is not None and mm.processing_interrupted())


def raise_interrupt() -> None:
    """Raise ComfyUI's own interrupt exception (and clear its flag), as its nodes do; a plain one outside."""
    mm = _module("comfy.model_management")
    if mm is not None:
        mm.throw_exception_if_processing_interrupted()
    raise InterruptedError("interrupted")


_unload_hooks: list[Callable[[], None]] = []


def on_unload(fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever ComfyUI unloads its models (``unload_all_models``), before ComfyUI's own work
    (once per ``fn``, however often registered). ComfyUI's function is wrapped once; the wrapper calls the
    original whatever a hook does."""
    if fn not in _unload_hooks:
        _unload_hooks.append(fn)
    mm = _module("comfy.model_management")
    if mm is None or getattr(mm.unload_all_models, "_ditsp_hooks", None) is _unload_hooks:
        return
    original = mm.unload_all_models

    @functools.wraps(original)
    def unload_all_models(*args, **kwargs):
        for hook in list(_unload_hooks):
            try:
                hook()
            except Exception:  # noqa: BLE001 - ComfyUI's own unloading goes on
                log.exception("ditsp: stopping the ranks on unload failed")
        return original(*args, **kwargs)

    unload_all_models._ditsp_hooks = _unload_hooks
    mm.unload_all_models = unload_all_models
