"""The scripts `verify_code` uploads into a sandbox: `grader.py` (trusted: holds the tests and the
report token), `worker.py` (untrusted: imports the solution and answers calls) and `codec.py` (the
data-only format between them). They use nothing but the standard library of the sandbox's python3.
"""
