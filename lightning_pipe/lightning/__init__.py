"""Pieces of the Lightning integration that the strategy glues together."""
