"""`palaestra gateway serve` builds its app with the collector off, then collects once and freezes
what is left (gateway/cli.py `_serve`): start-up's objects live as long as the process, so no
collection on the way is of use. The app and the server are stand-ins here: only the order of the
collector's switches around them is checked."""

from __future__ import annotations

import gc

from palaestra.gateway import cli


def test_serve_builds_the_app_with_the_collector_off_then_collects_and_freezes(monkeypatch, tmp_path) -> None:
    import palaestra.gateway.app as app_module
    from palaestra import quiet_server

    seen: dict[str, object] = {}

    def create_app(config):
        seen["enabled while building"] = gc.isenabled()
        return object()

    def run(app, **kwargs):
        seen["enabled while serving"] = gc.isenabled()
        seen["frozen while serving"] = gc.get_freeze_count()

    monkeypatch.setattr(app_module, "create_app", create_app)
    monkeypatch.setattr(quiet_server, "run", run)
    parser = cli.argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    monkeypatch.setenv("PALAESTRA_API_KEY", "k")
    monkeypatch.setenv("PALAESTRA_ADMIN_KEY", "a")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # what serve sets, undone after the test
    assert gc.isenabled()
    try:
        args = parser.parse_args(
            [
                "gateway",
                "serve",
                "--model",
                "tiny",
                "--engine-url",
                "http://127.0.0.1:9",
                "--spool-dir",
                str(tmp_path),
            ]
        )
        assert cli._serve(args) == 0
    finally:
        gc.unfreeze()  # the test process's objects back in the collector's reach
    assert seen["enabled while building"] is False
    assert seen["enabled while serving"] is True and seen["frozen while serving"] > 0
    assert gc.isenabled()
