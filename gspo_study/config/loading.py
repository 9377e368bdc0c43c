"""Loading a config: YAML files (safe, bounded in size and depth, no duplicate keys) layered on the schema's defaults
with `base:` inheritance, then `key.sub=value` overrides, then validated; and the listing `python -m gspo_study
config` prints (every field's value, doc, allowed values and the layer that set it)."""

from __future__ import annotations

import copy
import difflib
import functools
import os
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gspo_study.config.schema import (
    CHOICES,
    DEVICE_TEXT,
    RANGES,
    Config,
    _field_kind,
    _hints,
    declared,
    to_flat_dict,
)
from gspo_study.config.validation import _normalise, _number_kind, registries, validate
from gspo_study.errors import ConfigError  # noqa: F401  (defined below config, where tasks import it)


def _closest(key: str) -> str:
    keys = [d.key for d in declared()]
    leaf = key.split(".")[-1]
    best = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not best:
        by_leaf = {k.split(".")[-1]: k for k in keys}
        best = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)]
    return f"; did you mean '{best[0]}'?" if best else ""


class _DuplicateKey(yaml.YAMLError):
    pass


class _TooLarge(yaml.YAMLError):
    pass


# A config is small (the largest shipped one holds ~100 values): more than this many, aliases expanded, is refused
# before anything is built from it — a file of nested aliases (9 × 9 × …) once expanded for hours, and OmegaConf
# merges ~2,000 values a second.
MAX_YAML_VALUES = 1_000


def yaml_values(node, limit: float, memo: dict | None = None, path: tuple = ()) -> int:
    """How many values (scalars, sequences, mappings, keys) the YAML `node` holds with every alias expanded, counted
    without expanding (each node once); `_TooLarge` past `limit` or for an alias inside itself."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in path:
        raise _TooLarge("an alias refers to a node that holds it (a recursive structure)")
    inner = (*path, id(node))
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(yaml_values(child, limit, memo, inner) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(yaml_values(k, limit, memo, inner) + yaml_values(v, limit, memo, inner) for k, v in node.value)
    else:
        n = 1
    if n > limit:
        raise _TooLarge(f"its YAML holds more than {limit:,} values, aliases expanded; allowed: at most {limit:,}")
    memo[id(node)] = n
    return n


# Configs nest 3 levels (figures.yaml 5): deeper is refused while the document is composed, before PyYAML's recursive
# composer (or anything after it) can run out of stack — a file of 200,000 nested lists once ended in a RecursionError.
MAX_YAML_DEPTH = 32


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error (PyYAML keeps the last), a
    document nesting deeper than MAX_YAML_DEPTH is refused while it is composed, and a document of more than `limit`
    values, aliases expanded, is refused before it is built (`yaml_values`)."""

    limit: float = MAX_YAML_VALUES
    _depth: int = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise _TooLarge(
                    f"its YAML nests deeper than {MAX_YAML_DEPTH} levels (line {line}); allowed: at most "
                    f"{MAX_YAML_DEPTH}"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        yaml_values(node, self.limit)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by PyYAML, keys given here win
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise _DuplicateKey(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep)


def read_yaml_file(path: Path, limit: int) -> Any:
    """A YAML file that is not a config (experiments/figures.yaml): parsed like one (safe, no duplicate keys), at
    most `limit` values with its aliases expanded; a one-line ConfigError naming the file otherwise."""
    loader = type("_Bounded", (_StrictLoader,), {"limit": limit})
    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=loader)
    except (_DuplicateKey, _TooLarge) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None


def _no_dotted_keys(data: dict, path: Path, prefix: str = "") -> None:
    """`train.lr: 1e-3` in a file is a key named 'train.lr', not train's lr: say how to write it."""
    for key, value in data.items():
        if isinstance(key, str) and "." in key:
            head, _, leaf = key.partition(".")
            raise ConfigError(
                f"{path}: dotted key '{prefix}{key}' in a config file; allowed: nested keys, e.g. "
                f"'{head}: {{{leaf}: ...}}' ('key.sub=value' is for the command line)"
            )
        if isinstance(value, dict):
            _no_dotted_keys(value, path, f"{prefix}{key}.")


@functools.lru_cache(maxsize=256)
def _parse_yaml(text: str) -> Any:
    """A YAML text parsed, once per text (a sweep loads the same few files for every run; callers copy it)."""
    return yaml.load(text, Loader=_StrictLoader)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[dict]:
    """The chain of YAML dicts, base first."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    if path.resolve() in seen:
        raise ConfigError(f"config inheritance cycle at {path}")
    try:
        data = copy.deepcopy(_parse_yaml(path.read_text(encoding="utf-8"))) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {exc.start}); save it as UTF-8") from None
    except _DuplicateKey as dup:
        raise ConfigError(f"{path}: {dup}; each key may appear once per mapping") from None
    except _TooLarge as big:
        raise ConfigError(f"{path}: {big}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys, got {type(data).__name__}")
    _no_dotted_keys(data, path)
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: bad value {base!r} for 'base'; allowed: one file name (a string)")
    chain = _read_yaml(path.parent / base, (*seen, path.resolve())) if base else []
    return [*chain, data]


@functools.cache
def _defaults() -> DictConfig:
    """`Config`'s defaults as an OmegaConf node, built once (a merge copies it, never changes it)."""
    return OmegaConf.structured(Config)


@functools.cache
def _sections() -> dict[str, Any]:
    return get_type_hints(Config)


def _check_sections(data: Any, where: str) -> None:
    """A section (`train`, `algo`, …) given a scalar instead of a mapping: a one-line error with an example."""
    for name, value in data.items() if isinstance(data, (dict, DictConfig)) else ():
        section = _sections().get(name)
        if is_dataclass(section) and not isinstance(value, (dict, DictConfig)):
            example = fields(section)[0].name
            raise ConfigError(
                f"{where}: bad value {value!r} for '{name}'; allowed: a mapping of {name}.* keys, e.g. "
                f"'{name}: {{{example}: ...}}'"
            )


def _check_keys(data: Any, where: str, schema: Any = None, prefix: str = "") -> None:
    """Every key of a layer is a field of `Config` (a dataclass field's keys, recursively; a dict field takes any)."""
    hints = _hints(Config if schema is None else schema)
    for key, value in data.items() if isinstance(data, (dict, DictConfig)) else ():
        dotted = f"{prefix}{key}"
        if key not in hints:
            raise ConfigError(f"{where}: unknown config key '{dotted}'{_closest(dotted)}")
        if is_dataclass(hints[key]) and isinstance(value, (dict, DictConfig)):
            _check_keys(value, where, hints[key], dotted + ".")


def _merge_layers(layers: list[tuple[str, Any]]) -> DictConfig:
    """The defaults with every (where, data) layer merged over them in order. One OmegaConf merge for them all
    (one copy of the defaults, not one per layer: a config loads ~3x faster); when that merge fails, the layers
    are merged again one at a time so the error names the file or override at fault."""
    try:
        for where, data in layers:
            _check_sections(data, where)
            _check_keys(data, where)  # before any merge: an unknown key is named at once, whatever the rest holds
        return OmegaConf.merge(_defaults(), *(data for _, data in layers))
    except (ConfigError, OmegaConfBaseException):
        pass
    node = _defaults()
    for where, data in layers:
        _check_sections(data, where)
        try:
            node = OmegaConf.merge(node, data)
        except OmegaConfBaseException as exc:
            raise ConfigError(_explain(exc, where)) from None
    return node  # not reached: the layer that failed above fails here too


def _explain(exc: OmegaConfBaseException, where: str) -> str:
    key = getattr(exc, "full_key", None) or ""
    msg = str(exc).splitlines()[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        return f"{where}: unknown config key '{key}'{_closest(key)}"
    value = getattr(exc, "value", None) if hasattr(exc, "value") else None
    if key:
        want = _field_kind(key)
        return f"{where}: bad value {value!r} for '{key}' ({msg}){'; allowed: ' + want if want else ''}"
    return f"{where}: {msg}"


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key.sub=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _layers(paths: list, overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """(where, data) for every YAML file of the chains (base first) and every `key.sub=value` override, in the
    order they are merged."""
    layers = [(str(one), data) for one in paths for data in _read_yaml(Path(one))]
    for item in overrides:
        key, value = _parse_override(item)
        dotted = OmegaConf.create({})
        OmegaConf.update(dotted, key, value, force_add=True)
        layers.append((f"override '{item}'", dotted))
    return layers


def _paths(path: str | os.PathLike | list | tuple | None) -> list:
    return [] if path is None else list(path) if isinstance(path, (list, tuple)) else [path]


def load_config(
    path: str | os.PathLike | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults ← YAML chain(s) (base first; several files are layered in order) ← `key.sub=value`
    overrides, validated."""
    node = _merge_layers(_layers(_paths(path), overrides))
    cfg: Config = OmegaConf.to_object(node)  # type: ignore[assignment]
    validate(cfg)
    _normalise(cfg)
    return cfg


@functools.cache
def field_docs() -> dict[str, str]:
    """Every field's docstring (the string literal under it in `schema.py`) by dotted key, `Config`'s order."""
    import ast
    import inspect

    from gspo_study.config import schema

    tree = ast.parse(Path(schema.__file__).read_text(encoding="utf-8"))
    by_class: dict[str, dict[str, str]] = {}
    for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        docs = by_class.setdefault(node.name, {})
        for a, b in zip(node.body, node.body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
                docs[a.target.id] = " ".join(inspect.cleandoc(str(b.value.value)).split())

    out: dict[str, str] = {}

    def walk(cls: Any, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in fields(cls):
            out[prefix + f.name] = by_class.get(cls.__name__, {}).get(f.name, "")
            if is_dataclass(hints[f.name]):
                walk(hints[f.name], prefix + f.name + ".")

    walk(Config, "")
    return out


def allowed(key: str) -> str:
    """What a field accepts, in the words its one-line error uses."""
    named = {**CHOICES, **registries()}
    if key == "train.device":
        return DEVICE_TEXT
    if key in named:
        return ", ".join(map(str, named[key]))
    if key in RANGES:
        return RANGES[key].text(_number_kind(key))
    if key == "seed":
        return "an integer in [0, 2^63 - 1]"
    return _field_kind(key)


@dataclass(frozen=True)
class FieldRow:
    """One field of a resolved config, as `python -m gspo_study config` prints it."""

    key: str
    value: Any
    doc: str
    allowed: str
    source: str  # "default", a file, or "override 'key=value'": the last layer that set it


def describe_config(
    path: str | os.PathLike | list | tuple | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> list[FieldRow]:
    """Every field of the resolved (validated) config: its value, doc, allowed values and where it was set."""
    layers = _layers(_paths(path), overrides)
    flat = to_flat_dict(load_config(path, overrides))
    docs = field_docs()
    source: dict[str, str] = {}

    def mark(data: Any, prefix: str, where: str) -> None:
        for k, v in data.items():
            key = prefix + str(k)
            if isinstance(v, (dict, DictConfig)) and key not in flat:
                mark(v, key + ".", where)
            elif key in flat:
                source[key] = where

    for where, data in layers:
        mark(data, "", where)
    return [FieldRow(k, flat[k], docs.get(k, ""), allowed(k), source.get(k, "default")) for k in flat]
