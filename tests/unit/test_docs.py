"""The user docs hold together: every relative link of the README, the guides and the changelog
resolves to a file (and a heading, for ``#anchor``), every guide is in the site's navigation, no user
doc names an issue, the README stays a front page, and its test command is the one CI runs."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import yaml
from guides import REPO_ROOT, USER_DOCS, fenced_blocks, prose, without_fences

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(path: Path) -> set[str]:
    """The anchors a renderer gives the headings of ``path``: Python-Markdown's (the site) and
    GitHub's (the repository view), which differ only in how they treat runs of separators."""
    anchors = set()
    for line in without_fences(path.read_text()).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match[1]).replace("`", "")
        ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
        anchors.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_text).strip().lower()))
        anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text.lower()).strip()))
    return anchors


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path.read_text())) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(paths: list[Path], root: Path = REPO_ROOT) -> list[str]:
    broken = []
    for path in paths:
        for target in relative_links(path):
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{path.relative_to(root)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
                broken.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return broken


def test_every_relative_link_resolves_to_a_file_and_heading():
    docs = [*USER_DOCS, REPO_ROOT / "CHANGELOG.md"]
    assert sum(len(relative_links(p)) for p in docs) > 100  # the reader found the links
    assert broken_links(docs) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "guide.md").write_text("# A guide\n\n## Long samples: `split` -- and `truncate`\n\ntext\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](guide.md#long-samples-split-and-truncate), [github](guide.md#long-samples-split----and-truncate),\n"
        "[top](#a-page), [gone](missing.md), [bad](guide.md#nowhere), `[code](not-a-link.md)`,\n"
        "[web](https://example.com), ![image](picture.png).\n\n# A page\n\n```bash\n# not a heading\n```\n"
    )
    assert broken_links([page], root=tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: guide.md#nowhere (no such heading)",
    ]
    assert heading_anchors(page) == {"a-page"}


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


def test_every_guide_is_in_the_sites_navigation():
    config = yaml.load((REPO_ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    assert config["docs_dir"] == "docs"
    pages = nav_pages(config["nav"])
    assert sorted(pages) == sorted(p.name for p in (REPO_ROOT / "docs").glob("*.md"))
    assert len(pages) == len(set(pages))


ISSUE = re.compile(r"\bissues?[ -]?#?\d+|\bissue\d+|#\d{2,}\b", re.I)


def test_no_user_doc_names_an_issue():
    """Issue numbers are development history: CHANGELOG.md holds it."""
    found = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for path in USER_DOCS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert found == []
    assert [bool(ISSUE.search(t)) for t in ("issue 39's battery", "branch issue38", "(#45)", "an issue with it")] == [
        True, True, True, False,
    ]  # fmt: skip


def test_the_readme_is_a_front_page_and_each_guide_fits_on_a_page():
    lines = {p.relative_to(REPO_ROOT).as_posix(): len(p.read_text().splitlines()) for p in USER_DOCS}
    assert lines.pop("README.md") <= 300
    assert {name: n for name, n in lines.items() if n > 800} == {}


def test_the_readme_test_command_is_what_ci_runs():
    """The README's second command is .ci/run's setup line and its pytest line."""
    readme = (REPO_ROOT / "README.md").read_text()
    setups = [b.strip() for b in fenced_blocks(readme, "bash") if b.startswith("python3 -m venv")]
    (main_job,) = [b for b in setups if "pytest" not in b]
    (tests,) = [b for b in setups if "pytest" in b]
    ci = [line.split("  #")[0].strip() for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()]
    setup = next(line for line in ci if line.startswith("python3 -m venv"))
    pytest = next(line for line in ci if "-m pytest" in line)
    assert tests == f"{setup} && {pytest}"
    assert main_job == f"{setup} && .venv/bin/automodel finetune tiny_llama_sft"
