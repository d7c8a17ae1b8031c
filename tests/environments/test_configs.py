"""The example run configs of the tool environments load, validate and build their environment."""

from __future__ import annotations

import pytest

from palaestra.config import load_config
from palaestra.sdk.registry import load_environment


@pytest.mark.parametrize(
    "path, name",
    [("configs/code.yaml", "code"), ("configs/swe.yaml", "swe"), ("configs/harness.yaml", "harness")],
)
def test_config_loads_and_builds_its_environment(path, name):
    cfg = load_config(path)
    assert cfg.env.name == name
    args = {**cfg.env.args, "backend": "tests.support.doubles:SubprocessBackendForTests"}
    env = load_environment(cfg.env.name, **args)
    assert env.name == name and env.temperature == cfg.trainer.temperature


def test_bad_environment_arguments_name_the_field():
    with pytest.raises(ValueError, match="difficulty must be one of"):
        load_environment("code", difficulty=9, backend="tests.support.doubles:SubprocessBackendForTests")
    with pytest.raises(ValueError, match="source must be"):
        load_environment("code", source="mbpp", backend="tests.support.doubles:SubprocessBackendForTests")
    with pytest.raises(
        ValueError, match="sandbox backend .nowhere.module:Nothing.: no module named .nowhere."
    ):
        load_environment("swe", backend="nowhere.module:Nothing")


def test_episode_log_sampling_and_call_markers():
    import asyncio
    from types import SimpleNamespace

    from palaestra.environments.episode import EpisodeLog, looks_like_a_tool_call, sampling

    log = EpisodeLog()
    log.fail("tool_call_parse")
    log.fail("tool_call_parse")
    log.count("tool_calls", 3)

    async def timed():
        async with log.timed("sandbox"):
            await asyncio.sleep(0.01)

    asyncio.run(timed())
    metrics = log.metrics(correct=1.0)
    assert metrics["failure/tool_call_parse"] == 2.0 and metrics["failure/grader_error"] == 0.0
    assert metrics["tool_calls"] == 3.0 and metrics["correct"] == 1.0 and metrics["time/sandbox_s"] >= 0.01
    with pytest.raises(ValueError, match="unknown failure 'oops'"):
        log.fail("oops")
    # The run's choice wins over the environment's default.
    assert sampling(SimpleNamespace(sampling={"seed": 5, "temperature": 0.7}), temperature=1.0) == {
        "temperature": 0.7,
        "seed": 5,
    }
    assert sampling(SimpleNamespace(sampling={}), temperature=1.0) == {"temperature": 1.0}
    assert looks_like_a_tool_call('<tool_call>\n{"name": "bash", "arguments": \n')
    assert not looks_like_a_tool_call("def f():\n    return 1") and not looks_like_a_tool_call(None)
