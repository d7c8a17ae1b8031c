"""The solution's process (UNTRUSTED once the solution is imported): imports `solution.py` as
module `solution`, announces its top-level names, then answers one call per line on stdin.

Whatever this process does after the import — exit, patch this file's functions, print lookalike
lines — it can only change the values the grader receives, never how the grader judges them.
"""

import json
import os
import sys
import traceback
import types

from codec import decode, dumps, encode

channel_in = os.fdopen(os.dup(0), "r")
channel_out = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
os.dup2(2, 1)  # the solution's prints go to stderr, the run's output
sys.stdout = sys.stderr


def send(message):
    channel_out.write(dumps(message))
    channel_out.flush()


def describe(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else type(exc).__name__


def main():
    try:
        with open("solution.py") as f:
            code = compile(f.read(), "solution.py", "exec")
    except (SyntaxError, ValueError) as e:
        send({"syntax_error": describe(e)})
        return
    module = types.ModuleType("solution")
    module.__file__ = os.path.abspath("solution.py")
    sys.modules["solution"] = module
    try:
        exec(code, module.__dict__)
    except BaseException as e:
        print("solution.py raised on import:")
        traceback.print_exc()
        send({"import_error": describe(e)})
        return
    names = {}
    for name, value in list(module.__dict__.items()):
        if name.startswith("__"):
            continue
        if callable(value):
            names[name] = "callable"
        else:
            try:
                names[name] = {"value": encode(value)}
            except (TypeError, ValueError):
                pass  # modules, classes' instances: not visible to the tests
    send({"names": names})
    for line in channel_in:
        request = json.loads(line)
        try:
            function = module.__dict__[request["name"]]
            result = function(*decode(request["args"]), **decode(request["kwargs"]))
            reply = {"ok": encode(result)}
        except BaseException as e:
            reply = {"raised": type(e).__name__, "message": str(e)[:2000]}
        send(reply)


main()
sys.stdout.flush()
os._exit(0)
