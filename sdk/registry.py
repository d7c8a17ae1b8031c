"""Environments by name: built-ins, or any `package.module:Class` (a plug-in by import path).

    env = load_environment("math", difficulty=2)
    env = load_environment("mypkg.envs:WordEnv", max_turns=4)   # mypkg/ in the working directory

`BUILTIN` is the one list of built-in names: `--help` texts and docs are built from it.
`environment_arguments` reads what an environment's constructor takes, so that a run's
`env.args` are checked when its config loads (`palaestra.config`), before anything starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from palaestra.plugins import PluginError, is_import_path, load_object
from palaestra.sdk.environment import Environment

__all__ = [
    "BUILTIN",
    "EnvironmentArguments",
    "builtin_names",
    "environment_arguments",
    "environment_class",
    "load_environment",
]

BUILTIN = {
    "math": "palaestra.environments.math.env:MathEnv",
    "math-tool": "palaestra.environments.math.env:MathToolEnv",
    "code": "palaestra.environments.code_sandbox.env:CodeSandboxEnv",
    "swe": "palaestra.environments.swe_agent.env:SweAgentEnv",
    "reasoning-gym": "palaestra.environments.reasoning_gym.env:ReasoningGymEnv",
    "textarena": "palaestra.environments.textarena.env:TextArenaEnv",
    "mix": "palaestra.environments.mix.env:MixEnv",
    "harness": "palaestra.environments.harness.env:HarnessEnv",
    "harbor": "palaestra.environments.harbor.env:HarborEnv",
    "mcp-math": "palaestra.environments.mcp_tools.env:McpMathEnv",
    "judged-math": "palaestra.environments.judged.env:JudgedMathEnv",
}


def builtin_names() -> str:
    """The built-in environments' names, for help texts: ``math, math-tool, code, swe, ...``."""
    return ", ".join(BUILTIN)


def environment_class(name: str) -> type[Environment]:
    """The class a built-in name or a ``package.module:Class`` path names; PluginError (a
    ValueError) naming what failed otherwise (the working directory is on the import path)."""
    path = BUILTIN.get(name, name)
    if not isinstance(path, str) or not is_import_path(path):
        raise PluginError(
            f"unknown environment {name!r}: use one of {builtin_names()} or 'package.module:Class' "
            "(a module in the working directory or on PYTHONPATH)"
        )
    return load_object(path, "environment", subclass_of=Environment)


def load_environment(name: str, **kwargs: Any) -> Environment:
    """An instance of the environment `name` (see `environment_class`), built with `kwargs`."""
    return environment_class(name)(**kwargs)


@dataclass(frozen=True)
class EnvironmentArguments:
    """What an environment's constructor takes by keyword."""

    accepted: tuple[str, ...]
    """The keywords it names."""
    required: tuple[str, ...]
    """Those with no default."""
    any_keyword: bool
    """It takes **kwargs: any key is accepted here (checked only when it is built)."""

    def unknown(self, args: Mapping[str, Any]) -> list[str]:
        return [] if self.any_keyword else [k for k in args if k not in self.accepted]

    def missing(self, args: Mapping[str, Any]) -> list[str]:
        return [k for k in self.required if k not in args]

    def signature(self) -> str:
        """``difficulty, data, max_tokens, kinds`` (``**kwargs`` at the end when any keyword goes)."""
        names = [*self.accepted, *(["**kwargs"] if self.any_keyword else [])]
        return ", ".join(names) or "no arguments"


def environment_arguments(cls: type) -> EnvironmentArguments:
    """The keyword arguments `cls(...)` takes, read from its constructor's signature.

    A constructor that takes ``**kwargs`` accepts any key: where they go (a base's constructor,
    an options dict) is not in the signature, so nothing is refused that building might accept."""
    try:
        params = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a constructor written in C)
        return EnvironmentArguments((), (), True)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return EnvironmentArguments(
        accepted=tuple(p.name for p in named),
        required=tuple(p.name for p in named if p.default is p.empty),
        any_keyword=any(p.kind is p.VAR_KEYWORD for p in params),
    )
