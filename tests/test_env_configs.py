"""The example run configs of the tool environments load, validate and build their environment."""

from __future__ import annotations

import pytest

from palaestra.config import load_config
from palaestra.sdk.registry import load_environment


@pytest.mark.parametrize("path, name", [("configs/code.yaml", "code"), ("configs/swe.yaml", "swe")])
def test_config_loads_and_builds_its_environment(path, name):
    cfg = load_config(path)
    assert cfg.env.name == name
    args = {**cfg.env.args, "backend": "palaestra.verifiers.testing:SubprocessBackendForTests"}
    env = load_environment(cfg.env.name, **args)
    assert env.name == name and env.temperature == cfg.trainer.temperature


def test_bad_environment_arguments_name_the_field():
    with pytest.raises(ValueError, match="difficulty must be one of"):
        load_environment(
            "code", difficulty=9, backend="palaestra.verifiers.testing:SubprocessBackendForTests"
        )
    with pytest.raises(ValueError, match="source must be"):
        load_environment(
            "code", source="mbpp", backend="palaestra.verifiers.testing:SubprocessBackendForTests"
        )
    with pytest.raises(ValueError, match="cannot load sandbox backend"):
        load_environment("swe", backend="nowhere.module:Nothing")
