"""argparse types and checks shared by the commands and the benchmarks: a bad value is one line on stderr
before any work."""

from __future__ import annotations

import argparse
import os


def _number(kind, text: str, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    v = _number(int, text, "an integer >= 1")
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return v


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    v = _number(int, text, "an integer >= 0")
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return v


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    v = _number(float, text, "a number > 0")
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def nonneg_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    v = _number(float, text, "a number >= 0")
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def finite_float(text: str) -> float:
    """argparse type: a finite number (no inf, no nan)."""
    v = _number(float, text, "a finite number")
    if not abs(v) < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return v


MIN_TIMEOUT_S = 1.0  # below this a rank cannot even reach the rendezvous store (a 0 ms connect timeout)


def timeout_seconds(text: str) -> float:
    """argparse type: a stuck-rank timeout, a finite number of seconds >= :data:`MIN_TIMEOUT_S`."""
    v = _number(float, text, f"a number of seconds >= {MIN_TIMEOUT_S:g}")
    if not MIN_TIMEOUT_S <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= {MIN_TIMEOUT_S:g}, got {text!r}")
    return v


def positive_int_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 1 (e.g. ``2,4``), at least one."""
    items = [v.strip() for v in text.split(",")]
    if not text.strip() or any(not v for v in items):
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 (e.g. 2,4), got {text!r}")
    return [_list_item(v, text) for v in items]


def rank_numbers(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated finite numbers > 0, one per rank in rank order (e.g. ``32,24``); the
    count is checked against the SP degree by the command."""
    from .windows.capacity import parse_list  # local: argtypes loads with every command

    try:
        return parse_list(text, "expected")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("expected: ")) from None


def _list_item(v: str, text: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers >= 1 (e.g. 2,4), got {text!r}")
    return n


def choice_list(choices) -> callable:
    """argparse type: a comma-separated subset of ``choices`` (names checked up front)."""
    allowed = list(choices)

    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",")]
        bad = [v for v in names if v not in allowed]
        if not text.strip() or bad:
            raise argparse.ArgumentTypeError(
                f"unknown name(s) {', '.join(map(repr, bad)) or repr(text)}; choose from {', '.join(allowed)}")
        return list(dict.fromkeys(names))

    return parse


def check_layers(parser: argparse.ArgumentParser, layers: int | None, model: str, strict: bool = False) -> None:
    """``--layers`` must be >= 1 and, when ``strict`` (weights from a checkpoint), at most the preset's."""
    # the preset table imports the DiT (torch modules): not at the start of every command
    from .models.seedvr2.nadit.config import PRESETS

    if layers is None:
        return
    if layers < 1:
        parser.error(f"--layers must be >= 1, got {layers}")
    preset = PRESETS[model].num_layers if model in PRESETS else None
    if strict and preset is not None and layers > preset:
        parser.error(f"--layers {layers}: {model} has {preset} layers (a checkpoint cannot supply more)")


def check_output_file(parser: argparse.ArgumentParser, path: str | None, flag: str) -> None:
    """The folder of an output file must exist and be writable (checked before any work)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        parser.error(f"{flag} {path}: folder {folder} is not writable")
    if os.path.isdir(path):
        parser.error(f"{flag} {path}: is a folder, not a file")


def check_output_folder(parser: argparse.ArgumentParser, path: str, flag: str) -> None:
    """An output folder: created now (before any work) if missing; one line if that fails."""
    if os.path.exists(path) and not os.path.isdir(path):
        parser.error(f"{flag} {path}: exists and is not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        parser.error(f"{flag} {path}: cannot create the folder ({e.strerror or e})")
    if not os.access(path, os.W_OK):
        parser.error(f"{flag} {path}: folder is not writable")
