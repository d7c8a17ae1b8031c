"""OpenAI-compatible gateway: renders chats to token ids, routes to engines, records trajectories.

Built by the gateway issue; see docs/ and ../shared/ARCHITECTURE.md. Must not import the trainer.
"""
