"""Plug-ins by import path: the one way Palaestra loads ``package.module:attribute``.

    cls = load_object("mypkg.envs:WordEnv", "environment", subclass_of=Environment)
    fn = load_object("mypkg.routing:route", "teacher_routing", callable_=True)

Every place that takes a user's object by path (environments, sandbox backends, tool-call and
reasoning parsers, teacher routing, advantage estimators, model recipes) calls `load_object`, so
the resolution rules and the errors are the same everywhere:

- the working directory is on the import path (appended, so it never shadows an installed
  package), as it is for ``python -m`` and for a Ray worker given the run's working directory; a
  module next to where ``palaestra`` was started is found in ``rollout``, ``eval`` and ``train``
  alike;
- ``attribute`` may be dotted (``pkg.mod:Class.factory``);
- a failure raises `PluginError` (a ValueError) whose message names the path, the kind of plug-in
  and what failed: the module not found (with the working directory and a hint about
  PYTHONPATH), a module that raised while importing, a missing attribute (with the names the
  module does have), or an object of the wrong type.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__all__ = ["PluginError", "is_import_path", "load_object"]


class PluginError(ValueError):
    """A plug-in path that could not be loaded; the message says which part failed and why."""


def is_import_path(text: str) -> bool:
    """Whether `text` is shaped like ``package.module:attribute`` (not a URL, not a bare name)."""
    module, sep, attr = text.partition(":")
    return bool(sep and module and attr and "://" not in text and "/" not in module)


def _cwd_on_path() -> str:
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    return cwd


def _public_names(module: Any, limit: int = 12) -> str:
    names = sorted(n for n in vars(module) if not n.startswith("_"))
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "") if names else "none"


def load_object(
    path: str,
    what: str,
    *,
    subclass_of: type | None = None,
    instance_of: type | tuple[type, ...] | None = None,
    callable_: bool = False,
) -> Any:
    """The object at ``package.module:attribute``, checked; `what` names the plug-in in errors
    (e.g. ``"environment"``, ``"teacher_routing"``).

    `subclass_of`: the object must be a class deriving from it; `instance_of`: an instance of it;
    `callable_`: anything callable. Raises `PluginError` naming what failed."""
    if not isinstance(path, str) or not is_import_path(path):
        raise PluginError(f"{what} {path!r}: expected an import path 'package.module:attribute'")
    module_name, _, attr = path.partition(":")
    cwd = _cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise PluginError(
                f"{what} {path!r}: no module named {missing!r} on the import path. Modules are "
                f"looked up in the installed packages and the working directory ({cwd}); run "
                f"from the directory that holds {missing.split('.')[0]!r} or add its parent to "
                "PYTHONPATH"
            ) from None
        raise PluginError(
            f"{what} {path!r}: importing {module_name!r} failed: {exc} (a module it imports is "
            "missing; install it)"
        ) from exc
    except Exception as exc:
        raise PluginError(
            f"{what} {path!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module_name if i == 0 else f"{module_name}:{'.'.join(attr.split('.')[:i])}"
            raise PluginError(
                f"{what} {path!r}: {owner!r} has no attribute {part!r} (it has: {_public_names(obj)})"
            )
        obj = getattr(obj, part)
    if subclass_of is not None and not (isinstance(obj, type) and issubclass(obj, subclass_of)):
        raise PluginError(
            f"{what} {path!r} is {_describe(obj)}, not a subclass of "
            f"{subclass_of.__module__}.{subclass_of.__qualname__}"
        )
    if instance_of is not None and not isinstance(obj, instance_of):
        names = instance_of if isinstance(instance_of, tuple) else (instance_of,)
        raise PluginError(
            f"{what} {path!r} is {_describe(obj)}, not an instance of "
            f"{' or '.join(t.__qualname__ for t in names)}"
        )
    if callable_ and not callable(obj):
        raise PluginError(f"{what} {path!r} is {_describe(obj)}, which is not callable")
    return obj


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__module__}.{obj.__qualname__}"
    if callable(obj):
        return f"the function {getattr(obj, '__qualname__', repr(obj))}"
    return f"a {type(obj).__name__} ({obj!r:.60})"
