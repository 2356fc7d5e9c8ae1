"""Errors raised while reading a model from disk (weights, metadata, tokenizer)."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model on disk uses an architecture, tensor type or feature tandem does not run.

    The message names the file and the unsupported thing, and lists what is supported.
    """
