"""The code_sandbox environment (``--env code``): write a Python function, test it with the
``run_python`` tool in a sandbox, be graded by hidden tests in a fresh one.

- ``env.py``: the agent loop (`CodeSandboxEnv`);
- ``tasks.py``: the seeded generator (levels 0-3) and HumanEval from the installed package;
- ``tools.py``: the ``run_python`` tool and the answer extractor.

Grading is `palaestra.verifiers.code`; docs/environments.md has the details.
"""
