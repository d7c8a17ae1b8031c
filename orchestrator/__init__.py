"""The run: what `palaestra train` drives, step by step, on Ray.

Owns the step loop and what a run returns (`loop`), which finished groups train (`batching`:
the sample feed, staleness, filters; no Ray import, testable alone), what each `run.mode`
overlaps (`modes`), the Ray cluster (`cluster`: Ray itself, the boxes and their liveness;
`placement`: placement groups and threads; `waiting`: bounded, watched waits; `supervisor`: a
dead process restarted or replaced, every fault reported), the actors Ray runs (`server_host`:
an engine, the router or the gateway; `rollout_worker`: the environment runner, with its session
ledger in `ledger`; `trainer_worker`: a trainer rank; `nodes`: their addresses), the run's state and checkpoints (`checkpoint`), its metrics (`metrics`) and
what it shows at the end (`report`, `viewer`). `palaestra/train.py` reads it top to bottom.

Must not hold model, gateway or trainer logic: it starts those boxes and calls them (the
trainer through `palaestra.trainer.Trainer` in an actor, the gateway over HTTP, engines through
the trainer's `WeightSync`), and never reaches into their internals.

Importing this package is cheap: Ray is imported by the modules that use it, when they do.
"""
