"""The README's quick start is the contract: exactly two set-up commands, and CI runs the test one."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("pip install")]


def test_quick_start_has_exactly_two_setup_commands():
    commands = quick_start_commands()
    assert len(commands) == 2
    assert commands[0].endswith("python launch.py")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci_script = (ROOT / ".ci" / "run").read_text()
    assert quick_start_commands()[1] in ci_script.splitlines()
