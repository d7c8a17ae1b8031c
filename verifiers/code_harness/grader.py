"""The grader (TRUSTED): reads the tests and a per-run token from stdin, starts the solution in
its own process (`worker.py`), runs each test here with the solution's functions replaced by
proxies that call into that process, and reports each outcome on stdout behind the token.

Why two processes: a solution that shares the grader's process can patch it, exit before it
reports, or forge its output. Here the solution never runs in this process, the tests never touch
the disk, the token never leaves this process (which makes itself non-dumpable, so another process
of the same user cannot read its memory or open its file descriptors through /proc), and only
plain data comes back from the solution (`codec.py`). A solution that exits, hangs or dies fails
the test in progress; the next test starts a fresh process.

Limits of the proxy: arguments and results are copied, so a test that checks how the solution
mutated its argument sees no mutation, and functions cannot be passed as arguments.
"""

import ast
import asyncio
import builtins
import inspect
import json
import os
import subprocess
import sys
import traceback
import types

from codec import decode, dumps, encode


def make_non_dumpable():
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception as e:  # no ctypes or libc: the token still guards the reports
        print(f"grader: could not make itself non-dumpable: {e}")


make_non_dumpable()
config = json.loads(sys.stdin.read())
os.close(0)
TOKEN = config["token"]
TESTS = config["tests"]
MAX_STARTS = int(config.get("max_worker_starts", 20))
del config
_report_stream = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # anything else printed here joins the run's output on stderr
sys.stdout = sys.stderr


def report(*parts):
    _report_stream.write(" ".join([TOKEN, *map(str, parts)]) + "\n")
    _report_stream.flush()


def describe(exc):
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[-1].strip() if lines else type(exc).__name__


class SolutionGone(Exception):
    """The solution's process exited or answered nonsense."""


class Worker:
    def __init__(self):
        self.proc = None
        self.starts = 0

    def start(self):
        self.starts += 1
        if self.starts > MAX_STARTS:
            raise SolutionGone(f"the solution's process died {MAX_STARTS} times; not restarting it")
        self.proc = subprocess.Popen(
            [sys.executable, "-B", "-E", "-s", "worker.py"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.getcwd()},
        )
        return self.read()

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            self.stop()
            raise SolutionGone("the solution's process exited")
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if type(message) is not dict:
            self.stop()
            raise SolutionGone("the solution's process wrote something that is not a reply")
        return message

    def stop(self):
        if self.proc is not None:
            try:
                self.proc.kill()
            except OSError:
                pass
            self.proc.wait()
            self.proc = None

    def call(self, name, args, kwargs):
        if self.proc is None:
            hello = self.start()
            if "names" not in hello:
                self.stop()
                raise SolutionGone("the solution failed to import on restart")
        request = {"name": name, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
        try:
            self.proc.stdin.write(dumps(request).encode())
            self.proc.stdin.flush()
        except OSError:
            self.stop()
            raise SolutionGone("the solution's process exited") from None
        reply = self.read()
        if "ok" in reply:
            try:
                return decode(reply["ok"])
            except (ValueError, TypeError, RecursionError) as e:
                raise SolutionGone(f"unreadable result: {e}") from None
        raised = reply.get("raised")
        message = str(reply.get("message", ""))
        kind = getattr(builtins, raised, None) if type(raised) is str else None
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                error = kind(message)
            except Exception:
                error = RuntimeError(f"{raised}: {message}")
        else:
            error = RuntimeError(f"the solution raised {raised}: {message}")
        raise error


WORKER = Worker()


class Remote:
    """Stands for one of the solution's functions in the tests."""

    def __init__(self, name):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        return WORKER.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<solution function {self.__name__}>"


def main():
    tests_tree = ast.parse(TESTS, "tests.py")
    funcs = [
        n.name
        for n in tests_tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")
    ]
    asserts = [] if funcs else [n for n in tests_tree.body if isinstance(n, ast.Assert)]
    names = funcs or [f"assert line {n.lineno}" for n in asserts]
    report("total", len(names))
    if not names:
        report("done")
        return
    try:
        hello = WORKER.start()
    except SolutionGone:
        hello = {"import_error": "exited"}
    if "syntax_error" in hello:
        print("syntax error in solution.py: " + str(hello["syntax_error"]))
        report("syntax_error")
        return
    if type(hello.get("names")) is not dict:
        report("import_error")
        return
    module = types.ModuleType("solution")
    for name, kind in hello["names"].items():
        if type(name) is not str or hasattr(builtins, name):
            continue  # a solution's `abs` or `len` must not replace the one the tests use
        if kind == "callable":
            setattr(module, name, Remote(name))
        elif type(kind) is dict and "value" in kind:
            try:
                setattr(module, name, decode(kind["value"]))
            except (ValueError, TypeError, RecursionError):
                pass
    sys.modules["solution"] = module
    ns = {k: v for k, v in vars(module).items() if not k.startswith("__")}
    ns["__name__"] = "tests"
    ns["__builtins__"] = builtins
    if funcs:
        try:
            exec(compile(tests_tree, "tests.py", "exec"), ns)
        except BaseException:
            print("tests.py setup raised:")
            traceback.print_exc()
            report("done")
            return

        def call(name):
            result = ns[name]()
            if inspect.iscoroutine(result):  # an `async def test_*`
                asyncio.run(result)

        units = [(name, lambda name=name: call(name)) for name in funcs]
    else:
        units = []
        for node in tests_tree.body:
            one = compile(ast.Module(body=[node], type_ignores=[]), "tests.py", "exec")
            name = f"assert line {node.lineno}" if isinstance(node, ast.Assert) else None
            units.append((name, lambda one=one: exec(one, ns)))
    index = 0
    for name, run in units:
        try:
            run()
        except BaseException as e:
            if name is None:
                print("tests.py setup raised:")
                traceback.print_exc()
                break
            print(f"FAIL {name}: {describe(e)}")
            report("fail", index)
        else:
            if name is not None:
                report("pass", index)
        if name is not None:
            index += 1
    report("done")


main()
WORKER.stop()
sys.stdout.flush()
os._exit(0)
