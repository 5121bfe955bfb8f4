"""`python -m sidecar` and the `sidecar` command are one CLI (issue 56): every subcommand the
command has, the module has (once, `python -m sidecar replay` answered "invalid choice")."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sidecar", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_python_m_sidecar_is_the_sidecar_command():
    from api.cli import parser

    commands = parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"serve", "replay", "plan", "pin", "evict", "warm"} <= set(commands)
    for name in commands:
        got = run(name, "--help")
        assert got.returncode == 0, (name, got.stderr[-500:])
        assert f"usage: sidecar {name}" in got.stdout
    assert run("no-such-command").returncode == 2
