"""A byte-level transformer language model trained on the Python standard library's own sources."""
