"""Runs unittest test ids inside the grading sandbox and reports each outcome on stdout behind a
per-run token read from stdin (so the repository's prints cannot forge a result), then "done".
A run that ends before "done" (the code under test exited or crashed) leaves the unreported tests
failed. Standard library only; started with ``python3 -I`` so the repository cannot shadow
``unittest`` or plant a ``sitecustomize``.
"""

import json
import os
import sys
import traceback
import unittest

config = json.loads(sys.stdin.read())
TOKEN = config["token"]
del config["token"]
_report = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
sys.path.append(os.getcwd())  # after the standard library


def report(message):
    _report.write(TOKEN + " " + json.dumps(message) + "\n")
    _report.flush()


def where(tb):
    """The last line of a test file in the traceback: what the failing test was doing."""
    found = None
    for frame in traceback.extract_tb(tb):
        if "/tests/" in frame.filename or os.path.basename(frame.filename).startswith("test"):
            found = {"file": os.path.relpath(frame.filename), "line": frame.lineno, "code": frame.line}
    return found


class Recorder(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcome = "passed"
        self.detail = None

    def _bad(self, outcome, err):
        self.outcome = outcome
        exc_type, exc, tb = err
        message = traceback.format_exception_only(exc_type, exc)[-1].strip()
        self.detail = {"message": message[:2000], "at": where(tb)}

    def addFailure(self, test, err):
        self._bad("failed", err)

    def addError(self, test, err):
        self._bad("error", err)

    def addSkip(self, test, reason):
        self.outcome = "skipped"

    def addUnexpectedSuccess(self, test):
        self.outcome = "failed"


for test_id in config["tests"]:
    try:
        suite = unittest.defaultTestLoader.loadTestsFromName(test_id)
    except BaseException as e:
        report({"id": test_id, "outcome": "error", "message": "cannot load: " + str(e)[:500]})
        continue
    result = Recorder()
    count = suite.countTestCases()
    suite.run(result)
    if count == 0 or result.errors and result.outcome == "passed":
        report({"id": test_id, "outcome": "error", "message": "no such test"})
        continue
    report({"id": test_id, "outcome": result.outcome, **(result.detail or {})})
report("done")
sys.stdout.flush()
os._exit(0)
