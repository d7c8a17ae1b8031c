"""Isolated execution backends: docker and bubblewrap (a later issue)."""
