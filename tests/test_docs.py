"""What the READMEs tell a newcomer to run exists: every `kb ...` command they name, and every benchmark module."""

from __future__ import annotations

import importlib.util
import re

import click

from pipelines.cli import main
from pipelines.settings import REPO_ROOT

DOCS = [REPO_ROOT / "README.md", REPO_ROOT / "bench" / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)  # fenced blocks and inline code: what a reader runs
KB_COMMAND = re.compile(r"(?:^|[\s/])kb ((?:[a-z][a-z-]*)(?: [a-z][a-z-]*)?)", re.M)
BENCH_MODULE = re.compile(r"-m (bench\.[a-z_]+)")


def _code(path) -> str:
    return "\n".join(CODE.findall(path.read_text()))


def test_every_kb_command_the_docs_name_exists():
    named = {match for path in DOCS for match in KB_COMMAND.findall(_code(path))}
    assert len(named) >= 8  # the docs name commands at all: the pattern still matches them
    for words in sorted(named):
        first, _, second = words.partition(" ")
        command = main.commands.get(first)
        assert command is not None, f"`kb {first}` is named in the docs and does not exist"
        if isinstance(command, click.Group) and second and not second.startswith("-"):
            assert second in command.commands, f"`kb {words}` is named in the docs and does not exist"


def test_every_benchmark_the_docs_name_exists():
    named = {match for path in DOCS for match in BENCH_MODULE.findall(path.read_text())}
    assert named
    for module in sorted(named):
        assert importlib.util.find_spec(module) is not None, f"`python -m {module}` is named and does not exist"
