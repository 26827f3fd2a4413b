"""The ``selfspec`` command: every verb; ``train-*`` verbs come from their head's folder."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
