"""Run by tests/unit/test_mixer_kernels.py in a fresh interpreter with the stand-in kernel packages
(tests/unit/mixer_standin) first on PYTHONPATH: transformers then takes its Gated DeltaNet's
convolution and delta rule, and its Mamba-2 and Mamba mixers' convolution and scans, from them, as it
takes causal-conv1d's, flash-linear-attention's and mamba-ssm's on CUDA. Mamba (v1) mixers, whose scan
takes no boundaries, are refused; forced onto a packed row, they mix samples. Last, the stand-ins
ignore the boundaries (``STANDIN_IGNORE_LAYOUT``), as a kernel that does not take them would. Prints
one JSON line of findings."""

from __future__ import annotations

import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")

import causal_conv1d  # noqa: E402  (the stand-ins)
import fla.ops.gated_delta_rule as gated_delta_rule  # noqa: E402
import fla.ops.kda as kda  # noqa: E402
import mamba_ssm  # noqa: E402
from mamba_ssm.ops.selective_scan_interface import selective_scan_fn  # noqa: E402
from mamba_ssm.ops.triton.selective_state_update import selective_state_update  # noqa: E402
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402
from transformers.models.mamba import modeling_mamba  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402

from automodel.attention import ThdAttentionMetadata  # noqa: E402
from automodel.attention.mixers import mixer_backend_of, stateful_mixer_modules  # noqa: E402
from automodel.models import (  # noqa: E402
    ModelSpec,
    build_model,
    mixers,  # noqa: E402
)
from automodel.models.check_mixers import mixer_kernel_rows  # noqa: E402
from automodel.models.setup import check_mixer_backend  # noqa: E402
from automodel.models.tiny import tiny_config  # noqa: E402

# a Gated DeltaNet hybrid, a KDA hybrid, a pure Mamba-2 model and a Mamba-2 hybrid
FAMILIES = ("qwen3_5_text", "kimi_linear", "mamba2", "nemotron_h")
# Mamba (v1) mixers (a pure Mamba model, FalconMamba: norms inside the fused kernel, a hybrid), whose
# scan kernels take no sample boundaries
NO_BOUNDARIES = ("mamba", "falcon_mamba", "jamba")
STANDINS = (gated_delta_rule, kda, causal_conv1d, mamba_ssm)


def build(config, backend: str):
    spec = ModelSpec(
        config={"model_type": config.model_type}, attention_backend="portable", mixer_backend=backend
    )
    return build_model(spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0)


def step(model, config, train: bool):
    """One packed row's loss (and, ``train``, the gradients) with the stand-ins' calls of this step."""
    for standin in STANDINS:
        del standin.CALLS[:]
    model.train(train)
    cu = torch.tensor([0, 5, 6, 22, 32], dtype=torch.int32)  # four sequences, one of a single token
    lengths = cu.diff().tolist()
    ids = torch.randint(1, config.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.set_grad_enabled(train):
        loss = model(ids, positions, ids.roll(-1), ThdAttentionMetadata(cu, cu.clone(), max(lengths)))
    if train:
        loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads, [call for standin in STANDINS for call in standin.CALLS]


def family(model_type: str) -> dict:
    config = tiny_config(model_type)
    (cls,) = mixers.stateful_mixer_classes(config)
    found = {"class": cls.__name__, "missing": mixers.kernels_missing(cls)}
    found["error"] = mixers.kernel_error(config, cls, torch.device("cpu"))
    found["chosen"] = [
        c.__name__ for c in mixers.mixer_kernel_classes(config, "kernels", torch.device("cpu"))
    ]
    kernels, reference = build(config, "kernels"), build(config, "reference")
    found["backends"] = sorted({mixer_backend_of(m) for m in stateful_mixer_modules(kernels)})
    loss, grads, found["calls"] = step(kernels, config, train=True)
    ref_loss, ref_grads, _ = step(reference, config, train=True)
    found["loss_error"] = abs(loss - ref_loss) / abs(ref_loss)
    found["grad_error"] = max(
        float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()) for n in ref_grads
    )
    found["grad_names_equal"] = set(grads) == set(ref_grads)
    # validation runs the model in eval mode: Mamba-2 mixers then take their unfused kernels
    loss, _, found["eval_calls"] = step(kernels, config, train=False)
    ref_loss, _, _ = step(reference, config, train=False)
    found["eval_loss_error"] = abs(loss - ref_loss) / abs(ref_loss)
    return found


def refused(model_type: str) -> dict:
    """How automodel treats a mixer whose installed kernels take no sample boundaries: why, what
    ``auto`` picks on a GPU, ``kernels`` at build and at setup (as on a CUDA machine); then its
    kernel path forced through the stand-ins on the check's row (what the refusal keeps away)."""
    config = tiny_config(model_type)
    (cls,) = mixers.stateful_mixer_classes(config)
    found = {"class": cls.__name__, "missing": mixers.kernels_missing(cls)}
    found["auto"] = [c.__name__ for c in mixers.mixer_kernel_classes(config, "auto", torch.device("cuda"))]
    spec = ModelSpec(config={"model_type": model_type}, mixer_backend="kernels")
    is_available, torch.cuda.is_available = torch.cuda.is_available, lambda: True
    for key, check in (
        ("kernels", lambda: mixers.mixer_kernel_classes(config, "kernels", torch.device("cpu"))),
        ("setup", lambda: check_mixer_backend(spec, config)),
    ):
        try:
            check()
            found[key] = None
        except ValueError as error:
            found[key] = str(error)
    torch.cuda.is_available = is_available
    del mamba_ssm.CALLS[:], causal_conv1d.CALLS[:]
    found["forced_error"] = mixers.kernel_error(config, cls, torch.device("cpu"))
    found["forced_calls"] = sorted({c["fn"] for c in mamba_ssm.CALLS + causal_conv1d.CALLS})
    return found


def selective_scans() -> dict:
    """mamba-ssm's Mamba (v1) stand-ins: the scan against transformers' torch scan, the fused
    ``mamba_inner_fn`` (a Mamba mixer in training) against the convolution and scan apart (in eval);
    flash-linear-attention's KDA stand-ins on a row of three sequences; one real check of each."""
    g = torch.Generator().manual_seed(0)
    u, dt, z = (torch.randn(2, 6, 9, generator=g) for _ in range(3))
    A, D, delta_bias = (
        -torch.rand(6, 4, generator=g),
        torch.randn(6, generator=g),
        torch.randn(6, generator=g),
    )
    B, C = torch.randn(2, 4, 9, generator=g), torch.randn(2, 4, 9, generator=g)
    options = {"D": D, "z": z, "delta_bias": delta_bias, "delta_softplus": True, "return_last_state": True}
    out, state = selective_scan_fn(u, dt, A, B, C, **options)
    ref_out, ref_state = modeling_mamba.mamba_selective_scan.__wrapped__(u, dt, A, B, C, **options)
    found = {
        "selective_scan_error": max(
            float((out - ref_out).abs().max()), float((state - ref_state).abs().max())
        )
    }
    config = tiny_config("mamba")
    (cls,) = mixers.stateful_mixer_classes(config)
    module = mixers.probe_mixers(config).modules[cls][0]
    x = torch.randn(1, 16, config.hidden_size, generator=g)
    outputs = {}
    for training in (True, False):
        del mamba_ssm.CALLS[:]
        outputs[training] = module.train(training)(x)
        found[f"inner_calls_{training}"] = [c["fn"] for c in mamba_ssm.CALLS]
    found["inner_error"] = float((outputs[True] - outputs[False]).norm() / outputs[False].norm())
    # KDA with cu_seqlens on a row of three sequences == transformers' torch KDA on each alone
    q, k = torch.randn(1, 13, 2, 4, generator=g), torch.randn(1, 13, 2, 4, generator=g)
    v, kda_g = torch.randn(1, 13, 2, 3, generator=g), -torch.rand(1, 13, 2, 4, generator=g)
    beta = torch.rand(1, 13, 2, generator=g)
    bounds = [0, 5, 6, 13]
    reference = modeling_kimi_linear.chunk_kimi_delta_attention.__wrapped__
    per_sequence = torch.cat(
        [
            reference(
                q[:, a:b],
                k[:, a:b],
                v[:, a:b],
                g=kda_g[:, a:b],
                beta=beta[:, a:b],
                use_qk_l2norm_in_kernel=True,
            )[0]
            for a, b in zip(bounds[:-1], bounds[1:])
        ],
        dim=1,
    )
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    for fn in (kda.chunk_kda, kda.fused_recurrent_kda):
        out, _ = fn(q, k, v, kda_g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
        found[f"{fn.__name__}_error"] = float((out - per_sequence).abs().max())
    out, _ = kda.chunk_kda(q, k, v, kda_g, beta, use_qk_l2norm_in_kernel=True)  # no boundaries: one sequence
    found["kda_without_cu_seqlens_error"] = float((out - per_sequence).abs().max())
    try:
        kda.chunk_kda(q, k, v, kda_g[..., :3], beta)
        found["kda_short_g"] = None
    except AssertionError as error:
        found["kda_short_g"] = str(error)
    try:
        selective_scan_fn(u, dt, A, B, C, D.half())
        found["half_D"] = None
    except AssertionError as error:
        found["half_D"] = str(error)
    return found


def scans() -> dict:
    """mamba-ssm's scan stand-in on a row of three sequences against transformers' torch scan run on
    each sequence alone; and its decoding step against the scan one token further."""
    g = torch.Generator().manual_seed(0)
    x, dt = torch.randn(1, 13, 4, 3, generator=g), torch.randn(1, 13, 4, generator=g)
    A, D, dt_bias = -torch.rand(4, generator=g), torch.randn(4, generator=g), torch.randn(4, generator=g)
    B, C = torch.randn(1, 13, 2, 5, generator=g), torch.randn(1, 13, 2, 5, generator=g)
    reference = modeling_mamba2.mamba2_chunk_scan.__wrapped__  # the torch function, unwrapped
    options = {"D": D, "dt_bias": dt_bias, "dt_softplus": True}
    bounds = [(0, 5), (5, 6), (6, 13)]
    per_sequence = torch.cat(
        [
            reference(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], chunk_size=4, **options)
            for a, b in bounds
        ],
        dim=1,
    )
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor([5, 1, 7]))[None]
    found = {}
    out = mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=seq_idx, **options)
    found["scan_error"] = float((out - per_sequence).abs().max())
    os.environ["STANDIN_IGNORE_LAYOUT"] = "1"
    out = mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=seq_idx, **options)
    del os.environ["STANDIN_IGNORE_LAYOUT"]
    found["ignoring_error"] = float((out - per_sequence).abs().max())
    whole = reference(x, dt, A, B, C, chunk_size=4, **options)
    found["ignoring_whole_error"] = float((out - whole).abs().max())
    # decoding: the state after 12 tokens, then token 13 through selective_state_update (the
    # arguments laid out as transformers' Mamba2Mixer lays them) == the scan's token 13
    _, state = mamba_chunk_scan_combined(
        x[:, :12], dt[:, :12], A, B[:, :12], C[:, :12], 4, return_final_states=True, **options
    )
    expand = {"dt_bias": dt_bias[:, None].expand(-1, 3), "dt_softplus": True}
    token = (
        x[:, 12],
        dt[:, 12, :, None].expand(-1, -1, 3),
        A[:, None, None].expand(-1, 3, 5),
        B[:, 12],
        C[:, 12],
    )
    step_out = selective_state_update(state, *token, D[:, None].expand(-1, 3), **expand)
    found["decode_error"] = float((step_out - whole[:, 12]).abs().max())
    try:
        mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=seq_idx[:, :12], **options)
        found["short_seq_idx"] = None
    except AssertionError as error:
        found["short_seq_idx"] = str(error)
    return found


def main() -> None:
    found = {"families": {model_type: family(model_type) for model_type in FAMILIES}, **scans()}
    found["no_boundaries"] = {model_type: refused(model_type) for model_type in NO_BOUNDARIES}
    found.update(selective_scans())
    rows = mixer_kernel_rows(torch.device("cpu"))  # check-gpu's rows, here on the CPU
    found["rows"] = {row.case: row.status for row in rows}
    found["row_details"] = {row.case: row.detail for row in rows if row.status == "SKIP"}
    found["refused"] = {}
    for ignored in ("1", "mamba_chunk_scan_combined"):  # all kernels; mamba-ssm's unfused scan alone
        os.environ["STANDIN_IGNORE_LAYOUT"] = ignored
        mixers._CHOSEN.clear()
        for model_type in FAMILIES:
            try:
                mixers.mixer_kernel_classes(tiny_config(model_type), "kernels", torch.device("cpu"))
                found["refused"][f"{ignored} {model_type}"] = None
            except ValueError as error:
                found["refused"][f"{ignored} {model_type}"] = str(error)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
