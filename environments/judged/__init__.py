"""A judge-rewarded environment (``--env judged-math``): `env.py`'s `JudgedMathEnv`, math tasks
graded by a judge model (`palaestra.verifiers.judge`) instead of a rule."""
