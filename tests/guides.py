"""The user docs as tests read them: the README and the guides in docs/, their fenced code blocks and
the prose outside them (shared by tests/unit/test_docs.py and tests/functional/test_guide_commands.py)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The README and every guide: what a user reads (CHANGELOG.md is history, not a guide).
USER_DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(?P<fence>```+|~~~+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)


def fenced_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced code blocks of ``language`` (```bash, ```python), in order."""
    return [m["body"] for m in FENCE.finditer(text) if m["info"].strip().split(" ")[0] == language]


def without_fences(text: str) -> str:
    """``text`` with every fenced code block blanked (line numbers kept): its headings and prose."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and with inline code spans blanked: where links are read."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", lambda m: " " * len(m.group(0)), without_fences(text))
