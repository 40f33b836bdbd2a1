"""How the `ditsp` program ends (``ditsp.cli.run``/``fast_exit``): the command's code, its output flushed,
exit handlers run and non-daemon threads joined, without the interpreter's teardown (0.6-1 s of torch's
modules after every `ditsp upscale`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

_PROGRAM = """
import atexit, sys, threading, time
from ditsp.cli import fast_exit
atexit.register(lambda: print("handler ran", flush=True))
t = threading.Thread(target=lambda: (time.sleep(0.3), print("thread done")))
t.start()
sys.stdout.write("buffered, no newline ")
sys.stderr.write("err text")
fast_exit(int(sys.argv[1]) if sys.argv[1] != "None" else None)
print("never")
"""


@pytest.mark.parametrize("code,expected", [(0, 0), (3, 3), (None, 0)])
def test_fast_exit_keeps_the_code_the_output_the_handlers_and_the_threads(code, expected):
    out = subprocess.run([sys.executable, "-c", _PROGRAM, str(code)], capture_output=True, text=True, timeout=60)
    assert out.returncode == expected
    assert out.stdout.split("\n")[:3] == ["buffered, no newline thread done", "handler ran", ""]
    assert out.stderr == "err text"


def test_the_program_entry_is_run_and_exits_with_the_command_code():
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "ditsp"]
    assert script.value == "ditsp.cli:run"
    bad = subprocess.run([sys.executable, "-c", "from ditsp.cli import run; run(['plan', '--model', 'nope'])"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nope" in bad.stderr
