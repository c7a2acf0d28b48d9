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


def test_table_marks_failures_and_skips():
    results = [
        check_kit.CheckResult("te vs portable", "a", True, "ok"),
        check_kit.CheckResult("cp indices", "b", False, "mismatched ranks [1]"),
        check_kit.skip("varlen vs sdpa", "c", "torch 2.10.0's varlen_attn has no window_size"),
    ]
    table = check_kit.format_table(results)
    assert "PASS  te vs portable" in table and "FAIL  cp indices" in table
    assert "SKIP  varlen vs sdpa       c  torch 2.10.0's varlen_attn has no window_size" in table
    assert table.endswith("1 passed, 1 failed, 1 skipped")
    assert not check_kit.all_passed(results) and check_kit.all_passed([results[0], results[2]])


def test_a_case_that_raises_is_a_fail_row_not_a_traceback():
    def boom() -> check_kit.CheckResult:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")

    row = check_kit.guarded("varlen vs sdpa", "x", boom)
    assert (row.status, row.detail) == (
        "FAIL",
        "raised RuntimeError: FlashAttention only support fp16 and bf16 data type",
    )


def test_varlen_rows_on_torch_2_10_skip_the_window_they_cannot_apply(varlen_kernel, monkeypatch):
    """torch 2.10's varlen_attn has no window_size: check-gpu's window rows are SKIP rows naming
    why (they raised a ValueError out of check-gpu before), the other rows run and pass."""
    from automodel.attention.check_varlen import check_varlen_against_reference, varlen_cp_vs_varlen

    calls = varlen_kernel("2.10")
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    cpu = torch.device("cpu")
    mixes = [("length mix", [7, 60, 1, 19])]  # 60 tokens: past the window of 48
    rows = check_varlen_against_reference(cpu, 0, mixes) + varlen_cp_vs_varlen(cpu, 0, length_mixes=mixes)
    assert len(rows) == 2 * 2 * 3 + 2 * 2 * 2, check_kit.format_table(rows)  # padding x heads x windows
    skipped = [r for r in rows if r.skipped]
    assert {r.case.split("window ")[1].split(",")[0] for r in skipped} == {"48", "1"}
    assert all("window None" in r.case and r.passed for r in rows if not r.skipped), check_kit.format_table(
        rows
    )
    assert all(
        r.detail.startswith("torch 2.10.0's varlen_attn has no window_size (torch >= 2.11 has it), so it cannot "
                            "apply sliding_window=") for r in skipped
    )  # fmt: skip
    assert calls and all(c["heads"][1] in (8, 2) for c in calls)  # GQA's 2 key/value heads passed natively


def test_te_rows_name_the_backend_te_selected_and_the_header_its_cudnn(te_standin, monkeypatch):
    cpu = torch.device("cpu")
    rows = check_gpu.te_vs_portable(cpu, seed=0, length_mixes=[("length mix", [7, 30, 1, 19])])
    assert all(r.passed and r.detail.endswith("; FusedAttention (sub-backend 1)") for r in rows)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    header = check_gpu.header(torch.device("cuda", 0), None, rows)
    assert header.startswith(f"check-gpu on NVIDIA H100 80GB HBM3, torch {torch.__version__} (CUDA ")
    assert header.endswith(
        "Transformer Engine 2.20.0+standin (attention FusedAttention (sub-backend 1); cuDNN 9.18.1)"
    )
    assert check_gpu.header(torch.device("cuda", 0), "no TE", []).endswith("Transformer Engine not installed")


def test_te_cp_rows_skip_a_comm_type_older_than_the_installed_te(te_standin, one_process_group, monkeypatch):
    import transformer_engine

    monkeypatch.setattr(transformer_engine, "__version__", "2.17.1")
    rows = check_kit.cp_vs_one_process(
        torch.device("cpu"), 0, torch.distributed.group.WORLD, "te", [("length mix", [7, 30, 1, 19])]
    )
    by_comm = {r.case.split("cp 1 ")[1].split(",")[0]: r for r in rows}
    assert (
        by_comm["all_gather"].skipped
        and "needs Transformer Engine >= 2.18, found 2.17" in by_comm["all_gather"].detail
    )
    assert all(r.passed for comm, r in by_comm.items() if comm != "all_gather"), check_kit.format_table(rows)


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
