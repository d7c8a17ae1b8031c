"""Environments: each is a small package of tasks, an openai-SDK agent loop and a verifier."""
