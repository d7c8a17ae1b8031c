"""The router and SGLang launchers: option passthrough, help, and the real sglang-router.

The routing test starts the REAL sglang-router (Rust, 0.3.2) over two stand-in workers. The
stand-ins are test doubles, not engines: minimal FastAPI apps that answer the endpoints the router
probes and record every `/generate` they receive. The same test against real embedded engines
lives with the engine tests.
"""

from __future__ import annotations

import argparse
import shlex
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request

from palaestra.engine import router, sglang_launcher
from palaestra.net import ServerProcess, ServerStartError, free_port, wait_http_ok

W1, W2 = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _parser() -> argparse.ArgumentParser:
    """A top-level parser with only our two groups (palaestra.cli needs every group)."""
    parser = argparse.ArgumentParser(prog="palaestra")
    groups = parser.add_subparsers(dest="group", required=True)
    router.register(groups)
    sglang_launcher.register(groups)
    return parser


def _router_args(*argv: str):
    args, extra = _parser().parse_known_args(["router", "serve", *argv])
    return router.build_router_args(args, extra)


# --- router: our options and the --router-* passthrough ------------------------------------


def test_router_defaults_are_loopback_and_consistent_hashing():
    ra = _router_args("--worker-urls", W1, W2)
    assert ra.worker_urls == [W1, W2]
    assert (ra.host, ra.port, ra.policy) == ("127.0.0.1", 30000, "consistent_hashing")
    assert (ra.prometheus_host, ra.prometheus_port) == ("127.0.0.1", 40000)
    assert ra.log_level == "warn"  # info logs two lines per request
    # Untouched router options keep sglang-router's own defaults.
    assert ra.health_check_interval_secs == 60 and ra.health_check_endpoint == "/health"


@pytest.mark.parametrize(
    "argv",
    [
        ["--worker-urls", W1, W2, "--router-health-check-interval-secs", "1"],
        ["--router-health-check-interval-secs", "1", "--worker-urls", W1, W2],
        ["--worker-urls", W1, W2, "--router-health-check-interval-secs=1"],
    ],
    ids=["after", "before", "equals"],
)
def test_router_passthrough_reaches_router_args(argv):
    ra = _router_args(*argv, "--router-max-concurrent-requests", "-1", "--router-dp-aware")
    assert ra.health_check_interval_secs == 1
    assert ra.max_concurrent_requests == -1 and ra.dp_aware is True
    assert ra.worker_urls == [W1, W2]


def test_router_our_options_win_and_are_typed():
    ra = _router_args(
        "--worker-urls", W1, "--host", "127.0.0.2", "--port", "31000", "--policy", "round_robin",
        "--prometheus-host", "127.0.0.3", "--prometheus-port", "31999", "--log-level", "warn",
    )  # fmt: skip
    assert (ra.host, ra.port, ra.policy, ra.log_level) == ("127.0.0.2", 31000, "round_robin", "warn")
    assert (ra.prometheus_host, ra.prometheus_port) == ("127.0.0.3", 31999)


def test_router_prometheus_port_never_overflows():
    ra = _router_args("--worker-urls", W1, "--port", "60000")
    assert 0 < ra.prometheus_port <= 65535


# Decision: the four prefixed flags that duplicate our options are rejected (never merged), so
# e.g. --router-policy cannot silently override --policy; 0.3.2's --router-policy cannot even
# express consistent_hashing.
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--router-policy", "round_robin"], "use --policy"),
        (["--router-policy=cache_aware"], "use --policy"),
        (["--router-prometheus-port", "9"], "use --prometheus-port"),
        (["--router-prometheus-host", "0.0.0.0"], "use --prometheus-host"),
        (["--router-log-level", "debug"], "use --log-level"),
        (["--frobnicate"], "--router-<option>"),
        (["--router-frobnicate", "1"], "unknown router option"),
        (["--router-health-check-interval"], "unknown router option"),  # no abbreviations
        (["--router-health-check-interval-secs", "soon"], "bad router option"),
        (["--router-backend", "vllm"], "bad router option"),
        (["--router-host", "0.0.0.0"], "unknown router option"),
        (["stray"], "unrecognized argument 'stray'"),
    ],
)
def test_router_rejects_what_is_not_a_router_option(argv, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        _router_args(*argv, "--worker-urls", W1)


def test_router_rejects_worker_url_without_scheme():
    with pytest.raises(ValueError, match="must start with http"):
        _router_args("--worker-urls", "127.0.0.1:1")


def test_router_command_exits_2_with_a_clear_message(capsys):
    parser = _parser()
    args, extra = parser.parse_known_args(["router", "serve", "--worker-urls", W1, "--bogus", "1"])
    with pytest.raises(SystemExit) as exc:
        args.func(args, extra)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "palaestra router serve" in err and "'--bogus'" in err and "--router-<option>" in err


def test_router_help_lists_ours_and_passthrough(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["router", "serve", "--help"])
    out = capsys.readouterr().out
    for option in ("--worker-urls", "--host", "--port", "--policy", "--prometheus-host"):
        assert option in out
    assert "consistent_hashing" in out and "--log-level" in out
    for option in ("--router-health-check-interval-secs", "--router-cache-threshold", "--router-api-key"):
        assert option in out
    # Hidden: the duplicates we reject, and the passthrough parser's own unprefixed --worker-urls.
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  -")]
    assert "--router-policy" not in listed and "--router-prometheus-port" not in listed
    assert out.count("--worker-urls") == 2  # usage line + our option


def test_router_help_through_palaestra_cli(capsys):
    """`palaestra router serve --help` via the real CLI (needs every command group importable)."""
    from palaestra import cli

    cli.build_parser()
    with pytest.raises(SystemExit) as exc:
        cli.main(["router", "serve", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--worker-urls" in out and "--router-health-check-interval-secs" in out
    with pytest.raises(SystemExit) as exc:
        cli.main(["router", "serve", "--worker-urls", W1, "--nope"])
    assert exc.value.code == 2


# --- sglang launcher ----------------------------------------------------------------------


def test_sglang_command_passes_options_through_unchanged():
    argv = sglang_launcher.build_command(
        "Qwen/Qwen3-0.6B",
        "127.0.0.1",
        30005,
        [
            "--sglang-tp-size", "2",
            "--sglang-enable-memory-saver",  # a flag without a value stays a flag
            "--sglang-chat-template", "my template.jinja",  # a value with a space stays one value
            "--sglang-json-model-override-args", '{"a": 1}',
            "--sglang-mem-fraction-static=0.8",
            "--sglang-random-seed", "-1",
        ],
        python="python",
    )  # fmt: skip
    assert argv == [
        "python", "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen3-0.6B", "--host", "127.0.0.1", "--port", "30005",
        "--tp-size", "2",
        "--enable-memory-saver",
        "--chat-template", "my template.jinja",
        "--json-model-override-args", '{"a": 1}',
        "--mem-fraction-static=0.8",
        "--random-seed", "-1",
    ]  # fmt: skip


def test_sglang_command_defaults():
    argv = sglang_launcher.build_command("m")
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[3:] == ["--model-path", "m", "--host", "127.0.0.1", "--port", "30001"]


@pytest.mark.parametrize(
    "passthrough, needle",
    [
        (["--tp-size", "2"], "--sglang-<option>"),
        (["--sglang-port", "1"], "use --port"),
        (["--sglang-model-path=x"], "use --model"),
        (["--sglang-host", "0.0.0.0"], "use --host"),
        (["--sglang-"], "--sglang-<option>"),
        (["value-first"], "unrecognized argument 'value-first'"),
    ],
)
def test_sglang_rejects_what_is_not_an_sglang_option(passthrough, needle):
    with pytest.raises(ValueError, match=needle):
        sglang_launcher.build_command("m", passthrough=passthrough)


def test_sglang_dry_run_prints_the_command(capsys):
    parser = _parser()
    args, extra = parser.parse_known_args(
        [
            "sglang",
            "launch",
            "--model",
            "org/m",
            "--dry-run",
            "--sglang-chat-template",
            "a b",
            "--sglang-trust-remote-code",
        ]
    )
    assert args.func(args, extra) == 0
    printed = capsys.readouterr().out.strip()
    assert shlex.split(printed)[2:] == [
        "sglang.launch_server", "--model-path", "org/m", "--host", "127.0.0.1", "--port", "30001",
        "--chat-template", "a b", "--trust-remote-code",
    ]  # fmt: skip


def test_sglang_launch_rejects_unknown_args_with_exit_2(capsys):
    parser = _parser()
    args, extra = parser.parse_known_args(["sglang", "launch", "--model", "m", "--dry-run", "--tp", "2"])
    with pytest.raises(SystemExit) as exc:
        args.func(args, extra)
    assert exc.value.code == 2 and "--sglang-<option>" in capsys.readouterr().err


def test_sglang_help_lists_our_options(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["sglang", "launch", "--help"])
    out = capsys.readouterr().out
    for option in ("--model", "--host", "--port", "--dry-run", "--sglang-", "palaestra engine serve"):
        assert option in out


@pytest.mark.skipif(sglang_launcher.unavailable_reason() is None, reason="SGLang is installed here")
def test_sglang_launch_without_sglang_points_at_the_embedded_engine():
    with pytest.raises(sglang_launcher.SGLangUnavailable) as exc:
        sglang_launcher.launch("m", port=free_port())
    message = str(exc.value)
    assert "GPU" in message and "AVX-512" in message and "palaestra engine serve" in message


# --- the real router over stand-in workers -------------------------------------------------


@dataclass
class StandInWorker:
    """TEST DOUBLE, not an engine: answers what sglang-router probes, records /generate calls."""

    name: str
    url: str = ""
    seen: list[tuple[str | None, dict]] = field(default_factory=list)  # (routing key, JSON body)
    probes: list[str] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()
        info = {"model_path": "stand-in", "served_model_name": "stand-in", "tp_size": 1, "dp_size": 1}

        @app.middleware("http")
        async def record_probe(request: Request, call_next):
            self.probes.append(f"{request.method} {request.url.path}")
            return await call_next(request)

        @app.get("/health")
        def health() -> dict:
            return {}

        @app.get("/server_info")
        @app.get("/get_server_info")
        def server_info() -> dict:
            return {**info, "version": "stand-in", "weight_version": "default"}

        @app.get("/model_info")
        @app.get("/get_model_info")
        def model_info() -> dict:
            return {**info, "is_generation": True, "weight_version": "default"}

        @app.get("/v1/models")
        def models() -> dict:
            return {"object": "list", "data": [{"id": "stand-in", "object": "model", "owned_by": "sglang"}]}

        @app.post("/generate")
        async def generate(request: Request) -> dict:
            self.seen.append((request.headers.get("x-smg-routing-key"), await request.json()))
            finish = {"type": "length", "length": 1}
            return {
                "text": "x",
                "output_ids": [7],
                "meta_info": {"id": "r", "finish_reason": finish, "worker": self.name},
            }

        return app


@pytest.fixture
def stand_in_workers() -> Iterator[list[StandInWorker]]:
    workers, servers, threads = [], [], []
    for name in ("w1", "w2"):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # bound here, so no other process can take the port meanwhile
        worker = StandInWorker(name, url=f"http://127.0.0.1:{sock.getsockname()[1]}")
        server = uvicorn.Server(uvicorn.Config(worker.app(), log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        workers.append(worker)
        servers.append(server)
        threads.append(thread)
    try:
        for worker in workers:
            wait_http_ok(worker.url + "/health", timeout=10)
        yield workers
    finally:
        for server in servers:
            server.should_exit = True
        for thread in threads:
            thread.join(timeout=5)


def test_real_router_keeps_each_routing_key_on_one_worker(stand_in_workers):
    began = time.monotonic()
    # Health-check settings are the only router options changed from sglang-router's defaults.
    options = ["--router-health-check-interval-secs", "1", "--router-health-check-timeout-secs", "2"]
    with router.RouterProcess([w.url for w in stand_in_workers], router_options=options) as proc:
        assert proc.startup_seconds is not None and proc.startup_seconds < 15
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
        landed: dict[str, set[str]] = {}
        with httpx.Client(base_url=proc.url, timeout=10, trust_env=False) as client:
            for _ in range(3):
                for i in range(20):
                    key = f"session-{i}"
                    response = client.post("/generate", json=body, headers={"X-SMG-Routing-Key": key})
                    assert response.status_code == 200, response.text
                    landed.setdefault(key, set()).add(response.json()["meta_info"]["worker"])
            no_key = client.post("/generate", json=body)
            assert no_key.status_code == 200 and no_key.json()["output_ids"] == [7]
            assert httpx.get(proc.metrics_url, timeout=5, trust_env=False).status_code == 200
        # at the default log level (warn) the router logs nothing per request (info: two lines each)
        log = proc.log_tail(100_000)
        assert "router: http://" in log and "processing request" not in log, log[-2000:]
        proc_for_exit = proc
    assert proc_for_exit.poll() is not None  # stop() ended the subprocess

    assert all(len(workers) == 1 for workers in landed.values()), landed
    assert {next(iter(w)) for w in landed.values()} == {"w1", "w2"}
    # The router forwards X-SMG-Routing-Key to the worker (header names arrive lower-cased).
    for worker in stand_in_workers:
        keyed = [key for key, _ in worker.seen if key is not None]
        assert keyed and all(landed[key] == {worker.name} for key in keyed)
    assert sum(len(w.seen) for w in stand_in_workers) == 61

    # sglang-router 0.3.2 parses /generate into its typed request and re-serialises it: our
    # fields survive, `"model": null` and defaults are added, unknown fields would be dropped.
    # Measured body: {"model": null, "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1},
    #   "return_logprob": true, "return_text_in_logprobs": false, "stream": false,
    #   "log_metrics": true, "return_hidden_states": false, "background": false, "no_logs": false,
    #   "return_bytes": false, "return_entropy": false}
    _, received = stand_in_workers[0].seen[0]
    assert {k: received[k] for k in body} == body
    assert received.get("model", "absent") is None and received["stream"] is False

    # What the router probed on registration (besides HTTP/2 `PRI *`, which never reaches FastAPI).
    probes = set(stand_in_workers[0].probes)
    assert {"GET /health", "GET /server_info", "GET /model_info"} <= probes
    assert time.monotonic() - began < 30


def test_router_process_surfaces_the_log_tail_when_startup_fails(tmp_path):
    bad = router.RouterProcess(
        [W1], router_options=["--router-no-such-option", "1"], log_path=str(tmp_path / "router.log")
    )
    with pytest.raises(ServerStartError) as exc:
        bad.start()
    message = str(exc.value)
    assert "exited with code 2" in message and "--router-no-such-option" in message


def test_router_process_waits_for_every_worker(tmp_path):
    # The router itself is up at once, but /readiness stays 503 while a worker is unreachable.
    # The start must fail on the router's own 503, not on a router that had not answered yet: on a
    # loaded machine the router can take longer than the first window to listen, so widen it.
    missing = f"http://127.0.0.1:{free_port()}"
    for window in (1.5, 5.0, 15.0, 45.0):
        log = tmp_path / f"router-{window}.log"
        proc = router.RouterProcess([missing], startup_timeout=window, log_path=str(log))
        with pytest.raises(ServerStartError) as exc:
            proc.start()
        assert proc.poll() is not None  # a failed start does not leave the router running
        if "did not become ready" in str(exc.value) and "(last: ConnectError" in str(exc.value):
            continue  # the router was not listening yet: nothing was decided about readiness
        break
    assert "insufficient healthy workers" in str(exc.value)


# A server that binds the port after `--port` and answers GET /health (stdlib only).
_TINY_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other process holds (listening) while the test runs."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_server_whose_picked_port_was_taken_starts_on_a_fresh_one(tmp_path, taken_port):
    argv = [sys.executable, "-c", _TINY_SERVER, "--port", str(taken_port)]
    url = f"http://127.0.0.1:{taken_port}"
    # A port the caller chose itself stays: the start fails and says why.
    fixed = ServerProcess(argv, url, name="tiny", log_path=tmp_path / "fixed.log")
    with pytest.raises(ServerStartError, match="during start-up") as exc:
        fixed.start()
    assert "Address already in use" in str(exc.value)

    log = tmp_path / "moved.log"
    with ServerProcess(argv, url, name="tiny", log_path=log, free_ports=["--port"]) as moved:
        port = moved.port_of("--port")
        assert port != taken_port and moved.url == f"http://127.0.0.1:{port}"
        assert httpx.get(moved.url + "/health", timeout=5, trust_env=False).text == "ok"
    text = log.read_text()
    assert "Address already in use" in text  # the first attempt's output is kept
    assert f"a port was taken; again with --port {taken_port} -> {port}" in text


def test_free_ports_must_name_flags_of_the_argv():
    with pytest.raises(ValueError, match="--prometheus-port"):
        ServerProcess(["server", "--port", "1"], "http://127.0.0.1:1", free_ports=["--prometheus-port"])


def test_router_moves_its_metrics_port_when_another_process_took_it(
    stand_in_workers, taken_port, monkeypatch, tmp_path
):
    # The router binds its Prometheus port itself; the one it was handed is already taken (what
    # happened in a CI run: `failed to install Prometheus metrics exporter: ... Address already in
    # use`). Test double, labelled: the launcher's port picker returns the taken port for the
    # metrics port; the re-pick after the failed start is the real one.
    picks = iter([free_port(), taken_port])
    monkeypatch.setattr(router, "free_port", lambda host="127.0.0.1": next(picks))
    log = tmp_path / "router.log"
    with router.RouterProcess([w.url for w in stand_in_workers], log_path=str(log)) as proc:
        assert proc.prometheus_port != taken_port
        assert httpx.get(proc.metrics_url, timeout=5, trust_env=False).status_code == 200
        body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
        assert httpx.post(proc.url + "/generate", json=body, timeout=10, trust_env=False).status_code == 200
    assert f"--prometheus-port {taken_port} -> {proc.prometheus_port}" in log.read_text()
