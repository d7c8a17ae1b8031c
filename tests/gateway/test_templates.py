"""Bridging with real chat templates: Qwen3 (drops earlier <think>) and GLM-5 (no end-of-turn token).

Two halves:
* the real embedded engine serving `tiny-qwen3` / `tiny-glm5` (random weights, the real vocabularies and
  templates) behind the gateway, multi-turn: every turn's prompt is checked against what the engine got;
* a scripted engine (a labelled test double, see gateway_helpers) with the same tokenizers, so tool calls
  and reasoning happen on cue: tool loops bridge without forks, a new user message after reasoning
  forks with `reasoning_stripped` (or bridges with `--reasoning-policy keep`).
The printed lines show what bridging did with each template.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from palaestra.engine.cli import engine_process
from palaestra.gateway.parsers import render_tool_call_text
from palaestra.gateway.renderer import ChatRenderer, normalize_messages
from palaestra.models import resolve_model
from tests.support.servers import (
    INSECURE,
    RecordingProxy,
    ScriptedEngine,
    TextScript,
    ThreadServer,
    gateway_server,
)

FAMILIES = {  # preset -> (tool-call format, stop token that ends a turn, how the model writes reasoning + content)
    # Qwen3's generation prompt is "<|im_start|>assistant\n": the model opens its own think block.
    "tiny-qwen3": ("hermes", "<|im_end|>", "<think>\n{r}\n</think>\n\n{c}"),
    # GLM-5's generation prompt already ends in "<think>": the model continues inside it.
    "tiny-glm5": ("glm45", "<|observation|>", "{r}</think>{c}"),
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "arithmetic",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    model_dir = resolve_model(request.param)
    return request.param, model_dir, AutoTokenizer.from_pretrained(model_dir)


def test_fast_renderer_matches_apply_chat_template(family):
    _, _, tok = family
    renderer = ChatRenderer(tok)
    convos = [
        [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}],
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "think"},
            {"role": "user", "content": "q2"},
        ],
        [
            {"role": "user", "content": "calc"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
    ]
    for convo in convos:
        msgs = normalize_messages(convo)
        for tools in (None, [CALC]):
            for gen in (True, False):
                assert renderer.render(msgs, tools, gen) == tok.apply_chat_template(
                    msgs, tools=tools, tokenize=False, add_generation_prompt=gen
                )


def test_encoding_without_offsets_gives_the_tokenizers_ids(family, monkeypatch):
    """With the tokenizers' thread pool off (as `palaestra gateway serve` sets it), the renderer
    tokenizes through `encode_batch_fast` (without an NFC normaliser for a text in NFC); the ids are
    `tokenizer.encode`'s, special tokens, code, whitespace runs, non-ASCII and texts not in NFC
    included. Without the setting it encodes as before."""
    import random
    import unicodedata

    _, _, tok = family
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    renderer = ChatRenderer(tok)
    assert renderer._encode_one is not None  # the path under test is taken
    rng = random.Random(7)
    pieces = [
        *tok.all_special_tokens,
        "def f(x):\n",
        "    return x",
        "\t\t",
        "  ",
        "\n\n",
        "é",
        "中文",
        "🙂",
        '{"k": [1, 2]}',
        "e\u0301",  # not NFC: "é" decomposed, composed by Qwen's normaliser
        "\u212b",  # the angstrom sign, NFC's "Å"
        "\u1100\u1161",  # Hangul jamo, NFC's one syllable
    ]
    pieces += open(__file__, encoding="utf-8").read().split()[:200]
    # a Qwen tokenizer (normaliser NFC) skips it for a text already in NFC; GLM's has none
    assert (renderer._encode_nfc is not None) == (type(tok.backend_tokenizer.normalizer).__name__ == "NFC")
    nfc = 0
    for _ in range(200):
        text = "".join(rng.choice(pieces) + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(0, 60)))
        nfc += unicodedata.is_normalized("NFC", text)
        assert renderer.encode(text) == tok.encode(text, add_special_tokens=False), text
    assert 20 < nfc < 180  # both kinds of text were compared
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    assert ChatRenderer(tok)._encode_one is None


@pytest.mark.engine
@pytest.mark.parametrize("thinking", [True, False])
def test_real_engine_multi_turn(family, thinking, tmp_path):
    name, _, tok = family
    with engine_process(name, extra_args=["--num-threads", "1"]) as eng:
        rec = RecordingProxy(eng.url)
        with (
            ThreadServer(rec.app()) as proxy,
            gateway_server(proxy.url, tmp_path, tok, **INSECURE, model=name) as gw,
        ):
            s = httpx.post(f"{gw.url}/sessions", json={"env": "tmpl"}).json()
            client = openai.OpenAI(base_url=s["base_url"], api_key="x")
            msgs = [{"role": "user", "content": "Hello!"}]
            stop_id = tok.convert_tokens_to_ids("<|im_end|>" if "qwen" in name else "<|user|>")
            for turn in range(3):
                # random weights: three free tokens, then a strong bias makes the model end its turn
                r = client.chat.completions.create(
                    model=name,
                    messages=msgs,
                    max_tokens=12,
                    logit_bias={str(stop_id): 100},
                    extra_body={"min_tokens": 3, "chat_template_kwargs": {"enable_thinking": thinking}},
                )
                assert r.choices[0].finish_reason == "stop"
                msgs += [
                    {"role": "assistant", "content": r.choices[0].message.content or ""},
                    {"role": "user", "content": f"Next {turn}"},
                ]
            traj = httpx.get(f"{gw.url}/sessions/{s['session_id']}").json()
            for ex, t in zip(rec.exchanges, traj["turns"], strict=True):
                assert ex.body["input_ids"] == t["prompt_ids"] and ex.answer["output_ids"] == t["output_ids"]
                assert ex.headers["x-smg-routing-key"] == s["session_id"]
            bridged = sum(1 for t in traj["turns"] if t["parent"] is not None)
            reasons = [f["reason"] for f in traj["forks"]]
            print(f"{name} thinking={thinking} (real engine, 3 turns): bridged {bridged}, forks {reasons}")
            # Qwen3 without thinking opens each answer with an empty think block that later turns drop;
            # GLM-5 with thinking opens "<think>" and a random model never closes it: all reasoning, dropped later.
            expect_forks = (name == "tiny-qwen3" and not thinking) or (name == "tiny-glm5" and thinking)
            if expect_forks:
                assert bridged == 0 and reasons == ["reasoning_stripped"] * 2
            else:
                assert bridged == 2 and reasons == []
            httpx.post(f"{gw.url}/sessions/{s['session_id']}/reward", json={"reward": 1.0})
            samples = httpx.get(f"{gw.url}/samples").json()["samples"]
            assert len(samples) == 1 + len(reasons)
            last = rec.exchanges[-1]
            final = max(samples, key=lambda x: x["fork_index"])
            assert final["tokens"] == last.body["input_ids"] + last.answer["output_ids"]
            if not expect_forks:
                assert sum(final["loss_mask"]) == sum(len(e.answer["output_ids"]) for e in rec.exchanges)


def scripted_stack(name, tok, tmp_path):
    fmt, stop, _ = FAMILIES[name]
    script = TextScript(tok, stop, default=None)
    engine = ScriptedEngine(script, stop_ids={script.end})
    return script, engine, fmt


def test_tool_loop_bridges_and_new_query_strips_reasoning(family, tmp_path):
    name, _, tok = family
    for policy in ("strip", "keep"):
        script, engine, fmt = scripted_stack(name, tok, tmp_path)
        with (
            ThreadServer(engine.app()) as eng,
            gateway_server(
                eng.url, tmp_path / policy, tok, **INSECURE, model=name, reasoning_policy=policy
            ) as gw,
        ):
            s = httpx.post(f"{gw.url}/sessions", json={"env": "tmpl"}).json()
            client = openai.OpenAI(base_url=s["base_url"], api_key="x")
            msgs = [{"role": "user", "content": "What is 2+3, then times 4?"}]
            style = FAMILIES[name][2]
            script.queue += [
                style.format(
                    r="add first", c=render_tool_call_text(fmt, "calculator", '{"expression": "2+3"}')
                ),
                style.format(
                    r="now multiply", c=render_tool_call_text(fmt, "calculator", '{"expression": "5*4"}')
                ),
                style.format(r="done", c="The answer is 20."),
                style.format(r="again", c="Sure."),
            ]
            for _ in range(3):
                r = client.chat.completions.create(model=name, messages=msgs, tools=[CALC])
                m = r.choices[0].message
                assert m.reasoning_content  # reasoning split off the content
                msgs.append(m.model_dump(exclude_none=True))  # echoes reasoning_content back
                for call in m.tool_calls or []:
                    msgs.append(
                        {
                            "role": "tool",
                            "tool_call_id": call.id,
                            "content": str(eval(json.loads(call.function.arguments)["expression"])),
                        }
                    )  # noqa: S307 - test's own constant
            traj = httpx.get(f"{gw.url}/sessions/{s['session_id']}").json()
            assert traj["forks"] == [], f"{name}: the tool loop should bridge, got {traj['forks']}"
            for i in range(1, 3):  # each prompt = previous prompt + previous output + bridge
                prev, cur = engine.exchanges[i - 1], engine.exchanges[i]
                assert (
                    cur.body["input_ids"][: len(prev.body["input_ids"]) + len(prev.answer["output_ids"])]
                    == prev.body["input_ids"] + prev.answer["output_ids"]
                )
            # a new user question: the template now drops the earlier reasoning
            msgs.append({"role": "user", "content": "And minus 1?"})
            client.chat.completions.create(model=name, messages=msgs, tools=[CALC])
            traj = httpx.get(f"{gw.url}/sessions/{s['session_id']}").json()
            reasons = [f["reason"] for f in traj["forks"]]
            print(f"{name} (policy {policy}): tool loop bridged 3 turns; new user turn -> forks {reasons}")
            assert reasons == (["reasoning_stripped"] if policy == "strip" else [])


def test_nonmonotonic_template_forks(tiny_model_dir, tmp_path):
    """A template that renders the history differently as it grows (here: a turn counter in the header)."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # its own: the test rewrites its template
    tok.chat_template = (
        "{{ 'turns=' ~ (messages | length) ~ '\\n' }}{% for m in messages %}"
        "{{ '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    script = TextScript(tok, default=None)
    engine = ScriptedEngine(script, stop_ids={script.end})
    with (
        ThreadServer(engine.app()) as eng,
        gateway_server(eng.url, tmp_path, tok, **INSECURE) as gw,
    ):
        s = httpx.post(f"{gw.url}/sessions", json={"env": "tmpl"}).json()
        client = openai.OpenAI(base_url=s["base_url"], api_key="x")
        script.queue += ["one", "two"]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}])
        client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": "b"},
            ],
        )
        traj = httpx.get(f"{gw.url}/sessions/{s['session_id']}").json()
        assert [f["reason"] for f in traj["forks"]] == ["template_nonmonotonic"]


def test_incremental_render_probe(tiny_model_dir):
    """An append renders from a short context only on templates that pass the start-up probe: ChatML
    (gap ''), GLM-5 not (its generation prompt opens a think block past turns do not have); a
    template that counts the messages in its header fails it."""
    from palaestra.gateway.bridge import incremental_ok

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # its own: the test rewrites its template

    assert incremental_ok(ChatRenderer(tok)) == ""
    assert incremental_ok(ChatRenderer(AutoTokenizer.from_pretrained(resolve_model("tiny-glm5")))) is None
    tok.chat_template = (
        "{{ 'turns=' ~ (messages | length) ~ '\\n' }}{% for m in messages %}"
        "{{ '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert incremental_ok(ChatRenderer(tok)) is None


def test_render_gaps_are_probed_per_template_arguments():
    """Qwen3 passes the probe as the harnesses call it (thinking on) but not with thinking off (its
    generation prompt then holds an empty think block that past turns drop); the probes are bounded."""
    from palaestra.gateway.bridge import RenderGaps, ShortRender

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(resolve_model("tiny-qwen3")))
    gaps = RenderGaps(renderer, limit=3)
    short = ShortRender(gap="", tools_up_front=True)
    assert gaps.get(None) == short and gaps.get({"enable_thinking": True}) == short
    assert gaps.get({"enable_thinking": False}) is None
    assert gaps.get({"other": 1}) is None  # a fourth set of arguments: rendered in full, not probed
    assert gaps.get({"enable_thinking": True}) == short


def _tool_session_prompts(tmp_path, name, tok, extra):
    """A session of 4 tool turns and a final answer, tools on, template arguments `extra`: the
    messages, the engine's exchanges, the session's turns and its one sample."""
    script, engine, fmt = scripted_stack(name, tok, tmp_path)
    with (
        ThreadServer(engine.app()) as eng,
        gateway_server(eng.url, tmp_path, tok, **INSECURE, model=name) as gw,
    ):
        s = httpx.post(f"{gw.url}/sessions", json={"env": "tmpl"}).json()
        client = openai.OpenAI(base_url=s["base_url"], api_key="x")
        msgs = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "Add 1..4."}]
        for k in range(4):
            script.queue.append(
                render_tool_call_text(fmt, "calculator", json.dumps({"expression": f"{k}+1"}))
            )
            r = client.chat.completions.create(model=name, messages=msgs, tools=[CALC], extra_body=extra)
            call = r.choices[0].message.tool_calls[0]
            msgs += [
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": str(k + 1)},
            ]
        script.queue.append("The total is 10.")
        client.chat.completions.create(model=name, messages=msgs, tools=[CALC], extra_body=extra)
        turns = list(gw.app.state.service.sessions.get(s["session_id"]).turns)
        httpx.post(f"{gw.url}/sessions/{s['session_id']}/reward", json={"reward": 1.0})
        (sample,) = httpx.get(f"{gw.url}/samples").json()["samples"]
    return msgs, engine.exchanges, turns, sample


def test_an_append_with_template_arguments_renders_only_what_is_new_and_stays_exact(tmp_path, monkeypatch):
    """Tool turns of a session asking for thinking (chat_template_kwargs, as a harness's thinking ask
    maps to) bridge from a short rendering, and the prompts are still the template's whole rendering.
    Qwen3 puts the tools in its system block only (`tools_up_front`), so the short rendering leaves
    them out: every prompt is the same id for id as with the tools rendered."""
    from palaestra.gateway import bridge

    name = "tiny-qwen3"
    tok = AutoTokenizer.from_pretrained(resolve_model(name))
    extra = {"chat_template_kwargs": {"enable_thinking": True}}
    assert bridge.tools_up_front(ChatRenderer(tok), {"enable_thinking": True})
    msgs, exchanges, turns, sample = _tool_session_prompts(tmp_path / "without", name, tok, extra)
    assert [t.fork_reason for t in turns] == [None] * 5
    assert [t.rendered == "" for t in turns] == [False] + [True] * 4  # short renderings
    monkeypatch.setattr(bridge, "tools_up_front", lambda *_: False)  # the short renderings with the tools
    _, with_tools, turns, _ = _tool_session_prompts(tmp_path / "with", name, tok, extra)
    assert [t.rendered == "" for t in turns] == [False] + [True] * 4
    assert [ex.body["input_ids"] for ex in exchanges] == [ex.body["input_ids"] for ex in with_tools]
    # the last prompt is the template's rendering of the whole conversation (Qwen3 would show its own
    # last answer with an empty think block the model did not write, so that one is left out)
    last = exchanges[-1]
    assert sample["tokens"] == last.body["input_ids"] + last.answer["output_ids"]
    full = tok.apply_chat_template(
        normalize_messages(msgs),
        tools=[CALC],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=True,
    )
    assert tok.decode(last.body["input_ids"]) == full


def test_tools_up_front_probe(tiny_model_dir):
    """Qwen2.5's template (the `tiny` preset) renders its tools in the system block: the short
    rendering may leave them out; a template that renders them after the messages may not."""
    from palaestra.gateway.bridge import tools_up_front

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)  # its own: the test rewrites its template
    assert tools_up_front(ChatRenderer(tok))
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' }}"
        "{% endfor %}{% if tools %}{{ 'tools: ' ~ (tools | tojson) ~ '\\n' }}{% endif %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert not tools_up_front(ChatRenderer(tok))


def test_renderer_attribute_shortcuts_answer_as_the_sandbox():
    """The renderer's `getattr` (a plain dict's key at once, a plain str's method without the
    sandbox's checks) gives what jinja's sandbox gives for every object and name a template may
    read: keys that shadow dict methods, missing keys, private and format names, a dict subclass,
    jinja's loop and namespace objects (scalar fields, methods, a stored `str.format`), a list; and
    a template using them renders the same in both."""
    from jinja2.runtime import LoopContext, Undefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    from palaestra.gateway.renderer import _attribute_checks_memoised

    template = (
        "{% set ns = namespace(n=0, last=-1) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ m.role }}:{{ m.content.strip() if m.content is string else m.items() | list }}"
        "|{{ m.missing is defined }}|{{ m.get('role') }}|{{ m.content.format is defined }}"
        "|{{ loop.index0 }}{{ loop.last }}{{ loop.cycle('a', 'b') }}{{ ns.missing is defined }}{% endfor %}{{ ns.n }}"
    )
    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = _attribute_checks_memoised(reference.from_string(template), template)
    fast, slow = compiled.environment.getattr, reference.getattr

    class Sub(dict):
        role = "attribute"

    loop = LoopContext(iter([1, 2, 3]), Undefined)
    next(iter(loop))
    objects = [
        Namespace(n=1, s="x", f=1.5, none=None, fmt="{}".format, items=[1]),
        loop,
        {"role": "user", "content": " x ", "items": 1, "get": 2, "keys": 3, "__class__": 4, "_p": 5},
        {},
        Sub(role="key", content="c"),
        " text ",
        "",
        [1, 2],
        3,
    ]
    names = sorted(
        set(dir(dict))
        | set(dir(str))
        | {"role", "content", "missing", "_p", "__class__", "mro"}
        | {"n", "s", "f", "none", "fmt", "_Namespace__attrs", "index0", "last", "first", "length", "cycle"}
        | {"revindex", "previtem", "nextitem", "depth"}
    )
    for obj in objects:
        for name in names:
            got, want = fast(obj, name), slow(obj, name)
            if isinstance(want, Undefined):
                assert type(got) is type(want), (obj, name)
                assert (
                    got._undefined_name,
                    got._undefined_obj,
                    got._undefined_hint,
                    got._undefined_exception,
                ) == (
                    want._undefined_name,
                    want._undefined_obj,
                    want._undefined_hint,
                    want._undefined_exception,
                ), (obj, name)
            elif callable(want) and not isinstance(want, type):
                assert type(got) is type(want) and getattr(got, "__name__", None) == getattr(
                    want, "__name__", None
                ), (
                    obj,
                    name,
                )
                assert getattr(got, "__self__", None) is getattr(want, "__self__", None), (obj, name)
            else:
                assert got is want or got == want, (obj, name)
    messages = [objects[2], {"role": "tool", "content": ["a"]}, Sub(role="k", content=" s ")]
    assert compiled.render(messages=messages) == reference.from_string(template).render(messages=messages)
