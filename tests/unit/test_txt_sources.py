"""``.txt`` data files: one ``text`` sample per non-blank line, or per block of lines between blank
lines (``txt_samples="blocks"``), each traced to its file line; a ``.txt`` source needs ``format: text``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from automodel.data.sft_data import DataSource, SFTData
from automodel.data.sources import load_sft_source, txt_rows

TEXT = "The cat sat.\nIt purred.\n\n   \nA new block\n  indented line\n\n\nlast\n"


def test_lines_and_blocks_by_hand(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    assert txt_rows(str(path)) == [(1, "The cat sat."), (2, "It purred."), (5, "A new block"),
                                   (6, "  indented line"), (9, "last")]  # fmt: skip
    assert txt_rows(str(path), "blocks") == [(1, "The cat sat.\nIt purred."), (5, "A new block\n  indented line"),
                                             (9, "last")]  # fmt: skip
    rows, origin = load_sft_source(path, txt_samples="blocks")
    assert rows.column_names == ["text"] and rows["text"][1] == "A new block\n  indented line"
    assert origin(2) == f"{path} line 9"
    rows, origin = load_sft_source(path, split="train[1:]")
    assert (
        rows["text"] == ["It purred.", "A new block", "  indented line", "last"]
        and origin(0) == f"{path} line 2"
    )


def test_a_directory_of_txt_files_and_windows_line_ends(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_bytes(b"one\r\ntwo\r\n")
    (tmp_path / "d" / "b.txt").write_text("three\n")
    rows, origin = load_sft_source(tmp_path / "d")
    assert rows["text"] == ["one", "two", "three"] and origin(2) == f"{tmp_path / 'd' / 'b.txt'} line 1"


def test_bad_txt_input_is_refused_naming_the_field(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    with pytest.raises(ValueError, match=r"data.format='prompt_completion'.*\.txt.*set data.format=text"):
        SFTData(source=str(path))
    with pytest.raises(ValueError, match=r"data.txt_samples='paragraph'.*\('lines', 'blocks'\)"):
        DataSource(source=str(path), format="text", txt_samples="paragraph")
    (tmp_path / "blank.txt").write_text("\n  \n\n")
    with pytest.raises(ValueError, match=r"blank.txt is empty \(no rows, or only whitespace\)"):
        load_sft_source(tmp_path / "blank.txt")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"data.source=.*latin1.txt is not UTF-8"):
        DataSource(source=str(tmp_path / "latin1.txt"), format="text")


LINE = st.text(alphabet=st.sampled_from("ab \t"), max_size=6)


@settings(max_examples=200, deadline=None)
@given(st.lists(LINE, max_size=12))
def test_samples_are_the_non_blank_lines_in_order(tmp_path_factory, lines):
    path = tmp_path_factory.mktemp("txt") / "p.txt"
    path.write_text("".join(line + "\n" for line in lines))
    kept = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not kept:
        with pytest.raises(ValueError, match="has no text"):
            txt_rows(str(path))
        return
    assert txt_rows(str(path)) == kept
    blocks = txt_rows(str(path), "blocks")
    # the blocks hold the same lines in order; each starts after a blank line (or at the top)
    assert [line for _, text in blocks for line in text.split("\n")] == [line for _, line in kept]
    assert all(number == 1 or not lines[number - 2].strip() for number, _ in blocks)
    assert len(blocks) == sum(1 for i, (n, _) in enumerate(kept) if i == 0 or kept[i - 1][0] != n - 1)
