"""Our Terminus-style agent (environments/harness/terminus/agent.py) piece by piece, on the host: its
answers parsed or corrected, keystrokes, the terminal's output as the model sees it, a real bash on
a pty, and its loop against a stub model (a TEST DOUBLE: a list of replies). Against the gateway
and in the sandbox it runs in test_harness_binaries.py, test_harness_env.py and test_harbor_e2e.py.
"""

from __future__ import annotations

import json
import time

import pytest

from palaestra.environments.harness.terminus import agent

MARK = "PALAESTRA-42"
COMMAND = "echo PALAESTRA-$((6*7))\n"


def terminus_answer(keystrokes: list[str], complete: bool = False) -> str:
    """A terminus turn (its JSON answer) typing each of `keystrokes`, waiting up to 30 s after each
    (it returns as soon as bash is back at its prompt)."""
    commands = [{"keystrokes": k, "duration": 30} for k in keystrokes]
    answer = {"analysis": "Looking at the terminal.", "plan": "Type the commands.", "commands": commands}
    return json.dumps({**answer, "task_complete": complete})


def test_an_answer_is_parsed_around_text_or_refused_naming_each_problem():
    answer, problems = agent.parse("Sure.\n```json\n" + terminus_answer(["ls\n", "C-c"]) + "\n```")
    assert problems is None and answer == {
        "commands": [("ls\n", 30.0), ("C-c", 30.0)],
        "task_complete": False,
    }
    done = json.dumps({"analysis": "a", "plan": "p", "task_complete": True})  # no commands needed to end
    assert agent.parse(done) == ({"commands": [], "task_complete": True}, None)
    long_wait = json.dumps({"analysis": "a", "plan": "p", "commands": [{"keystrokes": "x", "duration": 1e9}]})
    assert agent.parse(long_wait)[0]["commands"] == [("x", agent.MAX_DURATION_S)]
    no_wait = json.dumps({"analysis": "a", "plan": "p", "commands": [{"keystrokes": "x"}]})
    assert agent.parse(no_wait)[0]["commands"] == [("x", agent.DEFAULT_DURATION_S)]
    bad = {
        "no object": ("I will run ls.", "it holds no JSON object"),
        "a list": ("[1, 2]", "it holds no JSON object"),
        "cut": ('{"analysis": "a", "plan": "p", "commands": [{"keys', "it holds no JSON object"),
        "types": (
            {"analysis": 1, "plan": "p", "commands": {}, "task_complete": "yes"},
            '"analysis" must be a string; "task_complete" must be true or false; "commands" must be a list',
        ),
        "no commands": ({"analysis": "a", "plan": "p"}, '"commands" must be a list'),
        "keystrokes": ({"analysis": "a", "plan": "p", "commands": [{"duration": 1}, "ls"]}, "commands[1] needs"),
        "durations": (
            {"analysis": "a", "plan": "p", "commands": [{"keystrokes": "x", "duration": d} for d in (-1, True, "1")]},
            "commands[0].duration must be a number of seconds, 0 or more; commands[1].duration",
        ),
        "nan": ('{"analysis": "a", "plan": "p", "commands": [{"keystrokes": "x", "duration": NaN}]}', "duration"),
    }  # fmt: skip
    for name, (text, problem) in bad.items():
        answer, problems = agent.parse(text if isinstance(text, str) else json.dumps(text))
        assert answer is None and problem in problems, (name, problems)


def test_keystrokes_and_what_the_model_sees_of_the_terminal():
    assert agent.keystrokes("C-c") == b"\x03" and agent.keystrokes("C-D") == b"\x04"
    assert agent.keystrokes("C-cat\n") == b"C-cat\n"  # only a whole C-<letter> is a control key
    raw = f"{agent.PS1_MARK}~$ ls\r\n\x1b[01;34mdir\x1b[0m\r\n10%\r50%\r100%\r\nab\b \bc\x07\r\n"
    assert agent.clean(raw) == "~$ ls\ndir\n100%\nac\n"
    text = "\n".join(f"line {i}" for i in range(5000))
    shown = agent.tail(text)
    assert shown.endswith("line 4999") and len(shown) <= agent.OUTPUT_CHARS + 60
    head, first = shown.split("\n", 2)[:2]
    assert head.startswith("[... ") and "earlier characters not shown" in head and first.startswith("line ")
    assert agent.tail("\n\n") == "(no output)"


@pytest.fixture
def terminal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    term = agent.Terminal({"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"})
    yield term
    term.close()


def test_a_wait_ends_when_bash_is_back_at_its_prompt_and_not_before(terminal):
    assert agent.clean(terminal.start()).endswith("$ ")
    start = time.monotonic()
    out = agent.clean(terminal.run(b"for i in 1 2\ndo echo item-$i\ndone\n" + COMMAND.encode(), 30))
    assert time.monotonic() - start < 10 and "item-2" in out and MARK in out, out  # 4 lines, 4 prompts
    start = time.monotonic()
    out = agent.clean(terminal.run(b"sleep 3; echo sl''ept\n", 0.3))  # its echo does not say "slept"
    assert time.monotonic() - start < 2.5 and "slept" not in out and terminal.owed == 1  # still running
    out = agent.clean(terminal.run(b"", 10))  # an empty batch: waits for what is owed
    assert "slept" in out and terminal.owed == 0, out
    terminal.run(b"cat > f.txt\nhello\n", 0.5)  # lines another program reads: no prompt owed them
    assert terminal.owed == 2
    agent.clean(terminal.run(agent.keystrokes("C-d"), 1))
    assert terminal.owed == 0 and (terminal.run(b"cat f.txt\n", 10).count("hello")) == 1
    out = agent.clean(terminal.run(b"exit\n", 5))
    assert "the shell exited" in out and terminal.fd is None
    assert "/" in agent.clean(terminal.run(b"pwd\n", 10))  # a new shell, started with the next keystrokes


class StubModel:
    """TEST DOUBLE for the session's model: answers with `replies` in order (an exception is
    raised), and keeps what each call was sent."""

    def __init__(self, *replies):
        self.replies, self.sent = list(replies), []

    def __call__(self, messages):
        self.sent.append([dict(m) for m in messages])
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply if isinstance(reply, tuple) else (reply, "stop")


def test_the_loop_corrects_bad_answers_and_ends_only_on_a_confirmed_completion(terminal):
    done = terminus_answer([], complete=True)
    model = StubModel(
        "I will look around first.",
        ('{"analysis": "a", "plan": "p", "commands": [{"keyst', "length"),
        terminus_answer([COMMAND]),
        done,
        terminus_answer(["echo more\n"]),  # not confirmed: it goes on
        done,
        done,
    )
    assert agent.episode(model, terminal, "Print the number.") == 0 and model.replies == []
    users = [m["content"] for m in model.sent[-1] if m["role"] == "user"]
    assert "Print the number." in users[0] and users[0].rstrip().endswith("$")
    assert users[1].startswith("Your answer could not be used: it holds no JSON object. Nothing was typed.")
    assert agent.CUT in users[2]
    assert users[3].startswith("New terminal output:") and MARK in users[3]
    assert "You set task_complete" in users[4]
    assert users[5].startswith("New terminal output:") and "more" in users[5]
    assert "You set task_complete" in users[6]
    # every reply goes back verbatim, each call's messages extending the last's
    assistants = [m["content"] for m in model.sent[-1] if m["role"] == "assistant"]
    assert assistants[2] == terminus_answer([COMMAND]) and len(assistants) == 6
    assert all(
        later[: len(earlier)] == earlier for earlier, later in zip(model.sent, model.sent[1:], strict=False)
    )


def test_a_refused_call_or_a_spent_budget_ends_it_non_zero(terminal):
    spent = agent.Refused(429, "429: the episode's budget of 3 model calls is spent")
    assert agent.episode(StubModel(terminus_answer([COMMAND]), spent), terminal, "t") == agent.BUDGET
    refused = agent.Refused(400, "400: max_tokens ...")
    assert agent.episode(StubModel(refused), terminal, "t") == agent.REFUSED
