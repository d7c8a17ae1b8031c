"""Writing Hugging Face model directories that transformers 4 and 5 (and so SGLang) read alike.

The recipes in this package save their models and tokenizers through `save_model` and
`save_tokenizer`, which fix up what transformers 5 writes and older readers misread.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay inside the builders
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["save_model", "save_tokenizer", "scoped_environ"]


def save_model(model: PreTrainedModel, out_dir: Path) -> None:
    """`save_pretrained` as safetensors, with config.json readable by transformers 4 as well.

    transformers 5 writes the RoPE base only inside ``rope_parameters``; transformers 4 (and so
    an SGLang that pins it) reads the top-level ``rope_theta`` and silently falls back to 10000
    without it. Writing both keeps every reader on the same rotary embedding.
    """
    model.save_pretrained(out_dir, safe_serialization=True)
    path = out_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):  # GLM's partial rotary: the same story
        if key in rope and key not in config:
            config[key] = rope[key]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: Path, **config: object) -> None:
    """`save_pretrained`, then set ``config`` entries in tokenizer_config.json.

    transformers 5 writes its own class name (``TokenizersBackend``), which transformers 4 (what
    many SGLang installs pin) cannot resolve, and load-time arguments (``local_files_only``)
    that do not belong in a saved config; callers name the class every version should load.
    """
    tokenizer.save_pretrained(out_dir)
    path = out_dir / "tokenizer_config.json"
    saved = json.loads(path.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        saved.pop(key, None)
    if isinstance(saved.get("extra_special_tokens"), list):
        # transformers 4 reads `extra_special_tokens` as a dict and fails on 5's list; both read
        # the list under its older name.
        saved["additional_special_tokens"] = saved.pop("extra_special_tokens")
    saved.update(config)
    path.write_text(json.dumps(saved, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


@contextlib.contextmanager
def scoped_environ(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of a block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
