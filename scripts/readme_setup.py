"""Prints one of the README's two set-up commands, so CI runs what the README says and the two cannot drift.

    python3 scripts/readme_setup.py main    # the dry run on the bundled default model
    python3 scripts/readme_setup.py test    # the test command
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def setup_commands(text: str) -> dict[str, str]:
    """The first two bash blocks of the README's "Set up and run" section: the main job, then the tests."""
    section = text.split("## Set up and run", 1)[-1].split("\n## ", 1)[0]
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]
    if len(blocks) < 2 or any("\n" in b for b in blocks[:2]):
        raise SystemExit("README.md: 'Set up and run' must open with two one-line bash blocks (main job, tests)")
    return {"main": blocks[0], "test": blocks[1]}


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    commands = setup_commands(README.read_text())
    if which not in commands:
        raise SystemExit("usage: python3 scripts/readme_setup.py main|test")
    print(commands[which])
