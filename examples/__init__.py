"""Runnable examples of lightning_pipe; see examples/README.md."""
