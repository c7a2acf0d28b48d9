"""``automodel data RECIPE``: what a recipe trains on, before any model is built.

Prints a few samples as the model sees them with the learned tokens (``loss_mask`` 1) between
``[[`` and ``]]`` (chat data: tool calls, tool outputs and reasoning marked apart, :data:`MARKS`), the
row and token counts, the fill of the micro-batches and the steps per epoch.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

from omegaconf import DictConfig

from automodel.config import build_section
from automodel.console import configure_console
from automodel.data.batching import LoaderEnv, sample_cap, sample_lengths, unit_token_counts
from automodel.data.chat import CONTEXT, LEARNED, REASONING_LEARNED, REASONING_MASKED, TOOL_CALL, TOOL_OUTPUT
from automodel.data.sft import other_tokenizer_warning
from automodel.data.sft_data import SFTData
from automodel.errors import ConfigError, DataError
from automodel.models.inputs import model_inputs

# How each kind of token is shown (automodel.data.chat's token kinds); context tokens are shown bare.
MARKS = {
    LEARNED: ("[[", "]]"),
    TOOL_CALL: ("{{", "}}"),
    TOOL_OUTPUT: ("<<", ">>"),
    REASONING_MASKED: ("((", "))"),
    REASONING_LEARNED: ("[(", ")]"),
}
LEGEND = ("[[learned]]  {{learned tool call}}  <<tool output, never learned>>  ((reasoning, not learned))  "
          "[(reasoning, learned)]")  # fmt: skip
logger = logging.getLogger("automodel")
FILL_BATCHES = 200  # micro-batches the fill is measured over (all of them when the epoch is shorter)


def render_sample(
    input_ids: list[int],
    labels: list[int],
    loss_mask: list[int],
    tokenizer: Any,
    kinds: list[int] | None = None,
) -> str:
    """The sample's text with each run of learned tokens between ``[[`` and ``]]``, and with ``kinds``
    (one per label: :mod:`automodel.data.chat`'s token kinds) each run of a kind between its
    :data:`MARKS`.

    ``labels`` are the next tokens of ``input_ids``, so the sample is ``input_ids + labels[-1:]`` and
    token t + 1 is learned where ``loss_mask[t]`` is 1. Example (prompt "1+2=", completion "3<eos>")::

        <bos>1+2=[[3<eos>]]

    A tool call, its output and a masked reasoning trace (a Qwen3-shaped template)::

        <|im_start|>assistant\n((<think>\nNeed the tool.\n</think>\n\n)){{<tool_call>...</tool_call><|im_end|>}}
        <|im_start|>user\n<tool_response>\n<<18 C>>\n</tool_response><|im_end|>
    """
    ids = [*input_ids, labels[-1]]
    shown = [CONTEXT, *(kinds if kinds is not None else [LEARNED * bool(m) for m in loss_mask])]
    if ids[-1] < 0:  # a ``tokens`` row whose last label is ignored (-100)
        ids, shown = ids[:-1], shown[:-1]
    parts = []
    for kind, run in itertools.groupby(zip(ids, shown, strict=True), key=lambda pair: pair[1]):
        text = tokenizer.decode([token for token, _ in run], skip_special_tokens=False)
        opening, closing = MARKS.get(kind, ("", ""))
        parts.append(f"{opening}{text}{closing}")
    return "".join(parts)


def preview(cfg: DictConfig, samples: int = 3) -> dict[str, Any]:
    """Print samples, counts, fill and steps per epoch for one process of ``WORLD_SIZE`` (default 1);
    returns the figures."""
    configure_console(is_main=True)
    model, data, batching = (
        build_section(cfg, "model"),
        build_section(cfg, "data"),
        build_section(cfg, "packing"),
    )
    trainer, parallel = build_section(cfg, "trainer"), build_section(cfg, "parallel")
    objective = next((name for name in ("dpo", "reward", "rl") if cfg.get(name) is not None), None)
    if objective is not None:
        raise ConfigError(
            f"automodel data previews SFT data; the data of a {objective} section (preference pairs, KTO "
            "samples, rollouts) is not shown yet"
        )
    try:
        tokenizer = data.load_tokenizer(
            trust_remote_code=model.trust_remote_code, checkpoint=model.pretrained_path
        )
        warning = other_tokenizer_warning(
            tokenizer,
            getattr(data, "tokenizer", None),
            model.pretrained_path,
            trust_remote_code=model.trust_remote_code,
        )
        if warning:  # as finetune says it: the samples shown are this tokenizer's
            logger.warning("%s", warning)
        kinds = {"token_kinds": True} if isinstance(data, SFTData) else {}  # what each chat token is
        dataset, validation = data.build(
            tokenizer, sample_cap=sample_cap(batching, parallel.cp_size), **kinds
        )
    except DataError:
        raise
    except ValueError as error:
        raise DataError(str(error)) from error
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cp_size = parallel.cp_size
    env = LoaderEnv(
        dp_rank=0,
        dp_size=max(1, world // cp_size),
        cp_size=cp_size,
        seed=trainer.seed,
        padding_idx=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
    )
    stream = batching.build(dataset.remove_columns("token_kinds") if kinds else dataset, env)

    shown = []
    for index in range(min(samples, len(dataset))):
        row = dataset[index]
        ids, labels, mask = (list(map(int, row[name])) for name in ("input_ids", "labels", "loss_mask"))
        shown.append((ids, labels, mask, row.get("token_kinds") or [LEARNED * m for m in mask]))
    if any(kind not in (CONTEXT, LEARNED) for *_, row_kinds in shown for kind in row_kinds):
        print(f"legend: {LEGEND}")
    for index, (ids, labels, mask, row_kinds) in enumerate(shown):
        print(f"--- sample {index + 1} of {len(dataset)} ({len(ids)} tokens, "
              f"{sum(mask)} learned between {MARKS[LEARNED][0]} {MARKS[LEARNED][1]})")  # fmt: skip
        print(render_sample(ids, labels, mask, tokenizer, row_kinds))
    lengths = sample_lengths(dataset)
    tokens, learned = stream.epoch_tokens()
    in_data = tuple(int(counts.sum()) for counts in unit_token_counts(dataset))
    measured = min(FILL_BATCHES, stream.batches_per_epoch)
    real = slots = 0
    for batch in itertools.islice(stream, measured):
        inputs = model_inputs(batch, vocab_size=len(tokenizer))
        real, slots = real + inputs["real_tokens"], slots + inputs["slots"]
    figures = {
        "rows": len(dataset),
        "tokens": tokens,  # what one epoch trains: the samples of its dealt micro-batches
        "learned_tokens": learned,
        "data_tokens": in_data[0],
        "data_learned_tokens": in_data[1],
        "validation_rows": 0 if validation is None else len(validation),
        "micro_batches_per_epoch": stream.batches_per_epoch,
        "fill": real / slots,
        "steps_per_epoch": stream.batches_per_epoch // trainer.grad_accum_steps,
    }
    print("---")
    print(
        f"rows {figures['rows']:,} (validation {figures['validation_rows']:,}), one epoch: tokens {tokens:,}, "
        f"learned {learned:,} ({100 * learned / max(1, tokens):.1f}%), sample length {min(lengths)}..{max(lengths)}"
    )
    if in_data != (tokens, learned):
        print(f"the rows hold {in_data[0]:,} tokens, {in_data[1]:,} learned: the rest is dropped by the batching mode "
              "or not dealt to the data-parallel ranks (see the log)")  # fmt: skip
    print(f"fill {100 * figures['fill']:.1f}% of the token slots (over {measured} micro-batches)")
    steps = stream.batches_per_epoch / trainer.grad_accum_steps  # below 1: a step spans epochs
    epochs = trainer.max_steps / max(steps, 1e-9)
    print(f"{stream.batches_per_epoch} micro-batches per epoch on each of {env.dp_size} data-parallel rank(s) "
          f"(WORLD_SIZE={world}, cp_size={cp_size}); grad_accum_steps {trainer.grad_accum_steps}: "
          f"{steps:.3g} steps per epoch, max_steps {trainer.max_steps} = {epochs:.1f} epochs")  # fmt: skip
    return figures
