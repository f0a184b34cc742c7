"""`kb` commands run in-process as a user types them, for tests that drive the CLI."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pipelines.cli import main


def kb(*args: str, expect: int = 0) -> str:
    """The command's stdout; a usage error's (exit 2) line is on stderr, so then its whole output."""
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result.output if expect == 2 else result.stdout


def ingest(*args: str, expect: int = 0) -> dict:
    """`kb ingest ... --json`: the run's summary."""
    return json.loads(kb("ingest", *args, "--json", expect=expect))
