"""Build the tiny SFT dataset and tokenizer shipped in ``automodel/assets`` (deterministic).

``python -m automodel.assets.build_tiny_assets`` rewrites these files byte for byte::

    tiny_sft.jsonl                          NUM_ROWS rows with columns prompt, completion, messages
    tiny_preference.jsonl                   NUM_PAIRS rows with columns prompt, chosen, rejected
    tiny_tokenizer/tokenizer.json           byte-level BPE with VOCAB_SIZE ids, trained on the rows
    tiny_tokenizer/tokenizer_config.json    bos/eos/pad tokens and the chat template
    tiny_corpus/part-0.txt, part-1.jsonl    NUM_DOCUMENTS pretraining documents (blocks; {"text": ...})
    tiny_tools.jsonl                        NUM_TOOL_ROWS tool-calling chats: messages, tools
    tiny_tools_tokenizer/...                a ChatML-style tokenizer (VOCAB_SIZE ids) for them (TOOLS_TEMPLATE)

Every row is one instance of a templated task that a model of a few million parameters starts to
learn within a hundred CPU steps (copy, reverse, sort, add, look up, count, capitalize). Task sizes
are drawn log-uniformly, so samples spread from about 10 to 300 tokens and packing has work to do.

One row in both forms (the prompt ends in a cue, the completion starts with its space)::

    prompt      "What is 12 plus 30?\\nAnswer:"
    completion  " 42"
    messages    [{"role": "user", "content": "What is 12 plus 30?"},
                 {"role": "assistant", "content": "42"}]

The chat template renders it as ``<|bos|><|user|>What is 12 plus 30?<|eos|><|assistant|>42<|eos|>``
with ``{% generation %}`` around the assistant content and its eos, so
``return_assistant_tokens_mask=True`` marks exactly the tokens to learn.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SEED = 20260
NUM_ROWS = 3000
NUM_PAIRS = 1000
PREFERENCE_SEED = SEED + 1  # other task instances than the SFT rows
CORPUS_SEED = SEED + 2
NUM_DOCUMENTS = 160
VOCAB_SIZE = 512
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)  # ids 0..5 in this order: padding is id 0

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('role must be system, user or assistant, got ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + eos_token -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)

# The tool-calling chats (tiny_tools.jsonl): ChatML turns with the row's tools in the system turn, a
# <think> block where the message carries reasoning, tool calls as <tool_call> JSON and tool results
# in tool turns. No {% generation %} blocks: the data path finds each assistant turn from the
# template's rendering (automodel.data.chat), as it does for most checkpoints' templates.
NUM_TOOL_ROWS = 600
TOOLS_SEED = SEED + 2
TOOLS_SPECIAL = (PAD, "<|im_start|>", "<|im_end|>")  # ids 0..2
TOOLS_MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # added tokens, not special
TOOLS_TEMPLATE = (
    "{%- if tools or messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- endif -%}"
    "{%- if tools -%}"
    "{{- '\\n\\n' if messages[0].role == 'system' else '' -}}{{- '# Tools' -}}"
    "{%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if message.reasoning_content -%}{{- '<think>' + message.reasoning_content + '</think>\\n' -}}{%- endif -%}"
    "{{- message.content or '' -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set function = call.function if call.function is defined else call -%}"
    "{{- '<tool_call>' + {'name': function.name, 'arguments': function.arguments} | tojson + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role in ['user', 'tool'] -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- elif not loop.first -%}"
    "{{- raise_exception('role must be system (first), user, assistant or tool, got ' + message.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Short everyday words: the tasks only need distinct, frequent, BPE-friendly tokens.
WORDS = (
    "apple bread chair cloud dance eagle field glass horse island juice kite lemon music night "
    "ocean paper queen river stone table umbrella voice water yellow zebra actor basket candle "
    "desert engine forest garden hammer insect jacket kettle ladder mirror needle orange pencil "
    "rabbit saddle tiger violin wagon window butter cotton dinner finger ginger honey letter "
    "market number pepper rocket silver summer winter spring autumn bridge castle dragon feather "
    "flower guitar helmet jungle monkey planet pocket puzzle shadow spider sugar tomato travel "
    "valley wallet blue green red black white brown quick slow happy quiet bright small large "
    "warm cold soft loud early late"
).split()
KEYS = WORDS[:40]  # lookup keys must be unique within a row


def _log_uniform_int(rng: random.Random, low: int, high: int) -> int:
    """An int in [low, high], log-uniform: short samples are common, long ones still appear."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def _words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(WORDS) for _ in range(n)]


def _reverse_word(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    question = rng.choice(("Reverse the letters of the word {}.", "Spell {} backwards."))
    return question.format(word), word[::-1]


def _spell(rng: random.Random) -> tuple[str, str]:
    word = rng.choice(WORDS)
    return f"Spell the word {word} with dashes.", "-".join(word)


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randrange(1000), rng.randrange(1000)
    question = rng.choice(("What is {} plus {}?", "Add {} and {}."))
    return question.format(a, b), str(a + b)


def _capitalize(rng: random.Random) -> tuple[str, str]:
    text = " ".join(_words(rng, _log_uniform_int(rng, 1, 30)))
    return f"Rewrite in capital letters: {text}", text.upper()


def _sort_numbers(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randrange(100) for _ in range(_log_uniform_int(rng, 2, 40))]
    question = "Sort these numbers from smallest to largest: " + ", ".join(map(str, numbers))
    return question, ", ".join(map(str, sorted(numbers)))


def _repeat(rng: random.Random) -> tuple[str, str]:
    text = " ".join(_words(rng, _log_uniform_int(rng, 1, 60)))
    return f"Repeat this list exactly: {text}", text


def _reverse_order(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, _log_uniform_int(rng, 2, 50))
    return "Write these words in reverse order: " + " ".join(words), " ".join(reversed(words))


def _count(rng: random.Random) -> tuple[str, str]:
    words = _words(rng, _log_uniform_int(rng, 1, 40))
    return "How many words are in this list? " + " ".join(words), str(len(words))


def _lookup(rng: random.Random) -> tuple[str, str]:
    keys = rng.sample(KEYS, _log_uniform_int(rng, 2, len(KEYS)))
    values = {key: rng.randrange(100) for key in keys}
    facts = "\n".join(f"{key} = {value}" for key, value in values.items())
    asked = rng.choice(keys)
    return f"Here is a table:\n{facts}\nWhat is the value of {asked}?", str(values[asked])


TASKS: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _reverse_word, _spell, _add, _capitalize, _sort_numbers, _repeat, _reverse_order, _count, _lookup,
)  # fmt: skip


def make_rows(seed: int = SEED, num_rows: int = NUM_ROWS) -> list[dict]:
    """Rows of the tiny SFT dataset, the same for the same arguments.

    Example row (task "add")::

        {"prompt": "What is 12 plus 30?\\nAnswer:", "completion": " 42",
         "messages": [{"role": "user", "content": "What is 12 plus 30?"},
                      {"role": "assistant", "content": "42"}]}
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        question, answer = rng.choice(TASKS)(rng)
        rows.append(
            {
                "prompt": f"{question}\nAnswer:",
                "completion": f" {answer}",
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            }
        )
    return rows


def _schema(name: str, description: str, **properties: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": v} for k, v in properties.items()}, "required": list(properties)}}}  # fmt: skip


TOOLS = (
    _schema("add", "The sum of two integers.", a="integer", b="integer"),
    _schema("reverse_words", "The words of a text in reverse order.", text="string"),
    _schema("count_words", "How many words a text has.", text="string"),
)


def make_tool_rows(seed: int = TOOLS_SEED, num_rows: int = NUM_TOOL_ROWS) -> list[dict]:
    """Tool-calling chats over the tiny tasks, the same for the same arguments. A row asks a question;
    the assistant calls the tool that answers it (with a reasoning trace on every other row), reads
    the tool's result and answers with it, or answers directly where no tool fits. Every fifth row opens
    with a greeting whose reply is not learned (``weight: 0``), and the tools ride with each row.

    Example row::

        {"tools": [...], "messages": [
            {"role": "user", "content": "What is 12 plus 30?"},
            {"role": "assistant", "content": null, "reasoning_content": "A sum: call add.",
             "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}]},
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "42"}]}
    """
    rng = random.Random(seed)
    rows = []
    for index in range(num_rows):
        kind = rng.choice(("add", "reverse_words", "count_words", None))
        if kind == "add":
            a, b = rng.randrange(1000), rng.randrange(1000)
            question, arguments, result = f"What is {a} plus {b}?", {"a": a, "b": b}, str(a + b)
            why = "A sum: call add."
        elif kind is not None:
            words = " ".join(_words(rng, _log_uniform_int(rng, 2, 12)))
            verb = (
                "Write these words in reverse order:" if kind == "reverse_words" else "How many words are in:"
            )
            question, arguments = f"{verb} {words}", {"text": words}
            result = " ".join(reversed(words.split())) if kind == "reverse_words" else str(len(words.split()))
            why = f"The tool {kind} does this."
        else:
            question, result = _capitalize(rng)
        messages = []
        if index % 5 == 0:
            messages += [{"role": "user", "content": "Hello"},
                         {"role": "assistant", "content": "Hello! Ask me a question.", "weight": 0}]  # fmt: skip
        messages.append({"role": "user", "content": question})
        if kind is not None:
            call = {"role": "assistant", "content": None,
                    "tool_calls": [{"type": "function", "function": {"name": kind, "arguments": arguments}}]}  # fmt: skip
            if index % 2:
                call["reasoning_content"] = why
            messages += [call, {"role": "tool", "content": result}]
        messages.append({"role": "assistant", "content": result})
        rows.append({"tools": list(TOOLS), "messages": messages})
    return rows


def corrupt(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: a number moved by 1..9, a list's words in another order, a word's
    letters reversed or one dropped. Never equal to ``answer``.

    Example: "42" -> "45"; "red blue green" -> "blue red green"; "tiger" -> "tger".
    """
    if answer.lstrip("-").isdigit():
        return str(int(answer) + rng.choice([-1, 1]) * rng.randint(1, 9))
    for separator in (", ", " "):
        parts = answer.split(separator)
        if len(parts) > 1 and len(set(parts)) > 1:
            wrong = parts[:]
            while wrong == parts:
                rng.shuffle(wrong)
            return separator.join(wrong)
    if len(set(answer)) > 1 and rng.random() < 0.5:
        return answer[::-1] if answer[::-1] != answer else answer[1:]
    cut = rng.randrange(len(answer))
    return (answer[:cut] + answer[cut + 1 :]) or answer + answer


def make_preference_rows(seed: int = PREFERENCE_SEED, num_rows: int = NUM_PAIRS) -> list[dict]:
    """Preference pairs over the same tasks: the correct answer is chosen, a corrupted one rejected.

    Example row::

        {"prompt": "What is 12 plus 30?\\nAnswer:", "chosen": " 42", "rejected": " 45"}
    """
    rng = random.Random(seed)
    return [
        {"prompt": row["prompt"], "chosen": row["completion"],
         "rejected": " " + corrupt(row["completion"][1:], rng)}
        for row in make_rows(seed, num_rows)
    ]  # fmt: skip


def make_corpus_documents(seed: int = CORPUS_SEED, num_documents: int = NUM_DOCUMENTS) -> list[str]:
    """Pretraining documents over the same tasks: each is 1 to 60 task instances (log-uniform)
    written as ``question\nAnswer: answer`` lines, so that a few are longer than a pack of 1,024
    tiny tokens. No line is blank (a blank line separates the documents of a ``.txt`` file).

    Example document of two instances::

        What is 12 plus 30?
        Answer: 42
        Spell the word tiger with dashes.
        Answer: t-i-g-e-r
    """
    rng = random.Random(seed)
    documents = []
    for _ in range(num_documents):
        instances = [rng.choice(TASKS)(rng) for _ in range(_log_uniform_int(rng, 1, 60))]
        documents.append("\n".join(f"{question}\nAnswer: {answer}" for question, answer in instances))
    return documents


def train_tokenizer(
    texts: list[str],
    vocab_size: int = VOCAB_SIZE,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    markup: tuple[str, ...] = (),
    bos: str | None = BOS,
) -> Tokenizer:
    """A byte-level BPE over ``texts``: ``special_tokens`` take the first ids, ``markup`` tokens are
    added (single tokens, not special) within ``vocab_size``, and ``bos`` is prepended on encode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(markup),
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in markup])
    if bos is not None:  # like Llama tokenizers: encode(text) adds bos; the chat template writes bos itself
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, special_tokens.index(bos))]
        )
    return tokenizer


def tokenizer_config() -> dict:
    """``tokenizer_config.json`` for ``transformers.AutoTokenizer`` (no ``config.json`` needed)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": list(ROLE_TOKENS),
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def tools_tokenizer_config() -> dict:
    """``tokenizer_config.json`` of the tool-calling tokenizer: no bos, ``<|im_end|>`` ends a turn."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": PAD,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": TOOLS_TEMPLATE,
    }


def _rendered(rows: list[dict]) -> list[str]:
    """The rows as TOOLS_TEMPLATE renders them, special and markup tokens cut out (BPE training text)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, _ = render_jinja_template(
        [row["messages"] for row in rows], tools=list(TOOLS), chat_template=TOOLS_TEMPLATE
    )
    markup = re.compile("|".join(re.escape(t) for t in (*TOOLS_SPECIAL, *TOOLS_MARKUP)))
    return [markup.sub(" ", text) for text in texts]


def build_tiny_assets(out_dir: Path, seed: int = SEED) -> list[Path]:
    """Write the dataset and tokenizer under ``out_dir``; returns the written paths."""
    rows = make_rows(seed)
    tokenizer = train_tokenizer([row["prompt"] + row["completion"] for row in rows])
    tokenizer_dir = out_dir / "tiny_tokenizer"
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tiny_corpus").mkdir(exist_ok=True)
    documents = make_corpus_documents(seed + 2)
    half = len(documents) // 2
    tool_rows = make_tool_rows(seed + 2)
    tools_tokenizer = train_tokenizer(_rendered(tool_rows), VOCAB_SIZE, TOOLS_SPECIAL, TOOLS_MARKUP, bos=None)
    tools_dir = out_dir / "tiny_tools_tokenizer"
    tools_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        out_dir / "tiny_sft.jsonl": "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows),
        out_dir / "tiny_preference.jsonl": "".join(
            json.dumps(row, separators=(",", ":")) + "\n" for row in make_preference_rows(seed + 1)
        ),
        tokenizer_dir / "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        tokenizer_dir / "tokenizer_config.json": json.dumps(tokenizer_config(), indent=2) + "\n",
        out_dir / "tiny_corpus" / "part-0.txt": "\n\n".join(documents[:half]) + "\n",
        out_dir / "tiny_corpus" / "part-1.jsonl": "".join(
            json.dumps({"text": text}, separators=(",", ":")) + "\n" for text in documents[half:]
        ),
        out_dir / "tiny_tools.jsonl": "".join(
            json.dumps(row, separators=(",", ":")) + "\n" for row in tool_rows
        ),
        tools_dir / "tokenizer.json": tools_tokenizer.to_str(pretty=True) + "\n",
        tools_dir / "tokenizer_config.json": json.dumps(tools_tokenizer_config(), indent=2) + "\n",
    }
    for path, text in paths.items():
        path.write_text(text, encoding="utf-8", newline="\n")
    return list(paths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args()
    for path in build_tiny_assets(args.out_dir, args.seed):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
