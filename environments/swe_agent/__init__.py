"""The swe_agent environment (``--env swe``): fix a bug in a repository with bash and edit tools
inside a sandbox; graded by FAIL_TO_PASS and PASS_TO_PASS on a fresh copy with the agent's diff.

- ``env.py``: the agent loop (`SweAgentEnv`); ``tools.py``: its tools;
- ``workspace.py``: the tasks, a task's sandbox and grading (`SweWorkspace`; the harness environment
  composes it too);
- ``instance.py``: SWE-bench-shaped instances and their JSONL;
- ``grading.py``: grading a patch, and validating an instance;
- ``generate.py`` + ``mutate.py``: instances from bugs planted in ``repos/`` (syntax-tree edits);
- ``snapshot.py``: repository snapshots, the agent's history-free copy, diffs and patches;
- ``testrun.py`` + ``unittest_runner.py``: running test ids in a sandbox;
- ``cli.py``: ``palaestra swe generate|validate``.

docs/environments.md has the details.
"""
