"""What starting an engine costs with its own modules for the model (the default for dense models)
and with transformers' model class: one run, ratios.

    .venv/bin/python -m bench.engine_start [--model tiny] [--rounds 3]

`palaestra engine serve --model-impl auto` builds a dense model from engine/native_model.py;
`--model-impl transformers` loads it with `AutoModelForCausalLM.from_pretrained`, which imports
transformers' model-loading code and, through it, torch.distributed's tensor package, sympy and
torch._dynamo. Each round starts one engine of each kind (one torch thread, as the training runs
start them), in alternating order, and reads, once it answers /health: the wall time from launch,
the process's CPU time (schedstat, every thread) and its resident memory. Printed: each start, the
medians per kind, and native / transformers. Run it on a quiet machine: a start is CPU-bound.
"""

from __future__ import annotations

import time

from bench import common
from palaestra.engine.cli import engine_process

KINDS = {"native": "auto", "transformers": "transformers"}


def start_once(model: str, impl: str) -> dict[str, float | str]:
    """One engine started and stopped: wall to ready, CPU, RSS, the implementation it reports."""
    import httpx

    t0 = time.perf_counter()
    with engine_process(model, extra_args=["--num-threads", "1", "--model-impl", impl]) as engine:
        wall = time.perf_counter() - t0
        assert engine.pid is not None
        figures = common.process_start_figures(engine.pid)
        used = httpx.get(f"{engine.url}/server_info", timeout=30, trust_env=False).json()["model_impl_used"]
    return {"wall s": wall, **figures, "used": used}


def main() -> None:
    args = common.start_bench_args(__doc__)
    runs = common.alternating_starts(
        list(KINDS), args.rounds, lambda kind, _r: start_once(args.model, KINDS[kind])
    )
    print()
    print(
        common.start_summary(
            f"== starting `palaestra engine serve --model {args.model}`, medians of {args.rounds}", runs
        )
    )


if __name__ == "__main__":
    main()
