"""The varlen backend on CPU: its window convention against transformers' own mask functions, the
arguments it hands torch's varlen op (recorded on meta tensors, where torch runs the op's fake
kernel), the padded-offsets rule against the portable backend, and its setup refusals. The kernel
itself runs in ``check_varlen_against_reference`` on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from automodel.attention import PortableAttention, ThdAttentionMetadata
from automodel.attention.check_varlen import reference_varlen_attention, varlen_reason, window_causal_mask
from automodel.attention.portable import LayerExtras, local_query_attention
from automodel.attention.varlen import (
    VarlenKernel,
    installed_varlen_kernel,
    varlen_attention,
    varlen_cp_layout,
    varlen_local_queries,
    varlen_missing,
    varlen_unsupported,
    varlen_window_size,
)
from automodel.distributed.cp_sharding import thd_get_partitioned_indices
from automodel.models.setup import check_backend_device


def transformers_mask(length: int, window: int | None) -> torch.Tensor:
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return fn(torch.tensor(0), torch.tensor(0), i, j).expand(length, length)


def flash_mask(length: int, window_size: tuple[int, int]) -> torch.Tensor:
    """FlashAttention's (left, right): query i sees keys i - left .. i + right (-1: unbounded)."""
    left, right = window_size
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    mask = j <= i + right
    return mask if left < 0 else mask & (j >= i - left)


@pytest.mark.parametrize("window", [None, 1, 2, 3, 5, 9, 12, 40])
def test_window_convention_is_transformers_sliding_window(window):
    expected = transformers_mask(12, window)
    assert torch.equal(flash_mask(12, varlen_window_size(window)), expected)
    assert torch.equal(window_causal_mask(12, window), expected)


def test_window_of_three_by_hand():
    # Token 4 sees itself and the 2 tokens before it.
    assert varlen_window_size(3) == (2, 0)
    assert window_causal_mask(6, 3)[4].tolist() == [False, False, True, True, True, False]


class RecordOps(TorchDispatchMode):
    """Records the arguments, by schema name, of each call of the op ``name``."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.calls = name, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func.overloadpacket) == self.name:
            schema = func._schema.arguments
            self.calls.append(
                {
                    a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                    for i, a in enumerate(schema)
                }
            )
        return func(*args, **kwargs)


@pytest.mark.parametrize(("heads", "window"), [((4, 4), None), ((4, 2), 5), ((6, 1), 1)])
def test_arguments_reach_torch_varlen_op(heads, window):
    """This torch's own op, run on meta tensors."""
    kernel = installed_varlen_kernel()
    if kernel is None or not kernel.takes_window_size:
        pytest.skip(f"torch {torch.__version__}'s varlen_attn is covered by the stand-in tests")
    h, h_kv = heads
    q = torch.empty(10, h, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.empty(10, h_kv, 64, device="meta", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    with RecordOps("torch_attn._varlen_attn") as forward:
        out = varlen_attention(q, k, v, cu, 6, scale=0.3, window=window)
    with RecordOps("torch_attn._varlen_attn_backward") as backward:
        out.sum().backward()
    assert out.shape == (10, h, 64) and k.grad.shape == k.shape
    (call,) = forward.calls
    assert [call[name] for name in ("query", "cu_seq_q", "cu_seq_k")] == [q, cu, cu]
    assert (call["max_q"], call["max_k"], call["scale"]) == (6, 6, 0.3)
    assert list(call["window_size"]) == list(varlen_window_size(window))
    assert call["is_causal"] == (window is None)
    assert [call["key"], call["value"]] == [k, v]  # fewer key/value heads passed as they are, no repeat
    if kernel.takes_enable_gqa:
        assert call["enable_gqa"] == (h != h_kv)
    (call_backward,) = backward.calls
    assert list(call_backward["window_size"]) == list(call["window_size"])
    assert (call_backward["scale"], call_backward["is_causal"]) == (0.3, call["is_causal"])


def random_qkv(total, h, h_kv, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, n, d, generator=g, dtype=torch.float64) for n in (h, h_kv, h_kv)]


def cumsum(lens):
    return torch.tensor([0, *lens]).cumsum(0).to(torch.int32)


def forward_backward(fn, q, k, v, dout):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("window", [None, 2])
def test_padded_offsets_give_real_lengths_result(window):
    """What the kernel computes when handed the padded offsets (every padded span one causal
    sequence) equals attention on the real lengths: real rows of out, and all of dq, dk, dv when
    the output gradient is 0 on padding rows."""
    real, padded = [5, 0, 3, 7], [8, 2, 3, 8]
    cu_real, cu_padded = cumsum(real), cumsum(padded)
    pad = torch.cat([torch.arange(p) >= r for r, p in zip(real, padded, strict=True)])
    q, k, v = random_qkv(sum(padded), 4, 2)
    dout = torch.randn(q.shape, dtype=torch.float64).masked_fill(pad[:, None, None], 0)
    scale = 0.4

    def kernel_semantics(q, k, v):
        return reference_varlen_attention(q, k, v, cu_padded, cu_padded, scale=scale, window=window)

    def real_lengths(q, k, v):
        return reference_varlen_attention(q, k, v, cu_real, cu_padded, scale=scale, window=window)

    got = forward_backward(kernel_semantics, q, k, v, dout)
    want = forward_backward(real_lengths, q, k, v, dout)
    torch.testing.assert_close(got[0][~pad], want[0][~pad], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if window is None:  # the reference on real lengths is the portable backend's function
        meta = ThdAttentionMetadata(cu_real, cu_padded, max(padded))
        portable = PortableAttention(4, 2, 8, softmax_scale=scale)
        by_portable = forward_backward(lambda q, k, v: portable(q, k, v, meta).view(q.shape), q, k, v, dout)
        torch.testing.assert_close(by_portable[0][~pad], want[0][~pad], rtol=1e-12, atol=1e-12)
        for a, b in zip(by_portable[1:], want[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"softcap": 50.0}, "softcap"),
        ({"sinks": True}, "sinks"),
        ({"head_dim": 100}, "head dim"),
        ({"head_dim": 512}, "head dim"),
        ({"device": "cpu"}, "CUDA"),
        ({"dtype": torch.float32}, "float32"),
    ],
)
def test_unsupported_features_are_named(kwargs, named):
    args = dict(device="cuda", dtype=torch.bfloat16, softcap=None, sinks=False, head_dim=64) | kwargs
    reason = varlen_unsupported(**args)
    assert reason is not None and named in reason and "varlen" in reason


def test_unavailable_here_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert "CUDA" in varlen_reason()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"cu_seqlens": torch.tensor([0, 4, 10])}, "cu_seqlens"),
        ({"max_seqlen": torch.tensor(6)}, "max_seqlen"),
        ({"k": torch.zeros(10, 3, 8), "v": torch.zeros(10, 3, 8)}, "heads"),
        ({"v": torch.zeros(9, 2, 8)}, "q, k, v"),
        ({"k": torch.zeros(9, 2, 8), "v": torch.zeros(9, 2, 8)}, "same tokens"),
        ({"window": 0}, "window"),
    ],
)
def test_bad_arguments_are_refused_before_the_kernel(change, named):
    args = (
        dict(
            q=torch.zeros(10, 4, 8),
            k=torch.zeros(10, 2, 8),
            v=torch.zeros(10, 2, 8),
            cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32),
            max_seqlen=6,
            window=None,
        )
        | change
    )
    with pytest.raises(ValueError, match=named):
        varlen_attention(
            args["q"],
            args["k"],
            args["v"],
            args["cu_seqlens"],
            args["max_seqlen"],
            scale=None,
            window=args["window"],
        )


# ---------------------------------------------------------------------------------------------
# every torch in the declared range: the kernel's signature read once, the call adapted to it


def test_each_releases_signature_is_read():
    import inspect

    import varlen_standin

    flags = {
        version: (kernel.takes_scale, kernel.takes_window_size, kernel.takes_enable_gqa)
        for version, fn in varlen_standin.BY_VERSION.items()
        for kernel in [VarlenKernel.of(fn)]
    }
    gqa = (True, True, True)
    assert flags == {"2.10": (False, False, False), "2.11": (True, True, False), "2.12": gqa, "2.13": gqa,
                     "2.14": gqa, "2.15": gqa}  # fmt: skip
    installed = ".".join(torch.__version__.split(".")[:2])
    if installed in varlen_standin.BY_VERSION:  # the stand-in's signature is the installed release's
        from torch.nn.attention.varlen import varlen_attn

        assert list(inspect.signature(varlen_standin.BY_VERSION[installed]).parameters) == list(
            inspect.signature(varlen_attn).parameters
        )


VERSIONS = ["2.10", "2.11", "2.12", "2.13", "2.14", "2.15"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("heads", "window", "scale"), [((4, 4), None, None), ((4, 2), None, 0.3), ((6, 2), 3, 0.3)]
)
def test_varlen_attention_through_each_signature(varlen_kernel, version, heads, window, scale):
    """Against the stand-in of each release: the per-sequence reference, forward and backward, or,
    where the release cannot apply the window, a refusal naming the torch version. Fewer key/value
    heads reach every release as they are (2.10 and 2.11: FlashAttention-2 takes them natively)."""
    calls = varlen_kernel(version, exact=True)
    h, h_kv = heads
    real, padded = [5, 2, 7], [6, 2, 8]
    cu_real, cu_padded = cumsum(real), cumsum(padded)
    pad = torch.cat([torch.arange(p) >= r for r, p in zip(real, padded, strict=True)])
    q, k, v = random_qkv(sum(padded), h, h_kv)
    dout = torch.randn(q.shape, dtype=torch.float64).masked_fill(pad[:, None, None], 0)

    def run(q, k, v):
        return varlen_attention(q, k, v, cu_padded, max(padded), scale=scale, window=window)

    if version == "2.10" and window is not None:
        with pytest.raises(ValueError, match=r"torch .*varlen_attn has no window_size .*sliding_window=3"):
            run(q, k, v)
        return
    got = forward_backward(run, q, k, v, dout)
    want = forward_backward(
        lambda q, k, v: reference_varlen_attention(q, k, v, cu_real, cu_padded, scale=scale, window=window),
        q, k, v, dout,
    )  # fmt: skip
    torch.testing.assert_close(got[0][~pad], want[0][~pad], rtol=1e-12, atol=1e-12)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    (call,) = calls
    takes_gqa = version not in ("2.10", "2.11")
    assert call["heads"] == (h, h_kv) and call["enable_gqa"] == ((h != h_kv) if takes_gqa else None)
    assert call["scale"] == (scale if version != "2.10" else None)


@pytest.mark.parametrize("version", VERSIONS)
def test_standins_refuse_what_the_kernels_refuse(varlen_kernel, version):
    """float32 (FlashAttention: fp16 and bf16 only), mixed dtypes, int64 offsets; from 2.12 fewer
    key/value heads without enable_gqa, in varlen_attn's own words; 2.15 a scale <= 0."""
    import varlen_standin

    varlen_kernel(version)
    fn = varlen_standin.BY_VERSION[version]
    cu = cumsum([3, 5])
    q, k, v = (torch.zeros(8, n, 16, dtype=torch.bfloat16) for n in (4, 2, 2))
    gqa = {} if version in ("2.10", "2.11") else {"enable_gqa": True}
    with pytest.raises(RuntimeError, match="^FlashAttention only support fp16 and bf16 data type$"):
        fn(q.float(), k.float(), v.float(), cu, cu, 5, 5, **gqa)
    with pytest.raises(RuntimeError, match="query and key must have the same dtype"):
        fn(q, k.half(), v, cu, cu, 5, 5, **gqa)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must have dtype int32"):
        fn(q, k, v, cu.long(), cu, 5, 5, **gqa)
    if version in ("2.10", "2.11"):  # FlashAttention-2 shares key/value heads natively
        assert fn(q, k, v, cu, cu, 5, 5).shape == q.shape
        with pytest.raises(RuntimeError, match="Number of heads in key/value must divide"):
            fn(q, k[:, :1].expand(8, 3, 16), v[:, :1].expand(8, 3, 16), cu, cu, 5, 5)
        return
    with pytest.raises(ValueError, match=r"Hq=4 and Hkv=2\. Try setting enable_gqa=True"):
        fn(q, k, v, cu, cu, 5, 5)
    assert fn(q, k, v, cu, cu, 5, 5, enable_gqa=True).shape == q.shape
    if version == "2.15":
        with pytest.raises(ValueError, match="scale must be greater than 0, got 0.0"):
            fn(q, k, v, cu, cu, 5, 5, enable_gqa=True, scale=0.0)


def test_float32_reaches_flash_and_fails_there(varlen_kernel):
    """Why setup refuses varlen in float32: the kernel fails at the first forward."""
    varlen_kernel("2.11")
    q, k, v = (torch.randn(8, n, 16) for n in (4, 2, 2))
    with pytest.raises(RuntimeError, match="FlashAttention only support fp16 and bf16"):
        varlen_attention(q, k, v, cumsum([3, 5]), 5, scale=None)


def test_torch_2_15_runs_cudnn_only_where_both_alignments_agree(varlen_kernel):
    """2.15 prefers cuDNN (top-left causal) for a causal call with one offsets tensor for q and k:
    the one-process call, where every query sequence is as long as its keys; the context-parallel
    calls (query chunks against longer key prefixes) pass two and stay on FlashAttention."""
    calls = varlen_kernel("2.15")
    real = [5, 2, 7]
    cu = cumsum(real)
    q, k, v = (x.bfloat16() for x in random_qkv(sum(real), 4, 2, d=16))
    out = varlen_attention(q, k, v, cu, max(real), scale=0.3)
    want = reference_varlen_attention(*(x.double() for x in (q, k, v)), cu, cu, scale=0.3)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    layout = varlen_cp_layout([8], 2, 0)
    varlen_local_queries(q[:4], k[:8], v[:8], layout, scale=0.3)
    assert [c["kernel"] for c in calls] == ["cudnn", "flash"]


def test_torch_without_varlen_reports_the_backend_unavailable(varlen_kernel, monkeypatch):
    varlen_kernel("2.9")
    reason = varlen_missing()
    assert "needs torch >= 2.10" in reason and "this is torch 2.9.0" in reason
    args = dict(device="cuda", dtype=torch.bfloat16, softcap=None, sinks=False, head_dim=64)
    assert varlen_unsupported(**args) == reason
    with pytest.raises(ValueError, match=r"model.attention_backend='varlen'.*torch >= 2.10.*torch 2.9.0"):
        check_backend_device("varlen", torch.bfloat16)
    import automodel.attention.backends as backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "te_pytorch", lambda: None)
    assert backends.resolve_attention_backend("auto", compute_dtype=torch.bfloat16) == "portable"


# ---------------------------------------------------------------------------------------------
# context parallelism: per-chunk queries against prefix keys, bottom-right aligned


def test_cp_layout_by_hand():
    # one sequence of 8 tokens over 2 ranks (chunks of 2): rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    rank0, rank1 = varlen_cp_layout([8], 2, 0), varlen_cp_layout([8], 2, 1)
    assert rank0.key_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert rank0.cu_seqlens_q.tolist() == [0, 2, 4] and rank0.cu_seqlens_k.tolist() == [0, 2, 10]
    assert (rank0.max_q, rank0.max_k) == (2, 8)
    assert rank1.key_index.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert rank1.cu_seqlens_k.tolist() == [0, 4, 10] and rank1.cu_seqlens_q.dtype == torch.int32
    # a second sequence's keys start at its own offset; an empty one adds no chunk
    two = varlen_cp_layout([4, 0, 4], 2, 1)
    assert two.key_index.tolist() == [0, 1, 0, 1, 2, 4, 5, 4, 5, 6]
    assert two.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("version", ["2.11", "2.13", "2.15"])
@pytest.mark.parametrize(("cp_size", "window"), [(2, None), (3, None), (2, 3)])
def test_varlen_cp_equals_the_portable_cp_path_and_one_process(varlen_kernel, version, cp_size, window):
    """Every rank's queries through the varlen CP layout (the stand-in honouring cu_seqlens_q/k
    bottom-right) against the portable backend's CP path on the same global keys, and the sum of
    the ranks' key/value gradients against one process: real rows of out, all of dq, dk, dv."""
    varlen_kernel(version, exact=True)
    real = [5, 1, 9, 3]
    padded = [-(-n // (2 * cp_size)) * (2 * cp_size) for n in real]
    cu_real, cu_padded = cumsum(real), cumsum(padded)
    total = sum(padded)
    meta = ThdAttentionMetadata(cu_real, cu_padded, max(padded))
    pad = torch.cat([torch.arange(p) >= r for r, p in zip(real, padded, strict=True)])
    q, k, v = random_qkv(total, 4, 2)
    dout = torch.randn(q.shape, dtype=torch.float64).masked_fill(pad[:, None, None], 0)
    scale = 0.4
    leaves = {name: [x.clone().requires_grad_() for x in (q, k, v)] for name in ("varlen", "portable")}
    for rank in range(cp_size):
        positions = thd_get_partitioned_indices(cu_padded, total, cp_size, rank).long()
        real_rows = ~pad[positions]
        lq, lk, lv = leaves["varlen"]
        layout = varlen_cp_layout(padded, cp_size, rank)
        got = varlen_local_queries(lq[positions], lk, lv, layout, scale=scale, window=window)
        pq, pk, pv = leaves["portable"]
        want = local_query_attention(
            pq[positions], pk, pv, positions, meta, cp_size, scale, LayerExtras(window=window)
        )
        torch.testing.assert_close(got[real_rows], want[real_rows], rtol=1e-12, atol=1e-12)
        (got * dout[positions]).sum().backward()
        (want * dout[positions]).sum().backward()
    one_process = forward_backward(
        lambda q, k, v: reference_varlen_attention(q, k, v, cu_real, cu_padded, scale=scale, window=window),
        q, k, v, dout,
    )  # fmt: skip
    for name in ("varlen", "portable"):
        for a, b in zip(leaves[name], one_process[1:], strict=True):
            torch.testing.assert_close(a.grad, b, rtol=1e-12, atol=1e-12)


def test_te_backend_is_checked_at_setup_where_transformer_engine_imports_or_not(te_standin, monkeypatch):
    """With TE importable (the stand-in) the check passes; without, it names the key before any data work."""
    check_backend_device("te", torch.bfloat16)
    import automodel.attention.te as te_module

    monkeypatch.setattr(te_module, "te_pytorch", lambda: None)
    with pytest.raises(
        ValueError,
        match=r"^model.attention_backend='te': attention backend 'te' needs Transformer "
        r"Engine, which cannot be imported here",
    ):
        check_backend_device("te", torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# the run's compute dtype: auto picks a backend that takes it, setup refuses one that cannot


@pytest.mark.parametrize(
    ("te", "dtype", "picked"),
    [(True, torch.bfloat16, "te"), (True, torch.float16, "te"), (True, torch.float32, "portable"),
     (False, torch.bfloat16, "varlen"), (False, torch.float32, "portable"), (False, torch.float64, "portable")],
)  # fmt: skip
def test_auto_picks_a_backend_that_takes_the_compute_dtype(varlen_kernel, monkeypatch, te, dtype, picked):
    """On CUDA (reported present), ``trainer.bf16_autocast=false`` with a float32 model makes the
    compute dtype float32: neither TE's THD kernels nor FlashAttention take it, portable does."""
    import automodel.attention.backends as backends

    varlen_kernel("2.11")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(backends, "te_pytorch", (lambda: object()) if te else (lambda: None))
    assert backends.resolve_attention_backend("auto", compute_dtype=dtype) == picked


@pytest.mark.parametrize("backend", ["varlen", "te"])
def test_setup_refuses_a_backend_that_cannot_take_the_compute_dtype(te_standin, monkeypatch, backend):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_backend_device(backend, torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=rf"^model.attention_backend='{backend}': attention would compute in torch.float32 .*cannot take: it "
        r"needs torch.bfloat16 or torch.float16; set trainer.bf16_autocast=true or model.dtype=bfloat16, or "
        r"model.attention_backend=portable",
    ):
        check_backend_device(backend, torch.float32)


def test_the_recipe_s_compute_dtype_is_the_autocast_s_or_the_model_s(tmp_path):
    """What setup checks the backend against: bf16 under the run's autocast (CUDA, trainer.bf16_autocast),
    else model.dtype; the same rule the step's autocast follows."""
    from types import SimpleNamespace

    from automodel.config import load_recipe
    from automodel.training.finetune import FinetuneRecipe

    def dtype(device: str, autocast: bool, model_dtype: str) -> torch.dtype:
        cfg = load_recipe("tiny_llama_sft", [f"trainer.bf16_autocast={autocast}", f"model.dtype={model_dtype}",
                                             f"trainer.output_dir={tmp_path}"])  # fmt: skip
        recipe = FinetuneRecipe(cfg)
        recipe.dims = SimpleNamespace(device=torch.device(device))
        return recipe._compute_dtype()

    assert dtype("cuda", True, "float32") == torch.bfloat16
    assert (
        dtype("cuda", False, "float32") == torch.float32
    )  # the case: varlen was picked, step 1 failed
    assert dtype("cuda", False, "bfloat16") == torch.bfloat16
    assert dtype("cpu", True, "float32") == torch.float32  # autocast is CUDA's only
