"""The constraints an image installs through, from ``.ci/constraints.txt``.

An NVIDIA PyTorch container brings its own builds of torch, triton, Transformer Engine and the CUDA
libraries, and pins every package it ships in its own constraint file (``/etc/pip/constraint.txt``,
applied to every ``pip install``). This script writes ``.ci/constraints.txt`` without the packages
the container builds itself, and removes from the container's file the packages ours pin, so that
the rest installs at the versions the suite passed with and the two files never disagree::

    python docker/constraints.py .ci/constraints.txt /tmp/constraints.txt --base /etc/pip/constraint.txt
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

# The container's own builds: replacing them from PyPI would drop its CUDA stack.
CONTAINER_BUILDS = re.compile(r"^(torch|triton|pytorch-triton|transformer-engine(-.+)?|nvidia-.+)$")


def package(line: str) -> str | None:
    """The normalized project name a requirement line pins (``Flask==3.1.3`` -> ``flask``), or None
    for a comment, a blank line or an option."""
    text = line.split("#", 1)[0].strip()
    if not text or text.startswith("-"):
        return None
    name = re.split(r"[\s;\[<>=!~@]", text, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def ours(lines: list[str]) -> list[str]:
    """The pins of ``lines`` (.ci/constraints.txt) the image installs through: all but the
    container's own builds."""
    return [
        line for line in lines if (name := package(line)) is not None and not CONTAINER_BUILDS.match(name)
    ]


def base_without(base: list[str], pinned: list[str]) -> list[str]:
    """The container's constraint lines without the packages ``pinned`` names (comments kept)."""
    names = {package(line) for line in pinned}
    return [line for line in base if package(line) not in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("constraints", type=Path, help="the project's pins (.ci/constraints.txt)")
    parser.add_argument("output", type=Path, help="the constraints to install through")
    parser.add_argument("--base", type=Path, help="the container's own constraint file, edited in place")
    args = parser.parse_args(argv)
    pinned = ours(args.constraints.read_text().splitlines())
    args.output.write_text("\n".join(pinned) + "\n")
    if args.base is not None and args.base.exists():
        args.base.write_text("\n".join(base_without(args.base.read_text().splitlines(), pinned)) + "\n")
    print(f"{args.output}: {len(pinned)} pins")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
