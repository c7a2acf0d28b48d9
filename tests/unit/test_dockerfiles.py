"""The Docker images install like CI: through ``.ci/constraints.txt``. No Docker daemon runs here, so
the Dockerfiles are read as text (instructions joined across continuation lines), and the script
that writes the GPU image's constraints runs on files made by hand."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO_ROOT / ".ci" / "constraints.txt"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` for each instruction, continuation lines joined, comments dropped."""
    joined, current = [], ""
    for line in dockerfile.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        joined.append(current.strip())
        current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1]) for text in joined]


def pip_installs(dockerfile: Path) -> list[list[str]]:
    """The argument lists of every ``pip install`` the RUN instructions make."""
    found = []
    for kind, arguments in instructions(dockerfile):
        if kind != "RUN":
            continue
        for command in re.split(r"&&|;", arguments):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"]:
                found.append(words[2:])
    return found


def pinned(name: str) -> str:
    (line,) = [line for line in CONSTRAINTS.read_text().splitlines() if line.startswith(f"{name}==")]
    return line.split("==", 1)[1]


def constraints_script():
    spec = importlib.util.spec_from_file_location(
        "docker_constraints", REPO_ROOT / "docker" / "constraints.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def installs_the_package_through(installs: list[list[str]]) -> list[str]:
    """The ``-c`` files of the pip installs of the package itself (``-e .`` or ``.``)."""
    files = []
    for words in installs:
        if "." in words or "-e" in words and words[words.index("-e") + 1].startswith("."):
            assert "-c" in words, (
                f"the package is installed without constraints: pip install {' '.join(words)}"
            )
            files.append(words[words.index("-c") + 1])
    return files


def test_the_gpu_image_installs_through_the_constraints_on_a_current_base():
    dockerfile = REPO_ROOT / "docker" / "Dockerfile"
    steps = instructions(dockerfile)
    (base,) = [arguments for kind, arguments in steps if kind == "ARG" and arguments.startswith("BASE=")]
    release = re.fullmatch(r"BASE=nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", base)
    assert release and (int(release[1]), int(release[2])) >= (26, 9), base
    assert ("FROM", "${BASE}") in steps
    copied = [arguments.split()[0] for kind, arguments in steps if kind == "COPY"]
    assert ".ci/constraints.txt" in copied and "docker/constraints.py" in copied
    runs = " ".join(arguments for kind, arguments in steps if kind == "RUN")
    # the constraints installed through are the script's output from the project's pins
    assert (
        "python docker/constraints.py .ci/constraints.txt /tmp/constraints.txt --base /etc/pip/constraint.txt"
        in runs
    )
    assert installs_the_package_through(pip_installs(dockerfile)) == ["/tmp/constraints.txt"]
    # nothing in the image replaces the container's torch: no pip install names torch
    assert not any(word.startswith("torch") for words in pip_installs(dockerfile) for word in words)


def test_the_cpu_image_pins_the_ci_torch_and_the_constraints():
    dockerfile = REPO_ROOT / "docker" / "Dockerfile.cpu"
    steps = instructions(dockerfile)
    (base,) = [arguments for kind, arguments in steps if kind == "FROM"]
    assert re.fullmatch(r"python:3\.\d+-slim", base), base
    installs = pip_installs(dockerfile)
    torch_pin = f"torch=={pinned('torch')}"
    assert torch_pin in (REPO_ROOT / ".ci" / "run").read_text()  # the torch CI installs
    (torch_install,) = [words for words in installs if torch_pin in words]
    assert torch_install[torch_install.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert installs.index(torch_install) == 0  # before the package, so pip keeps the CPU build
    assert installs_the_package_through(installs) == [".ci/constraints.txt"]
    assert any(kind == "COPY" and arguments.startswith(".ci/constraints.txt") for kind, arguments in steps)


def test_the_constraints_script_keeps_the_containers_builds_and_removes_its_conflicting_pins(tmp_path):
    script = constraints_script()
    ours = tmp_path / "constraints.txt"
    ours.write_text(
        "# pins\nFlask==3.1.3\ntorch==2.13.0\ntransformer_engine==2.20.2\nnvidia-nccl-cu13==2.28\n"
        "triton==3.5.0\nnumpy==2.4.6\ntyping_extensions==4.16.0\n"
    )
    base = tmp_path / "constraint.txt"
    base.write_text(
        "# container\nnumpy==1.26.4\ntorch==2.14.0a0+nv26.9\ntyping-extensions==4.12.2\nsix==1.16.0\n"
    )
    output = tmp_path / "install.txt"
    assert script.main([str(ours), str(output), "--base", str(base)]) == 0
    assert output.read_text() == "Flask==3.1.3\nnumpy==2.4.6\ntyping_extensions==4.16.0\n"
    assert base.read_text() == "# container\ntorch==2.14.0a0+nv26.9\nsix==1.16.0\n"
    # no container file (another base): only the output is written
    assert script.main([str(ours), str(tmp_path / "again.txt"), "--base", str(tmp_path / "absent.txt")]) == 0
    assert (tmp_path / "again.txt").read_text() == output.read_text()


def test_the_gpu_image_keeps_every_pin_of_ci_but_the_containers_builds():
    script = constraints_script()
    lines = CONSTRAINTS.read_text().splitlines()
    kept = script.ours(lines)
    names = {script.package(line) for line in lines} - {None}
    assert {script.package(line) for line in kept} == names - {"torch"}  # CI pins no triton, TE or nvidia-*
    assert script.package("mlflow-skinny==3.17.2 ; python_version >= '3.10'") == "mlflow-skinny"
    assert script.package("-e .") is None and script.package("  # note") is None
