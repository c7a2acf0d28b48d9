"""``automodel check-gpu``: its exit code and reason without CUDA, its checks run against the TE
stand-in on CPU, and its comparison failing on a wrong result."""

from __future__ import annotations

import pytest
import torch

from automodel.attention import check_gpu, check_kit


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_prints_why_and_exits_2(capsys):
    assert check_gpu.main([]) == check_gpu.EXIT_UNAVAILABLE == 2
    out = capsys.readouterr().out
    assert "check-gpu: cannot run here: no CUDA device is available" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_cuda_exits_2_even_with_te_importable(te_standin, capsys):
    assert check_gpu.main(["--seed", "3"]) == check_gpu.EXIT_UNAVAILABLE
    assert "no CUDA device" in capsys.readouterr().out


def test_checks_pass_against_the_standin_on_cpu(te_standin):
    # The same code path as on a GPU, with the stand-in's reference math in place of TE's kernels.
    # Shorter length mixes than on a GPU, to keep the dense reference quick on CPU.
    mixes = [("one sequence", [100]), ("length mix", [7, 30, 1, 19])]
    cpu = torch.device("cpu")
    results = check_gpu.te_vs_portable(cpu, seed=0, length_mixes=mixes) + check_gpu.cp_indices(cpu, mixes)
    assert len(results) == 2 * 2 * 2 + 2 * 3  # (mixes x padding x heads) + (mixes x cp sizes)
    assert all(r.passed for r in results), check_kit.format_table(results)
    assert {r.check for r in results} == {"te vs portable", "cp indices"}
    assert any("padded" in r.case and "heads 8/2" in r.case for r in results)


def test_compare_fails_outside_tolerance_and_on_nan():
    want = {"out": torch.ones(4, 2)}
    assert check_kit.compare("c", "case", {"out": torch.ones(4, 2) * 1.02}, want, 2.5e-2).passed
    assert not check_kit.compare("c", "case", {"out": torch.ones(4, 2) * 1.06}, want, 2.5e-2).passed
    nan = torch.ones(4, 2)
    nan[1, 1] = float("nan")
    assert not check_kit.compare("c", "case", {"out": nan}, want, 2.5e-2).passed


def test_table_marks_failures():
    results = [
        check_kit.CheckResult("te vs portable", "a", True, "ok"),
        check_kit.CheckResult("cp indices", "b", False, "mismatched ranks [1]"),
    ]
    table = check_kit.format_table(results)
    assert "PASS  te vs portable" in table and "FAIL  cp indices" in table
    assert table.endswith("1 passed, 1 failed")


def test_tolerances_are_tes():
    assert check_kit.bf16_tolerance(8, 8) == 2.5e-2
    assert check_kit.bf16_tolerance(8, 2) == 3.5e-2


def test_varlen_cp_row_passes_against_the_standin_on_cpu(varlen_kernel):
    """check-gpu's "varlen cp vs varlen" row, 2 ranks simulated in one process, with torch's kernel
    replaced by the CPU stand-in of its 2.13 signature (which honours cu_seqlens_q/k bottom-right)."""
    from automodel.attention.check_varlen import varlen_cp_vs_varlen

    calls = varlen_kernel("2.13")
    results = varlen_cp_vs_varlen(torch.device("cpu"), seed=0, length_mixes=[("length mix", [7, 30, 1, 19])])
    assert len(results) == 2 * 2 * 2  # padding x heads x windows
    assert all(r.passed for r in results), check_kit.format_table(results)
    assert {r.check for r in results} == {"varlen cp vs varlen"}
    # per simulated rank a call with 2 query chunks per sequence against longer key prefixes
    cp_calls = [c for c in calls if c["max_k"] > c["max_q"]]
    assert len(cp_calls) == 2 * len(results)
