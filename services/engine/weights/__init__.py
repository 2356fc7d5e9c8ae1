"""Load a Llama-family model's weights from a GGUF file or a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from services.engine.weights.loaded import LoadedWeights
from services.model.errors import UnsupportedModelError

__all__ = ["LoadedWeights", "UnsupportedModelError", "load_weights"]


def load_weights(path: str | Path) -> LoadedWeights:
    """Read the model at `path` (a .gguf file or an HF directory with config.json and
    safetensors). Raises FileNotFoundError for a missing path and UnsupportedModelError for
    an architecture, tensor type or layout tandem does not run."""
    p = Path(path)
    if p.is_dir():
        from services.engine.weights.hf_loader import load_hf_dir

        return load_hf_dir(p)
    if p.is_file() and p.suffix == ".gguf":
        from services.engine.weights.gguf_loader import load_gguf

        return load_gguf(p)
    if p.exists():
        raise UnsupportedModelError(f"{p} is neither a .gguf file nor a model directory")
    raise FileNotFoundError(f"model path {p} does not exist")
