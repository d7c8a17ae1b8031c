"""Our Terminus-style terminal agent (`agent.py`), a stdlib-only program the harness environments
mount into a sandbox and run against the session URL; the host never imports it at run time."""
