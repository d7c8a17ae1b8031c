"""The agents' gateway (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages): renders chats
to token ids, routes to engines, records trajectories.

Layout: `app.py` mounts `routes.py` (HTTP), which binds each path to a dialect (`dialect.py`: the
seam; `openai_request.py` parses and `openai_response.py` shapes OpenAI chat, `responses_api.py`
and `responses_answer.py` the Responses API, `anthropic_api.py` Anthropic Messages; `validate.py` the
field checks they share) over the one turn
core in `service.py` (plan with `bridge.py` and `renderer.py`, generate with `engine_client.py`,
stream with `streaming.py`, parse with `parsers.py` (and `parse_status.py`), record with `trajectory.py`, make samples
durable with `spool.py`, journal sessions with `journal.py` and rebuild them at start with `replay.py`;
limits and the idle timeout in `limits.py`; a session's record in `session.py` and the store of them
in `session_store.py`, the pause gate in `pause.py`, the Prometheus metrics in `metrics.py`; the
configuration in `config.py` over the run-tunable `options.py`). docs/gateway.md is the
user guide, docs/architecture.md the map; the engine side is docs/engine-protocol.md.
Must not import the trainer.
"""
