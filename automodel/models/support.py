"""Which transformers model types train exactly on the THD path: the supported table, the verdict
on a run's own config and its cache.

Support is decided by the differential check (:mod:`automodel.models.verify`), not by hand.
``automodel families --verify`` runs it on every type's default config (:func:`sweep`) and writes
``supported.json`` beside this module: the table users read, and the verdict setup uses when
``model.verify=false``. Setup runs the same check on the run's own config (:func:`config_verdict`:
shrunk in width only, every layer kind and threshold kept, samples and row indices crossing every
length field the run can reach), cached, each entry bound to the config, lengths, versions and the
check's own code.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import hmac
import json
import logging
import os
import signal
import stat
import sys
import time
import traceback
from dataclasses import asdict
from functools import cache
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import automodel
from automodel.config import ConfigError, automodel_cache_dir
from automodel.models.mixers import stateful_mixer_classes
from automodel.models.tiny import WINDOW, length_fields, tiny_config, width_config
from automodel.models.verify import (
    BASE_TOKENS,
    MIXER_CHUNK,
    REAL_LENS,
    REASONS,
    RTOL,
    Verdict,
    backends_for,
    check_lengths,
    features_of,
    mixer_lengths,
    one_line,
    packed_step_errors,
    verify_config,
)

logger = logging.getLogger(__name__)


@cache
def supported_table() -> dict[str, dict]:
    """``model_type`` -> its entry in ``supported.json`` (status, reason or features and backends)."""
    return read_table()["types"]


def uses_dense_mask(entry: dict) -> bool:
    """Whether a verdict (:func:`config_verdict`, a table entry) runs the type's own attention code
    under a block-diagonal dense mask: the check found the registered THD attention never called or
    not exact for it, and the dense mask exact."""
    return "dense_mask" in entry.get("features", [])


def verified_types() -> dict[str, dict]:
    return {name: entry for name, entry in supported_table().items() if entry["status"] == "verified"}


def table_verdict(config: PretrainedConfig) -> dict:
    """The shipped table's entry for the type (its default config's verdict), for ``model.verify=false``;
    a :class:`ConfigError` for a type the table lacks (newer than the table's transformers)."""
    entry = supported_table().get(config.model_type)
    if entry is None:
        raise ConfigError(
            f"model_type {config.model_type!r} is not in the supported table (made with transformers "
            f"{read_table()['transformers']}, this is {transformers.__version__}) and model.verify=false skips the "
            "check on this config; set model.verify=true"
        )
    return entry


def config_verdict(
    config: PretrainedConfig,
    *,
    sample_tokens: int | None,
    row_tokens: int | None,
    cache_dir: Path | None = None,
) -> dict:
    """The differential check on the run's own config (:func:`~automodel.models.tiny.width_config`)
    with one packed row whose samples and row indices cross every length field of the config
    (:func:`~automodel.models.tiny.length_fields`) the run's longest sample (``sample_tokens``) and
    row (``row_tokens``) can reach (:func:`~automodel.models.verify.check_lengths`), as a table
    entry. A verified config is cached in ``cache_dir`` (default :func:`exactness_cache_dir`)
    bound to the checked config, the lengths, the versions and the check's own code
    (:func:`cache_binding`): a second run pays nothing, and an entry that does not match is checked
    again. Under ``torch.distributed`` rank 0 runs it and every rank gets its verdict."""
    checked = width_config(config)
    thresholds = [*length_fields(checked).values(), *([MIXER_CHUNK] if _has_stateful_mixers(checked) else [])]
    lengths = check_lengths(sample_tokens or row_tokens or BASE_TOKENS, row_tokens, thresholds)
    binding = cache_binding(checked, lengths)
    path = (cache_dir or exactness_cache_dir()) / cache_file_name(checked.model_type, binding)
    entry = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        entry[0] = _cached_or_checked(checked, lengths, path, binding, own_config=config)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(entry, src=0)
    return entry[0]


def _has_stateful_mixers(config: PretrainedConfig) -> bool:
    """Whether ``config``'s model mixes tokens besides attention (False where the probe cannot run
    it: the check then names why)."""
    try:
        return bool(stateful_mixer_classes(config))
    except Exception:  # noqa: BLE001  (the differential check reports the failure)
        return False


def _cached_or_checked(
    checked: PretrainedConfig,
    lengths: tuple[int, ...],
    path: Path,
    binding: dict,
    own_config: PretrainedConfig | None = None,
) -> dict:
    what = f"{checked.model_type}, {checked.num_hidden_layers} layers, samples {list(lengths)}"
    cached = read_cached_verdict(path, binding)
    if cached is not None:
        logger.info("exactness verified for this config (%s; cached %s)", what, path)
        return cached
    logger.info("checking this config's packed step against each sample alone (%s)", what)
    start = time.perf_counter()
    # the dense-mask fallback (an O(T^2) mask) unless the table verified the type on the THD path: for a
    # type that needs it, and one the table has not seen or could not check (a newer release's)
    default = supported_table().get(checked.model_type) or {}
    thd_verified = default.get("status") == "verified" and not uses_dense_mask(default)
    verdict = verify_config(checked, lengths, dense_mask_fallback=not thd_verified, own_config=own_config)
    entry = {k: v for k, v in asdict(verdict).items() if v not in ("", [], None)}
    if verdict.status != "verified":  # not cached: a refusal stops the run, and may come from the machine
        return entry
    logger.info(
        "exactness verified for this config (%s; max rel error %.1e, %.1f s)",
        what,
        verdict.max_error,
        time.perf_counter() - start,
    )
    write_cached_verdict(path, binding, entry)
    return entry


def exactness_cache_dir() -> Path:
    """``$AUTOMODEL_CACHE/exactness``, else ``$XDG_CACHE_HOME/automodel/exactness``, else ``~/.cache/...``."""
    return automodel_cache_dir("exactness")


# ---------------------------------------------------------------------------------------------
# The exactness cache: its file format and how an entry is read. Nothing read from it is trusted:
# an entry is used only when it binds exactly this check (config, lengths, versions, the check's
# code), its verdict is a well-formed acceptance, and it is signed with this user's key (an HMAC
# with a random key only this user can read: an entry anyone else wrote, on a shared cache, is not
# one this user's check wrote); anything else is named in one warning line and the check runs again.

CACHE_FORMAT = 3
_CACHE_KEYS = {"format", "binding", "verdict", "mac"}
_KEY_BYTES = 32
_VERDICT_KEYS = {"status", "features", "backends", "ignores", "max_error"}
_MAX_ENTRY_BYTES = 1 << 24  # a config document is kilobytes; anything larger is not an entry


@cache
def check_code_version() -> str:
    """The check's own version: a digest of the package's Python sources (the check runs the
    project's data path, attention and loss), so any code change checks every config again."""
    package = Path(automodel.__file__).parent
    digest = hashlib.sha256()
    for source in sorted(package.rglob("*.py")):
        digest.update(source.relative_to(package).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:16]


def cache_binding(checked: PretrainedConfig, lengths: tuple[int, ...]) -> dict:
    """What a cached verdict is bound to: the full checked config (as JSON), the sample lengths,
    the transformers, torch and project versions, and the check's code (:func:`check_code_version`)."""
    document = checked.to_dict()
    document.pop("transformers_version", None)
    return {
        "config": json.loads(json.dumps(document, sort_keys=True, default=str)),
        "lengths": list(lengths),
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "automodel": automodel.__version__,
            "check": check_code_version(),
        },
    }


def cache_file_name(model_type: str, binding: dict) -> str:
    """One file per config, lengths, versions and user (each user's entries are signed with their own
    key: on a shared cache, users do not overwrite each other's)."""
    key = hashlib.sha256(json.dumps(binding, sort_keys=True).encode()).hexdigest()[:24]
    return f"{model_type}-{key}-{os.getuid()}.json"


def cache_key(directory: Path) -> bytes | None:
    """This user's key for signing entries in ``directory``: ``.key-<uid>``, random bytes made once,
    readable by this user only. None (with a warning naming the file, and no entry read or written)
    when the file there is not that: another user's, readable by others, a link or not a regular
    file: a key anyone else could read or have written signs nothing this user can trust."""
    path = directory / f".key-{os.getuid()}"
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as error:
        logger.warning(
            "exactness cache key %s not used (%s): the check runs on every run and nothing is cached; remove "
            "the file (a new key is made)",
            path,
            error,
        )
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        descriptor = os.open(
            staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600
        )
        with os.fdopen(descriptor, "w") as file:
            file.write(os.urandom(_KEY_BYTES).hex())
        try:
            os.link(staging, path)  # never replaces: of two processes making it at once, the first's is kept
        except FileExistsError:
            pass
        finally:
            staging.unlink()
        return _read_key(path)
    except (OSError, ValueError) as error:  # an unwritable cache costs the next run the check, nothing else
        logger.warning("exactness check not cached (%s): %s", path, error)
        return None


def _read_key(path: Path) -> bytes:
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(descriptor, "rb") as file:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"not a regular file (mode {stat.filemode(status.st_mode)})")
        if status.st_uid != os.getuid():
            raise ValueError(f"owned by uid {status.st_uid}, not this user's {os.getuid()}")
        if status.st_mode & 0o077:
            raise ValueError(f"mode {stat.filemode(status.st_mode)}: others may read it")
        key = file.read(4 * _KEY_BYTES)
    if len(key) != 2 * _KEY_BYTES:
        raise ValueError(f"{len(key)} bytes, not a key of {2 * _KEY_BYTES} hex digits")
    return key


def _signature(key: bytes, entry: dict) -> str:
    """The HMAC-SHA256 of an entry's format, binding and verdict under ``key``."""
    message = json.dumps({k: entry[k] for k in ("format", "binding", "verdict")}, sort_keys=True, default=str)
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def read_cached_verdict(path: Path, binding: dict) -> dict | None:
    """The verified verdict cached at ``path`` for exactly ``binding``; None when there is none (no
    word) or the file is not one (a warning naming it and why): not a regular file (a FIFO is never
    waited on), unreadable, not JSON, another format, bound to another config, lengths, version or
    check code, a verdict that is not a well-formed acceptance (a cached refusal included), or not
    signed with this user's key (:func:`cache_key`: written by anyone else)."""
    try:
        problem, entry = None, _read_entry(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        problem, entry = str(error), None
    if problem is None:
        problem = _entry_problem(entry, binding)
    if problem is None:
        key = cache_key(path.parent)
        if key is None:
            return None
        if not hmac.compare_digest(str(entry["mac"]), _signature(key, entry)):
            problem = f"not signed with this user's key {path.parent / f'.key-{os.getuid()}'}: written by someone else"
    if problem is not None:
        logger.warning("exactness cache entry %s ignored (%s); checking this config again", path, problem)
        return None
    return entry["verdict"]


def _read_entry(path: Path) -> object:
    """The JSON at ``path``, opened without blocking or following a link and read only if it is a
    regular file of at most ``_MAX_ENTRY_BYTES``."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(descriptor, "rb") as file:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"not a regular file (mode {stat.filemode(mode)})")
        data = file.read(_MAX_ENTRY_BYTES + 1)
    if len(data) > _MAX_ENTRY_BYTES:
        raise ValueError(f"larger than {_MAX_ENTRY_BYTES} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"not JSON: {one_line(error)}") from None


def _entry_problem(entry: object, binding: dict) -> str | None:
    """Why ``entry`` is not a cached acceptance of ``binding``, or None."""
    if not isinstance(entry, dict) or set(entry) != _CACHE_KEYS:
        return f"not a cache entry of format {CACHE_FORMAT}: {json.dumps(entry, default=str)[:80]}"
    if entry["format"] != CACHE_FORMAT:
        return f"format {entry['format']!r}, not {CACHE_FORMAT}"
    bound = entry["binding"]
    if not isinstance(bound, dict):
        return "no binding"
    for part, other in (
        ("config", "another config"),
        ("lengths", "other lengths"),
        ("versions", "other versions"),
    ):
        if bound.get(part) != binding[part]:
            return f"bound to {other}: {_first_difference(bound.get(part), binding[part])}"
    verdict = entry["verdict"]
    if (
        not isinstance(verdict, dict)
        or not set(verdict) <= _VERDICT_KEYS
        or verdict.get("status") != "verified"
    ):
        return f"not a verified verdict: {json.dumps(verdict, default=str)[:80]}"
    features, error = verdict.get("features", []), verdict.get("max_error")
    if not (isinstance(features, list) and all(isinstance(f, str) for f in features)):
        return f"features {features!r} are not a list of names"
    if verdict.get("backends") != backends_for(features):
        return f"backends {verdict.get('backends')!r} do not follow from features {features}"
    if verdict.get("ignores", []) not in ([], ["sliding_window"]):
        return f"ignores {verdict.get('ignores')!r}"
    if isinstance(error, bool) or not isinstance(error, (int, float)) or not 0 <= error <= RTOL:
        return f"max_error {error!r} is not within the check's tolerance {RTOL}"
    return None


def _first_difference(stored: object, wanted: object) -> str:
    if isinstance(stored, dict) and isinstance(wanted, dict):
        key = next((k for k in sorted(set(stored) | set(wanted)) if stored.get(k) != wanted.get(k)), None)
        if key is not None:
            return (
                f"{key} {json.dumps(stored.get(key))[:40]}, this check's {json.dumps(wanted.get(key))[:40]}"
            )
    return f"{json.dumps(stored, default=str)[:40]}, this check's {json.dumps(wanted)[:40]}"


def write_cached_verdict(path: Path, binding: dict, verdict: dict) -> None:
    """``verdict`` (verified) written to ``path`` with its binding, signed with this user's key
    (:func:`cache_key`), atomically; a failure is a warning."""
    key = cache_key(path.parent)
    if key is None:
        return
    entry = {"format": CACHE_FORMAT, "binding": binding, "verdict": verdict}
    entry["mac"] = _signature(key, entry)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(entry))
        staging.replace(path)  # atomic: a reader sees a whole entry or none
    except OSError as error:  # an unwritable cache costs the next run the check, nothing else
        logger.warning("exactness check not cached (%s): %s", path, error)


# ---------------------------------------------------------------------------------------------
# The supported table

SUPPORTED_TABLE = Path(__file__).with_name("supported.json")


def verify(model_type: str) -> Verdict:
    """The differential for one type's default config (:func:`tiny_config`), with the reason when it
    fails: on ``REAL_LENS``, or for a model with stateful token mixers on :func:`mixer_lengths` (a
    sample past their chunk sizes, a one-token sample). A window left off by default
    (``sliding_window: null``) is verified switched on too."""
    try:
        config = tiny_config(model_type)
    except Exception as error:  # any failure to build is recorded as the reason, not raised
        return Verdict("not_buildable", one_line(error))
    lengths = mixer_lengths(config) if _has_stateful_mixers(config) else REAL_LENS
    verdict = verify_config(config, lengths, own_config=AutoConfig.for_model(model_type, is_decoder=True))
    if verdict.status == "verified" and getattr(config, "sliding_window", 0) is None:
        windowed = copy.deepcopy(config)
        windowed.sliding_window = WINDOW
        with contextlib.suppress(Exception):
            windowed_errors, windowed_calls, windowed_worst = packed_step_errors(windowed)
            if not windowed_errors:
                verdict.features = sorted(set(verdict.features) | set(features_of(windowed, windowed_calls)))
                verdict.backends = backends_for(verdict.features)
                verdict.max_error = max(verdict.max_error, float(f"{windowed_worst:.1e}"))
    return verdict


def causal_lm_types() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class _TooSlow(BaseException):  # not caught by the checks' own `except Exception`
    pass


def _too_slow(signum, frame):
    raise _TooSlow


def sweep(types: list[str], log=print, seconds_per_type: int = 120) -> dict[str, dict]:
    """Each type's verdict; a type whose tiny model takes longer than ``seconds_per_type`` is listed
    as not buildable tiny."""
    table = {}
    previous = signal.signal(signal.SIGALRM, _too_slow)
    for model_type in types:
        signal.alarm(seconds_per_type)
        try:
            verdict = verify(model_type)
        except _TooSlow:
            verdict = Verdict("not_buildable", f"its tiny config takes over {seconds_per_type} s to check")
        except Exception as error:  # a bug in a check must not stop the sweep; it is recorded
            verdict = Verdict("refused", REASONS["differs"].format(one_line(error)))
            log(traceback.format_exc())
        finally:
            signal.alarm(0)
        table[model_type] = {k: v for k, v in asdict(verdict).items() if v not in ("", [], None)}
        log(f"{model_type:28} {verdict.status:13} {verdict.reason or ', '.join(verdict.features)}")
    signal.signal(signal.SIGALRM, previous)
    return table


def write_table(table: dict[str, dict], path: Path = SUPPORTED_TABLE) -> None:
    import transformers

    document = {
        "generated_by": "python -m automodel families --verify",
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
        "rtol": RTOL,
        "types": dict(sorted(table.items())),
    }
    path.write_text(json.dumps(document, indent=1) + "\n")


def read_table(path: Path = SUPPORTED_TABLE) -> dict:
    return json.loads(path.read_text())


def markdown_table(document: dict) -> str:
    """The supported table of docs/models.md, printed from the table file."""
    types = document["types"]
    rows = ["| `model_type` | features | backends |", "|---|---|---|"]
    for name, entry in types.items():
        if entry["status"] == "verified":
            rows.append(
                f"| `{name}` | {', '.join(entry.get('features', [])) or 'plain'} | "
                f"{', '.join(entry['backends'])} |"
            )
    refused = ["| `model_type` | why refused |", "|---|---|"]
    for name, entry in types.items():
        if entry["status"] != "verified":
            kind = "not buildable tiny: " if entry["status"] == "not_buildable" else ""
            refused.append(f"| `{name}` | {kind}{entry['reason'].replace('|', '/')} |")
    counts = {
        s: sum(e["status"] == s for e in types.values()) for s in ("verified", "refused", "not_buildable")
    }
    head = (
        f"transformers {document['transformers']}: {counts['verified']} verified, {counts['refused']} refused, "
        f"{counts['not_buildable']} not buildable tiny, of {len(types)} causal-LM types."
    )
    return "\n".join([head, "", *rows, "", *refused]) + "\n"


def main(argv: list[str]) -> int:
    """``automodel families [--verify [TYPE ...]] [--markdown]``."""
    import argparse
    import logging
    import warnings

    parser = argparse.ArgumentParser(
        prog="automodel families",
        description="The supported model types (automodel/models/supported.json), or re-verify them.",
    )
    parser.add_argument(
        "--verify",
        nargs="*",
        metavar="TYPE",
        help="run the differential check on these types (all causal-LM types when none given) "
        "and update the table",
    )
    parser.add_argument("--markdown", action="store_true", help="print the tables of docs/models.md")
    args = parser.parse_args(argv)
    if args.verify is None:
        document = read_table()
        if args.markdown:
            print(markdown_table(document), end="")
        else:
            for name, entry in document["types"].items():
                print(
                    f"{name:28} {entry['status']:13} {entry.get('reason') or ', '.join(entry.get('features', []))}"
                )
        return 0
    unknown = sorted(set(args.verify) - set(causal_lm_types()))
    if unknown:
        print(f"automodel families: not in transformers' causal-LM table: {unknown}", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    table = sweep(args.verify or causal_lm_types())
    document = read_table() if args.verify and SUPPORTED_TABLE.exists() else {"types": {}}
    write_table({**document["types"], **table})
    counts = {
        s: sum(e["status"] == s for e in table.values()) for s in ("verified", "refused", "not_buildable")
    }
    print(
        f"{len(table)} types: {counts['verified']} verified, {counts['refused']} refused, "
        f"{counts['not_buildable']} not buildable tiny; written to {SUPPORTED_TABLE}"
    )
    return 0
