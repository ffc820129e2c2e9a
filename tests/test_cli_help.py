"""Every `swarm-*` command answers --help with status 0 and at least one example."""

from __future__ import annotations

import configparser
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def console_scripts() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    entries = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in entry.split("=")) for entry in entries)


@pytest.mark.parametrize("command", sorted(console_scripts()))
def test_help_exits_zero_and_names_an_example(command, capsys, monkeypatch):
    # in this process (each command's own interpreter start is exercised by the tests that run it)
    module, function = console_scripts()[command].split(":")
    monkeypatch.setattr(sys, "argv", [command, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        getattr(importlib.import_module(module), function)()
    output = capsys.readouterr().out
    assert exit_info.value.code in (0, None), capsys.readouterr().err
    assert "example" in output.lower(), output
    assert command in output


@pytest.mark.swarm
def test_arguments_can_come_from_a_file(tmp_path):
    args = tmp_path / "plan.args"
    args.write_text("place\n--algo\npetals\n")
    problem = '{"model": {"num_blocks": 2, "block_bytes": 1, "cache_bytes": 1, "hidden_size": 8}, '
    problem += '"servers": [{"name": "a", "memory_bytes": 1e10, "tau": 0.01}]}'
    result = subprocess.run(
        [sys.executable, "-m", "llm_swarm.scheduler.plan.cli", f"@{args}"],
        input=problem,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert '"placement"' in result.stdout
