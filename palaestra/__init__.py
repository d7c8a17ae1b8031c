"""Palaestra: an environment-centric agentic RL gym.

The root package holds the CLI, typed config, the Sample schema and model presets; the card's
other folders are mounted under it (`palaestra.gateway`, `palaestra.engine`, ...).
"""

__version__ = "0.1.0"

# A server started by palaestra.net.ServerProcess ends with the process that started it (even one
# killed by SIGKILL); a no-op in every other process (palaestra/lifeline.py).
from palaestra import lifeline as _lifeline  # noqa: E402

_lifeline.watch_parent_from_env()
