"""The result of loading a model's weights, whatever the file format."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.engine.quant.groups import QuantSource
from services.model.arch import ModelArchConfig


@dataclass(frozen=True)
class LoadedWeights:
    """Architecture plus tensors in Hugging Face naming.

    Every tensor is float32, on the CPU, contiguous; linear weights are [out, in] (torch
    layout); q/k rows are in Hugging Face order (GGUF's rotary permutation undone).
    ``lm_head.weight`` is absent when ``arch.tie_word_embeddings`` (use the embedding).
    The set of names and shapes is exactly `layout.expected_shapes(arch)`.
    ``quant`` holds what a quantized runner can take from the file as stored (GGUF blocks).
    """

    arch: ModelArchConfig
    tensors: dict[str, torch.Tensor]
    source: Path
    quant: QuantSource = field(default_factory=QuantSource)
