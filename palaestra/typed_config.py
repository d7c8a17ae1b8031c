"""Typed configs: dataclasses whose field docstrings are the documentation, read from YAML.

The machinery behind `palaestra.config.RunConfig` (and `palaestra gateway serve`'s flags), for any
tree of dataclasses whose fields are typed (int, float, str, bool, Literal, X | None, list,
dict) and documented by a docstring under each field:

- `read_mapping(cls, path, overrides)`: the YAML file's mapping with ``a.b.c=value`` overrides
  applied, each path checked against `cls` (unknown keys fail with the closest names);
- `build(cls, raw)`: the dataclass instance, with every unknown key and type error reported at
  once in a `ConfigError` that names each key path;
- `dump_yaml(data)`: YAML that `read_mapping` reads back to equal values;
- `options_help(cls, intro, notes)`: every field as ``path: type = default`` with its docstring
  (and a note the code adds, e.g. a registry's names);
- `add_arguments(parser, cls)`: one ``--field`` command-line option per field, its help the
  docstring; `to_flags(options)`: the other way, options as command-line flags.

YAML is read as YAML 1.2 reads numbers (``1e-5`` is a float). Dict-typed fields accept any key
(backend options passed through under their own names); dataclass fields only their own.

Renamed keys: a dataclass may list the keys of an earlier release in a class attribute
``RENAMED = {"old_key": "section.new_key"}`` (paths relative to it). Such a key is still read, in
a YAML file, an override and `build`'s mapping alike, with a one-line `FutureWarning`
(``trainer.sync_mode is deprecated: use trainer.sync.mode``); setting both the old and the new key
is an error (`move_renamed`).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import difflib
import inspect
import logging
import re
import textwrap
import types
import typing
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

log = logging.getLogger("palaestra.config")

__all__ = [
    "ConfigError",
    "add_arguments",
    "apply_override",
    "build",
    "dump_yaml",
    "field_docs",
    "move_renamed",
    "options_help",
    "read_mapping",
    "to_flags",
    "type_text",
    "unknown_key",
]


class ConfigError(ValueError):
    """A config that cannot be loaded: one line per problem, each naming its key path."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("invalid config:\n  " + "\n  ".join(self.problems))


def to_flags(options: Mapping[str, Any], prefix: str = "--") -> list[str]:
    """Options as command-line flags: {"tp_size": 2, "enable_x": True, "y": False} -> --tp-size 2 --enable-x.

    True is a bare flag, False and None are left out, a list repeats nothing but its items after
    one flag (argparse's nargs), anything else is str(value). Underscores become hyphens.
    """
    flags: list[str] = []
    for key, value in options.items():
        flag = prefix + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2 floats: PyYAML alone reads `1e-5` (no dot) as a string."""


class _Dumper(yaml.SafeDumper):
    """Quotes the strings that _Loader would read as floats, so saved configs load back equal."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )


def _yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where}: not valid YAML: {exc}"]) from None


def _is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def unknown_key(
    path: str,
    key: str,
    known: Sequence[str],
    *,
    list_known: bool = True,
    renamed: Mapping[str, str] | None = None,
) -> str:
    """``path.key: unknown key (did you mean ...?)``, and with `list_known` the keys there are.
    A close match among the `renamed` keys (old -> new) is suggested under its new name."""
    renamed = renamed or {}
    close = difflib.get_close_matches(key, [*known, *renamed], n=3, cutoff=0.6)
    close = list(dict.fromkeys(renamed.get(c, c) for c in close))
    message = f"{_join(path, key)}: unknown key"
    if close:
        message += f" (did you mean {', '.join(repr(_join(path, c)) for c in close)}?)"
    if list_known:
        message += f"; {path or 'the top level'} has {', '.join(known)}"
    return message


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def type_text(hint: Any) -> str:
    """A type hint as a reader writes it: ``int``, ``str | None``, ``'sync' | 'async'``."""
    if hint is Any:
        return "any"
    if typing.get_origin(hint) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(type_text(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "")


class _Mismatch(Exception):
    pass


def _check(value: Any, hint: Any) -> Any:
    """`value` as type `hint` (ints widen to float), or _Mismatch."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            try:
                return _check(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        if isinstance(value, bool) and ("on" if value else "off") in args:
            return "on" if value else "off"  # YAML 1.1 reads a bare on / off as true / false
        raise _Mismatch
    if hint is bool or hint is int or hint is str:
        if type(value) is hint:
            return value
        raise _Mismatch
    if hint is float:
        if type(value) in (int, float):
            return float(value)
        raise _Mismatch
    if origin is list:
        if not isinstance(value, list):
            raise _Mismatch
        return [_check(v, args[0]) for v in value] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Mismatch
        return {k: _check(v, args[1]) for k, v in value.items()} if args else dict(value)
    raise TypeError(f"config type {hint!r} is not supported by palaestra.typed_config")


def _mismatch(path: str, value: Any, hint: Any) -> str:
    message = f"{path}: expected {type_text(hint)}, got {value!r} ({type(value).__name__})"
    choices = [
        a
        for arg in [hint, *typing.get_args(hint)]
        if typing.get_origin(arg) is Literal
        for a in typing.get_args(arg)
    ]
    if isinstance(value, str) and choices:
        close = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.6)
        if close:
            message += f" (did you mean {close[0]!r}?)"
    return message


def read_mapping(cls: type, path: str | Path | None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The raw mapping of a `cls`: the YAML file at `path` (if any), then each override
    ``dotted.key=value`` (the value parsed as YAML: 1e-5, true, null, [a, b], {k: v}).

    Override paths are checked against `cls` here; everything else when `build` makes the
    instance. Raises ConfigError.
    """
    raw: Any = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError([f"{path}: cannot read: {exc}"]) from None
        raw = _yaml(text, str(path)) or {}
        if not isinstance(raw, dict):
            raise ConfigError(
                [f"{path}: expected a mapping of sections at the top, got {type(raw).__name__}"]
            )
        problems = move_renamed(cls, raw)
        if problems:
            raise ConfigError([f"{path}: {p}" for p in problems])
    spelled: dict[str, tuple[str, str]] = {}  # resolved key path -> (key path as written, override)
    for item in overrides:
        resolved = apply_override(cls, raw, item)
        written = item.split("=", 1)[0].strip()
        earlier = spelled.setdefault(resolved, (written, item))
        if earlier[0] != written:  # the old and the new name of one key
            raise ConfigError(
                [f"overrides {earlier[1]!r} and {item!r} both set {resolved}; keep only {resolved}=..."]
            )
    return raw


def build(cls: type, raw: Mapping[str, Any]) -> Any:
    """An instance of dataclass `cls` from a raw mapping; a ConfigError lists every unknown key
    (with close matches), type error and failed ``__post_init__`` check, each with its key path."""
    raw = copy.deepcopy(dict(raw))
    problems = move_renamed(cls, raw)
    instance = _build(cls, raw, "", problems)
    if problems:
        raise ConfigError(problems)
    return instance


def _build(cls: type, data: Any, path: str, problems: list[str]) -> Any:
    """An instance of dataclass `cls` from a mapping: unknown keys and type errors go to `problems`."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{path or 'config'}: expected a mapping of {cls.__name__} options, got {data!r}")
        return None
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    kwargs: dict[str, Any] = {}
    ok = True
    for key, value in _moved(cls, data, path).items():
        key_path = _join(path, str(key))
        if key not in names:
            problems.append(unknown_key(path, str(key), names, renamed=_renamed(cls)))
            ok = False
            continue
        hint = hints[key]
        if _is_dataclass_type(hint):
            built = _build(hint, value, key_path, problems)
            ok = ok and built is not None
            kwargs[key] = built
            continue
        if value is None and typing.get_origin(hint) is dict:
            value = {}  # an empty YAML section (`router:`)
        try:
            kwargs[key] = _check(value, hint)
        except _Mismatch:
            problems.append(_mismatch(key_path, value, hint))
            ok = False
    if not ok:
        return None
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:  # the dataclass's own __post_init__ checks
        problems.append(_post_init_problem(path, str(exc), names))
        return None


def _moved(cls: type, data: dict[str, Any], path: str) -> dict[str, Any]:
    """`data` with the keys a section moved (its ``moved_key(key, value)`` hook: the new dotted key
    and value, or None) read at their new place, each with a warning naming the new key."""
    hook = getattr(cls, "moved_key", None)
    if hook is None:
        return data
    out: dict[str, Any] = {}
    for key, value in data.items():
        moved = hook(str(key), value)
        if moved is None:
            earlier = out.get(key)  # a section earlier moved keys went into: theirs kept
            out[key] = (
                {**value, **earlier} if isinstance(value, dict) and isinstance(earlier, dict) else value
            )
            continue
        new, new_value = moved
        log.warning("config key %s is now %s: read there", _join(path, str(key)), _join(path, new))
        *parents, last = new.split(".")
        node = out
        for parent in parents:
            if not isinstance(node.get(parent), dict):
                node[parent] = {}
            node = node[parent]
        node[last] = new_value
    return out


def _post_init_problem(path: str, message: str, names: list[str]) -> str:
    """A failed ``__post_init__`` check under the key path of the field its message starts with
    (``advantage_eps must be positive`` -> ``trainer.advantage_eps: must be positive``), else under
    the section's."""
    first, _, rest = message.partition(" ")
    field = first.rstrip(":")
    if field in names and rest:
        return f"{_join(path, field)}: {rest}"
    return f"{path or 'config'}: {message}"


def _renamed(cls: type) -> dict[str, str]:
    return dict(getattr(cls, "RENAMED", {}))


def _deprecated(path: str, old: str, new: str) -> None:
    warnings.warn(f"{_join(path, old)} is deprecated: use {_join(path, new)}", FutureWarning, stacklevel=2)


def move_renamed(cls: type, raw: dict[str, Any], path: str = "") -> list[str]:
    """Moves the renamed keys of `raw` (a mapping of dataclass `cls`; its sections' too) to their
    new places, in place, each with a deprecation warning. Returns the problems: a key set both
    under its old and its new name (the old one is dropped)."""
    problems: list[str] = []
    for old, new in _renamed(cls).items():
        if old not in raw:
            continue
        *sections, leaf = new.split(".")
        node = raw
        for section in sections:
            if node.get(section) is None:
                node[section] = {}
            node = node[section]
            if not isinstance(node, dict):
                break  # reported by _build as the section's type error
        else:
            if leaf in node:
                del raw[old]
                problems.append(
                    f"{_join(path, old)}: set as well as its new name {_join(path, new)}; keep only {_join(path, new)}"
                )
            else:
                _deprecated(path, old, new)
                node[leaf] = raw.pop(old)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if _is_dataclass_type(hints[f.name]) and isinstance(raw.get(f.name), dict):
            problems += move_renamed(hints[f.name], raw[f.name], _join(path, f.name))
    return problems


def _resolve_renamed(cls: type, keys: list[str]) -> list[str]:
    """The key path `keys` (of a `cls`) with each renamed key replaced by its new path, warning."""
    keys = list(keys)
    i = 0
    while i < len(keys):
        renamed = _renamed(cls)
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if keys[i] not in names and keys[i] in renamed:
            _deprecated(".".join(keys[:i]), keys[i], renamed[keys[i]])
            keys[i : i + 1] = renamed[keys[i]].split(".")
            continue  # the new path's first key, from this class
        hint = typing.get_type_hints(cls).get(keys[i]) if keys[i] in names else None
        if not _is_dataclass_type(hint):
            break
        cls, i = hint, i + 1
    return keys


def apply_override(cls: type, raw: dict[str, Any], item: str) -> str:
    """Applies one `a.b.c=value` to the raw mapping of a `cls`, checking the path against `cls`.
    Returns the key path set (a renamed key's new path).

    The value is parsed as YAML; a string field keeps the text as written (``run.name=2024``)."""
    if "=" not in item:
        raise ConfigError([f"override {item!r}: expected key.path=value (e.g. run.steps=10)"])
    dotted, text = item.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError([f"override {item!r}: empty key in {dotted!r}"])
    keys = _resolve_renamed(cls, keys)
    value = _yaml(text, f"override {dotted}")
    node = raw
    for i, key in enumerate(keys):
        path = ".".join(keys[:i])
        hook = getattr(cls, "moved_key", None)
        moved = hook(key, value) if hook is not None and i == len(keys) - 1 else None
        if moved is not None:  # an earlier name of the key: set at its new place (the loop goes on there)
            log.warning("config key %s is now %s: set there", _join(path, key), _join(path, moved[0]))
            value, keys[i:] = moved[1], moved[0].split(".")
            key = keys[i]
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        if key not in names:
            raise ConfigError([unknown_key(path, key, names, renamed=_renamed(cls))])
        hint = typing.get_type_hints(cls)[key]
        last = i == len(keys) - 1
        if _is_dataclass_type(hint) and not last:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node, cls = child, hint
            continue
        if typing.get_origin(hint) is dict and not last:  # passthrough: any key, nested as given
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            for sub in keys[i + 1 : -1]:
                if not isinstance(child.get(sub), dict):
                    child[sub] = {}
                child = child[sub]
            child[keys[-1]] = value
            return ".".join(keys)
        if not last:
            raise ConfigError([f"override {item!r}: {_join(path, key)} is {type_text(hint)}, not a section"])
        if isinstance(value, int | float | bool) and _accepts_str(hint):
            try:
                _check(value, hint)
            except _Mismatch:
                value = text.strip()  # run.name=2024 is the string "2024"
        node[key] = value
    return ".".join(keys)


def _accepts_str(hint: Any) -> bool:
    return hint is str or (
        typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint)
    )


# ----------------------------------------------------------------------------------------------
# Writing, help and command-line options
# ----------------------------------------------------------------------------------------------
def field_docs(cls: type) -> dict[str, str]:
    """{field: docstring} of a dataclass, its bases' fields included (from each class's source:
    Python drops attribute docstrings at runtime)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object and dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            doc = ""
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                doc = inspect.cleandoc(str(after.value.value))
            docs[node.target.id] = doc
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _show(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def options_help(cls: type, intro: Sequence[str] = (), notes: Mapping[str, str] | None = None) -> str:
    """Every field of `cls`, nested sections included, as ``path: type = default`` with its docstring.

    `notes` adds a line under a field's docstring by key path (e.g. ``{"env.name": "built-in:
    math, code"}``): for what the code knows and a docstring cannot list, such as a registry's
    names, so the help is built from the registry instead of repeating it."""
    lines = list(intro)
    notes = dict(notes or {})

    def walk(cls: type, prefix: str, depth: int) -> None:
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            path = _join(prefix, f.name)
            doc = docs.get(f.name, "")
            indent = "  " * depth
            if _is_dataclass_type(hints[f.name]):
                lines.append(f"{indent}{path}: {doc or hints[f.name].__name__}")
                walk(hints[f.name], path, depth + 1)
                lines.append("")
                continue
            lines.append(f"{indent}{path}: {type_text(hints[f.name])} = {_show(_default(f))}")
            for line in (doc or "(undocumented)").splitlines():
                lines.append(f"{indent}    {line}")
            if path in notes:
                lines.append(f"{indent}    {notes.pop(path)}")
            if depth == 0:
                lines.append("")

    walk(cls, "", 0)
    if notes:
        raise KeyError(f"options_help: notes for no field: {sorted(notes)}")
    return "\n".join(lines).rstrip() + "\n"


def dump_yaml(data: Any) -> str:
    """`data` (plain dicts, lists, scalars) as YAML that `read_mapping` reads back to equal values."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def add_arguments(
    parser: argparse._ActionsContainer, cls: type, names: Iterable[str] | None = None, prefix: str = ""
) -> None:
    """One ``--<field>`` option per field of dataclass `cls` (or per name in `names`).

    The field gives everything: the type (int, float, str, X | None of those, a Literal as
    choices), the default (no default: a required option; a bool defaulting to False: a bare
    flag), and the help (its docstring). The option's dest is the field name, so
    ``cls(**{f: getattr(args, f) ...})`` builds the dataclass back.
    """
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in fields if names is None else names:
        hint, default = hints[name], _default(fields[name])
        flag = "--" + (prefix + name).replace("_", "-")
        options: dict[str, Any] = {
            "dest": prefix + name,
            "help": " ".join(docs.get(name, "").split()).replace("%", "%%") or None,
        }
        if default is dataclasses.MISSING:
            options["required"] = True
        else:
            options["default"] = default
        if hint is bool and default is False:
            parser.add_argument(flag, action="store_true", **options)
            continue
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            hint = args[0]  # X | None: None is the default, not something to type
        if typing.get_origin(hint) is Literal:
            choices = list(typing.get_args(hint))
            options.update(choices=choices, type=type(choices[0]))
        elif hint in (int, float, str):
            options["type"] = hint
        else:
            raise TypeError(f"{cls.__name__}.{name}: {type_text(hints[name])} has no command-line form")
        parser.add_argument(flag, **options)
