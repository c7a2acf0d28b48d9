"""Run by tests/unit/test_mixer_kernels.py in a fresh interpreter with the stand-in kernel packages
(tests/unit/mixer_standin) first on PYTHONPATH: transformers then takes its Gated DeltaNet's
convolution and delta rule from them, as it takes causal-conv1d's and flash-linear-attention's on
CUDA. Last, the stand-ins ignore the boundaries (``STANDIN_IGNORE_LAYOUT``), as a kernel that does not
take them would. Prints one JSON line of findings."""

from __future__ import annotations

import json
import os
import warnings

import torch

warnings.filterwarnings("ignore")

import causal_conv1d  # noqa: E402  (the stand-ins)
import fla.ops.gated_delta_rule as gated_delta_rule  # noqa: E402

from automodel.attention import ThdAttentionMetadata  # noqa: E402
from automodel.attention.mixers import mixer_backend_of, stateful_mixer_modules  # noqa: E402
from automodel.models import (  # noqa: E402
    ModelSpec,
    build_model,
    mixers,  # noqa: E402
)
from automodel.models.check_mixers import mixer_kernel_rows  # noqa: E402
from automodel.models.tiny import tiny_config  # noqa: E402


def step(config, backend: str):
    spec = ModelSpec(
        config={"model_type": config.model_type}, attention_backend="portable", mixer_backend=backend
    )
    model = build_model(spec, config, device=torch.device("cpu"), shard=lambda m: None, seed=0)
    cu = torch.tensor([0, 5, 6, 22, 32], dtype=torch.int32)  # four sequences, one of a single token
    lengths = cu.diff().tolist()
    ids = torch.randint(1, config.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    loss = model(ids, positions, ids.roll(-1), ThdAttentionMetadata(cu, cu.clone(), max(lengths)))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return model, float(loss), grads


def main() -> None:
    config = tiny_config("qwen3_5_text")
    (cls,) = mixers.stateful_mixer_classes(config)
    found = {"missing": mixers.kernels_missing(cls)}
    found["error"] = mixers.kernel_error(config, cls, torch.device("cpu"))
    found["chosen"] = [
        c.__name__ for c in mixers.mixer_kernel_classes(config, "kernels", torch.device("cpu"))
    ]
    model, loss, grads = step(config, "kernels")
    found["backends"] = sorted({mixer_backend_of(m) for m in stateful_mixer_modules(model)})
    del gated_delta_rule.CALLS[:], causal_conv1d.CALLS[:]
    model, loss, grads = step(config, "kernels")
    found["calls"] = gated_delta_rule.CALLS + causal_conv1d.CALLS
    _, ref_loss, ref_grads = step(config, "reference")
    found["loss_error"] = abs(loss - ref_loss) / abs(ref_loss)
    found["grad_error"] = max(
        float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()) for n in ref_grads
    )
    found["grad_names_equal"] = set(grads) == set(ref_grads)
    rows = mixer_kernel_rows(torch.device("cpu"))  # check-gpu's rows, here on the CPU
    found["rows"] = {row.case: row.status for row in rows}
    os.environ["STANDIN_IGNORE_LAYOUT"] = "1"  # the stand-ins now run the row as one sequence
    mixers._CHOSEN.clear()
    try:
        mixers.mixer_kernel_classes(config, "kernels", torch.device("cpu"))
        found["refused"] = None
    except ValueError as error:
        found["refused"] = str(error)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
