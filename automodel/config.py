"""Recipe configs: Hydra composition of ``recipes/`` over the ``configs/`` groups, checked up front.

A recipe is a YAML file with a defaults list over the config groups (model, data, packing,
parallel, optim, trainer). Every section names its component with ``_target_``; before anything
runs, each key is checked against that component's signature, so a typo fails at once with the key
named instead of after minutes of tokenization.

Nothing in a recipe runs code it names freely: a ``_target_`` must be one of the project's
components (``automodel.*``) or in :data:`ALLOWED_TARGETS`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib
import inspect
import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, OverrideParseException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from automodel.errors import ConfigError

SECTIONS = ("model", "data", "packing", "parallel", "optim", "trainer")
# Sections a recipe may leave out (or set to null): ``peft`` absent means full fine-tuning, ``dpo``
# present means preference optimization (automodel.training.dpo) instead of SFT, ``kd`` knowledge
# distillation from a teacher (automodel.training.kd), ``reward`` a reward model
# (automodel.training.reward), ``rl`` a policy-gradient step on rollouts (automodel.training.rl).
OPTIONAL_SECTIONS = ("peft", "dpo", "kd", "reward", "rl")
OBJECTIVE_SECTIONS = ("dpo", "kd", "reward", "rl")  # at most one per recipe
_HYDRA_KEYS = {"_target_", "_recursive_", "_convert_", "_partial_", "_args_"}
# Components from outside the project a recipe may name: configuration classes, nothing that reads
# files or runs code.
ALLOWED_TARGETS = frozenset(
    {
        "transformers.LlamaConfig",
        "transformers.Qwen2Config",
        "transformers.MistralConfig",
    }
)


def automodel_cache_dir(name: str) -> Path:
    """``$AUTOMODEL_CACHE/<name>``, else ``$XDG_CACHE_HOME/automodel/<name>``, else ``~/.cache/automodel/<name>``."""
    root = os.environ.get("AUTOMODEL_CACHE")
    if root:
        return Path(root) / name
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "automodel" / name


def refuse_remote_code(directory: str | Path, field: str, trust_remote_code: bool) -> None:
    """ConfigError when a local checkpoint or tokenizer directory asks transformers to import its own
    Python files (``auto_map`` in config.json or tokenizer_config.json) and the recipe did not opt in
    with ``model.trust_remote_code=true``. transformers gets the flag explicitly too, so it never asks."""
    if trust_remote_code or not Path(directory).is_dir():
        return
    import json

    for name in ("config.json", "tokenizer_config.json"):
        file = Path(directory) / name
        try:
            auto_map = json.loads(file.read_text()).get("auto_map") if file.is_file() else None
        except (OSError, ValueError, AttributeError):
            continue  # unreadable: the loader names it
        if auto_map:
            raise ConfigError(
                f"{field}={str(directory)!r}: {file} has auto_map {auto_map!r}, which runs Python code from that "
                "directory; set model.trust_remote_code=true only if you trust it, or use a checkpoint without it"
            )


def _package_or_repo_dir(name: str) -> Path:
    """``configs``/``recipes`` ship inside the wheel as ``automodel/_<name>``; a source checkout has
    them at the repository root."""
    package = Path(__file__).resolve().parent
    installed = package / f"_{name}"
    return installed if installed.is_dir() else package.parent / name


CONFIGS_DIR = _package_or_repo_dir("configs")
RECIPES_DIR = _package_or_repo_dir("recipes")


def resolve_recipe(recipe: str) -> Path:
    """A recipe given as a YAML path, or as a name found under ``recipes/`` (``tiny_llama_sft``)."""
    path = Path(recipe)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml"))
        raise ConfigError(
            f"recipe {recipe!r} is a directory; pass one recipe file in it ({', '.join(found[:5]) or 'none found'}) "
            "or a recipe name (automodel recipes lists them)"
        )
    if path.is_file() and path.suffix not in (".yaml", ".yml"):
        raise ConfigError(
            f"recipe {recipe!r} is not a YAML file (.yaml or .yml): a recipe is Hydra YAML and never Python; "
            "pass a .yaml recipe or a recipe name (automodel recipes lists them)"
        )
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"recipe file {recipe!r} does not exist")
        return path.resolve()
    matches = sorted(RECIPES_DIR.rglob(f"{recipe}.yaml"))
    if not matches:
        known = sorted(p.stem for p in RECIPES_DIR.rglob("*.yaml"))
        raise ConfigError(
            f"no recipe named {recipe!r}; known recipes: {known} (or pass a path to a .yaml file)"
        )
    return matches[0]


def load_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose a recipe with command-line overrides (``trainer.max_steps=10``), resolve it and check
    every key against the components' signatures."""
    try:
        os.getcwd()  # Hydra records it; relative paths are read from it
    except FileNotFoundError:
        raise ConfigError(
            "the current directory no longer exists (deleted or moved after the shell entered it); cd to an "
            "existing directory and run again"
        ) from None
    path = resolve_recipe(recipe)
    sections = [
        o.partition("=")[0][1:] for o in overrides if o.partition("=")[0][1:] in SECTIONS and o[0] == "~"
    ]
    if sections:  # every other section interpolates from it (${trainer.seed}): Hydra's traceback
        raise ConfigError(
            f"override '~{sections[0]}' deletes the {sections[0]} section, which every recipe needs; set its keys "
            f"instead ({sections[0]}.<key>=<value>), or pick another option of its group ({sections[0]}=<option>)"
        )
    deleted = [o.partition("=")[0][1:] for o in overrides if o.startswith("~model.config.")]
    if deleted:  # transformers fills the key with its own default: another model, trained without a word
        raise ConfigError(
            f"override '~{deleted[0]}' deletes a key of the recipe's model config, which transformers then fills "
            f"with its own default (~model.config.hidden_size trained a 27M model in place of a 0.85M one); set the "
            f"value you want instead: {deleted[0]}=<value>"
        )
    try:
        cfg = _compose(path, overrides)
    except RecursionError:  # Hydra follows the defaults lists without a guard
        raise ConfigError(
            f"recipe {path.name}: its defaults list includes itself, directly or through a file it includes (an "
            f"entry '- {path.stem}' or a config that names it); remove that entry"
        ) from None
    except (HydraException, OmegaConfBaseException) as error:
        unknown = re.search(r"Could not override '([^']+)'", str(error))
        if unknown:  # the same "did you mean" as a typo in a YAML file
            key = unknown.group(1)
            groups_only = [
                o for o in overrides if "." not in o.split("=", 1)[0] and o.split("=", 1)[0] != key
            ]
            raise ConfigError(_unknown_key_message(key, _compose(path, groups_only))) from None
        option = re.search(
            r"Could not find '([^'/]+)/([^']+)'\s+Available options in '[^']+':\s+(.*?)\s+Config search",
            str(error),
            re.S,
        )
        if option:  # a config group option that does not exist: trainer=nonexistent
            group, name, available = option.groups()
            raise ConfigError(
                f"{group}={name}: no such option in the {group} config group; available: {', '.join(available.split())} "
                f"(configs/{group}/*.yaml)"
            ) from None
        merging = re.match(r"Error merging override (([^=]+)=.*)", str(error), re.S)
        if merging and isinstance(error.__cause__, OmegaConfBaseException):  # a mapping where a list is, ...
            override, key = merging.group(1).strip(), merging.group(2).lstrip("+")
            groups_only = [o for o in overrides if "." not in o.split("=", 1)[0]]
            current = OmegaConf.select(_compose(path, groups_only), key)
            kind = (
                "list" if OmegaConf.is_list(current) else "mapping" if OmegaConf.is_dict(current) else "value"
            )
            value = OmegaConf.to_container(current, resolve=True) if kind != "value" else current
            shown = (
                f"its first entry {json.dumps(value[0], default=str)}"
                if kind == "list" and value
                else repr(value)
            )
            raise ConfigError(
                f"override {override!r}: {key} is a {kind} in the recipe ({shown[:160]}), and the override gives "
                f"another kind ({str(error.__cause__).splitlines()[0]}); give a {kind}"
            ) from None
        unreadable = getattr(error, "override", None)
        if (
            isinstance(error, OverrideParseException)
            and unreadable
            and not unreadable.partition("=")[0].isascii()
        ):
            key = unreadable.partition("=")[0]  # a non-ASCII letter in the key: no recipe key has one
            groups_only = [o for o in overrides if "." not in o.split("=", 1)[0]]
            raise ConfigError(_unknown_key_message(key, _compose(path, groups_only))) from None
        if isinstance(error, OverrideParseException) and unreadable and "=" in unreadable:
            # ~/..., non-ASCII letters, brackets (train[:10]): the grammar reads only quoted strings there
            key, _, value = unreadable.partition("=")
            raise ConfigError(
                f"override {unreadable!r}: Hydra's override grammar cannot read {value!r} unquoted (a ~, a non-ASCII "
                f"letter, [ ] ...); quote the value: \"{key}='{value}'\" (the double quotes keep the single ones "
                "from the shell)"
            ) from None
        missing = re.search(r"Interpolation key '(\w+)\.[^']*' not found", str(error))
        if missing and missing.group(1) in SECTIONS:  # ${trainer.seed} with no trainer section
            raise ConfigError(
                f"recipe {path.name} has no {missing.group(1)} section ({error}); add '- {missing.group(1)}: "
                f"<option>' to its defaults list (configs/{missing.group(1)}/*.yaml)"
            ) from None
        raise ConfigError(f"recipe {path.name}: {error}") from None
    except (
        yaml.YAMLError
    ) as error:  # the recipe's or a config group's file (the message names it, with the line)
        raise ConfigError(f"recipe {path.name}: not valid YAML: {' '.join(str(error).split())}") from None
    except ValueError as error:  # Hydra's own defaults-list checks (an int entry, a mapping, two keys)
        raise ConfigError(
            f"recipe {path.name}: its defaults list: {' '.join(str(error).split())}; a defaults list is a YAML list "
            "of 'group: option' entries and _self_, e.g. '- model: tiny_llama'"
        ) from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: required and not set; give it on the command line, e.g. {missing[0]}=<value>"
        )
    check_config(cfg)
    return cfg


def _compose(path: Path, overrides: list[str] | tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
        cfg = compose(
            config_name=path.stem, overrides=[f"hydra.searchpath=[file://{CONFIGS_DIR}]", *overrides]
        )
    OmegaConf.resolve(cfg)
    return cfg


def _unknown_key_message(key: str, cfg: DictConfig) -> str:
    """``unknown key 'trainer.max_stepz'; did you mean 'max_steps'?`` for a key set on the command line."""
    node: Any = cfg
    parts = key.lstrip("+~").split(".")
    for depth, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            break
        if part not in node:
            keys = [str(k) for k in node if k not in _HYDRA_KEYS]
            close = difflib.get_close_matches(part, keys, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {sorted(keys)}"
            options = _options_with_key(parts[0], parts[1:]) if depth == 1 else []
            if (
                options
            ):  # a key of another option of the group: model.pretrained_path needs model=hf_checkpoint
                hint = (f"it is a key of {' and '.join(f'{parts[0]}={o}' for o in options)}: select that option too, "
                        f"e.g. {parts[0]}={options[0]} {key.lstrip('+~')}=...")  # fmt: skip
            where = ".".join(parts[:depth]) or "the recipe"
            return f"unknown key {key!r} (no {part!r} in {where}); {hint}"
        node = node[part]
    return f"cannot override {key!r}: it is not a key of this recipe"


def _options_with_key(group: str, path: list[str]) -> list[str]:
    """The options of config group ``group`` (``configs/<group>/*.yaml``) whose YAML has the key ``path``."""
    found = []
    for file in sorted((CONFIGS_DIR / group).glob("*.yaml")):
        try:
            node = yaml.safe_load(file.read_text())
        except yaml.YAMLError:
            continue
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] in node:
            found.append(file.stem)
    return found


def check_config(cfg: DictConfig) -> None:
    unknown = [key for key in cfg if key not in SECTIONS + OPTIONAL_SECTIONS]
    if unknown:
        raise ConfigError(
            f"unknown top-level key(s) {unknown}; a recipe has the sections {list(SECTIONS)} "
            f"and optionally {list(OPTIONAL_SECTIONS)}"
        )
    missing = [key for key in SECTIONS if key not in cfg]
    if missing:
        raise ConfigError(f"recipe lacks section(s) {missing}; add them to its defaults list")
    objectives = [name for name in OBJECTIVE_SECTIONS if cfg.get(name) is not None]
    if len(objectives) > 1:
        raise ConfigError(
            f"a recipe has one objective, this one has the sections {objectives}; remove all but one"
        )
    packing = str(cfg.packing.get("_target_", "")) if isinstance(cfg.packing, DictConfig) else ""
    if cfg.get("dpo") is not None and not packing.startswith("automodel.data.preference."):
        raise ConfigError(
            f"the dpo objective trains on preference pairs, which packing=preference batches (both sides of a pair "
            f"in one row); packing._target_={packing} batches single samples: use packing=preference"
        )
    for section in SECTIONS + OPTIONAL_SECTIONS:
        if cfg.get(section) is not None:
            _check_node(cfg[section], section)


def _check_node(node: Any, where: str, types: bool = False) -> None:
    """Keys against the components' parameters (read from source: no import); with ``types`` also
    the values typed ``bool``, which needs the component imported (``build_section`` does it)."""
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            _check_node(item, f"{where}[{i}]", types)
        return
    if not isinstance(node, DictConfig):
        return
    if "_target_" in node:
        parameters = _parameters(node["_target_"], where)
        if parameters is not None:
            for key in node:
                if key not in _HYDRA_KEYS and key not in parameters:
                    close = difflib.get_close_matches(str(key), parameters, n=1)
                    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(parameters)}"
                    raise ConfigError(f"unknown key '{where}.{key}' for {node['_target_']}{hint}")
        if types:
            _check_bools(node, _type_hints(_component(node["_target_"], where)), where)
    for key in node:
        if key not in _HYDRA_KEYS:
            _check_node(node[key], f"{where}.{key}", types)


def _check_bools(node: Any, hints: dict[str, Any], where: str) -> None:
    """ConfigError for a value other than true/false (or null where allowed) under a parameter
    annotated ``bool``; nested sections typed as dataclasses (``trainer.tracking``) are checked the
    same way. ``maybe``, ``1`` or ``"false"`` would otherwise be taken as true by an ``if``."""
    if not isinstance(node, DictConfig):
        return
    for key in node:
        hint = hints.get(str(key))
        if hint is None or key in _HYDRA_KEYS:
            continue
        value, options = node[key], _union_members(hint)
        if bool in options and not isinstance(value, bool) and not (value is None and type(None) in options):
            allowed = "true or false" + (" or null" if type(None) in options else "")
            raise ConfigError(f"{where}.{key} must be {allowed}, got {value!r}")
        for option in options:
            if dataclasses.is_dataclass(option) and isinstance(value, DictConfig) and "_target_" not in value:
                _check_bools(value, _type_hints(option), f"{where}.{key}")
            elif typing.get_origin(option) is list and isinstance(value, ListConfig):
                for member in _union_members(typing.get_args(option)[0] if typing.get_args(option) else Any):
                    if dataclasses.is_dataclass(member):
                        for i, item in enumerate(value):
                            _check_bools(item, _type_hints(member), f"{where}.{key}[{i}]")


def _union_members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _type_hints(component: Any) -> dict[str, Any]:
    """Resolved annotations of a dataclass's fields or a function's parameters ({} if unresolvable)."""
    annotated = (
        component.__init__
        if inspect.isclass(component) and not dataclasses.is_dataclass(component)
        else component
    )
    try:
        return typing.get_type_hints(annotated)
    except Exception:  # noqa: BLE001 - a forward reference we cannot resolve: no type check, not an error
        return {}


def check_target(target: Any, where: str) -> None:
    """ConfigError unless ``target`` is a project component or in :data:`ALLOWED_TARGETS`."""
    if not isinstance(target, str) or not (target.startswith("automodel.") or target in ALLOWED_TARGETS):
        raise ConfigError(
            f"{where}._target_={target!r} is not allowed: a recipe may name automodel components and "
            f"{sorted(ALLOWED_TARGETS)} only (nothing that loads files or runs code)"
        )


def _check_targets(node: Any, where: str) -> None:
    if isinstance(node, ListConfig):
        for i, item in enumerate(node):
            _check_targets(item, f"{where}[{i}]")
    elif isinstance(node, DictConfig):
        if "_target_" in node:
            check_target(node["_target_"], where)
        for key in node:
            if key != "_target_":
                _check_targets(node[key], f"{where}.{key}")


def _component(target: str, where: str) -> Any:
    check_target(target, where)
    module_name, _, attribute = str(target).rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError):
        raise ConfigError(f"{where}._target_: cannot import {target!r}") from None


def _parameters(target: str, where: str) -> list[str] | None:
    """Keyword parameters of ``target``, or None when it takes ``**kwargs``. A project component's
    are read from its source, so that checking a recipe imports no torch, transformers or datasets."""
    check_target(target, where)
    module_name, _, attribute = str(target).rpartition(".")
    if module_name.startswith("automodel."):
        try:
            return source_parameters(module_name, attribute)
        except LookupError:  # not a plain class of that module (a re-export, a factory): import it
            pass
    parameters = inspect.signature(_component(target, where)).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind is not inspect.Parameter.VAR_POSITIONAL]


def source_parameters(module_name: str, class_name: str) -> list[str] | None:
    """The keyword parameters of class ``class_name`` of the project module ``module_name``, read
    from the source without importing it: ``__init__``'s parameters, or a dataclass's init fields
    (its own and its dataclass bases', following ``from automodel... import`` to other modules).
    None when it takes ``**kwargs``; LookupError when the source does not say (the caller then
    imports the module)."""
    classes, imported = _module_source(module_name)
    node = classes.get(class_name)
    if node is None:
        if class_name in imported:
            return source_parameters(*imported[class_name])
        raise LookupError(f"{module_name}.{class_name}")
    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is not None:
        if init.args.kwarg is not None:
            return None
        return [a.arg for a in init.args.args[1:] + init.args.kwonlyargs]
    bases = []
    for base in node.bases:
        if not isinstance(base, ast.Name):
            raise LookupError(f"{module_name}.{class_name}")
        bases.append(source_parameters(module_name, base.id))
    if any(b is None for b in bases):
        return None
    inherited = [p for b in bases for p in b]
    if not any(_decorator_name(d) == "dataclass" for d in node.decorator_list):
        return inherited
    own = [
        item.target.id for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
        and "ClassVar" not in ast.unparse(item.annotation) and not _init_false(item.value)
    ]  # fmt: skip
    return inherited + [p for p in own if p not in inherited]


@functools.cache
def _module_source(module_name: str) -> tuple[dict[str, ast.ClassDef], dict[str, tuple[str, str]]]:
    """A project module's classes, and the names it imports from other project modules."""
    path = Path(__file__).resolve().parent.parent.joinpath(*module_name.split(".")).with_suffix(".py")
    if not module_name.startswith("automodel.") or not path.is_file():
        raise LookupError(module_name)
    tree = ast.parse(path.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    imported = {
        alias.asname or alias.name: (node.module, alias.name) for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("automodel.")
        for alias in node.names
    }  # fmt: skip
    return classes, imported


def _decorator_name(decorator: ast.expr) -> str:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def _init_false(value: ast.expr | None) -> bool:
    """``field(init=False)``: a dataclass field that is not a parameter."""
    return isinstance(value, ast.Call) and any(
        k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in value.keywords
    )


def build_section(cfg: DictConfig, section: str) -> Any:
    """Instantiate one section (None for an optional section left out or null); a bad value raises
    ConfigError naming the section."""
    if section in OPTIONAL_SECTIONS and cfg.get(section) is None:
        return None
    _check_targets(cfg[section], section)
    _check_node(cfg[section], section, types=True)
    try:
        return instantiate(cfg[section], _convert_="all")
    except Exception as error:  # Hydra wraps the component's own error; surface its message
        cause = error.__cause__ or error
        raise ConfigError(f"{section}: {cause}") from None
