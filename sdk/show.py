"""Episodes as text: `palaestra rollout/eval --show N` and `palaestra session show ID`.

    picked = pick(summary.results, 2, "worst", seed=0)
    print(episode_text(await gateway.trajectory(result.session_id), result))

The text comes from the gateway (``GET /sessions/{id}?text=true``, gateway/sessions/as_text.py):
each turn's new context (the whole rendered prompt for the first turn, the tool results or user
message after a reply for the next ones) and its reply, decoded from the ids the model read and
sampled, so it is what was trained on, not what the environment believes it sent. Then the reward,
the metrics, the failures, forks, outputs that did not parse and controls the gateway ignored.
"""

from __future__ import annotations

import random
import sysconfig
import traceback
from collections.abc import Sequence
from typing import Any, Literal

__all__ = ["PICKS", "episode_text", "error_where", "pick"]

PICKS = ("worst", "best", "random")
Pick = Literal["worst", "best", "random"]


def pick(results: Sequence[Any], n: int, how: Pick, seed: int = 0) -> list[Any]:
    """`n` of `results` (`RolloutResult`s): the lowest rewards (failed episodes first), the highest
    (failed last), or a seeded random choice."""
    if n <= 0:
        return []
    if how == "random":
        return random.Random(seed).sample(list(results), min(n, len(results)))
    if how not in ("worst", "best"):
        raise ValueError(f"--show-pick must be one of {', '.join(PICKS)}; got {how!r}")
    ok = sorted((r for r in results if r.status != "failed"), key=lambda r: r.reward)
    failed = [r for r in results if r.status == "failed"]
    ordered = failed + ok if how == "worst" else ok[::-1] + failed
    return ordered[:n]


def error_where(exc: BaseException) -> str:
    """Where `exc` was raised: ``path:line in function`` of the innermost frame outside the
    installed libraries and the standard library (the environment's own code), else the innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    libraries = tuple(p for p in {sysconfig.get_path("stdlib"), sysconfig.get_path("purelib")} if p)
    own = [f for f in frames if not f.filename.startswith(libraries) and "site-packages" not in f.filename]
    last = (own or frames)[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in (text.splitlines() or [""]))


def _numbers(values: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, int | float) else f"{k} {v}" for k, v in values.items())


def episode_text(trajectory: dict[str, Any] | None, result: Any | None = None) -> str:
    """One episode as text: `trajectory` (GET /sessions/{id}?text=true; None when there is no
    session) and, from a rollout, its `RolloutResult` (reward, metrics, error)."""
    lines = []
    if result is not None:
        head = f"=== task {result.task_id} session {result.session_id}: {result.status}, reward {result.reward:.3f}"
    else:
        t = trajectory or {}
        head = (
            f"=== session {t.get('session_id')} (env {t.get('env')}, task {t.get('task_id')}): "
            f"{t.get('status') or 'open'}, reward {t.get('reward')}"
        )
    lines.append(head)
    if result is not None and result.error:
        lines.append(f"  error: {result.error}" + (f" ({result.where})" if result.where else ""))
    if trajectory is None:
        return "\n".join(lines)
    metrics = trajectory.get("metrics") or (result.metrics if result is not None else {})
    if metrics:
        lines.append(f"  metrics: {_numbers(metrics)}")
    if trajectory.get("failures"):
        lines.append(f"  failures: {', '.join(trajectory['failures'])}")
    for turn in trajectory.get("turns", []):
        parent = turn.get("parent")
        about = [f"turn {turn['turn_id']}"]
        if parent is not None:
            about.append(f"after turn {parent}")
        if turn.get("fork_reason"):
            about.append(
                f"FORK ({turn['fork_reason']}"
                + (f": {turn['fork_detail']}" if turn.get("fork_detail") else "")
                + ")"
            )
        finish = turn.get("finish_reason")
        if isinstance(finish, dict):  # the engine's {"type": "length", "length": 24}
            finish = " ".join(str(v) for v in finish.values())
        about.append(f"finish {finish}")
        lines.append("  --- " + ", ".join(about))
        text = turn.get("text")
        if text is None:
            lines.append("    (token ids no longer in the gateway's spool)")
            continue
        lines.append("  context:" if parent is None else f"  new context (from token {text['from']}):")
        lines.append(_indent(text["context"]))
        lines.append("  reply:")
        lines.append(_indent(text["reply"]))
    forks = trajectory.get("forks") or []
    if forks:
        described = [f"turn {fork['turn_id']} ({fork['reason']})" for fork in forks]
        lines.append(f"  forks: {', '.join(described)}")
    for key, label in (
        ("parse_errors", "outputs that did not parse"),
        ("ignored_controls", "ignored controls"),
    ):
        if trajectory.get(key):
            lines.append(f"  {label}: {_numbers(trajectory[key])}")
    if not forks and not trajectory.get("ignored_controls"):
        lines.append("  no forks, no ignored controls")
    return "\n".join(lines)
