"""Environments by name: built-ins, or any `package.module:Class` (a plug-in by import path)."""

from __future__ import annotations

import importlib
from typing import Any

from palaestra.sdk.environment import Environment

BUILTIN = {
    "math": "palaestra.environments.math.env:MathEnv",
    "math-tool": "palaestra.environments.math.env:MathToolEnv",
    "code": "palaestra.environments.code_sandbox.env:CodeSandboxEnv",
    "swe": "palaestra.environments.swe_agent.env:SweAgentEnv",
}


def load_environment(name: str, **kwargs: Any) -> Environment:
    path = BUILTIN.get(name, name)
    if ":" not in path:
        raise ValueError(
            f"unknown environment {name!r}: use one of {', '.join(BUILTIN)} or 'package.module:Class'"
        )
    module, attr = path.split(":", 1)
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load environment {path!r}: {exc}") from None
    env = cls(**kwargs)
    if not isinstance(env, Environment):
        raise ValueError(f"{path} is not a palaestra.sdk.Environment")
    return env
