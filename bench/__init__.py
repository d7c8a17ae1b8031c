"""The benchmarks: one module each, run from the repository root as `.venv/bin/python -m bench.NAME`
(`--help` prints what it measures and its options); `.venv/bin/python -m bench` (`make bench`)
lists what each one answers. What they share is in `bench/common.py`.
"""
