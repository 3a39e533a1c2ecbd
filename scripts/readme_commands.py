"""Print README.md's set-up command N (1: install and run the main job; 2: install and run the tests).

The README is the one place the two commands are written: `.ci/run` reads them from it with this script and runs
them verbatim, so CI cannot test commands other than the ones a newcomer is told to type. Each command is the
indented line after a marker `<!-- setup-command-N -->`. Standard library only: it runs before anything is
installed.

    python scripts/readme_commands.py 1
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
MARKER = re.compile(r"<!-- setup-command-(\d+) -->")


def setup_commands(readme: Path = README) -> dict[int, str]:
    """{N: command} for every marker in `readme`; a marker not followed by an indented command is an error."""
    lines = readme.read_text().splitlines()
    commands = {}
    for index, line in enumerate(lines):
        match = MARKER.search(line)
        if not match:
            continue
        following = [text for text in lines[index + 1:] if text.strip()][:1]
        if not following or not following[0].startswith("    "):
            raise ValueError(f"{readme}: marker {match.group(0)} is not followed by an indented command")
        commands[int(match.group(1))] = following[0].strip()
    return commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("number", type=int, choices=(1, 2), help="1: the main job; 2: the tests")
    parser.add_argument("--readme", type=Path, default=README, help="the README to read (default: this checkout's)")
    args = parser.parse_args(argv)
    commands = setup_commands(args.readme)
    if args.number not in commands:
        print(f"{args.readme}: no <!-- setup-command-{args.number} --> marker", file=sys.stderr)
        return 1
    print(commands[args.number])
    return 0


if __name__ == "__main__":
    sys.exit(main())
