"""The environment runner's session ledger, the group ids that tell a redone group apart, and the
run's step ledger (what each step trained, across launches).

    client = ledgered_client(gateway_url, api_key, "runs/x/logs/rollout-sessions-0.jsonl")
    ...                                     # the runner opens and finishes sessions through it
    open_sessions("runs/x/logs/rollout-sessions-0.jsonl")   # after it died: {session_id: group_id}

The runner (`rollout_worker.RolloutWorker`) notes each session it opens and each it finishes, one JSON
line each, appended at once; when its process is killed the driver reads what it left open and
finishes those sessions on the gateway as aborted (`Cluster.replace_rollout`), or asks a restarted
gateway whether it still knows them (`Cluster.sessions_lost`). `group_run_id` names a task's group
per attempt, so samples of a group abandoned after a fault never mix with its redone twin
(`batching.group_attempt` reads it back).

    note_step("runs/x/trained.jsonl", launch, step=3, trained=[...], not_trained={sid: reason})
    history, reasons = read_steps("runs/x/trained.jsonl")   # per step, what its last record trained

The step ledger (`trained.jsonl` in the run's directory) survives the driver: every launch of a run
(`run.resume=true` after a driver was killed) appends one line per step it trained, and a step
redone after a rollback or a resume appends another, which is the one that counts. A line also
records the samples not trained since the last one, with their reasons; a resumed launch reads a
killed launch's samples after its checkpoint back from the spool and records them as
`earlier_launch` (`batching.SampleFeed`). So `read_steps` shows every sample trained once, or its
reason, whatever was killed when.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from palaestra.sdk import GatewayClient

__all__ = ["group_run_id", "ledgered_client", "note_step", "open_sessions", "read_steps"]


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


def note_step(
    path: str | Path, launch: str, step: int | None, trained: list[str], not_trained: dict[str, str]
) -> None:
    """Appends what `step` (1-based; None: the run's end) of `launch` trained, and the samples not
    trained since the last line with their reasons, to the step ledger; flushed at once."""
    entry = {"launch": launch, "step": step, "trained": trained, "not_trained": not_trained}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def read_steps(path: str | Path) -> tuple[dict[int, list[str]], dict[str, str]]:
    """The step ledger read back: per step, the samples its last line trained (the final history),
    and every sample any line recorded as not trained, with its reason."""
    history: dict[int, list[str]] = {}
    reasons: dict[str, str] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # the last line, cut by a kill
            continue
        if entry["step"] is not None:
            history[entry["step"]] = entry["trained"]
        reasons.update(entry["not_trained"])
    return history, reasons
