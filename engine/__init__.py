"""Inference engines and their launchers.

- `server`/`core`: the embedded CPU engine, a FastAPI app over a transformers causal LM that
  serves SGLang's native HTTP API (see docs/engine.md for what is implemented).
- `router`: launches the real sglang-router with consistent hashing on loopback.
- `sglang_launcher`: builds the `sglang.launch_server` command from `--sglang-*` options.

The stand-in engines for benchmarks and tests (zero-work, simulated) live in `palaestra.testing`.

Must not hold training logic.
"""
