"""The README and docs/ stay honest: the README's Python examples run as written, in order, in one
namespace; every `ditsp` and `make` command in a shell block parses; every relative link and anchor
resolves; docs/cli.md names exactly the flags each command has; the README stays a newcomer's page
(at most 500 lines, no test counts to go stale); user docs name no commit and no "this VM"."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
USER_DOCS = [README] + sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 500

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)


def python_blocks() -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == "python"]


def test_readme_has_examples():
    assert len(python_blocks()) >= 5


@pytest.mark.timeout(240)
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_example_runs(index, capsys):
    block = python_blocks()[index]
    exec(compile(block, f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip(), "every example prints what it shows"


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {MAX_README_LINES})"


def test_readme_quotes_no_test_count():
    """Counts of tests go stale with every test added; the README says how to run them instead."""
    counts = re.findall(r"\b\d[\d,]*\s+(?:\w+\s+)?tests?\b", README.read_text())
    assert not counts, f"README.md quotes test counts: {counts}"


# -- commands -------------------------------------------------------------------------------------------


def shell_commands(path: Path) -> list[list[str]]:
    """Each command line of the file's bash blocks as tokens (continuations joined, comments dropped)."""
    out = []
    for lang, body in FENCE.findall(path.read_text()):
        if lang not in ("bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line.removeprefix("$ "), comments=True)
            for part in _split_on(tokens, ("&&", ";", "|")):
                if part:
                    out.append(part)
    return out


def _split_on(tokens: list[str], seps: tuple[str, ...]) -> list[list[str]]:
    parts, cur = [], []
    for t in tokens:
        if t in seps:
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    return parts + [cur]


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", text, flags=re.M))


def documented_commands() -> list[tuple[str, list[str]]]:
    """(file, argv after `ditsp`) for every `ditsp` command in a shell block of the user docs."""
    found = []
    for path in USER_DOCS:
        for tokens in shell_commands(path):
            if "ditsp" in tokens:
                found.append((path.name, tokens[tokens.index("ditsp") + 1:]))
    return found


def test_docs_have_commands():
    files = {name for name, _ in documented_commands()}
    assert {"README.md", "cli.md"} <= files


@pytest.mark.parametrize("where,argv", documented_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_documented_command_parses(where, argv):
    from ditsp.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"{where}: `ditsp {' '.join(argv)}` does not parse: {err.getvalue().strip()}"


def test_documented_make_targets_exist():
    targets = make_targets()
    for path in USER_DOCS:
        for tokens in shell_commands(path):
            if tokens[0] == "make":
                named = [t for t in tokens[1:] if not t.startswith("-") and "=" not in t]
                assert set(named) <= targets, f"{path.name}: `{' '.join(tokens)}`: no such Makefile target"


# -- links ----------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_links_resolve(path):
    for target in links(path):
        if re.match(r"^[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{path.name}: link to {target}: no such heading in {dest.name}"


# -- docs/cli.md against the parser ---------------------------------------------------------------------


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}


def cli_sections() -> dict[str, str]:
    """docs/cli.md's text per command (the section headed "## `ditsp NAME`...")."""
    parts = re.split(r"^## `ditsp (\w[\w-]*)`.*$", CLI_DOC.read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def described_flags(text: str) -> set[str]:
    """The flags a section's tables describe (a row's first cell); prose may name other commands' flags."""
    cells = re.findall(r"^\| ([^|]*) \|", FENCE.sub("", text), flags=re.M)
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", " ".join(cells))) - {"-h", "--help"}


def test_readme_and_cli_doc_cover_every_command():
    from ditsp.commands import COMMANDS

    readme = README.read_text()
    missing = [c for c in COMMANDS if f"`ditsp {c}`" not in readme]
    assert not missing, f"README.md's command line section lacks {missing}"
    assert set(cli_sections()) == set(COMMANDS), "docs/cli.md has one section per command, no other"


def test_cli_doc_names_exactly_each_commands_flags():
    from ditsp.cli import build_parser

    commands = subparsers(build_parser())
    sections = cli_sections()
    for name, sub in commands.items():
        if name == "bench":
            continue
        have, named = flags(sub), described_flags(sections[name])
        assert not have - named, f"docs/cli.md, ditsp {name}: flags not described: {sorted(have - named)}"
        assert not named - have, f"docs/cli.md, ditsp {name}: no such flags: {sorted(named - have)}"


def test_cli_doc_lists_every_benchmark():
    from ditsp.cli import build_parser

    benches = subparsers(subparsers(build_parser())["bench"])
    text = cli_sections()["bench"]
    listed = set(re.findall(r"`ditsp bench ([\w-]+)`", text))
    assert listed == set(benches), f"docs/cli.md's bench table: missing {sorted(set(benches) - listed)}, " \
                                   f"unknown {sorted(listed - set(benches))}"


# -- user docs ------------------------------------------------------------------------------------------

HASH = re.compile(r"(?<![0-9a-f])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])(?:[0-9a-f]{7,12}|[0-9a-f]{40})(?![0-9a-f])")


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: p.name)
def test_user_docs_name_no_commit_and_no_vm(path):
    text = path.read_text()
    assert "this vm" not in text.lower(), f"{path.name} says 'this VM': name the machine"
    hashes = HASH.findall(text)
    assert not hashes, f"{path.name} quotes commit hashes {hashes}: name a date or a results file instead"
