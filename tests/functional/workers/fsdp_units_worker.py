"""torchrun worker (4 ranks, gloo): apply_fsdp's units (decoder layers, input embeddings and output
head each on their own) against the grouping before them (decoder layers, everything else in the
root unit): the loss and every reduced gradient equal bitwise, in float32 and bf16 compute, untied
and tied, full fine-tuning and LoRA (frozen embeddings and head: units with nothing to reduce).

Prints one ``FAIL`` line per mismatch and exits 1 if any.
"""

from __future__ import annotations

import copy
import sys

import peft
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from automodel.attention import ThdAttentionMetadata
from automodel.attention.hf import THD_ATTENTION, attach_thd_attention, register_thd_attention
from automodel.models.build import CausalLMForTraining
from automodel.models.parallelize import apply_fsdp

TOKENS = 64


def root_grouping(model: CausalLMForTraining, mesh, compute_dtype: torch.dtype) -> None:
    """apply_fsdp before the embeddings and the head had units of their own."""
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in model.decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def model(tied: bool, lora: bool) -> CausalLMForTraining:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)  # fmt: skip
    hf = LlamaForCausalLM._from_config(config, attn_implementation=THD_ATTENTION)
    attach_thd_attention(hf, "portable", "p2p")
    if lora:
        hf = peft.get_peft_model(hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
        for name, param in hf.named_parameters():  # B = 0 at init would leave A's gradients zero
            if "lora_B" in name:
                torch.nn.init.normal_(param)
    return CausalLMForTraining(hf)


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    register_thd_attention()
    ids = torch.randint(1, 1000, (TOKENS,), generator=torch.Generator().manual_seed(rank))
    cu = torch.tensor([0, 20, TOKENS], dtype=torch.int32)
    positions = torch.cat([torch.arange(20), torch.arange(TOKENS - 20)])
    failures = 0
    for dtype in (torch.float32, torch.bfloat16):
        for tied, lora in ((False, False), (True, False), (False, True)):
            case = f"{dtype} tied={tied} lora={lora}"
            before = model(tied, lora)
            after = copy.deepcopy(before)
            root_grouping(before, mesh, dtype)
            apply_fsdp(after, mesh, dtype)
            head = after.transformers_model.get_output_embeddings()
            if isinstance(head, FSDPModule) == tied:
                print(f"FAIL {case}: the head is {'' if tied else 'not '}a unit of its own", flush=True)
                failures += 1
            losses = []
            for m in (before, after):
                loss = m(ids, positions, ids.roll(-1), ThdAttentionMetadata(cu, cu, TOKENS))
                loss.backward()
                losses.append(loss.detach())
            if not torch.equal(*losses):
                print(f"FAIL {case}: loss {losses[0].item()} != {losses[1].item()}", flush=True)
                failures += 1
            reference = {n: p.grad.full_tensor() for n, p in before.named_parameters() if p.grad is not None}
            grads = {n: p.grad.full_tensor() for n, p in after.named_parameters() if p.grad is not None}
            if grads.keys() != reference.keys() or not grads:
                print(f"FAIL {case}: gradients of {sorted(grads)} vs {sorted(reference)}", flush=True)
                failures += 1
            for name in sorted(grads.keys() & reference.keys()):
                if not torch.equal(grads[name], reference[name]):
                    print(f"FAIL {case}: gradient of {name} differs", flush=True)
                    failures += 1
    dist.barrier()  # every rank done with its collectives before any tears the group down
    dist.destroy_process_group()
    if rank == 0 and not failures:
        print("fsdp units: losses and gradients equal bitwise", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
