"""A shared check for the bad-input tests: a command fails with its one error line and no traceback."""

from __future__ import annotations

from ditsp.cli import main


def fails(capsys, args, code=2) -> str:
    """Run the CLI, expect exit ``code``, return stderr's one error line (no traceback)."""
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    assert rc == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and "Traceback" not in "\n".join(lines)
    return lines[-1]
