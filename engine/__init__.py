"""Inference engines and their launchers.

- `server`/`core`: the embedded CPU engine, a FastAPI app over a transformers causal LM that
  serves SGLang's native HTTP API (see docs/engine.md for what is implemented).
- `router`: launches the real sglang-router with consistent hashing on loopback.
- `sglang_launcher`: builds the `sglang.launch_server` command from `--sglang-*` options.
- `zero`: a zero-work engine (no model) for benchmarks and load tests of what stands in front.
- `sim` (+ `sim_model`): a simulated engine answering after a modelled prefill / decode / queueing
  latency for Llama-3-8B on one H100 (docs/routing.md), many per process, for routing benchmarks.

Must not hold training logic.
"""
