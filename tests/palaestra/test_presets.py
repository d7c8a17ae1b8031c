"""Model presets: the tiny build (speed, size, determinism, tokenizer, chat template), resolution,
concurrent builds, the `palaestra model build` command, and the SmolLM2 conversion (slow).

Everything builds into temporary caches, never into ~/.cache/palaestra.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

from palaestra.models import PRESETS, cache_root, resolve_model, tiny
from palaestra.models.cli import register

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "You are a careful calculator agent."},
    {"role": "user", "content": "What is 3*4?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3*4"}}}
        ],
    },
    {"role": "tool", "content": "12"},
    {"role": "assistant", "content": "3*4 = 12, so the answer is \\boxed{12}."},
]


def _report(request: pytest.FixtureRequest, line: str) -> None:
    """Print a line to the terminal even while pytest captures output (timings, counts)."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(line)


def _file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def _build_in_subprocess(name: str, cache: Path) -> subprocess.Popen[str]:
    code = f"from palaestra.models import resolve_model; print(resolve_model({name!r}, cache_dir={str(cache)!r}))"
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="session")
def tiny_build(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """(cache root, model directory) of the tiny preset, built once for this module's session."""
    cache = tmp_path_factory.mktemp("presets-cache")
    started = time.perf_counter()
    model_dir = resolve_model("tiny", cache_dir=cache)
    seconds = time.perf_counter() - started
    # Reported, not asserted: a build time depends on the machine's load (a loaded run took > 60 s).
    _report(request, f"\n[presets] tiny built in {seconds:.1f} s -> {model_dir}")
    return cache, model_dir


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_build):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_build[1])


def test_tiny_layout_and_size(tiny_build, request):
    _, model_dir = tiny_build
    assert model_dir.name == f"tiny-v{tiny.VERSION}"
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (model_dir / name).is_file(), name
    info = json.loads((model_dir / "palaestra_preset.json").read_text())
    assert (info["name"], info["seed"]) == ("tiny", tiny.TINY_SEED)
    _report(request, f"[presets] tiny: {info['parameters']:,} parameters, vocab {info['vocab_size']}")
    assert 1_000_000 <= info["parameters"] <= 10_000_000
    assert info["vocab_size"] == tiny.TINY_VOCAB_SIZE


def test_tiny_loads_with_auto_classes(tiny_build, tiny_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_build[1])
    config = model.config
    assert config.model_type == "qwen2"
    assert config.max_position_embeddings >= 8192
    assert model.dtype == torch.float32
    assert 1_000_000 <= sum(p.numel() for p in model.parameters()) <= 10_000_000
    assert config.vocab_size >= len(tiny_tokenizer) and config.vocab_size % 64 == 0
    im_end, endoftext = tiny_tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert config.eos_token_id == [im_end, endoftext]
    assert config.bos_token_id is None and config.pad_token_id == endoftext
    assert model.generation_config.eos_token_id == [im_end, endoftext]
    assert not model.generation_config.do_sample
    # transformers 4 reads the RoPE base from the top level; it must agree with rope_parameters.
    saved = json.loads((tiny_build[1] / "config.json").read_text())
    assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"]

    ids = torch.tensor([tiny_tokenizer("What is 3*4?").input_ids])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids.shape[1] + 4


def test_two_builds_are_identical(tiny_build, tmp_path):
    """A second build, in another process, gives byte-identical files (tokenizer and weights)."""
    proc = _build_in_subprocess("tiny", tmp_path)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    second = Path(stdout.strip())
    assert second != tiny_build[1]
    assert _file_hashes(second) == _file_hashes(tiny_build[1])


def test_concurrent_builds_share_one_result(tmp_path):
    procs = [_build_in_subprocess("tiny", tmp_path) for _ in range(2)]
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, stderr) in zip(procs, results, strict=True):
        assert proc.returncode == 0, stderr
    paths = {stdout.strip() for stdout, _ in results}
    target = tmp_path / "models" / f"tiny-v{tiny.VERSION}"
    assert paths == {str(target)}
    leftovers = [p.name for p in (tmp_path / "models").iterdir() if ".tmp-" in p.name]
    assert leftovers == []
    assert (target / "palaestra_preset.json").is_file()


def test_resolve_reuses_a_build(tiny_build):
    cache, model_dir = tiny_build
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny", cache_dir=cache) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_tokenizer_mirrors_qwen25(tiny_build, tiny_tokenizer):
    from tokenizers import Tokenizer

    tok = tiny_tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None and tok.unk_token is None
    decoder = {t.content: t.special for t in tok.added_tokens_decoder.values()}
    for token in tiny.SPECIAL_TOKENS:
        assert decoder[token] is True, token
    for token in tiny.NONSPECIAL_ADDED_TOKENS:
        assert decoder[token] is False, token
        assert len(tok(token).input_ids) == 1, token
    # transformers 5 rebuilds a qwen2 model's tokenizer as Qwen2Tokenizer from vocab and merges;
    # it must tokenize exactly as tokenizer.json does (what SGLang and transformers 4 use).
    raw = Tokenizer.from_file(str(tiny_build[1] / "tokenizer.json"))
    text = "Zürich 1234 +  x_1\n\n\tdef f(): return '<tool_call>' 東京 🙂 <|im_start|>user\n"
    assert tok(text).input_ids == raw.encode(text).ids
    # Special tokens go with skip_special_tokens; the tool and think tags stay, as in Qwen2.5.
    ids = tok("<|im_start|>assistant\n<think>x</think><tool_call>\n{}\n</tool_call><|im_end|>").input_ids
    assert (
        tok.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>x</think><tool_call>\n{}\n</tool_call>"
    )


def test_unicode_round_trip(tiny_tokenizer):
    """Byte-level BPE round-trips any NFC text exactly; like Qwen2.5 it normalises input to NFC."""
    rng = random.Random(0)
    ranges = [(0x09, 0x0D), (0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x6FF), (0x900, 0x97F), (0x3040, 0x30FF)]
    ranges += [(0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x10000, 0x1FFFF)]
    for _ in range(300):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 80))]
        text = unicodedata.normalize("NFC", "".join(chars))
        assert tiny_tokenizer.decode(tiny_tokenizer(text).input_ids) == text, repr(text)
    assert tiny_tokenizer.decode(tiny_tokenizer("cafe\u0301").input_ids) == "caf\u00e9"


def test_chat_template_renders_tools(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a careful calculator agent.")
    assert '"name": "calculator"' in text.split("\n</tools>")[0]
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>" in text
    prompt = tiny_tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tiny_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, return_dict=True)[
        "input_ids"
    ]
    assert tiny_tokenizer.decode(ids) == text


def test_resolve_model_paths_and_errors(tiny_build, tmp_path):
    assert resolve_model(str(tiny_build[1])) == tiny_build[1].resolve()
    with pytest.raises(ValueError) as error:
        resolve_model("no-such-model")
    for name in PRESETS:
        assert repr(name) in str(error.value)
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))  # a directory, but not a model


def test_incomplete_target_is_not_reused(tmp_path):
    (tmp_path / "models" / f"tiny-v{tiny.VERSION}").mkdir(parents=True)
    with pytest.raises(RuntimeError, match="not a complete build"):
        resolve_model("tiny", cache_dir=tmp_path)


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("PALAESTRA_CACHE", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("PALAESTRA_CACHE")
    assert cache_root() == Path.home() / ".cache" / "palaestra"


def test_register_adds_model_build(tiny_build, capsys):
    parser = argparse.ArgumentParser(prog="palaestra")
    register(parser.add_subparsers(dest="group", required=True))
    with pytest.raises(SystemExit) as done:
        parser.parse_args(["model", "build", "--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert "--cache-dir DIR" in help_text
    for name in PRESETS:
        assert name in help_text

    cache, model_dir = tiny_build
    args = parser.parse_args(["model", "build", "tiny", "--cache-dir", str(cache)])
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)

    with pytest.raises(SystemExit):
        parser.parse_args(["model", "build", "huge"])


def test_cli_main_model_build(tiny_build, capsys):
    from palaestra.cli import main

    cache, model_dir = tiny_build
    assert main(["model", "build", "tiny", "--cache-dir", str(cache)]) == 0
    assert capsys.readouterr().out.strip() == str(model_dir)


@pytest.mark.slow
def test_smollm2_converts_and_answers(tmp_path, request):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    model_dir = resolve_model("smollm2-135m", cache_dir=tmp_path)
    seconds = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.float32
    assert tokenizer.chat_template, "the GGUF's chat template was lost"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    _report(request, f"\n[presets] smollm2-135m converted in {seconds:.1f} s; answer: {answer!r}")
    assert "Paris" in answer
