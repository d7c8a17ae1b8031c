"""The tiny-<family> presets: real tokenizers and chat templates on tiny random models.

Each family builds (fast, deterministic, offline), loads with the Auto classes, tokenizes exactly
as the family's own tokenizer.json, renders tools and tool calls with its real template, and is
served by the embedded engine with logprobs that match the transformers forward pass.
Everything builds into a temporary cache, never into ~/.cache/palaestra.
"""

from __future__ import annotations

import hashlib
import json
import time
import unicodedata
from pathlib import Path

import httpx
import pytest
import torch

from palaestra.engine.cli import engine_process
from palaestra.gateway.parsers import detect_parsers, get_reasoning_parser, get_tool_parser, parse_output
from palaestra.models import PRESETS, real_vocab, resolve_model
from palaestra.models.real_vocab import REAL_VOCAB_FAMILIES, real_vocab_chat_template, real_vocab_file

FAMILIES = sorted(REAL_VOCAB_FAMILIES)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
ARGUMENTS = {"city": "Zürich", "days": 3}
CONVERSATION = [
    {"role": "system", "content": "You are a weather agent."},
    {"role": "user", "content": "Weather in Zürich for 3 days?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temperature_c": 21}'},
    {"role": "assistant", "content": "It is 21 °C."},
]
TEXTS = [
    "Hello, world! 12345 + 67 = 12412; 3.14159 and 1,000,000.",
    "  leading and trailing spaces  \n\n\tTabs\r\nCRLF   ",
    "café naïve Zürich São Paulo Ελλάδα Москва 東京 서울 नमस्ते مرحبا 🙂🚀 ✓ √ π °C … —",
    "def f(x):\n    return [i * 2 for i in range(x)]  # comment\n",
    "don't I'LL we've THEY'RE 'quoted' \"double\"",
    "e\u0301 A\u030a \ufb01",  # not NFC: Qwen normalizes it, GLM does not
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhm\n</think>\n\n<tool_call>\n"
    '{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>\n<|endoftext|>',
    "[gMASK]<sop><|system|>s<|user|>u<|assistant|><think>r</think>c<tool_call>f<arg_key>a</arg_key>"
    "<arg_value>1</arg_value></tool_call><|observation|><tool_response>x</tool_response><|endoftext|>",
]


def _report(request: pytest.FixtureRequest, line: str) -> None:
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(line)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("real-vocab-cache")


@pytest.fixture(scope="module")
def built(cache: Path, request: pytest.FixtureRequest) -> dict[str, Path]:
    """family -> model directory, each built once; build times are reported (not asserted: how fast
    a build is depends on the machine's load, 35 s for one at load average 55)."""
    dirs, times = {}, {}
    for family in FAMILIES:
        started = time.perf_counter()
        dirs[family] = resolve_model(f"tiny-{family}", cache_dir=cache)
        times[family] = time.perf_counter() - started
    _report(request, "\n[real-vocab] built " + ", ".join(f"tiny-{f} {s:.1f} s" for f, s in times.items()))
    return dirs


@pytest.fixture(scope="module")
def auto_tokenizers(built: dict[str, Path]) -> dict:
    """family -> AutoTokenizer.from_pretrained(model dir): what the engine and the gateway load."""
    from transformers import AutoTokenizer

    return {family: AutoTokenizer.from_pretrained(path) for family, path in built.items()}


def _raw_tokenizer(family: str):
    from tokenizers import Tokenizer

    data = real_vocab_file(REAL_VOCAB_FAMILIES[family].tokenizer_dir, "tokenizer.json")
    return Tokenizer.from_str(data.decode("utf-8"))


def test_presets_are_listed(built: dict[str, Path]):
    """Every family is a preset built by this module's recipe into a versioned cache directory."""
    for family in FAMILIES:
        assert PRESETS[f"tiny-{family}"].load_recipe() is real_vocab.resolve
        assert built[family].name == f"tiny-{family}-v{real_vocab.VERSION}"
        marker = json.loads((built[family] / "palaestra_preset.json").read_text())
        assert (marker["name"], marker["version"]) == (f"tiny-{family}", real_vocab.VERSION)
    with pytest.raises(ValueError, match="not a tiny-<family> preset"):
        real_vocab.resolve("tiny-llama9")


def test_build_is_deterministic(built: dict[str, Path], tmp_path: Path):
    again = resolve_model("tiny-glm5", cache_dir=tmp_path)

    def hashes(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    assert hashes(again) == hashes(built["glm5"])


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_with_auto_classes(built: dict[str, Path], auto_tokenizers: dict, family: str):
    from transformers import AutoModelForCausalLM, GenerationConfig

    spec = REAL_VOCAB_FAMILIES[family]
    tokenizer = auto_tokenizers[family]
    model = AutoModelForCausalLM.from_pretrained(built[family])
    stop_ids = tokenizer.convert_tokens_to_ids(list(spec.stop_tokens))
    assert model.config.model_type == spec.architecture
    assert model.config.vocab_size % 64 == 0 and 0 <= model.config.vocab_size - len(tokenizer) < 64
    assert model.config.max_position_embeddings >= 8192
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    assert GenerationConfig.from_pretrained(built[family]).eos_token_id == stop_ids
    assert model.config.eos_token_id == stop_ids
    assert tokenizer.chat_template == real_vocab_chat_template(spec)
    assert (built[family] / "tokenizer.json").read_bytes() == real_vocab_file(
        spec.tokenizer_dir, "tokenizer.json"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_agrees_with_tokenizer_json(auto_tokenizers: dict, family: str):
    """AutoTokenizer (what the engine and gateway load) encodes exactly as the raw tokenizer.json."""
    tokenizer = auto_tokenizers[family]
    raw = _raw_tokenizer(family)
    rendered = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    for text in [*TEXTS, rendered]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == raw.encode(text, add_special_tokens=False).ids, text
        decoded = tokenizer.decode(ids, skip_special_tokens=False)
        expected = unicodedata.normalize("NFC", text) if family.startswith("qwen") else text
        assert decoded == expected
    # Qwen's pre-tokenizer splits digits one by one, GLM's in groups of up to three.
    digits = tokenizer.tokenize("12345")
    assert digits == (list("12345") if family.startswith("qwen") else ["123", "45"])


def test_glm5_tokenizer_is_glm5s():
    """GLM-5's listed special tokens are, in order, the first added tokens of GLM-4.7-Flash's
    tokenizer.json; the ids of its stop tokens are GLM-5's eos ids; every tag its template writes
    is a single token."""
    raw = _raw_tokenizer("glm5")
    glm5 = json.loads(real_vocab_file("glm-5", "tokenizer_config.json"))
    added = raw.get_added_tokens_decoder()
    first = [added[i] for i in sorted(added)][: len(glm5["extra_special_tokens"])]
    assert [t.content for t in first] == glm5["extra_special_tokens"]
    assert all(t.special for t in first)
    assert [raw.token_to_id(t) for t in REAL_VOCAB_FAMILIES["glm5"].stop_tokens] == [154820, 154827, 154829]
    assert raw.get_vocab_size() == 154856  # GLM-5's config.json: vocab_size 154880 = this, padded to 64
    template = real_vocab_chat_template(REAL_VOCAB_FAMILIES["glm5"])
    for tag in ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>"]:
        assert tag in template
        assert len(raw.encode(tag, add_special_tokens=False).ids) == 1, tag
    for tag in ["</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>"]:
        assert len(raw.encode(tag, add_special_tokens=False).ids) == 1, tag
    assert len(raw.encode("</arg_value><tool_response></tool_response>", add_special_tokens=False).ids) == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_tools_and_calls(auto_tokenizers: dict, family: str):
    tokenizer = auto_tokenizers[family]
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert '"name": "get_weather"' in text  # the tool schema
    assert "<tool_call>" in text and '{"temperature_c": 21}' in text
    # The assistant turn with the call parses back into the same call.
    tool_name, reasoning_name = detect_parsers(tokenizer.chat_template)
    assert tool_name == ("hermes" if family.startswith("qwen") else "glm45")
    start = text.index("Let me check.")
    end = text.index("<|im_end|>" if family.startswith("qwen") else "<|observation|>", start)
    parsed = parse_output(
        text[start:end], get_tool_parser(tool_name), get_reasoning_parser(reasoning_name), "s", True, TOOLS
    )
    assert parsed.content == "Let me check." and parsed.parse_errors == []
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", ARGUMENTS)]


@pytest.mark.engine
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_serves_it(
    built: dict[str, Path], auto_tokenizers: dict, cache: Path, family: str, request: pytest.FixtureRequest
):
    """`palaestra engine serve --model tiny-<family>` loads the preset; generation stays inside the
    vocabulary and scoring matches the transformers forward pass."""
    from transformers import AutoModelForCausalLM

    tokenizer = auto_tokenizers[family]
    prompt = tokenizer.apply_chat_template(
        CONVERSATION[:2], tools=TOOLS, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    env = {"PALAESTRA_CACHE": str(cache)}
    with (
        engine_process(f"tiny-{family}", extra_args=["--num-threads", "1"], env=env) as engine,
        httpx.Client(base_url=engine.url, timeout=60, trust_env=False) as client,
    ):
        info = client.get("/model_info").json()
        generated = client.post(
            "/generate",
            json={
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 7},
                "return_logprob": True,
            },
        ).json()
        output = generated["output_ids"]
        scored = client.post(
            "/generate",
            json={
                "input_ids": prompt + output,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        ).json()
    _report(request, f"\n[real-vocab] tiny-{family} engine started in {engine.startup_seconds:.1f} s")
    assert Path(info["model_path"]) == built[family]  # the preset name resolved in our cache
    assert info["model_type"] == REAL_VOCAB_FAMILIES[family].architecture
    assert info["preferred_sampling_params"] is None  # no sampling defaults in generation_config
    assert 1 <= len(output) <= 16 and all(0 <= i < len(tokenizer) + 64 for i in output)
    model = AutoModelForCausalLM.from_pretrained(built[family])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    expected = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor([prompt + output])[0, 1:, None])[
        :, 0
    ]
    served = torch.tensor([e[0] for e in scored["meta_info"]["input_token_logprobs"][1:]])
    assert torch.allclose(served, expected, atol=1e-4), (served - expected).abs().max()
