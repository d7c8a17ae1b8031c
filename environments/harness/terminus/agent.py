"""Our Terminus-style terminal agent: the model types keystrokes into an interactive bash and reads
what the terminal printed back.

The host does not run it (only its tests import it): the harness environments mount this folder
read-only at /opt/harness/terminus@VERSION and run it in the sandbox as one headless harness,

    PALAESTRA_SESSION_KEY=<token> /usr/bin/python3 -I -S agent.py \\
        --base-url http://127.0.0.1:8080/s/<id>/v1 --model policy [--max-tokens N] "<task>"

(stdlib only: the sandbox's own Python, 3.8 or later; configure.terminus gives this command).

Each turn is one Chat Completions call with no tools: `messages`, `model`, and `max_tokens` when the
harness is told a budget. The model answers one JSON object (`SYSTEM` says which): its analysis, a
plan, `commands` (keystroke batches, each with a `duration` in seconds) and `task_complete`. Each
batch is typed into ``bash -i`` on a pseudo-terminal (stdlib `pty`); after the wait the terminal's
new output (escape sequences dropped, carriage returns applied, its last `OUTPUT_CHARS` characters)
is the next user message. An answer that is not such an object gets a message naming what is wrong
instead, and nothing is typed. `task_complete` is taken only when answered twice in a row: the first
time the model is shown the terminal and asked to confirm. Every call's reply goes back verbatim
as the assistant message, so each prompt extends the last (the gateway bridges it on exact ids).

A wait ends early when bash is back at its prompt having read every line typed: bash's prompts
carry an invisible mark (`PS1_MARK`, `PS2_MARK`), and a batch of n lines has run once n prompts
followed it and the last is PS1. A batch read by another program (a REPL, `cat > f`) waits its full
duration, as Terminus-2 always does.

It ends: the model confirms completion (exit 0); the session refuses a call (exit `REFUSED`,
e.g. a 400 naming a field) or the tunnel's turn budget is spent (429, exit `BUDGET`). There is no
turn limit of its own and no summarisation of a long history (Terminus-2 summarises): a prompt past
the model's context is a refused call.
"""

import argparse
import codecs
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
import urllib.error
import urllib.request

REFUSED = 2
BUDGET = 3
OUTPUT_CHARS = 10_000
"""The most of a batch's output the model is shown: its tail."""
MAX_DURATION_S = 60.0
DEFAULT_DURATION_S = 1.0
QUIET_S = 0.05
"""How long the terminal must stay silent after bash's prompt for a wait to end early."""
ROWS, COLS = 48, 160
PS1_MARK = "\x1b]133;A\x07"
PS2_MARK = "\x1b]133;A;k=s\x07"
"""Prompt marks (the terminals' OSC 133 prompt-start sequence): never shown to the model."""

SYSTEM = """You are an agent at a Linux terminal, doing the task the user gives. You work by typing \
keystrokes into an interactive bash shell and reading what the terminal prints.

Every answer is one JSON object and nothing else:
{
  "analysis": "what the terminal shows, what is done and what is left",
  "plan": "what the keystrokes below will do, and why",
  "commands": [
    {"keystrokes": "ls -la\\n", "duration": 0.5},
    {"keystrokes": "python3 -m pytest -q\\n", "duration": 20}
  ],
  "task_complete": false
}

- "commands" are typed in order, each exactly as written: end a command line with "\\n" to run it. \
A batch that is exactly C-c, C-d, C-z (any C-<letter>) sends that control key.
- "duration" is how many seconds to wait after typing a batch (at most 60): short for quick \
commands, longer for installs, builds and tests. The wait ends early once bash is back at its \
prompt; if a command is still running when it ends, you see its output so far and can wait more \
with an empty batch.
- The terminal is a stream, not a screen: full-screen programs (vim, less, top) do not display. \
Write files with shell commands (cat <<'EOF' > file, sed, python3).
- Set "task_complete" to true when the task is done; you will be asked to confirm, and it ends \
when you answer true again."""

TASK = "Task:\n{instruction}\n\nThe terminal now:\n{screen}"
OUTPUT = "New terminal output:\n{screen}"
CONFIRM = (
    "The terminal now:\n{screen}\n\nYou set task_complete. The task ends and is graded as the "
    'files and processes are now; nothing can be changed after. Answer with "task_complete": true '
    "again to end it, or false with the commands that are still needed."
)
CORRECT = (
    "Your answer could not be used: {problems}. Nothing was typed. Answer with one JSON object with "
    'the fields "analysis", "plan", "commands" (a list of {{"keystrokes": ..., "duration": ...}}) '
    'and "task_complete".'
)
CUT = "it was cut at the output limit (max_tokens): answer shorter"


def parse(text):
    """(the answer as a dict with `commands` a list of (keystrokes, duration) and `task_complete`,
    None) or (None, what is wrong)."""
    decoder = json.JSONDecoder()
    answer = None
    for m in re.finditer(r"\{", text):
        try:
            value, _ = decoder.raw_decode(text, m.start())
        except ValueError:
            continue
        if isinstance(value, dict):
            answer = value
            break
    if answer is None:
        return None, "it holds no JSON object"
    problems = []
    for key in ("analysis", "plan"):
        if not isinstance(answer.get(key), str):
            problems.append(f'"{key}" must be a string')
    done = answer.get("task_complete", False)
    if not isinstance(done, bool):
        problems.append('"task_complete" must be true or false')
    commands = answer.get("commands", [] if done is True else None)
    batches = []
    if not isinstance(commands, list):
        problems.append('"commands" must be a list')
        commands = []
    for i, command in enumerate(commands):
        keys = command.get("keystrokes") if isinstance(command, dict) else None
        duration = command.get("duration", DEFAULT_DURATION_S) if isinstance(command, dict) else None
        if not isinstance(keys, str):
            problems.append(f'commands[{i}] needs "keystrokes", a string')
        elif isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration >= 0:
            problems.append(f"commands[{i}].duration must be a number of seconds, 0 or more")
        else:
            batches.append((keys, min(float(duration), MAX_DURATION_S)))
    if problems:
        return None, "; ".join(problems)
    return {"commands": batches, "task_complete": done}, None


def keystrokes(keys):
    """The bytes a batch types: a control key for ``C-<letter>``, else the text as written."""
    if re.fullmatch(r"C-[a-zA-Z]", keys):
        return bytes([ord(keys[2].lower()) - ord("a") + 1])
    return keys.encode()


_ESCAPES = re.compile(r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean(raw):
    """What a terminal would leave of `raw` output, as text: escape sequences dropped, a backspace
    erasing the character before it, a carriage return starting its line over."""
    text = _ESCAPES.sub("", raw.replace("\r\n", "\n"))
    lines = []
    for line in text.split("\n"):
        line = line.rsplit("\r", 1)[-1]  # \r then new text: the terminal overwrites (progress bars)
        out = []
        for ch in line:
            if ch == "\b":
                if out:
                    out.pop()
            elif ch == "\t" or not _CONTROLS.match(ch):
                out.append(ch)
        lines.append("".join(out))
    return "\n".join(lines)


def tail(text, limit=OUTPUT_CHARS):
    text = text.strip("\n")
    if not text:
        return "(no output)"
    if len(text) <= limit:
        return text
    kept = text[-limit:]
    kept = kept[kept.find("\n") + 1 :] if "\n" in kept else kept
    return f"[... {len(text) - len(kept)} earlier characters not shown ...]\n{kept}"


class Terminal:
    """An interactive bash on a pseudo-terminal, its output read as it comes.

    `owed` counts the lines typed that bash has not answered with a prompt yet (across batches: a
    command still running when its wait ended owes its prompt to the next batch)."""

    def __init__(self, env):
        self.env = dict(env, PS1=PS1_MARK + "\\w$ ", PS2=PS2_MARK + "> ", TERM="dumb", PAGER="cat")
        self.pid = self.fd = None
        self.owed = 0

    def start(self):
        """Starts bash; returns what it printed until its first prompt (at most 10 s)."""
        pid, fd = pty.fork()
        if pid == 0:  # the child: bash with the pty as its controlling terminal
            try:
                # no readline (the tty echoes what is typed), no rc files, no history expansion
                os.execvpe("bash", ["bash", "--noprofile", "--norc", "--noediting", "+H", "-i"], self.env)
            finally:
                os._exit(127)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
        os.set_blocking(fd, False)
        self.pid, self.fd, self.owed = pid, fd, 1  # its first prompt
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return self.run(b"", 10.0)

    def run(self, data, duration):
        """Types `data`, then reads for `duration` seconds, less once bash is back at its prompt
        having answered every line; returns the raw output."""
        out = [] if self.fd is not None else [self.start()]
        pending, owed = data, self.owed + data.count(b"\n") + data.count(b"\r")
        start = time.monotonic()
        deadline, last_output, ended = start + duration, start, False
        while True:
            now = time.monotonic()
            raw = "".join(out)
            marks = raw.count(PS1_MARK) + raw.count(PS2_MARK)
            idle = marks >= owed and raw.rfind(PS1_MARK) > raw.rfind(PS2_MARK)
            if not pending and (now >= deadline or (idle and now - last_output >= QUIET_S)):
                break
            if pending and now >= deadline + MAX_DURATION_S:
                out.append(f"\n[{len(pending)} keystrokes were not typed: the terminal took no more]\n")
                break
            wait = QUIET_S if pending else max(0.0, min(QUIET_S, deadline - now))
            readable, writable, _ = select.select([self.fd], [self.fd] if pending else [], [], wait)
            if writable:
                pending = pending[os.write(self.fd, pending[:1024]) :]
            if readable:
                try:
                    chunk = os.read(self.fd, 1 << 16)
                except OSError:  # EIO: the shell exited and the pty closed
                    chunk = b""
                if not chunk:
                    out.append("\n[the shell exited; a new one starts with the next keystrokes]\n")
                    ended = True
                    break
                out.append(self.decoder.decode(chunk))
                last_output = time.monotonic()
        raw = "".join(out)
        self.owed = max(0, owed - raw.count(PS1_MARK) - raw.count(PS2_MARK))
        if PS1_MARK in raw and "\n" not in raw.rsplit(PS1_MARK, 1)[1]:
            self.owed = 0  # waiting at its prompt: lines another program read owe nothing
        if ended:
            self.close()
        return raw

    def close(self):
        if self.fd is not None:
            os.close(self.fd)  # a hangup: bash exits and hangs up its jobs
            self.fd = None
        if self.pid is not None:
            for _ in range(20):
                if os.waitpid(self.pid, os.WNOHANG)[0]:
                    break
                time.sleep(0.05)
            else:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            self.pid = None


class Refused(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class Model:
    """The session's Chat Completions, without a proxy."""

    def __init__(self, base_url, token, model, max_tokens, timeout_s):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.token, self.model, self.max_tokens, self.timeout_s = token, model, max_tokens, timeout_s
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __call__(self, messages):
        """(the reply's text, its finish_reason)."""
        body = {"model": self.model, "messages": messages}
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
        )
        for attempt in range(3):
            try:
                with self.opener.open(request, timeout=self.timeout_s) as response:
                    choice = json.load(response)["choices"][0]
                return choice["message"].get("content") or "", choice.get("finish_reason")
            except urllib.error.HTTPError as exc:
                text = exc.read().decode(errors="replace")[:2000]
                if exc.code < 500 or attempt == 2:
                    raise Refused(exc.code, f"{exc.code}: {text}") from None
            except (urllib.error.URLError, OSError) as exc:
                if attempt == 2:
                    raise Refused(None, f"unreachable: {exc}") from None
            time.sleep(1 + attempt)  # a 5xx or a dropped connection: twice more
        raise AssertionError("unreachable")


def say(*parts):
    print(*parts, flush=True)


def episode(model, terminal, instruction):
    """The agent's loop, to a confirmed completion (0) or a refused call (REFUSED or BUDGET)."""
    screen = clean(terminal.start())
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": TASK.format(instruction=instruction, screen=tail(screen))},
    ]
    asked_to_confirm = False
    turn = 0
    while True:
        turn += 1
        try:
            reply, finish = model(messages)
        except Refused as exc:
            say(f"terminus: turn {turn}: the model call was refused ({exc})")
            return BUDGET if exc.status == 429 else REFUSED
        messages.append({"role": "assistant", "content": reply})
        answer, problems = parse(reply)
        if answer is None:
            if finish == "length":
                problems += "; " + CUT
            say(f"terminus: turn {turn}: unusable answer: {problems}")
            messages.append({"role": "user", "content": CORRECT.format(problems=problems)})
            continue
        output = ""
        for keys, duration in answer["commands"]:
            say(f"terminus: turn {turn}: typing {keys!r}, waiting up to {duration:g} s")
            output += terminal.run(keystrokes(keys), duration)
        screen = tail(clean(output))
        say(screen)
        if answer["task_complete"] and asked_to_confirm:
            say(f"terminus: turn {turn}: task complete (confirmed)")
            return 0
        asked_to_confirm = answer["task_complete"]
        text = (CONFIRM if asked_to_confirm else OUTPUT).format(screen=screen)
        messages.append({"role": "user", "content": text})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the session's base URL (.../s/<id>/v1)")
    p.add_argument("--model", default="policy")
    p.add_argument("--max-tokens", type=int, default=0, help="output tokens per call (0: none sent)")
    p.add_argument("--call-timeout", type=float, default=3600.0, help="seconds one model call may take")
    p.add_argument("instruction")
    args = p.parse_args(argv)
    token = os.environ.get("PALAESTRA_SESSION_KEY")
    if not token:
        p.error("PALAESTRA_SESSION_KEY (the session's token) is not set")
    model = Model(args.base_url, token, args.model, args.max_tokens, args.call_timeout)
    terminal = Terminal({k: v for k, v in os.environ.items() if k != "PALAESTRA_SESSION_KEY"})
    try:
        return episode(model, terminal, args.instruction)
    finally:
        terminal.close()


if __name__ == "__main__":
    sys.exit(main())
