"""Every command the README and the guides show is true: the ``automodel ...`` lines of their
```bash blocks run in this process through ``automodel.cli.main`` (the imports are paid once), each
document's commands in order, then its ```python blocks, in one working directory for a group of
documents (so a command may use what an earlier one wrote, as a reader's would); training runs are
cut to 1 optimizer step. A command that needs what a CPU test cannot give (a GPU, the network, a big model,
a file of the user's, minutes of CPU, several processes) says so in a trailing ``# needs: <reason>``,
and only its recipe is composed, which checks every key it sets."""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from guides import REPO_ROOT, USER_DOCS, fenced_blocks

from automodel.cli import main
from automodel.config import RECIPES_DIR, load_recipe

# A training run shown in a guide, cut to what proves it runs.
SHRINK = ["trainer.max_steps=1", "trainer.progress_bar=false"]


@dataclass(frozen=True)
class Command:
    doc: str  # the document, relative to the repository
    text: str  # the line as written (continuation lines joined)
    argv: tuple[str, ...]  # what follows ``automodel`` (or ``python -m automodel``)
    needs: str | None  # the reason of a trailing ``# needs: ...``, else None
    exits: int = 0  # a trailing ``# exits N: ...`` shows a refusal: the code it ends with
    shell: bool = False  # a ``printf ... > FILE`` line that writes an example file: run by bash


def shell_lines(block: str) -> list[tuple[str, str]]:
    """``(code, comment)`` for each of the shell's lines of ``block``: a backslash-newline continues a
    line, a newline inside quotes is part of it (``python -c "..."`` over several lines), and a ``#``
    outside quotes that starts a word starts the line's comment."""
    lines, code, comment, quote, i = [], "", None, None, 0
    while i < len(block):
        char = block[i]
        if comment is not None and char != "\n":
            comment += char
        elif quote:
            quote = None if char == quote else quote
            code += char
        elif char in "'\"":
            quote = char
            code += char
        elif block.startswith("\\\n", i):
            code += " "
            i += 1
        elif char == "#" and (not code or code[-1].isspace()):
            comment = ""
        elif char == "\n":
            lines.append((code, (comment or "").strip()))
            code, comment = "", None
        else:
            code += char
        i += 1
    lines.append((code, (comment or "").strip()))
    return [(code, comment) for code, comment in lines if code.strip()]


def automodel_argv(words: list[str]) -> list[str] | None:
    """The arguments after ``automodel`` of one simple command (leading ``NAME=value`` settings
    skipped), or None when the command runs something else."""
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]
    if words and Path(words[0]).name in ("time", "nice"):  # /usr/bin/time -v ..., nice -n 5 ...
        words = words[1:]
        while words and (words[0].startswith("-") or words[0].isdigit()):
            words = words[1:]
    if words and Path(words[0]).name == "automodel":
        return words[1:]
    if len(words) > 2 and Path(words[0]).name in ("python", "python3") and words[1:3] == ["-m", "automodel"]:
        return words[3:]
    return None


def commands(path: Path, root: Path = REPO_ROOT) -> list[Command]:
    """The ``automodel`` commands of the ```bash blocks of ``path``, and the ``printf`` lines that
    write the files they read, in order."""
    found = []
    for block in fenced_blocks(path.read_text(), "bash"):
        for code, comment in shell_lines(block):
            if re.match(r"\s*printf\s.*>\s*[\w./-]+\s*$", code):
                found.append(Command(path.relative_to(root).as_posix(), code.strip(), (), None, shell=True))
                continue
            lexer = shlex.shlex(code, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            words, simple = [], []
            for word in [*lexer, ";"]:
                if word in (";", "&&", "||", "|", "&"):
                    simple.append(words)
                    words = []
                else:
                    words.append(word)
            needs = re.search(r"\bneeds:\s*(.*)", comment)
            exits = re.match(r"exits (\d+)\b", comment)
            for argv in [a for a in map(automodel_argv, simple) if a is not None]:
                reason = needs[1].strip() if needs else None
                found.append(Command(path.relative_to(root).as_posix(), code.strip(), tuple(argv), reason,
                                     int(exits[1]) if exits else 0))  # fmt: skip
    return found


ALL = [command for path in USER_DOCS for command in commands(path)]


def test_every_command_runs_or_says_what_it_needs():
    assert len(ALL) > 60, len(ALL)  # the reader found the guides' commands
    assert [c for c in ALL if c.needs == ""] == []  # a reason after every needs:
    run = {(c.doc, c.argv) for c in ALL if c.needs is None}
    assert ("README.md", ("finetune", "tiny_llama_sft")) in run  # the main job, from the setup line
    assert ("docs/pretraining.md", ("tokenize", "tiny_corpus", "corpus.tokens", "--tokenizer", "tiny",
                                    "--txt-samples", "blocks")) in run  # fmt: skip
    assert sum(c.needs is None for c in ALL) > 30


def test_a_command_line_is_read_as_the_shell_reads_it(tmp_path):
    text = (
        "```bash\n"
        "python3 -m venv .venv && .venv/bin/automodel finetune tiny_llama_sft   # the main job\n"
        "OMP_NUM_THREADS=1 automodel data r 'data.columns={a: b}' \\\n    \"data.split='train[:8]'\" # needs: your file\n"
        "torchrun --nproc-per-node 2 -m automodel finetune r; python -m automodel --version\n"
        "python -m automodel.benchmarks.packing  # not automodel's CLI\n"
        "nice -n 5 automodel bench chat_masks --no-gc  # needs: minutes\n"
        "printf '%s\\n' '{\"text\": \"a\"}' \\\n  '{\"text\": 1}' > rows.jsonl\n"
        "automodel data r data.source=rows.jsonl  # exits 2: line 2 is refused\n"
        "```\n```python\nautomodel finetune r\n```\n"
    )  # fmt: skip
    (tmp_path / "x.md").write_text(text)
    found = [(c.argv, c.needs, c.exits, c.shell) for c in commands(tmp_path / "x.md", root=tmp_path)]
    assert found == [
        (("finetune", "tiny_llama_sft"), None, 0, False),
        (("data", "r", "data.columns={a: b}", "data.split='train[:8]'"), "your file", 0, False),
        (("--version",), None, 0, False),
        (("bench", "chat_masks", "--no-gc"), "minutes", 0, False),
        ((), None, 0, True),
        (("data", "r", "data.source=rows.jsonl"), None, 2, False),
    ]


def run(argv: tuple[str, ...]) -> int:
    if argv[:1] == ("finetune",) and not {"--cfg", "--help", "-h"} & set(argv):
        argv = (*argv, *SHRINK)
    try:
        return main(list(argv))
    except SystemExit as done:  # argparse's --help
        return done.code or 0


def compose(argv: tuple[str, ...]) -> None:
    """Compose the recipe of a command that does not run here: every key it sets is checked."""
    if "finetune" in argv or "data" in argv:
        recipe, *overrides = argv[argv.index("finetune" if "finetune" in argv else "data") + 1 :]
        if (RECIPES_DIR / "llm" / f"{recipe}.yaml").exists():
            load_recipe(recipe, [o for o in overrides if not o.startswith("--")])


# Two groups of documents, each run in order in one directory of its own (a reader who follows the
# guides in one working directory); the objectives' guides apart, so that xdist can run both at once.
OBJECTIVES = {"lora.md", "dpo.md", "distillation.md", "rl.md"}
GROUPS = {
    "front_door_and_data": [p for p in USER_DOCS if p.name not in OBJECTIVES],
    "objectives": [p for p in USER_DOCS if p.name in OBJECTIVES],
}


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    """W&B offline with nothing of the user's: no key, no netrc, its files in tmp_path."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    import wandb

    wandb.teardown()  # W&B reads its settings once per process: the next test would inherit offline mode
    yield
    wandb.teardown()


@pytest.mark.parametrize("group", GROUPS)
def test_the_commands_of_the_guides_run(group, tmp_path, monkeypatch, offline_trackers, capfd):
    work = tmp_path / "work"
    work.mkdir()
    (work / "tests").symlink_to(REPO_ROOT / "tests")  # a reader runs them in a clone: its example files
    monkeypatch.chdir(work)
    done = set()
    for doc in GROUPS[group]:
        for command in commands(doc):
            if command.shell:
                subprocess.run(["bash", "-c", command.text], check=True)
            elif command.needs:
                compose(command.argv)
            elif command.argv not in done:  # the same command again in this directory: the same result
                code = run(command.argv)
                assert code == command.exits, (command.doc, command.text, capfd.readouterr().err[-3000:])
                done.add(command.argv)
        for block in fenced_blocks(doc.read_text(), "python"):
            exec(compile(block, f"{doc.name} (python block)", "exec"), {"__name__": "__guide__"})
    assert len(done) >= 5
