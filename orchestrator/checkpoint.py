"""A run's state (`RunState`) and its checkpoints on disk: where a run starts, how one is kept.

    state, checkpoint = prepare_run(cfg)       # fresh (checkpoint None) or the latest checkpoint's
    ...
    commit_checkpoint(cfg, state, ckpt_dir)    # after the trainer saved into ckpt_dir/trainer

A checkpoint is `checkpoints/step-NNNNNN/` in the run's output directory: `trainer/` (written by
`Trainer.save` in its actor), `config.yaml` and `state.json` (this `RunState`);
`checkpoints/latest` names the newest complete one and moves only once it is whole.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from palaestra.config import RunConfig, save_config
from palaestra.orchestrator.errors import RunFailed

__all__ = ["RunState", "checkpoint_dir", "commit_checkpoint", "prepare_run"]

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What a run remembers between steps and across a resume (`state.json`)."""

    step: int = 0  # steps done
    weight_version: int = 0  # what the engines hold, as the trainer reported it after its last sync
    cursors: list[int] = field(default_factory=list)  # per gateway shard: spool position read ([] = none)
    watermark: int = 0  # every task index below it was consumed (trained or dropped)
    consumed_above: list[int] = field(default_factory=list)  # consumed indices >= watermark (async)
    rows: list[dict[str, float]] = field(default_factory=list)  # per-step metrics (the reward curve)
    counts: dict[str, int] = field(default_factory=dict)  # run totals: drops, statuses, ...
    # Samples read before `cursors` that no step had taken (async, one_step_off: groups generated
    # ahead): a resumed launch never reads them again, so it records them as `earlier_launch`.
    unclaimed: list[str] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path) -> RunState:
        """The state a checkpoint's `state.json` holds (one written before gateway shards has one
        `cursor`: the one gateway's)."""
        saved = json.loads(path.read_text())
        if "cursor" in saved:
            saved["cursors"] = [saved.pop("cursor")]
        return cls(**saved)

    def consume(self, indices: list[int]) -> None:
        """Marks these task indices consumed (trained, or dropped by the filters)."""
        done = set(self.consumed_above) | set(indices)
        while self.watermark in done:
            done.discard(self.watermark)
            self.watermark += 1
        self.consumed_above = sorted(i for i in done if i > self.watermark)


def prepare_run(cfg: RunConfig) -> tuple[RunState, Path | None]:
    """Checks what the config alone cannot, makes the run's directory (with its `config.yaml`) and
    returns its starting state: fresh, or the latest checkpoint's (and that checkpoint)."""
    temperature = cfg.env.args.get("temperature", cfg.trainer.temperature)
    if temperature != cfg.trainer.temperature:
        raise RunFailed(
            f"env.args.temperature={temperature} but trainer.temperature={cfg.trainer.temperature}: the "
            "trainer's logprobs are only right at the sampling temperature; set trainer.temperature "
            "alone (the run passes it to the environment in session.sampling)"
        )
    _warn_off_policy(cfg)
    out = cfg.output_dir
    latest = out / "checkpoints" / "latest"
    if latest.is_file() and not cfg.run.resume:
        raise RunFailed(
            f"{out} holds checkpoints of an earlier run: set run.resume=true to continue it, or "
            "choose another run.name / run.output_dir"
        )
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    if not (cfg.run.resume and latest.is_file()):
        if cfg.run.resume:
            log.warning("run.resume: no checkpoint in %s; starting at step 0", out / "checkpoints")
        return RunState(), None
    ckpt = out / "checkpoints" / latest.read_text().strip()
    state = RunState.load(ckpt / "state.json")
    log.info("resuming from %s: step %d, weight version %d", ckpt, state.step, state.weight_version)
    return state, ckpt


def checkpoint_dir(cfg: RunConfig, state: RunState) -> Path:
    """Where the checkpoint after `state.step` steps goes."""
    return cfg.output_dir / "checkpoints" / f"step-{state.step:06d}"


def commit_checkpoint(cfg: RunConfig, state: RunState, ckpt: Path) -> None:
    """Completes `ckpt` (the trainer's part is in already) and points `latest` at it."""
    save_config(cfg, ckpt / "config.yaml")
    (ckpt / "state.json").write_text(json.dumps(asdict(state)) + "\n")
    tmp = ckpt.parent / "latest.tmp"
    tmp.write_text(ckpt.name + "\n")
    tmp.replace(ckpt.parent / "latest")  # the pointer moves only once the checkpoint is whole


def _warn_off_policy(cfg: RunConfig) -> None:
    tr = cfg.trainer
    if cfg.run.mode != "sync" and not (tr.keep_old_actor or tr.tis.enabled or tr.rs.mode):
        log.warning(
            "run.mode=%s trains on samples up to %d version(s) old, but trainer.keep_old_actor, "
            "trainer.tis.enabled and trainer.rs.mode are all off: the PPO ratio then treats them as "
            "on-policy. keep_old_actor=true fits one_step_off; tis.enabled=true fits async.",
            cfg.run.mode,
            cfg.run.max_staleness,
        )
