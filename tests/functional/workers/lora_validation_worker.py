"""Two gloo ranks: validation's reduction and LoRA under FSDP2 data parallel equal one process.

1. evaluate: rank r holds half of the micro-batches (DP) and half of each sequence's tokens (CP);
   the all-reduced val_loss equals one process's over everything.
2. LoRA: a peft model with every decoder layer and the root fully_shard-ed, each rank training on
   half of the batch, gives the adapter one process gets on the whole batch (exported, reloaded).
"""

from __future__ import annotations

import sys
import tempfile

import peft
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, "tests/unit")
from test_lora import CONFIG, LORA, logits, tiny_llama  # noqa: E402
from test_validation import Tiny, batches  # noqa: E402

from automodel.models.lora import export_adapter, lora_decoder_layers, trainable_parameters  # noqa: E402
from automodel.training.validation import evaluate  # noqa: E402


def check_validation(rank: int) -> None:
    torch.manual_seed(0)
    model = Tiny()
    data = batches()
    alone = evaluate(model, data, lambda b: model(b["input_ids"], b["labels"]), group=dist.new_group([rank]))
    dp = evaluate(model, data[rank::2], lambda b: model(b["input_ids"], b["labels"]))  # micro-batches split over ranks
    # CP: this rank's half of every sequence (labels stay aligned with their positions).
    halves = [{k: v.chunk(2, dim=-1)[rank] if v.shape[-1] > 1 else v for k, v in b.items()} for b in data]
    cp = evaluate(model, halves, lambda b: model(b["input_ids"], b["labels"]))
    assert dp.val_label_tokens == cp.val_label_tokens == alone.val_label_tokens, (dp, cp, alone)
    for result in (dp, cp):
        # float32 CE sums per micro-batch, so regrouping tokens moves the mean by float32 rounding only
        assert abs(result.val_loss - alone.val_loss) <= 1e-6 * alone.val_loss, (result, alone)


def train(model: torch.nn.Module, ids: torch.Tensor, steps: int = 3) -> None:
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def check_lora_data_parallel(rank: int) -> None:
    ids = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=torch.Generator().manual_seed(1))
    reference = LORA.apply(tiny_llama())
    train(reference, ids)  # one process, the whole batch
    model = LORA.apply(tiny_llama())
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    for layer in lora_decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    train(model, ids[2 * rank : 2 * rank + 2])  # equal halves: FSDP's gradient average is the full mean
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:  # with cpu_offload only rank 0 receives the full state dict
        assert set(full) == set(reference.state_dict())  # FSDP2 keeps peft's names
        with tempfile.TemporaryDirectory() as out:
            export_adapter(model, full, out)
            reloaded = peft.PeftModel.from_pretrained(tiny_llama(), out).eval()
            torch.testing.assert_close(logits(reloaded), logits(reference.eval()), rtol=0, atol=1e-5)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    check_validation(rank)
    check_lora_data_parallel(rank)
    dist.barrier()
    if rank == 0:
        print("lora_validation_worker: all checks passed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
