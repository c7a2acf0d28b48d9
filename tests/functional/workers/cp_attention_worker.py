"""torchrun worker: context-parallel THD attention equals the single-process result (gloo, CPU).

CP runs over the whole world, then (with 4 or more ranks) over groups of 2 ranks ([0, 1], [2, 3], ...:
groups whose global ranks differ from their group ranks). Every rank of a CP group builds the same
random batch of packs, laid out as pack_dataset and the collater lay
it out for cp_size = world size, shards it with make_cp_batch_for_te, and runs each case: CP attention on its local
tokens against the same backend without CP on the whole batch, index-selected with the partition
indices; forward and q/k/v gradients. Any mismatch raises (non-zero exit). Each rank prints one
``CP-ATTENTION PASS ...`` line per case.

Backends: ``portable`` always; ``varlen`` through check-gpu's CP comparison with torch's kernel
replaced by the CPU stand-in (tests/unit/varlen_standin.py on PYTHONPATH); ``te`` when ``transformer_engine`` imports (the CPU stand-in in
tests/te_standin on PYTHONPATH), for each cp_comm_type, plus check-gpu's CP comparison.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.distributed as dist

from automodel.attention import ThdAttentionMetadata, build_attention, check_kit
from automodel.distributed import make_cp_batch_for_te, process_input_for_thd
from automodel.te_support import te_pytorch

HEAD_DIM = 8


def packed_batch(seed: int, cp_size: int, pack_size: int, num_packs: int = 3) -> dict:
    """``[B, S]`` packs as ``packed_sequence_thd_collater`` returns them: every sample padded to a
    multiple of 2*cp_size, the pack's tail padding added to its last sample, token id 0 for padding.
    (Built by hand: importing the data stack would cost each rank seconds.)"""
    rng = random.Random(seed)
    multiple = 2 * cp_size
    rows, seq_lens, seq_lens_padded = [], [], []
    for _ in range(num_packs):
        ids, real, padded = [], [], []
        while True:
            n = rng.randint(1, pack_size // 2)
            n_padded = -(-n // multiple) * multiple
            if len(ids) + n_padded > pack_size:
                break
            ids += [rng.randint(1, 99) for _ in range(n)] + [0] * (n_padded - n)
            real.append(n)
            padded.append(n_padded)
        padded[-1] += pack_size - len(ids)
        ids += [0] * (pack_size - len(ids))
        rows.append(ids)
        seq_lens.append(real)
        seq_lens_padded.append(padded)
    width = max(map(len, seq_lens))
    pad = lambda lens: lens + [-1000] * (width - len(lens))  # noqa: E731
    positions = [[i for p in padded for i in range(p)] for padded in seq_lens_padded]
    return {
        "input_ids": torch.tensor(rows),
        "labels": torch.tensor(rows),
        "position_ids": torch.tensor(positions),
        "seq_lens": torch.tensor([pad(r) for r in seq_lens]),
        "seq_lens_padded": torch.tensor([pad(p) for p in seq_lens_padded]),
    }


def run_case(backend, cp_comm_type, heads, dtype, batch, seed, group) -> dict[str, float]:
    rank, cp_size = dist.get_rank(group), dist.get_world_size(group)
    full = process_input_for_thd(dict(batch))
    local = make_cp_batch_for_te(None, dict(batch), cp_size=cp_size, cp_rank=rank)
    meta_full = ThdAttentionMetadata.from_batch(full)
    meta = ThdAttentionMetadata.from_batch(local, cp_group=group)
    idx = meta.partition_indices[rank]
    if not torch.equal(local["input_ids"], full["input_ids"][idx]):
        raise AssertionError("make_cp_batch_for_te and ThdAttentionMetadata.partition_indices disagree")

    h, h_kv = heads
    total = meta.total_tokens
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(total, n, HEAD_DIM, generator=g).to(dtype) for n in (h, h_kv, h_kv))
    weights = torch.randn(total, h * HEAD_DIM, generator=g)
    attn = build_attention(backend, h, h_kv, HEAD_DIM, cp_comm_type=cp_comm_type)

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out_ref = attn(*leaves, meta_full)
    (out_ref.float() * weights).sum().backward()
    refs = [out_ref.detach()[idx], *(x.grad[idx] for x in leaves)]

    local_leaves = [x[idx].clone().requires_grad_() for x in (q, k, v)]
    out = attn(*local_leaves, meta)
    (out.float() * weights[idx]).sum().backward()
    got = [out.detach(), *(x.grad for x in local_leaves)]
    if backend == "te":
        attn(*local_leaves, meta)  # a second step with the same group must not set it again
        expected = dict(
            cp_group=group,
            cp_global_ranks=dist.get_process_group_ranks(group),
            cp_stream=None,
            cp_comm_type=cp_comm_type,
        )
        if attn.core_attention.cp_calls != [expected]:
            raise AssertionError(
                f"set_context_parallel_group calls {attn.core_attention.cp_calls}, expected [{expected}]"
            )

    # float32: rounding only. bf16: TE's own CP test tolerances.
    tol = 1e-5 if dtype == torch.float32 else (2.5e-2 if h == h_kv else 3.5e-2)
    errors = {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, refs, strict=True):
        torch.testing.assert_close(
            a.float(), b.float(), atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}"
        )
        errors[name] = (a.float() - b.float()).abs().max().item()
    return errors


def check_cp_group(group, seed: int, pack_size: int) -> None:
    """Every case on ``group``; prints one ``CP-ATTENTION PASS ... cp=<size> rank=<global rank>`` per case."""
    rank, cp_size = dist.get_rank(), dist.get_world_size(group)
    batch = packed_batch(seed, cp_size, pack_size)

    cases = [("portable", "p2p", (4, 2), torch.float32), ("portable", "p2p", (2, 2), torch.float32)]
    cases += [("portable", "p2p", (4, 2), torch.bfloat16)]
    if te_pytorch() is not None:
        cases += [
            ("te", comm, (2 * cp_size, cp_size), torch.bfloat16) for comm in ("p2p", "all_gather", "a2a")
        ]
    for i, (backend, comm, heads, dtype) in enumerate(cases):
        errors = run_case(backend, comm, heads, dtype, batch, seed + i, group)
        summary = " ".join(f"{name}={err:.1e}" for name, err in errors.items())
        print(
            f"CP-ATTENTION PASS backend={backend} cp_comm_type={comm} heads={heads[0]}/{heads[1]} "
            f"cp={cp_size} rank={rank} tokens={batch['input_ids'].numel()} max_abs_err {summary}",
            flush=True,
        )
    # the varlen backend's CP (all-gather over gloo, per-chunk queries against prefix keys) through
    # check-gpu's comparison, with torch's varlen_attn replaced by the CPU stand-in of its 2.13 signature
    results = check_kit.cp_vs_one_process(
        torch.device("cpu"), seed, group, "varlen", [("length mix", [7, 30, 1, 19])]
    )
    if not all(r.passed for r in results):
        raise AssertionError(check_kit.format_table(results))
    print(
        f"CP-ATTENTION PASS check_gpu varlen cp vs varlen: {len(results)} rows cp={cp_size} rank={rank}",
        flush=True,
    )
    if te_pytorch() is not None:
        # check-gpu's CP rows, on the stand-in: the same comparison it makes on GPUs.
        results = check_kit.cp_vs_one_process(
            torch.device("cpu"), seed, group, "te", [("length mix", [7, 30, 1, 19])]
        )
        if not all(r.passed for r in results):
            raise AssertionError(check_kit.format_table(results))
        print(
            f"CP-ATTENTION PASS check_gpu te cp vs te: {len(results)} rows cp={cp_size} rank={rank}",
            flush=True,
        )
        # a2a scatters heads over the ranks: an indivisible head count must fail on the host.
        try:
            run_case("te", "a2a", (2 * cp_size, 1), torch.bfloat16, batch, seed, group)
        except ValueError as error:
            if "must both be divisible by cp_size" not in str(error):
                raise
            print(f"CP-ATTENTION PASS a2a rejects num_kv_heads=1 over cp={cp_size} rank={rank}", flush=True)
        else:
            raise AssertionError(
                "te backend accepted cp_comm_type='a2a' with num_kv_heads=1 indivisible by cp"
            )


def use_varlen_standin() -> None:
    """torch's varlen_attn -> the CPU stand-in (tests/unit/varlen_standin.py, on PYTHONPATH)."""
    import torch.nn.attention.varlen as torch_varlen
    import varlen_standin

    from automodel.attention.varlen import installed_varlen_kernel

    torch_varlen.varlen_attn = varlen_standin.BY_VERSION["2.13"]
    installed_varlen_kernel.cache_clear()


def main() -> None:
    use_varlen_standin()
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pack-size", type=int, default=32)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    check_cp_group(dist.group.WORLD, args.seed, args.pack_size)
    if world >= 4:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world - 1, 2)]  # every rank makes every group
        check_cp_group(pairs[dist.get_rank() // 2], args.seed + 100, args.pack_size)
    dist.barrier()  # no rank tears the group down while another is in a collective (gloo aborts it)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
