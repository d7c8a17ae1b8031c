"""Palaestra: an environment-centric agentic RL gym.

The root package holds the CLI, typed config, the Sample schema and model presets; the card's
other folders are mounted under it (`palaestra.gateway`, `palaestra.engine`, ...).
"""

__version__ = "0.1.0"
