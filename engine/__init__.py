"""Inference engines and their launchers.

- `server`/`core`: the embedded CPU engine, a FastAPI app over a transformers causal LM that
  serves SGLang's native HTTP API (see docs/engine.md for what is implemented).
- `router`: launches the real sglang-router with consistent hashing on loopback.
- `sglang_launcher`: builds the `sglang.launch_server` command from `--sglang-*` options.
- `zero`: a zero-work engine (no model) for benchmarks and load tests of what stands in front.

Must not hold training logic.
"""
