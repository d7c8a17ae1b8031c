"""OpenAI-compatible gateway: renders chats to token ids, routes to engines, records trajectories.

See docs/gateway.md (and docs/architecture.md for where it sits). Must not import the trainer.
"""
