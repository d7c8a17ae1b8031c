"""What trains: finished groups, read from the gateway's sample cursor, through the staleness bound
and the filters into one step's `Batch`. No Ray here: every piece is testable alone.

    feed = SampleFeed(gateway_url, api_key, run_id, shards=2) # the trainer's side of /samples
    feed.poll(); samples = feed.claim(record)                 # a finished group's samples, or None
    batch = select_batch([(record, samples)], trainer_version=3, max_staleness=1,
                         stale_policy="drop", filter_zero_variance=True)

* `GroupRecord` — one finished group (a task's `samples_per_task` sessions) as the environment
  runner reports it: task index, sample ids, rewards, statuses, timing.
* `SampleFeed` — reads `/samples?after=CURSOR` of every gateway shard (one cursor per shard's
  spool, gateway/shards.py): deduplicates by `sample_id`, drops failed/aborted samples and those of
  evaluations or of another launch (all counted; another launch's recorded as `earlier_launch`:
  a resumed run reads a killed one's samples after its checkpoint), and hands out a group's samples once they are
  all read; `ack(cursors)` lets each shard delete what a checkpoint holds.
  After a fault the driver `retire`s the groups in flight: their samples, read already or later,
  are recorded as not trained with the fault as the reason.
* `sample_lag` — how many weight versions a sample is behind the trainer (its oldest sampled token).
* `select_batch` — the staleness bound per sample (drop, or keep with the loss masked) and the
  zero-reward-variance filter per group, with every decision counted in `Batch.counts` and every
  sample not trained on recorded with its reason in `Batch.dropped` (`DROP_REASONS`), the group's
  failed / aborted samples (`GroupRecord.dropped`, from the feed) included.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from palaestra.sample import Sample

__all__ = [
    "DROP_REASONS",
    "TRAINABLE",
    "Batch",
    "GroupRecord",
    "SampleFeed",
    "group_attempt",
    "sample_lag",
    "select_batch",
]

TRAINABLE = ("completed", "truncated")  # session statuses whose samples train
DROP_REASONS = ("stale", "stale_masked", "zero_variance", "failed", "aborted")
"""Why a sample is not trained on: beyond the staleness bound (dropped, or kept with its loss
masked), in a group whose rewards do not vary, or from a session that failed / was aborted."""


@dataclass
class GroupRecord:
    """One finished group (a task's `samples_per_task` sessions), as the driver needs it."""

    task_index: int
    task_id: str
    group_id: str
    sample_ids: list[str]  # of sessions that completed or were truncated (the trainable ones)
    rewards: list[float]  # of those sessions
    statuses: dict[str, int]  # sessions per status
    metrics: dict[str, float]  # the environment's metrics, averaged over trainable sessions
    sampled_tokens: int
    started: float  # wall clock (time.time()) of the first session's start
    finished: float
    errors: list[str] = field(default_factory=list)
    kind: str | None = None  # the task's `kind` (a dataset, a game, a mix's family), when it has one
    longest_tokens: int = 0  # sampled tokens of the group's longest trainable session
    # sample_id -> reason, of this group's samples that never train (failed / aborted sessions);
    # filled by `SampleFeed.claim`, so the step that takes the group counts them in `Batch.dropped`
    dropped: dict[str, str] = field(default_factory=dict)
    # failed sessions per reason (`RolloutResult.failure`: sandbox_error, error, session, ...)
    failures: dict[str, int] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------
# Samples: the gateway's cursor
# ----------------------------------------------------------------------------------------------
class SampleFeed:
    """Reads `/samples?after=CURSOR` of each gateway shard, keeps trainable samples of this launch
    until their group is claimed. `cursors[i]` is the last position read in shard i's spool:
    everything up to it has been seen. With one shard the gateway is asked as always; with more,
    the front is asked for each shard's spool (``&shard=<i>``)."""

    def __init__(
        self, gateway_url: str, api_key: str, run_id: str, cursors: list[int] | None = None, shards: int = 1
    ):
        self.url, self.run_id, self.shards = gateway_url.rstrip("/"), run_id, shards
        self.cursors = list(cursors) if cursors else [0] * shards
        if len(self.cursors) != shards:
            raise ValueError(
                f"{len(self.cursors)} spool cursors for {shards} gateway shards: a run resumes with the "
                f"gateway.shards it was checkpointed with ({len(self.cursors)})"
            )
        self.headers = {"Authorization": f"Bearer {api_key}"}
        self.seen: set[str] = set()
        self.buffer: dict[str, Sample] = {}
        self.counts: Counter[str] = Counter()
        self.dropped: dict[str, str] = {}  # sample_id -> reason (`DROP_REASONS`, `earlier_launch`)
        self._unclaimed_drops: dict[
            str, dict[str, str]
        ] = {}  # group_id -> its part of `dropped`, until claimed
        self.client = httpx.Client(timeout=60, trust_env=False, headers=self.headers)
        self.attempt = 0  # groups of earlier attempts (`ledger.group_run_id`) never train
        self.retired: dict[int, str] = {}  # attempt -> why its unclaimed groups were abandoned

    def _shard(self, shard: int) -> dict[str, int]:
        return {"shard": shard} if self.shards > 1 else {}

    def retire(self, reason: str) -> int:
        """Abandons every group not claimed yet (a fault ended the try that was generating them):
        their samples read so far, and those read later, are recorded in `dropped` with `reason`;
        groups from now on are the next attempt's. Returns how many samples were retired now."""
        self.retired[self.attempt] = reason
        self.attempt += 1
        for sid in self.buffer:
            self.dropped[sid] = reason
        retired = len(self.buffer)
        self.counts[f"retired_{reason}"] += retired
        self.buffer.clear()
        self._unclaimed_drops.clear()  # failed / aborted ones stay in `dropped` with their status
        return retired

    def close(self) -> None:
        self.client.close()

    def _ours(self, group_id: str) -> bool:
        # Group ids are `env/task_id/<run_id>.<task index>` (the rollout worker's run ids); samples
        # of another launch (a crashed attempt before a resume) or of evaluations are not trained.
        return group_id.rsplit("/", 1)[-1].startswith(self.run_id + ".")

    def poll(self) -> int:
        """Reads every sample after the cursor of each shard; returns how many were new."""
        new = 0
        for shard in range(self.shards):
            while True:
                params = {"after": self.cursors[shard], "limit": 1000, **self._shard(shard)}
                r = self.client.get(f"{self.url}/samples", params=params)
                r.raise_for_status()
                page = r.json()
                for data in page["samples"]:
                    new += self._take(data)
                self.cursors[shard] = int(page["cursor"])
                if not page["samples"] or self.cursors[shard] >= int(page["last_cursor"]):
                    break
        return new

    def ack(self, cursors: list[int]) -> None:
        """Tells each shard that everything up to its cursor is consumed for good (a checkpoint
        records them: a resumed run reads after them), so its spool may delete those samples
        (`POST /samples/ack`)."""
        for shard, cursor in enumerate(cursors):
            r = self.client.post(
                f"{self.url}/samples/ack", params=self._shard(shard), json={"cursor": cursor}
            )
            r.raise_for_status()

    def _take(self, data: dict[str, Any]) -> int:
        sid = data["sample_id"]
        if sid in self.seen:
            self.counts["duplicates"] += 1
            return 0
        self.seen.add(sid)
        if not self._ours(data["group_id"]):
            evaluation = data["group_id"].rsplit("/", 1)[-1].startswith("eval-")
            self.counts["eval" if evaluation else "other_run"] += 1
            if not evaluation:  # a launch killed after its checkpoint: this one redoes its steps
                self.dropped[sid] = "earlier_launch"
            return 0
        attempt = group_attempt(data["group_id"])
        if attempt < self.attempt and data["status"] in TRAINABLE:
            reason = self.retired.get(attempt, "retired")
            self.counts[f"retired_{reason}"] += 1
            self.dropped[sid] = reason
            return 0
        if data["status"] not in TRAINABLE:
            self.counts[f"status_{data['status']}"] += 1
            self.dropped[sid] = data["status"]
            self._unclaimed_drops.setdefault(data["group_id"], {})[sid] = data["status"]
            return 0
        self.buffer[sid] = Sample.from_dict(data)
        return 1

    def claim(self, record: GroupRecord) -> list[Sample] | None:
        """The group's samples once all are read (None: poll again), removed from the buffer; the
        group's samples that do not train (failed / aborted) go into `record.dropped`, so that the
        step taking the group counts them (the record arrives once every session ended, and each
        session's samples are spooled before it ends, so they are read by now)."""
        if not all(sid in self.buffer for sid in record.sample_ids):
            return None
        record.dropped.update(self._unclaimed_drops.pop(record.group_id, {}))
        return [self.buffer.pop(sid) for sid in record.sample_ids]


def group_attempt(group_id: str) -> int:
    """The attempt of a group (`ledger.group_run_id`: `.../<run_id>.<index>[.a<attempt>]`)."""
    parts = group_id.rsplit("/", 1)[-1].split(".")
    if len(parts) > 2 and parts[2].startswith("a") and parts[2][1:].isdigit():
        return int(parts[2][1:])
    return 0


# ----------------------------------------------------------------------------------------------
# What trains
# ----------------------------------------------------------------------------------------------
def sample_lag(sample: Sample, trainer_version: int) -> float:
    """Weight versions between the trainer and the oldest policy that sampled a token of `sample`
    (inf when a version is not a number, e.g. an engine left at "default")."""
    versions = [v for v, m in zip(sample.weight_versions, sample.loss_mask, strict=True) if m == 1]
    if not versions:
        return 0.0
    try:
        return float(trainer_version - min(int(v) for v in versions))
    except ValueError:
        return math.inf


@dataclass
class Batch:
    samples: list[Sample]  # what trains
    groups: list[GroupRecord]  # the groups they came from
    lags: list[float]  # per trained sample, in weight versions
    counts: Counter[str]  # stale_dropped, stale_masked, groups_zero_variance, zero_variance_samples, ...
    considered: list[GroupRecord] = field(default_factory=list)  # every group looked at (kept or not)
    dropped: dict[str, str] = field(default_factory=dict)  # sample_id -> why it does not train
    rounds: int = 1  # generation rounds that made it (dynamic sampling refills; async: groups / step size)

    @property
    def samples_generated(self) -> int:
        """Samples of every group looked at, trained or not (failed / aborted ones included)."""
        return sum(len(g.sample_ids) + len(g.dropped) for g in self.considered)

    def dropped_counts(self) -> Counter[str]:
        """Samples not trained on, per reason (`DROP_REASONS`)."""
        return Counter(self.dropped.values())

    @classmethod
    def empty(cls) -> Batch:
        return cls([], [], [], Counter())

    def why_empty(self) -> str:
        """Why no sample trains: the filters' counts, and the first distinct errors of the sessions
        (when every session failed, those say why: an engine refusing, a gateway error)."""
        errors = sorted({e for g in self.considered for e in g.errors})
        said = f"; the sessions' errors: {' | '.join(errors[:3])}" if errors else ""
        return f"{dict(self.counts)}{said}"

    def session_failures(self) -> Counter[str]:
        """Failed sessions per reason over every group looked at (kept or not)."""
        failures: Counter[str] = Counter()
        for g in self.considered:
            failures.update(g.failures)
        return failures

    def session_statuses(self) -> Counter[str]:
        """Sessions per status over every group looked at (kept or not)."""
        statuses: Counter[str] = Counter()
        for g in self.considered:
            statuses.update(g.statuses)
        return statuses

    def extend(self, other: Batch) -> None:
        self.samples += other.samples
        self.groups += other.groups
        self.lags += other.lags
        self.counts += other.counts
        self.considered += other.considered
        self.dropped.update(other.dropped)


def select_batch(
    groups: Sequence[tuple[GroupRecord, list[Sample]]],
    trainer_version: int,
    max_staleness: int,
    stale_policy: str,
    filter_zero_variance: bool,
) -> Batch:
    """Applies the staleness bound (per sample: drop, or keep with loss_mask zeroed) and the
    zero-reward-variance filter (per group, after the staleness drop); counts every decision, and
    records each sample not trained on with its reason (failed / aborted ones from the records)."""
    batch = Batch([], [], [], Counter(), [record for record, _ in groups])
    for record, group in groups:
        batch.dropped.update(record.dropped)  # failed / aborted, set aside by the feed
        fresh = []
        for s in group:
            lag = sample_lag(s, trainer_version)
            if lag > max_staleness:
                if stale_policy == "drop":
                    batch.counts["stale_dropped"] += 1
                    batch.dropped[s.sample_id] = "stale"
                    continue
                s = Sample.from_dict({**s.to_dict(), "loss_mask": [0] * s.response_len})
                batch.counts["stale_masked"] += 1
                batch.dropped[s.sample_id] = "stale_masked"
            fresh.append((s, lag))
        if not fresh:
            batch.counts["groups_empty"] += 1
            continue
        if filter_zero_variance and len({s.reward for s, _ in fresh}) == 1:
            batch.counts["groups_zero_variance"] += 1
            batch.counts["zero_variance_samples"] += len(fresh)
            batch.dropped.update({s.sample_id: "zero_variance" for s, _ in fresh})
            continue
        batch.groups.append(record)
        batch.samples += [s for s, _ in fresh]
        batch.lags += [lag for _, lag in fresh]
    return batch
