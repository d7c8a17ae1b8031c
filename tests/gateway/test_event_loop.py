"""`gateway.event_loop`: auto takes uvloop where it is installed, asyncio and uvloop are honoured by
`palaestra gateway serve` (uvicorn) and the shards' front (aiohttp), a bad value is one line."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
import uvloop

from palaestra.cli import build_parser
from palaestra.gateway import app as gateway_app
from palaestra.gateway import cli, shards
from palaestra.gateway.event_loop import loop_name, new_event_loop
from palaestra.gateway.options import GatewayOptions

SERVE = ["gateway", "serve", "--model", "tiny", "--engine-url", "http://127.0.0.1:1"]


def test_auto_takes_uvloop_where_installed_and_asyncio_where_not(monkeypatch):
    assert loop_name("auto") == "uvloop"
    assert loop_name("uvloop") == "uvloop"
    assert loop_name("asyncio") == "asyncio"
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop_name("auto") == "asyncio"
    assert loop_name("asyncio") == "asyncio"
    with pytest.raises(ValueError, match="gateway.event_loop is uvloop but uvloop is not importable"):
        loop_name("uvloop")


def test_a_bad_event_loop_is_one_line_naming_the_option(capsys):
    with pytest.raises(
        ValueError, match=r"gateway.event_loop must be one of auto, asyncio, uvloop; got 'tokio'"
    ):
        loop_name("tokio")
    with pytest.raises(
        ValueError, match=r"gateway.event_loop must be one of auto, asyncio, uvloop \(got 'trio'\)"
    ):
        GatewayOptions(event_loop="trio")  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        build_parser("gateway").parse_args([*SERVE, "--event-loop", "tokio"])
    assert "argument --event-loop: invalid choice: 'tokio'" in capsys.readouterr().err


def test_the_run_passes_the_loop_to_its_gateways():
    flags = GatewayOptions(event_loop="asyncio").serve_flags()
    assert flags[flags.index("--event-loop") + 1] == "asyncio"


@pytest.mark.parametrize(("flag", "expected"), [([], "uvloop"), (["--event-loop", "asyncio"], "asyncio")])
def test_serve_runs_uvicorn_on_the_loop_asked(monkeypatch, caplog, tmp_path, flag, expected):
    ran: dict = {}
    monkeypatch.setattr(gateway_app, "create_app", lambda config: "app")
    monkeypatch.setattr("palaestra.quiet_server.run", lambda app, **kw: ran.update(kw))
    argv = [*SERVE, "--spool-dir", str(tmp_path), "--log-level", "info", *flag]
    args = build_parser("gateway").parse_args(argv)
    with caplog.at_level(logging.INFO, logger="palaestra.gateway.event_loop"):
        assert cli._serve(args) == 0
    assert ran["loop"] == expected
    assert f"palaestra gateway serve: event loop {expected}" in caplog.text


@pytest.mark.parametrize(("choice", "loop_type"), [("auto", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)])
def test_the_front_runs_on_the_loop_asked(monkeypatch, choice, loop_type):
    ran: dict = {}
    monkeypatch.setattr(shards.web, "run_app", lambda app, **kw: ran.update(kw))
    shards.serve_front(["http://127.0.0.1:1"], "127.0.0.1", 1, event_loop=choice)
    loop = ran["loop"]
    try:
        assert isinstance(loop, loop_type)
        assert isinstance(loop, uvloop.Loop) == (choice == "auto")
    finally:
        loop.close()


def test_new_event_loop_runs_coroutines():
    loop = new_event_loop("uvloop", "test")
    try:
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()


def test_a_run_config_names_the_bad_event_loop_in_one_line():
    from palaestra.config import load_config
    from palaestra.typed_config import ConfigError

    assert load_config(None, ["gateway.event_loop=asyncio"]).gateway.event_loop == "asyncio"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["gateway.event_loop=tokio"])
    assert "gateway.event_loop: expected 'auto' | 'asyncio' | 'uvloop', got 'tokio'" in str(err.value)


@pytest.mark.parametrize("choice", ["asyncio", "uvloop"])
def test_the_fronts_process_is_started_on_the_shards_loop(monkeypatch, choice):
    """`front_process` (tests, benches, the run's server host) and `GatewayFleet` pass the shards'
    `gateway.event_loop` on to `palaestra gateway front`, whose parser takes it."""
    argv = shards.front_process(["http://127.0.0.1:1"], port=9, event_loop=choice).argv
    assert argv[argv.index("--event-loop") + 1] == choice
    args = build_parser("gateway").parse_args(argv[argv.index("gateway") :])
    assert args.event_loop == choice
    default = shards.front_process(["http://127.0.0.1:1"], port=9).argv
    assert default[default.index("--event-loop") + 1] == "auto"
    serve_args = [*GatewayOptions(event_loop=choice).serve_flags(), "--host", "h"]
    assert shards._event_loop(serve_args) == choice and shards._event_loop([]) == "auto"
    assert shards._event_loop([f"--event-loop={choice}"]) == choice

    from palaestra.orchestrator.server_host import ServerHost

    started: dict = {}
    monkeypatch.setattr(ServerHost, "_run", lambda self, argv, *a, **kw: started.update(argv=argv) or "url")
    ServerHost.__new__(ServerHost).start_front(["http://127.0.0.1:1"], "127.0.0.1", choice)
    assert started["argv"][started["argv"].index("--event-loop") + 1] == choice
