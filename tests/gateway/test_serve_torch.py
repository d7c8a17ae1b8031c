"""`palaestra gateway serve` starts without importing torch (gateway/cli.py `build_app`).

The gateway needs the model's tokenizer, template and config, never its weights; transformers
reaches torch only through its configuration module. The served process is checked for torch's
library, the tokenizer loaded with torch marked absent is compared with the one loaded beside torch
(every preset the gateway tests serve), and the way out for a tokenizer that does need torch is
checked with a stand-in `create_app` that imports it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoConfig, AutoTokenizer

from palaestra.gateway.cli import TORCH_ENV, gateway_process
from palaestra.models import resolve_model

PRESETS = ["tiny", "tiny-qwen3", "tiny-glm5"]  # Qwen2.5's, Qwen3's and GLM-5's tokenizer and template
TEXT = 'Hello <|im_start|>wörld</think> \n\n  tabs\t🙂 <tool_call>{"a": 1}</tool_call>'

# What the gateway reads off a tokenizer and a config (app.py, renderer.py), as JSON.
FACTS = textwrap.dedent(
    """
    def facts(tok, cfg, text):
        ids = tok.encode(text, add_special_tokens=False)
        return {
            "class": type(tok).__name__,
            "template": tok.chat_template,
            "special": {k: str(v) for k, v in tok.special_tokens_map.items()},
            "special_ids": list(tok.all_special_ids),
            "added": {str(i): [t.content, t.special] for i, t in tok.added_tokens_decoder.items()},
            "vocab": len(tok.get_vocab()),
            "ids": ids,
            "backend_ids": tok._tokenizer.encode(text, add_special_tokens=False).ids,
            "decoded": tok.decode(ids, skip_special_tokens=False),
            "tokens": tok.convert_ids_to_tokens(ids),
            "cleanup": bool(getattr(tok, "clean_up_tokenization_spaces", False)),
            "context": getattr(cfg, "max_position_embeddings", None),
        }
    """
)


def test_the_served_gateway_has_not_loaded_torch(tmp_path) -> None:
    resolve_model("tiny")  # built here, with torch, if this is its first use
    env = {k: v for k, v in os.environ.items() if k != TORCH_ENV}
    with gateway_process(
        "tiny", "http://127.0.0.1:9", str(tmp_path), env=env, extra_args=["--insecure-local"]
    ) as gw:
        with open(f"/proc/{gw.pid}/maps") as maps:
            libraries = maps.read()
    assert "libtorch" not in libraries
    assert "libtokenizers" in libraries or "tokenizers" in libraries  # the map was read whole


def test_the_tokenizer_loaded_without_torch_is_the_one_loaded_beside_it() -> None:
    dirs = {name: str(resolve_model(name)) for name in PRESETS}
    script = FACTS + textwrap.dedent(
        """
        import json, sys
        sys.modules["torch"] = None  # as build_app marks it
        from transformers import AutoConfig, AutoTokenizer
        dirs, text = json.loads(sys.argv[1]), sys.argv[2]
        out = {n: facts(AutoTokenizer.from_pretrained(d), AutoConfig.from_pretrained(d), text) for n, d in dirs.items()}
        assert sys.modules["torch"] is None
        print(json.dumps(out))
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script, json.dumps(dirs), TEXT], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    without = json.loads(run.stdout)
    namespace: dict = {}
    exec(FACTS, namespace)
    for name, d in dirs.items():
        beside = namespace["facts"](AutoTokenizer.from_pretrained(d), AutoConfig.from_pretrained(d), TEXT)
        beside = json.loads(json.dumps(beside))  # the same JSON round trip
        assert without[name] == beside, name
        assert len(beside["ids"]) > 10 and beside["template"], name  # a real tokenizer and template


STAND_IN = textwrap.dedent(
    """
    import sys
    from palaestra.gateway.cli import build_app
    from palaestra.gateway.config import GatewayConfig

    def create_app(config):  # a stand-in: a tokenizer that needs torch
        import torch
        return torch.__name__

    print(build_app(GatewayConfig(model="tiny", engine_url="http://127.0.0.1:9"), create_app))
    """
)


@pytest.mark.parametrize("keep", [False, True], ids=["default", TORCH_ENV])
def test_a_tokenizer_that_needs_torch_stops_the_start_in_one_line_unless_torch_is_kept(keep) -> None:
    resolve_model("tiny")
    env = {k: v for k, v in os.environ.items() if k != TORCH_ENV}
    if keep:
        env[TORCH_ENV] = "1"
    run = subprocess.run(
        [sys.executable, "-c", STAND_IN], capture_output=True, text=True, env=env, timeout=300
    )
    if keep:
        assert run.returncode == 0 and run.stdout.strip() == "torch", run.stderr[-2000:]
    else:
        assert run.returncode == 1 and run.stdout == ""
        last = run.stderr.strip().splitlines()
        assert len(last) == 1 and last[0].startswith("palaestra gateway: loading 'tiny' needs torch"), (
            run.stderr
        )
        assert f"{TORCH_ENV}=1" in last[0]
