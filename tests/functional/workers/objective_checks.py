"""Step 1 of each post-training objective against its formula computed by hand on the unpacked samples.

For an objective, :func:`check_step_one` sets its recipe up (one process, or one rank of a torchrun
launch: CP or DP with accumulation), runs the first step's forward and backward through the recipe
(``_forward_backward`` on the micro-batches the step draws: packed rows, CP shards, every DP rank's)
and compares the loss and every gradient with a hand computation: the same global step's samples
(all DP ranks' micro-batches, read from the plan of epoch 0) each run ALONE through an eager
transformers copy of the starting weights, float32, the objective's formula written out here again
(not the library's function), and autograd through that formula.

Used in one process by tests/functional/test_post_training.py and under torchrun by
workers/post_training_worker.py.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from workers.hf_families import compare, full_grads

from automodel.config import load_recipe
from automodel.training.run import recipe_class

FAST = ["trainer.progress_bar=false", "trainer.export_hf=false", "trainer.eval_every=null",
        "data.val_fraction=null", "trainer.max_steps=1", "trainer.grad_accum_steps=2"]  # fmt: skip

# name -> (recipe, overrides); every one draws 2 units per micro-batch, 2 micro-batches per rank
OBJECTIVES = {
    "dpo_sigmoid_smoothed": ("tiny_llama_dpo", ["dpo.label_smoothing=0.2"]),
    "dpo_ipo": ("tiny_llama_dpo", ["dpo=ipo"]),
    "dpo_rpo": ("tiny_llama_dpo", ["dpo=rpo", "dpo.nll_weight=0.5"]),
    "dpo_simpo": ("tiny_llama_dpo", ["dpo=simpo"]),
    "dpo_orpo": ("tiny_llama_dpo", ["dpo=orpo"]),
    "kto": ("tiny_llama_kto", ["dpo.undesirable_weight=1.5"]),
    "reward": ("tiny_llama_rm", ["reward.center_coefficient=0.05", "data.margin=margin"]),
    # clipped both ways (behaviour log-probs moved off the policy's), KL to the rollouts' reference
    "rl_token_mean": ("tiny_llama_grpo", ["rl.kl_coef=0.1", "rl.reference=given", "rl.clip_high=0.28"]),
    "rl_sample_mean": (
        "tiny_llama_grpo",
        ["rl.kl_coef=0.05", "rl.kl_estimator=k1", "rl.loss_aggregation=sample_mean"],
    ),
    # from Python: each DP rank hands over its own groups (a CP group the same ones)
    "rl_python": (
        "tiny_llama_grpo",
        ["rl.kl_coef=0.1", "rl.reference=given", "data.source=null", "data.max_length=256"],
    ),
    "rl_sequence_sum": (
        "tiny_llama_grpo",
        ["rl.loss_aggregation=sequence_sum", "rl.sequence_divisor=8", "data.normalize_by_std=false"],
    ),
}
_DATA = {
    "tiny_llama_dpo": ["data.split='train[:32]'", "packing.pairs_per_micro_batch=2"],
    "tiny_llama_kto": ["data.split='train[:32]'", "packing.samples_per_micro_batch=3"],
    "tiny_llama_rm": ["packing.pairs_per_micro_batch=2"],
    "tiny_llama_grpo": ["packing.samples_per_micro_batch=3"],
}


def check_step_one(name: str, output_dir: Path, *overrides: str) -> list[str]:
    """Mismatches between the recipe's step-1 loss and gradients and the hand computation (empty: equal)."""
    if name == "rl_python":
        return check_python_step(output_dir, *overrides)
    recipe_name, own = OBJECTIVES[name]
    data = [f"data.source={margin_pairs(Path(output_dir).parent)}"] if "data.margin=margin" in own else []
    if recipe_name == "tiny_llama_grpo":
        data = [f"data.source={varied_rollouts(Path(output_dir).parent, 'rl.reference=given' in own)}"]
    cfg = load_recipe(recipe_name, [f"trainer.output_dir={output_dir}", *FAST, *_DATA[recipe_name], *data, *own,
                                    *overrides])  # fmt: skip
    recipe = recipe_class(cfg)(cfg)
    try:
        recipe.setup()
        start = eager_copy(recipe)
        micro_batches = step_units(recipe)
        batches = [recipe._shard(next(recipe.stream)) for _ in range(cfg.trainer.grad_accum_steps)]
        loss = float(recipe._step_forward_backward(batches)[0]["loss"])
        grads = full_grads(recipe.model)
    finally:
        recipe.cleanup()
    expected = HAND[recipe_name](start, micro_batches, cfg)
    where = f"{name} dp{recipe.dims.dp_size} cp{recipe.dims.cp_size}"
    return compare(where, loss, grads, float(expected), {n: p.grad for n, p in start.named_parameters()
                                                         if p.grad is not None})  # fmt: skip


def eager_copy(recipe) -> torch.nn.Module:
    """The recipe's model's starting weights in its transformers class, eager attention, float32
    (collective under FSDP: every rank calls it)."""
    state = get_model_state_dict(recipe.model, options=StateDictOptions(full_state_dict=True))
    hf = recipe.model.transformers_model
    model = type(hf)._from_config(copy.deepcopy(hf.config), attn_implementation="eager", dtype=torch.float32)
    model.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()})
    return model.train()


def step_units(recipe) -> list[list[dict[str, Any]]]:
    """The first step's global micro-batches (every DP rank's), each a list of its units (pairs,
    samples), read from epoch 0's plan."""
    plan, units = recipe.stream.plan(0), recipe.stream.prepared.units
    count = recipe.dims.dp_size * recipe.trainer.grad_accum_steps
    return [
        [units[int(i)] for i in plan.sample_order[plan.pack_offsets[m] : plan.pack_offsets[m + 1]]]
        for m in range(count)
    ]


def sequence_log_prob(model, input_ids, labels, loss_mask) -> tuple[torch.Tensor, int]:
    """One sample alone: the sum of its learned labels' log-probs, and how many there are."""
    ids, labels = torch.as_tensor(input_ids).long(), torch.as_tensor(labels).long()
    learned = torch.as_tensor(loss_mask) != 0
    logp = model(ids[None]).logits[0].float().log_softmax(-1)
    return logp[learned].gather(1, labels[learned][:, None]).sum(), int(learned.sum())


def _side(model, unit, side, grad=True) -> tuple[torch.Tensor, int]:
    with torch.set_grad_enabled(grad):
        return sequence_log_prob(model, *(unit[f"{side}_{c}"] for c in ("input_ids", "labels", "loss_mask")))


def dpo_family_loss(start, micro_batches, cfg) -> torch.Tensor:
    """The mean over the step's pairs of the loss type's formula (backward done on ``start``)."""
    d = cfg.dpo
    policy = start
    reference = None if d.loss_type in ("simpo", "orpo") else _frozen(start)
    pairs = [pair for batch in micro_batches for pair in batch]
    losses = []
    for pair in pairs:
        (pc, nc), (pr, nr) = _side(policy, pair, "chosen"), _side(policy, pair, "rejected")
        if reference is not None:
            rc, rr = _side(reference, pair, "chosen", False)[0], _side(reference, pair, "rejected", False)[0]
        eps = d.get("label_smoothing", 0.0)
        if d.loss_type in ("sigmoid", "rpo"):
            h = d.beta * ((pc - rc) - (pr - rr))
            loss = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
            if d.loss_type == "rpo":
                loss = loss + d.nll_weight * (-pc / nc)
        elif d.loss_type == "ipo":
            loss = ((pc - rc) - (pr - rr) - 1 / (2 * d.beta)) ** 2
        elif d.loss_type == "simpo":
            h = d.beta * (pc / nc - pr / nr) - d.gamma
            loss = -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)
        else:  # orpo: log odds of the per-token mean probability
            ac, ar = pc / nc, pr / nr
            odds_c, odds_r = ac - torch.log(1 - torch.exp(ac)), ar - torch.log(1 - torch.exp(ar))
            loss = -ac - d.beta * F.logsigmoid(odds_c - odds_r)
        losses.append(loss)
    total = torch.stack(losses).mean()
    total.backward()
    return total.detach()


def kto_loss(start, micro_batches, cfg) -> torch.Tensor:
    """KTO: z0 from each micro-batch's mismatched samples (sample i's prompt, sample i+1's completion),
    then the mean over the step's samples of the weighted 1 - sigmoid terms."""
    d = cfg.dpo
    reference = _frozen(start)
    ratios = []
    with torch.no_grad():
        for batch in micro_batches:
            for i, sample in enumerate(batch):
                other = batch[(i + 1) % len(batch)]
                s = list(sample["loss_mask"]).index(1)  # position whose label is the first learned token
                t = list(other["loss_mask"]).index(1)
                ids = [*sample["input_ids"][: s + 1], *other["input_ids"][t + 1 :]]
                labels = [*sample["labels"][:s], *other["labels"][t:]]
                mask = [0] * s + list(other["loss_mask"][t:])
                ratios.append(
                    sequence_log_prob(start, ids, labels, mask)[0]
                    - sequence_log_prob(reference, ids, labels, mask)[0]
                )
    z0 = torch.stack(ratios).mean().clamp(min=0)
    losses = []
    for sample in (s for batch in micro_batches for s in batch):
        args = (sample["input_ids"], sample["labels"], sample["loss_mask"])
        with torch.no_grad():
            ref = sequence_log_prob(reference, *args)[0]
        r = sequence_log_prob(start, *args)[0] - ref
        if sample["desirable"]:
            losses.append(d.desirable_weight * (1 - torch.sigmoid(d.beta * (r - z0))))
        else:
            losses.append(d.undesirable_weight * (1 - torch.sigmoid(d.beta * (z0 - r))))
    total = torch.stack(losses).mean()
    total.backward()
    return total.detach()


def _frozen(model) -> torch.nn.Module:
    return copy.deepcopy(model).eval().requires_grad_(False)


def reward_loss(start, micro_batches, cfg) -> torch.Tensor:
    """Bradley-Terry: each side alone through the sequence-classification class (its own reading of
    the last token), -log sigmoid(rc - rr - m) + c (rc + rr)^2, mean over the step's pairs."""
    losses = []
    for pair in (p for batch in micro_batches for p in batch):
        rc, rr = (
            start(torch.as_tensor(pair[f"{side}_input_ids"]).long()[None]).logits[0, 0]
            for side in ("chosen", "rejected")
        )
        losses.append(
            -F.logsigmoid(rc - rr - float(pair["margin"])) + cfg.reward.center_coefficient * (rc + rr) ** 2
        )
    total = torch.stack(losses).mean()
    total.backward()
    return total.detach()


def check_python_step(output_dir: Path, *overrides: str) -> list[str]:
    """:meth:`RLRecipe.forward_backward` on rollouts handed over from Python: the loss and gradients
    against the hand computation over every rank's rollouts, the returned log-probs against each
    rollout alone, then :meth:`RLRecipe.optim_step`."""
    from automodel.data.rollouts import Rollout, rollout_samples

    _, own = OBJECTIVES["rl_python"]
    cfg = load_recipe("tiny_llama_grpo", [f"trainer.output_dir={output_dir}", *FAST, *own, *overrides])
    path = varied_rollouts(Path(output_dir).parent, True)
    rows = [
        json.loads(line) for line in path.read_text().splitlines()[:16]
    ]  # groups 0-3: rewards per rollout
    recipe = recipe_class(cfg)(cfg)
    try:
        recipe.setup()
        start = eager_copy(recipe)
        dp, dp_rank = recipe.dims.dp_size, recipe.dims.dp_rank
        mine = [row for row in rows if owner(row["group"], dp) == dp_rank]
        result = recipe.forward_backward([Rollout(**row) for row in mine])
        grads = {name: g.clone() for name, g in full_grads(recipe.model).items()}  # optim_step clips in place
        record = recipe.optim_step()
    finally:
        recipe.cleanup()
    errors = []
    with torch.no_grad():
        for row, logp in zip(mine, result.log_probs):
            ids = torch.tensor([*row["prompt"], *row["response"]])
            n = len(row["response"])
            alone = (
                start(ids[None])
                .logits[0]
                .float()
                .log_softmax(-1)[-n - 1 : -1]
                .gather(1, ids[-n:, None])[:, 0]
            )
            if logp.shape != alone.shape or float((logp - alone).abs().max()) > 1e-5:
                errors.append(f"rl_python: log-probs of group {row['group']} differ from the rollout alone")
    if len(result.log_probs) != len(mine) or record["step"] != 1 or not math.isfinite(record["grad_norm"]):
        errors.append(
            f"rl_python: {len(result.log_probs)} log-prob tensors for {len(mine)} rollouts; record {record}"
        )
    groups = [[row for row in rows if owner(row["group"], dp) == d] for d in range(dp)]
    columns = [rollout_samples(g, True) for g in groups]
    units = [[dict(zip(c, v)) for v in zip(*c.values())] for c in columns]
    expected = rl_loss(start, units, cfg)
    where = f"rl_python dp{recipe.dims.dp_size} cp{recipe.dims.cp_size}"
    ref_grads = {n: p.grad for n, p in start.named_parameters() if p.grad is not None}
    return errors + compare(where, result.loss, grads, float(expected), ref_grads)


def owner(group: int, dp: int) -> int:
    """The DP rank handed a group's rollouts: groups 0-2 to rank 0, the rest to the last rank (under
    DP 2 rank 0 has 4 micro-batches of 3 rollouts and rank 1 two: it runs two fillers)."""
    return min(group // 3, dp - 1)


def rl_loss(start, micro_batches, cfg) -> torch.Tensor:
    """The policy-gradient step: each rollout alone, per response token ratio, clipped surrogate and
    KL (k1 or k3; the reference given or the frozen start), aggregated over the step's rollouts."""
    c = cfg.rl
    reference = _frozen(start)
    per_sample = []  # (sum of m * l, sum of m)
    for unit in (u for batch in micro_batches for u in batch):
        ids = torch.as_tensor(unit["input_ids"]).long()
        n = len(unit["advantages"])
        logp = start(ids[None]).logits[0].float().log_softmax(-1)[-n - 1 : -1].gather(1, ids[-n:, None])[:, 0]
        b, a, m = (
            torch.as_tensor(unit[k]).float() for k in ("behaviour_log_probs", "advantages", "loss_mask")
        )
        ratio = torch.exp(logp - b)
        pg = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - c.clip_low, 1 + c.clip_high) * a)
        kl = torch.zeros(n)
        if c.kl_coef:
            if c.reference == "given":
                ref = torch.as_tensor(unit["ref_log_probs"]).float()
            else:
                with torch.no_grad():
                    ref = (
                        reference(ids[None])
                        .logits[0]
                        .float()
                        .log_softmax(-1)[-n - 1 : -1]
                        .gather(1, ids[-n:, None])[:, 0]
                    )
            kl = logp - ref if c.kl_estimator == "k1" else torch.exp(ref - logp) - (ref - logp) - 1
        per_sample.append(((m * (pg + c.kl_coef * kl)).sum(), m.sum()))
    kept = [(total, count) for total, count in per_sample if count > 0]
    if c.loss_aggregation == "token_mean":
        loss = sum(t for t, _ in kept) / sum(n for _, n in kept)
    elif c.loss_aggregation == "sample_mean":
        loss = sum(t / n for t, n in kept) / len(kept)
    else:
        loss = sum(t for t, _ in kept) / c.sequence_divisor / len(kept)
    loss.backward()
    return loss.detach()


def varied_rollouts(directory: Path, with_reference: bool) -> Path:
    """The first 12 groups of the shipped rollouts made to exercise every path: behaviour log-probs
    moved off the policy's by -0.3, 0 or +0.3 per token (ratios clipped both ways), per-sample rewards
    (groups 0-3), per-token rewards (4-7), given advantages (8-9: one number; 10-11: per token), a masked
    first token in every fifth rollout, and with ``with_reference`` reference log-probs."""
    from automodel.assets import TINY_ROLLOUTS_PATH

    rows = [json.loads(line) for line in TINY_ROLLOUTS_PATH.read_text().splitlines()[:48]]
    out = []
    for i, row in enumerate(rows):
        n, g = len(row["response"]), row["group"]
        row["behaviour_log_probs"] = [
            round(v + 0.3 * ((t + i) % 3 - 1), 6) for t, v in enumerate(row["behaviour_log_probs"])
        ]
        reward = row.pop("reward")
        if 4 <= g < 8:
            row["rewards"] = [round(reward / n + 0.1 * (t % 2), 3) for t in range(n)]
        elif 8 <= g < 10:
            row["advantage"] = round(reward - 0.25 + 0.1 * (i % 3), 3)
        elif g >= 10:
            row["advantages"] = [round(reward - 0.3 + 0.05 * t, 3) for t in range(n)]
        else:
            row["reward"] = reward
        if i % 5 == 0:
            row["loss_mask"] = [0] + [1] * (n - 1)
        if with_reference:
            row["ref_log_probs"] = [
                round(v - 0.2 * (t % 2), 6) for t, v in enumerate(row["behaviour_log_probs"])
            ]
        out.append(row)
    path = directory / f"varied_rollouts{'_ref' if with_reference else ''}.jsonl"
    staging = path.with_suffix(f".{os.getpid()}")
    staging.write_text("".join(json.dumps(r) + "\n" for r in out))
    os.replace(staging, path)
    return path


def margin_pairs(directory: Path) -> Path:
    """The first 32 shipped preference pairs with a ``margin`` column (the same file on every rank)."""
    from automodel.assets import TINY_PREFERENCE_PATH

    path = directory / "margin_pairs.jsonl"
    rows = [json.loads(line) for line in TINY_PREFERENCE_PATH.read_text().splitlines()[:32]]
    text = "".join(
        json.dumps({**row, "margin": round(0.1 * (i % 7) - 0.2, 2)}) + "\n" for i, row in enumerate(rows)
    )
    staging = path.with_suffix(f".{os.getpid()}")
    staging.write_text(text)
    os.replace(staging, path)  # atomic: ranks writing the same file never read a half-written one
    return path


HAND = {
    "tiny_llama_dpo": dpo_family_loss,
    "tiny_llama_kto": kto_loss,
    "tiny_llama_rm": reward_loss,
    "tiny_llama_grpo": rl_loss,
}
