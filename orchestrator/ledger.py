"""The environment runner's session ledger, and the group ids that tell a redone group apart.

    client = ledgered_client(gateway_url, api_key, "runs/x/logs/rollout-sessions-0.jsonl")
    ...                                     # the runner opens and finishes sessions through it
    open_sessions("runs/x/logs/rollout-sessions-0.jsonl")   # after it died: {session_id: group_id}

The runner (`rollout_worker.RolloutWorker`) notes each session it opens and each it finishes, one JSON
line each, appended at once; when its process is killed the driver reads what it left open and
finishes those sessions on the gateway as aborted (`Cluster.replace_rollout`), or asks a restarted
gateway whether it still knows them (`Cluster.sessions_lost`). `group_run_id` names a task's group
per attempt, so samples of a group abandoned after a fault never mix with its redone twin
(`batching.group_attempt` reads it back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from palaestra.sdk import GatewayClient

__all__ = ["group_run_id", "ledgered_client", "open_sessions"]


def group_run_id(run_id: str, index: int, attempt: int = 0) -> str:
    """The run id of task `index`'s group (the tail of its group id, `env/task_id/<this>`):
    `<run_id>.<index>`, and `<run_id>.<index>.a<attempt>` for a group redone after a fault, so the
    sample feed tells the samples of an abandoned try from those of the one that trains."""
    return f"{run_id}.{index}" + (f".a{attempt}" if attempt else "")


def ledgered_client(url: str, api_key: str, ledger: str | None) -> GatewayClient:
    """The SDK's GatewayClient, noting every session it opens and finishes in `ledger` (one JSON
    line each, flushed at once) when given: the driver reads it when this process dies."""
    from palaestra.sdk import GatewayClient
    from palaestra.sdk.session import GatewayError

    if ledger is None:
        return GatewayClient(url, api_key, retries=5)

    @dataclass
    class LedgeredClient(GatewayClient):
        def _note(self, entry: dict[str, str]) -> None:
            with open(ledger, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")

        async def session(self, *args, **kwargs):
            session = await super().session(*args, **kwargs)
            self._note({"open": session.session_id, "group": session.group_id})
            return session

        async def reward(self, session_id: str, *args, **kwargs):
            try:
                answer = await super().reward(session_id, *args, **kwargs)
            except GatewayError as exc:
                if exc.status == 404:  # the gateway does not know it (a restart lost it): not open
                    self._note({"done": session_id})
                raise  # other errors: still open, for the driver to abort if this process dies
            self._note({"done": session_id})
            return answer

    return LedgeredClient(url, api_key, retries=5)


def open_sessions(ledger: str | Path) -> dict[str, str]:
    """Sessions a (dead) environment runner opened and never finished: session id -> group id."""
    path = Path(ledger)
    if not path.exists():
        return {}
    opened: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # the last line, cut by the kill
            continue
        if "open" in entry:
            opened[entry["open"]] = entry.get("group", "")
        elif "done" in entry:
            opened.pop(entry["done"], None)
    return opened
