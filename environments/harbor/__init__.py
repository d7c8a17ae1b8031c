"""Harbor task directories as an environment (`env.py`), built offline in our sandboxes, and
`palaestra harbor validate` (`cli.py`). See docs/environments.md, "The harbor environment"."""
