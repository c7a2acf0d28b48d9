"""``automodel``: finetune | data | recipes | bench | check-gpu | families."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from automodel.benchmarks import BENCHMARKS
from automodel.errors import PeerLostError, Terminated, UserError, WriteError, refused_write, sigterm_raises

# Writes the filesystem refuses (the user's machine, not a bug): one line naming the file where the
# error does, with the way out (automodel.errors.WRITE_FIXES), instead of a traceback.
RUN_OUTPUTS = "trainer.output_dir (and packing.cache_dir)"

USAGE = """automodel <command> [...]    (automodel --version; --debug: tracebacks of input errors)

  finetune RECIPE [OVERRIDES...]   train from a recipe (name or .yaml path); overrides like trainer.max_steps=10
                                   (under torchrun for several processes or nodes); --cfg job prints the
                                   resolved recipe and exits; automodel finetune --help: groups, keys, torchrun
  data RECIPE [OVERRIDES...]       rendered samples with the learned tokens marked, token/row counts, pack fill,
                                   steps per epoch; builds no model
  recipes                          the shipped recipes and the options of each config group
  tokenize SOURCE OUTPUT [...]     text files (.txt/.jsonl/.parquet, a directory or glob) -> a token file for
                                   pretraining (flat token ids + document offsets, memory-mapped: data=corpus)
  bench packing [...]              packing speed, memory and tightness
  bench throughput [...]           real tokens/s of packed THD against padded batches (CPU)
  bench batching [...]             rmpad / dyn_bsz fill and speed against VeOmni's arrival-order scan
  bench balance [...]              balanced packing: per-step load balance across DP ranks
  bench gpu [...]                  every GPU figure: tokens/s, MFU, memory, host syncs per backend (tiny on CPU)
  bench init_memory [...]          host memory of a from-scratch build: each rank its own shards vs rank 0 + broadcast
  bench tokenize [...]             tokenizing and packing a generated text corpus against datasets.map; peak memory
  bench chat_masks [...]           chat rows masked from their own template: rows and tokens per CPU second
  bench cli_latency [...]          how fast the CLI answers --cfg job, typos and bad values
  check-gpu [...]                  Transformer Engine against the portable attention, hybrids' mixer kernels against their reference, on this machine's GPUs
  families [--verify [TYPE ...]]   the supported model types; --verify re-runs the differential check
  torchrun [OPTIONS] COMMAND ...   torchrun's launch of automodel COMMAND on every rank, with automodel's exit
                                   codes (2: input error, printed once; 143/130: stopped on a signal)
"""


def console() -> NoReturn:
    """``automodel`` on the command line (and ``python -m automodel``): :func:`main`'s exit code."""
    sys.exit(main(exit_at_once_when_out_of_memory=True))


def main(argv: list[str] | None = None, exit_at_once_when_out_of_memory: bool = False) -> int:
    """Run one command of ``argv`` (``sys.argv[1:]`` when None); its exit code. With
    ``exit_at_once_when_out_of_memory``, an allocation the machine refused ends the process right
    after its line, without the interpreter's teardown: a library whose mapping failed half-way can
    crash that (SIGSEGV instead of the exit code 1 just printed)."""
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv or os.environ.get("AUTOMODEL_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        with sigterm_raises():  # outside the training loop too: one line, staging removed, exit 143
            return _dispatch(command, rest, argv, debug)
    except UserError as error:  # the user's input: one line; the project's own bugs keep their traceback
        if debug:
            raise
        if _first_to_report(_one_line(error)):
            print(f"automodel {command}: {error.kind} error: {_one_line(error)}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated) as error:  # Ctrl-C (a second one while training), or SIGTERM
        if debug:
            raise
        signum = getattr(error, "signum", signal.SIGINT)
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        done = f" ({error})" if str(error) else ""
        again = ("a run resumes from its newest checkpoint when the same command runs again" if command == "finetune"
                 else "run the same command again")  # fmt: skip
        print(f"automodel {command}: {what}{done}; nothing half-written is left: {again}", file=sys.stderr)
        return 128 + signum
    except PeerLostError as error:  # a rank froze or died: the ranks that answer name the ones that do not
        if debug:
            raise
        print(f"automodel {command}: {error}", file=sys.stderr)
        return 1
    except WriteError as error:  # a checkpoint or the export, with the bytes needed and free
        if debug:
            raise
        print(f"automodel {command}: {error}", file=sys.stderr)
        return 1
    except (MemoryError, RuntimeError, ImportError) as error:  # an allocation refused, not the project's bug
        if debug or not _out_of_memory(error):
            raise
        print(f"automodel {command}: out of memory: {_one_line(error)[:200]} (--debug shows the traceback); "
              f"{_memory_limit()}lower the sizes the run needs (model, packing, trainer.grad_accum_steps) or run "
              "where there is more memory", file=sys.stderr)  # fmt: skip
        if exit_at_once_when_out_of_memory:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return 1
    except OSError as error:
        fix = refused_write(error, RUN_OUTPUTS)
        if fix is None or debug:
            raise
        where = f"{error.filename}: " if error.filename else ""
        cache = _hugging_face_cache(error.filename)
        if cache is not None:  # datasets' or the hub's cache, not the run's directory
            fix = f"the Hugging Face cache {cache} is not writable: set HF_HOME (or HF_DATASETS_CACHE) to a writable directory"
        print(f"automodel {command}: {where}{error.strerror} (--debug shows the traceback): {fix}, then run the "
              "same command again (a run resumes from its newest checkpoint)", file=sys.stderr)  # fmt: skip
        return 1


_ALLOCATION_FAILED = (
    "can't allocate memory",
    "Cannot allocate memory",
    "failed to map segment",
    "out of memory",
)


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation the machine or a limit refused (torch's allocators, a shared
    library that could not be mapped under ``ulimit -v``, CUDA's out of memory)."""
    return isinstance(error, MemoryError) or any(text in str(error) for text in _ALLOCATION_FAILED)


def _memory_limit() -> str:
    """``ulimit -v``, in words, when this process has an address-space limit."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return ""
    return f"this process's address space is limited (ulimit -v {soft // 1024} KiB): raise the limit, or "


def _hugging_face_cache(filename: str | None) -> str | None:
    """The Hugging Face cache directory (HF_HOME, HF_DATASETS_CACHE, HF_HUB_CACHE, else
    ``~/.cache/huggingface``) that ``filename`` is in, or None."""
    if not filename:
        return None
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    for cache in (home, os.environ.get("HF_DATASETS_CACHE"), os.environ.get("HF_HUB_CACHE")):
        if cache and os.path.abspath(os.fspath(filename)).startswith(os.path.abspath(cache)):
            return cache
    return None


def _first_to_report(message: str) -> bool:
    """Whether this process prints ``message``: under torchrun every rank meets the same input error,
    and the first to count it in the launch's store prints it (each distinct message once; printed
    anyway when the store cannot be reached within a few seconds)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or "MASTER_ADDR" not in os.environ:
        return True
    import datetime
    import hashlib

    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=datetime.timedelta(seconds=5),
        )  # fmt: skip
        key = "automodel/input_error/" + hashlib.sha256(message.encode()).hexdigest()[:16]
        return store.add(key, 1) == 1
    except (RuntimeError, ValueError, KeyError):  # no store to count in: say it
        return True


def _torchrun(argv: list[str], debug: bool = False) -> int:
    """``automodel torchrun [torchrun options] COMMAND [ARGS...]``: ``torchrun ... -m automodel COMMAND
    ARGS`` run in this process, with automodel's exit codes: 2 when a rank stopped on an input error
    (printed once, by the first rank), 143/130 when the ranks stopped on a signal after their
    checkpoint, else 1 naming the first failed rank (torchrun itself exits 1 with its traceback)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    if not argv or argv[0] in ("-h", "--help"):
        print("automodel torchrun [torchrun options] COMMAND [ARGS...]: runs python -m automodel COMMAND ARGS on "
              "every rank (torchrun --help lists the options)")  # fmt: skip
        return 0 if argv else 2
    args = parse_args(argv)
    args.module, args.no_python = True, False
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = "automodel"
    debug_before = os.environ.get("AUTOMODEL_DEBUG")
    if debug:  # the ranks inherit the environment: each shows its traceback too
        os.environ["AUTOMODEL_DEBUG"] = "1"
    try:
        run(args)
    except ChildFailedError as error:
        rank, first = error.get_first_failure()
        codes = sorted({failure.exitcode for failure in error.failures.values()})
        if 2 in codes:
            return 2  # the input error is above, printed by the first rank that met it
        stopped = [c for c in codes if c in (128 + signal.SIGTERM, 128 + signal.SIGINT)]
        print(f"automodel torchrun: rank {rank} exited with code {first.exitcode} (all exit codes {codes}); "
              "its output above says why", file=sys.stderr)  # fmt: skip
        return stopped[0] if stopped and len(codes) == len(stopped) else 1
    except SignalException as error:  # torchrun itself was signalled; it has stopped the ranks
        return 128 + error.sigval
    except RendezvousError as error:
        print(f"automodel torchrun: the ranks did not meet: {_one_line(error)}; start the same command on every "
              "node (--node-rank 0 .. --nnodes - 1) with the same --rdzv-endpoint", file=sys.stderr)  # fmt: skip
        return 2
    finally:
        if debug_before is None:
            os.environ.pop("AUTOMODEL_DEBUG", None)
        else:
            os.environ["AUTOMODEL_DEBUG"] = debug_before
    return 0


def _dispatch(command: str, rest: list[str], argv: list[str], debug: bool = False) -> int:
    if command == "--version":
        from automodel import __version__

        print(f"automodel {__version__}")
        return 0
    if command == "finetune":
        return _finetune(rest)
    if command == "data":
        return _data(rest)
    if command == "recipes":
        return _recipes()
    if command == "tokenize":
        return _tokenize(rest)
    if command == "bench" and rest and rest[0] in BENCHMARKS:
        from automodel.benchmarks import run_benchmark

        return run_benchmark(rest[0], rest[1:])
    if command == "torchrun":
        return _torchrun(rest, debug)
    if command == "families":
        from automodel.models.support import main as families

        return families(rest)
    if command == "check-gpu":
        import torch

        from automodel.attention.check_gpu import main as check_gpu
        from automodel.attention.check_kit import EXIT_FAILED, all_passed, format_table
        from automodel.models.check_mixers import mixer_kernel_rows

        code = check_gpu(rest)
        if not torch.cuda.is_available():
            return code
        rows = mixer_kernel_rows(torch.device("cuda", torch.cuda.current_device()))
        print(format_table(rows))
        return code if all_passed(rows) else EXIT_FAILED
    print(f"automodel: unknown command {' '.join(argv[:2])!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def _count(text: str) -> int:
    """An argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def _recipe_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog=_recipe_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "recipe", help="recipe name (e.g. tiny_llama_sft; see automodel recipes) or path to a .yaml"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: GROUP=OPTION or KEY=VALUE (see below)")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of input errors too (AUTOMODEL_DEBUG=1)"
    )
    return parser


def _parse_recipe_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    if not argv:  # no recipe: show what to type rather than argparse's "required" line
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    return parser.parse_intermixed_args(argv)


def _finetune(argv: list[str]) -> int:
    parser = _recipe_parser("automodel finetune", "Fine-tune from a Hydra recipe.")
    parser.add_argument("--cfg", choices=["job"], help="print the resolved recipe (after overrides) and exit")
    args = _parse_recipe_args(parser, argv)

    # Hydra and the recipe only: no torch before the recipe is checked
    from automodel.config import load_recipe

    cfg = load_recipe(args.recipe, args.overrides)
    if args.cfg == "job":
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg), end="")
        return 0

    from automodel.training.checkpoint import NonFiniteError
    from automodel.training.run import run
    from automodel.training.signals import TrainingStopped

    try:
        run(cfg)
    except NonFiniteError as error:
        print(f"automodel finetune: {error}", file=sys.stderr)
        return 1
    except TrainingStopped as stopped:  # logged with its checkpoint; the shell's code for the signal
        return stopped.exit_code
    return 0


def _data(argv: list[str]) -> int:
    parser = _recipe_parser(
        "automodel data",
        "Show what a recipe trains on: rendered samples with the learned tokens marked, "
        "token and row counts, pack fill and steps per epoch. Builds no model.",
    )
    parser.add_argument("--samples", type=_count, default=3, help="rendered samples to print (default 3)")
    args = _parse_recipe_args(parser, argv)

    from automodel.config import load_recipe

    cfg = load_recipe(args.recipe, args.overrides)
    from automodel.training.preview import preview

    preview(cfg, samples=args.samples)
    return 0


def _tokenize(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="automodel tokenize",
        description="Tokenize text files as a stream into a token file (the format: automodel/data/token_files.py), "
        "which data=corpus memory-maps: data.source=OUTPUT.",
    )
    parser.add_argument(
        "source", help="a .txt/.jsonl/.parquet file, a directory or glob of them, or tiny_corpus"
    )
    parser.add_argument("output", help="the token-file directory to write (must not exist)")
    parser.add_argument(
        "--tokenizer", default="tiny", help="tiny, or a local tokenizer directory (default tiny)"
    )
    parser.add_argument("--text-column", default="text", help="the text of a .jsonl row or .parquet column")
    parser.add_argument("--txt-samples", default="lines", choices=("lines", "blocks"),
                        help="a .txt file's documents: each non-blank line, or each run of lines between blank lines")  # fmt: skip
    parser.add_argument(
        "--num-proc", type=int, default=None, help="processes that encode (default: this one)"
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow a tokenizer's own Python code"
    )
    args = parser.parse_args(argv)

    from automodel.data.sft import load_tokenizer
    from automodel.data.sources import check_source
    from automodel.data.token_files import write_token_file
    from automodel.errors import DataError

    try:
        check_source(args.source, "source")
        tokenizer = load_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
        written = write_token_file(args.source, args.output, tokenizer, tokenizer_name=args.tokenizer,
                                   text_column=args.text_column, txt_samples=args.txt_samples,
                                   num_proc=args.num_proc)  # fmt: skip
    except ValueError as error:
        raise DataError(str(error)) from None
    except OSError as error:  # a full disk under OUTPUT is OUTPUT's, not a run's trainer.output_dir
        output = Path(args.output).expanduser().absolute()
        fix = refused_write(error, "OUTPUT", under=output.parent)
        if fix is None:
            raise
        named = f": {error.filename}" if error.filename else ""
        raise WriteError(f"could not write the token file {output} ({error.strerror}{named}): {fix}, then run the "
                         "same command again") from None  # fmt: skip
    meta = written.meta
    print(f"{written.path}: {meta['documents']:,} documents, {meta['tokens']:,} tokens ({meta['dtype']}) "
          f"from {len(meta['sources'])} file(s)")  # fmt: skip
    return 0


# Keys most runs set; every key of a group is in its YAML (automodel finetune RECIPE --cfg job).
COMMON_KEYS = (
    ("trainer.max_steps, trainer.grad_accum_steps", "optimizer steps, micro-batches per step"),
    (
        "trainer.output_dir, trainer.resume",
        "run directory; auto resumes from its newest checkpoint, never starts over",
    ),
    ("trainer.log_every, trainer.eval_every, trainer.checkpoint_every", "every N steps"),
    ("optim.lr, optim.warmup_steps, optim.max_grad_norm", "AdamW peak lr, linear warmup, clipping"),
    (
        "model.pretrained_path, model.dtype",
        "a local HF checkpoint (model=hf_checkpoint); float32 or bfloat16",
    ),
    (
        "data.source, data.format, data.tokenizer",
        "file/dir/glob/Hub id; messages, sharegpt, ...; null: the checkpoint's",
    ),
    ("data.assistant_turns, data.reasoning", "chat: all or last turns learn; learn or mask reasoning traces"),
    ("data.max_length, data.long_samples", "the most tokens per sample; split | truncate | drop longer ones"),
    ("data.val_fraction, data.num_proc", "hold out for validation; tokenizing processes"),
    ("packing.packed_sequence_size, packing.micro_batch_size", "tokens per pack, packs per micro-batch"),
    ("parallel.cp_size", "context parallel size (divides the torchrun world size)"),
    ("+peft=lora peft.rank=16", "LoRA adapters instead of full fine-tuning"),
)


def _recipe_help() -> str:
    from automodel.config import CONFIGS_DIR

    lines = ["config groups (GROUP=OPTION, e.g. packing=sequential):"]
    for group in sorted(p for p in CONFIGS_DIR.iterdir() if p.is_dir()):
        lines.append(f"  {group.name:<10} {', '.join(sorted(p.stem for p in group.glob('*.yaml')))}")
    lines.append("\ncommon keys (KEY=VALUE, e.g. trainer.max_steps=20):")
    lines += [f"  {keys:<63} {what}" for keys, what in COMMON_KEYS]
    lines += [
        "\nexamples:",
        "  automodel finetune tiny_llama_sft trainer.max_steps=20 packing=sequential",
        "  automodel finetune tiny_llama_sft --cfg job           # the resolved recipe, nothing run",
        "  automodel data tiny_llama_sft                         # samples, learned tokens, steps per epoch",
        "  torchrun --nproc-per-node 2 -m automodel finetune tiny_llama_sft parallel.cp_size=2",
        "  torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --rdzv-backend c10d \\",
        "    --rdzv-endpoint $MASTER_ADDR:29500 -m automodel finetune RECIPE ...",
        "\ninput errors print one line and exit 2; AUTOMODEL_DEBUG=1 or --debug shows their traceback.",
    ]
    return "\n".join(lines)


def _recipes() -> int:
    from automodel.config import CONFIGS_DIR, RECIPES_DIR

    print("recipes (automodel finetune NAME):")
    for path in sorted(RECIPES_DIR.rglob("*.yaml")):
        print(f"  {path.stem:<28} {path.relative_to(RECIPES_DIR)}")
    print("config groups (override with GROUP=OPTION, e.g. packing=sequential; keys with GROUP.KEY=VALUE):")
    for group in sorted(p for p in CONFIGS_DIR.iterdir() if p.is_dir()):
        print(f"  {group.name:<10} {', '.join(sorted(p.stem for p in group.glob('*.yaml')))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
