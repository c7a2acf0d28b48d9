"""Build the shipped GRPO rollouts ``automodel/assets/tiny_rollouts.jsonl`` (deterministic).

``python -m automodel.training.tiny_rollouts`` rewrites the file::

    tiny_rollouts.jsonl   NUM_GROUPS groups of GROUP_SIZE rollouts, one per line:
                          {"group", "prompt", "response", "reward", "behaviour_log_probs"}

Each group is a prompt of the tiny tasks (``build_tiny_assets.make_rows``, its own seed) with
GROUP_SIZE responses in a seeded order: the task's answer and corrupted ones
(``build_tiny_assets.corrupt``, the preference data's corruption), each tokenized as the SFT data
is (``[bos] + prompt`` and ``completion + [eos]``); groups whose prompt or responses are longer than
MAX_PROMPT_TOKENS or MAX_RESPONSE_TOKENS are skipped (short answers: the few tokens that tell the
answer from a corruption carry the signal). The reward is a verifier's: 1 for the answer, 0 for
the others.

The responses are chosen, not sampled: the tiny random policy would sample nothing that scores. Their
``behaviour_log_probs`` are the log-probs of the ``tiny_llama_grpo`` recipe's starting policy (its
``model.config`` initialized from ``trainer.seed`` exactly as a run initializes it,
:func:`automodel.models.build.initialized_model`), each rollout run alone, so the run's first step
is on-policy: every importance ratio is 1 (to float32 rounding).

It lives with the trainer, not in ``automodel/assets``, because it builds the recipe's model.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import datasets
import torch

from automodel.assets import TINY_ROLLOUTS_PATH
from automodel.assets.build_tiny_assets import SEED, corrupt, make_rows
from automodel.config import build_section, load_recipe
from automodel.data.preference import completion_start
from automodel.data.sft import load_tokenizer, tokenize_sft_dataset
from automodel.models.build import initialized_model

ROLLOUT_SEED = SEED + 5  # other task instances than the SFT rows and the preference pairs
NUM_GROUPS = 200
GROUP_SIZE = 4
MAX_PROMPT_TOKENS = 48  # short prompts: many groups per micro-batch
MAX_RESPONSE_TOKENS = 6
RECIPE = "tiny_llama_grpo"


def make_groups(seed: int = ROLLOUT_SEED, num_groups: int = 10 * NUM_GROUPS) -> list[dict]:
    """``num_groups`` text groups ``{"prompt", "responses", "rewards"}``, the same for the same arguments.

    Example: {"prompt": "What is 12 plus 30?\\nAnswer:", "responses": [" 45", " 42", " 38", " 44"],
    "rewards": [0, 1, 0, 0]}.
    """
    rng = random.Random(seed)
    groups = []
    for row in make_rows(seed, 20 * num_groups):
        if len(groups) == num_groups:
            break
        answer = row["completion"][1:]
        wrong: list[str] = []
        for _ in range(50):  # a short answer may have fewer distinct corruptions: then it is skipped
            candidate = corrupt(answer, rng)
            if candidate != answer and candidate not in wrong:
                wrong.append(candidate)
            if len(wrong) == GROUP_SIZE - 1:
                break
        if len(wrong) < GROUP_SIZE - 1:
            continue
        responses = [answer, *wrong]
        order = list(range(GROUP_SIZE))
        rng.shuffle(order)
        groups.append({
            "prompt": row["prompt"],
            "responses": [" " + responses[i] for i in order],
            "rewards": [1.0 if i == 0 else 0.0 for i in order],
        })  # fmt: skip
    return groups


def tokenized_rollouts(groups: list[dict], num_groups: int = NUM_GROUPS) -> list[dict]:
    """The first ``num_groups`` groups within the length limits as rollouts of token ids (numbered
    0, 1, ...), tokenized as SFT prompt/completion samples."""
    tokenizer = load_tokenizer("tiny")
    rows = [{"prompt": g["prompt"], "completion": r} for g in groups for r in g["responses"]]
    tokenized = tokenize_sft_dataset(datasets.Dataset.from_list(rows), tokenizer, format="prompt_completion")
    rollouts = []
    for start in range(0, len(tokenized), GROUP_SIZE):
        members = []
        for i in range(start, start + GROUP_SIZE):
            sample = tokenized[i]
            s = completion_start(sample["loss_mask"])
            members.append({
                "group": len(rollouts) // GROUP_SIZE,
                "prompt": sample["input_ids"][: s + 1],
                "response": sample["labels"][s:],
                "reward": groups[i // GROUP_SIZE]["rewards"][i % GROUP_SIZE],
            })  # fmt: skip
        if all(
            len(m["prompt"]) <= MAX_PROMPT_TOKENS and len(m["response"]) <= MAX_RESPONSE_TOKENS
            for m in members
        ):
            rollouts += members
        if len(rollouts) == num_groups * GROUP_SIZE:
            break
    return rollouts


@torch.no_grad()
def behaviour_log_probs(rollouts: list[dict]) -> list[list[float]]:
    """The recipe's starting policy's log-probs of each rollout's response tokens, each rollout alone."""
    cfg = load_recipe(RECIPE)
    spec = build_section(cfg, "model")
    model = initialized_model(spec, spec.hf_config(), cfg.trainer.seed).eval()
    out = []
    for rollout in rollouts:
        ids = torch.tensor([*rollout["prompt"], *rollout["response"]])
        n = len(rollout["response"])
        logp = model(ids[None]).logits[0].float().log_softmax(-1)
        out.append(logp[-n - 1 : -1].gather(1, ids[-n:, None])[:, 0].tolist())
    return out


def build_tiny_rollouts(path: Path = TINY_ROLLOUTS_PATH, num_groups: int = NUM_GROUPS) -> Path:
    rollouts = tokenized_rollouts(make_groups(), num_groups)
    for rollout, logps in zip(rollouts, behaviour_log_probs(rollouts)):
        rollout["behaviour_log_probs"] = [round(v, 6) for v in logps]
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rollouts))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=TINY_ROLLOUTS_PATH)
    print(build_tiny_rollouts(parser.parse_args().out))


if __name__ == "__main__":
    main()
