"""Runnable examples (run from the repository root with `python -m examples.<name>`)."""
