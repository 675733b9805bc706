"""The README is an entrance, and true of the code: at most `MAX_LINES` lines, every relative link
resolves to a file, every `shadow COMMAND` it names is a sub-command of the real CLI parser, and
every `--flag` it names is accepted by the parser of the command it is written with (a flag alone,
outside any command, by some `shadow` parser; flags of other programs are listed in
`FOREIGN_FLAGS` with the program they belong to)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from shadow.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 300

#: Flags the README names that belong to other programs, each with its program.
FOREIGN_FLAGS: dict[str, str] = {
    "--vllm-pd-disaggregation": "vllm-router",
    "--decoder-hosts": "the vllm-ascend P/D proxy",
    "--decoder-ports": "the vllm-ascend P/D proxy",
    "--max-num-seqs": "vllm serve",
}

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
LINK = re.compile(r"\]\(([^)]+)\)")
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:  # argparse offers no public walk of its tree
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of the verbs below it (`shadow dashboards build`)."""
    opts = {o for action in parser._actions for o in action.option_strings}
    for sub in _subparsers(parser).values():
        opts |= _options(sub)
    return opts


CLI = build_parser()
COMMANDS = _subparsers(CLI)
ALL_OPTIONS = set().union(*(_options(p) for p in COMMANDS.values())) | _options(CLI)


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _commands_in(text: str) -> Iterator[tuple[str, list[str], str]]:
    """Each shell command in `text`: (program, the words after it, its text); `a && b | c` are three."""
    text = text.replace("\\\n", " ").replace("\\|", "|")
    for line in text.splitlines():
        line = "" if line.lstrip().startswith("#") else line.split(" #", 1)[0]
        for part in re.split(r"&&|\|\||;|(?<!\w)\|(?!\w)", line):
            words = part.split()
            if words:
                yield words[0].rsplit("/", 1)[-1], words[1:], part


def _spans() -> Iterator[tuple[str | None, str]]:
    """(the `shadow` command a table row is about or None, text) for every code block and span."""
    text = _text()
    yield from ((None, block) for block in FENCE.findall(text))
    for line in FENCE.sub("", text).splitlines():
        row = re.match(r"\|\s*`shadow (\w+)", line)
        for span in SPAN.findall(line):
            yield (row.group(1) if row else None), span


def _named() -> tuple[list[tuple[str, list[str]]], list[tuple[str | None, str]]]:
    """The `shadow` commands named (command, its flags) and the flags named alone (row, flag)."""
    commands: list[tuple[str, list[str]]] = []
    alone: list[tuple[str | None, str]] = []
    for row, span in _spans():
        if span.lstrip().startswith("```") and not span.lstrip().startswith("```bash"):
            alone.extend((None, f) for f in FLAG.findall(span))  # a picture, not a shell
            commands.extend((c, []) for c in re.findall(r"\bshadow ([a-z]+)", span))
            continue
        for program, words, part in _commands_in(span):
            if program == "shadow" and words and not words[0].startswith("-"):
                commands.append((words[0], FLAG.findall(" ".join(words))))
            elif program == "shadow" or program.startswith("--"):
                alone.extend((row, f) for f in FLAG.findall(part))
            # else: another program's command line, whose flags are its own
    return commands, alone


def test_readme_has_at_most_max_lines() -> None:
    n = len(_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, more than {MAX_LINES}: move depth to docs/"


def test_every_relative_link_resolves_to_a_file() -> None:
    broken = []
    for target in LINK.findall(_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"README.md links to missing files: {broken}"


def test_the_readme_names_commands_and_flags_at_all() -> None:
    commands, alone = _named()
    assert {c for c, _ in commands} >= {"demo", "tap", "serve", "replay"}
    assert len(alone) > 5


def test_every_shadow_command_named_exists() -> None:
    commands, _ = _named()
    missing = sorted({c for c, _ in commands if c not in COMMANDS})
    assert not missing, f"README.md names `shadow` commands the CLI does not have: {missing}"


def test_every_flag_named_with_a_command_is_that_commands() -> None:
    commands, _ = _named()
    wrong = sorted(
        {f"shadow {c} {f}" for c, flags in commands if c in COMMANDS for f in flags}
        - {f"shadow {c} {f}" for c, flags in commands if c in COMMANDS for f in _options(COMMANDS[c])}
    )
    assert not wrong, f"README.md names flags these commands do not accept: {wrong}"


def test_every_flag_named_alone_exists() -> None:
    _, alone = _named()
    wrong = sorted(
        {
            f"{row or 'any command'}: {f}"
            for row, f in alone
            if f not in FOREIGN_FLAGS
            and f not in (_options(COMMANDS[row]) if row in COMMANDS else ALL_OPTIONS)
        }
    )
    assert not wrong, f"README.md names flags no `shadow` parser accepts: {wrong}"


@pytest.mark.parametrize("flag", sorted(FOREIGN_FLAGS))
def test_foreign_flags_are_not_shadows_own(flag: str) -> None:
    """A flag listed as another program's must not be one of shadow's (else it needs no listing)."""
    assert flag not in ALL_OPTIONS, f"{flag} is a shadow flag: drop it from FOREIGN_FLAGS"
    assert flag in _text(), f"{flag} ({FOREIGN_FLAGS[flag]}) is no longer in README.md: drop it"


def test_every_verb_named_exists() -> None:
    """`shadow dashboards build|push`: each verb of a command that has verbs is one of them."""
    wrong = []
    for _, span in _spans():
        for program, words, _ in _commands_in(span):
            if program != "shadow" or not words or words[0] not in COMMANDS:
                continue
            verbs = _subparsers(COMMANDS[words[0]])
            if verbs and len(words) > 1 and not words[1].startswith("-"):
                wrong += [f"shadow {words[0]} {v}" for v in words[1].split("|") if v not in verbs]
    assert not wrong, f"README.md names verbs the CLI does not have: {wrong}"
