"""What the command line tells a user agrees with the code: a flag's help names only flags its own command
has, and `ditsp doctor` names the kernel policy's default as ditsp.fixed_shape sets it."""

from __future__ import annotations

import argparse
import re

import pytest

from ditsp.cli import build_parser
from ditsp.fixed_shape import DEFAULT_DETERMINISTIC, SERVE_DETERMINISTIC
from ditsp.fixed_shape_probe import format_probe


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, bench's benchmarks included, by its command line."""
    out = {}

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        out[name] = p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    walk(sub, f"{name} {sub_name}")

    walk(build_parser(), "ditsp")
    return out


PARSERS = parsers()
# A help text that names a flag its command lacks; the owner of the text fixes it, then this entry goes.
KNOWN: dict[str, str] = {}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_a_flags_help_names_only_its_own_commands_flags(command, request):
    if command in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN[command]))
    parser = PARSERS[command]
    own = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:
        named = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", action.help or ""))
        assert named <= own, f"`{command} {action.option_strings}`'s help names {sorted(named - own)}, " \
                             f"which `{command}` does not have"


def test_doctor_names_the_default_policy_as_it_is():
    result = {"model": "tiny", "cpu": "CPU capability usage: AVX2", "threads": 1, "cpu_malloc": "reuse",
              "checks": [], "holds": True}
    verdict = next(line for line in format_probe(result).splitlines() if "--deterministic" in line)
    assert ("the default)" in verdict) == DEFAULT_DETERMINISTIC, verdict
    assert ("opt-in" in verdict) == (not DEFAULT_DETERMINISTIC), verdict
    assert ("ditsp serve" in verdict) == (SERVE_DETERMINISTIC and not DEFAULT_DETERMINISTIC), verdict
