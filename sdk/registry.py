"""Environments by name: built-ins, or any `package.module:Class` (a plug-in by import path)."""

from __future__ import annotations

from typing import Any

from palaestra.plugins import load_object
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
    cls = load_object(path, "environment", subclass_of=Environment)
    return cls(**kwargs)
