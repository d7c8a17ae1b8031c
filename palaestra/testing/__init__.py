"""Stand-in engines for benchmarks and tests of what stands in front of an engine.

- `zero`: a zero-work engine (no model) that answers SGLang's /generate at once, for measuring and
  loading the router and the gateway.
- `sim` (+ `sim_model`): simulated engines answering after a modelled prefill / decode / queueing
  latency for Llama-3-8B on one H100 (docs/routing.md), many per process, for routing benchmarks.
- `transport`: a stand-in asyncio transport, for feeding an HTTP server protocol by hand.

Neither is an engine a run trains with: they parse requests with the real engine's parser
(`engine/protocol.py`) and otherwise only keep up appearances.
"""
