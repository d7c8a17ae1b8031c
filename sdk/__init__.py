"""What an environment writer touches: `Environment`, `Session`, the rollout runner.

Must not know about tokens or the trainer: an environment talks to the model only through
`session.client`, an `openai.AsyncOpenAI` bound to the session's gateway URL.
"""

from palaestra.sdk.environment import Environment, Reward, Task
from palaestra.sdk.mix import WeightedMix
from palaestra.sdk.options import OptionError, read_options
from palaestra.sdk.registry import load_environment
from palaestra.sdk.runner import RolloutResult, RolloutSummary, run_rollouts, wilson_interval
from palaestra.sdk.session import EpisodeFailed, GatewayClient, GatewayError, Session

__all__ = [
    "Environment",
    "EpisodeFailed",
    "GatewayClient",
    "GatewayError",
    "OptionError",
    "Reward",
    "RolloutResult",
    "RolloutSummary",
    "Session",
    "Task",
    "WeightedMix",
    "load_environment",
    "read_options",
    "run_rollouts",
    "wilson_interval",
]
