"""Build an engine from the cluster config: resolve the model, load weights and tokenizer,
pick the runner. The one place that knows how the engine's pieces fit together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from services.api.kv_events import KvEvent
from services.common.config import ClusterConfig, EngineConfig
from services.engine.engine import LLMEngine
from services.engine.runner.base import ModelRunner
from services.model.store import resolve_model_path, served_model_name
from services.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

    from services.engine.multimodal.blocks import EmbeddingBlockAllocator
    from services.engine.multimodal.embedder import ImageEmbedder, LocalEncodeChannel
    from services.engine.multimodal.transfer import EncodeChannel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineParts:
    """What a worker process needs: the engine, its tokenizer and the served model name."""

    engine: LLMEngine
    tokenizer: Tokenizer | None
    model_name: str
    model_path: Path | None


def stream_interval(cfg: EngineConfig) -> int | Literal["auto"]:
    """``engine.stream_interval`` as AsyncEngine takes it: "auto" is 1 on the mock runner,
    whose clusters the simulator (which delivers each token as it is made) is checked against."""
    if cfg.stream_interval == "auto" and cfg.runner == "mock":
        return 1
    return cfg.stream_interval


def is_llava_dir(model_path: Path | None) -> bool:
    """Whether the model is a LLaVA (vision-language) Hugging Face directory."""
    if model_path is None or not (model_path / "config.json").is_file():
        return False
    import json

    from services.model.llava_config import is_llava_config

    return is_llava_config(json.loads((model_path / "config.json").read_text(encoding="utf-8")))


def build_embedder(cfg: ClusterConfig, model_path: Path | None, device: str = "cpu",
                   remote: Callable[[], Sequence[EncodeChannel]] | None = None,
                   dtype: torch.dtype | None = None) -> WorkerImages | None:
    """How a worker that prefills gets image embeddings, or None for a text-only model:
    from ``remote()`` (the encode workers discovery lists), or, without it, from the vision
    model loaded here (``encode.replicas: 0``)."""
    if cfg.engine.runner != "torch" or not is_llava_dir(model_path):
        return None
    from services.engine.multimodal.blocks import EmbeddingBlockAllocator
    from services.engine.multimodal.buffers import EmbeddingBuffers
    from services.engine.multimodal.embedder import ImageEmbedder, VisionEncoder, local_embedder
    from services.engine.multimodal.transfer import EmbeddingReceiver
    from services.engine.multimodal.weights import read_llava_arch

    mm = cfg.multimodal
    assert model_path is not None
    if remote is not None:
        hidden = read_llava_arch(model_path).text.hidden_size
        import torch

        # NOTE: the language model's dtype: an encode worker on the same dtype sends its rows
        # as they are (no widening) and may write them into this side's shared memory.
        receiver = EmbeddingReceiver(EmbeddingBlockAllocator(mm.num_blocks, mm.block_size, mm.default_blocks),
                                     EmbeddingBuffers(mm.num_blocks, mm.block_size, hidden, dtype or torch.float32),
                                     mm.encode_timeout_s)
        return WorkerImages(ImageEmbedder(receiver, remote), (receiver.allocator,), None)
    import torch

    encoder = VisionEncoder(model_path, device, dtype or torch.float32, cache_entries=mm.embedding_cache_entries)
    embedder, channel = local_embedder(encoder, mm.block_size, mm.default_blocks, mm.num_blocks,
                                       mm.encode_timeout_s)
    return WorkerImages(embedder, (embedder.receiver.allocator, channel.sender.allocator), channel)


@dataclass(slots=True)
class WorkerImages:
    """A multimodal worker's image path: the embedder, the block allocators its metrics
    read, and the in-process encode channel when it encodes itself (close it at exit)."""

    embedder: ImageEmbedder
    allocators: tuple[EmbeddingBlockAllocator, ...]
    local: LocalEncodeChannel | None

    def close(self) -> None:
        if self.local is not None:
            self.local.close()


def build_runner(cfg: ClusterConfig, model_path: Path | None) -> ModelRunner:
    if cfg.engine.runner == "mock":
        from services.engine.runner.mock_runner import MockRunner

        return MockRunner(cfg.engine)
    from services.engine.runner.torch_runner import TorchRunner
    from services.engine.weights import load_weights

    assert model_path is not None  # NOTE: resolved by build_engine for the torch runner
    if is_llava_dir(model_path):
        from services.engine.multimodal.weights import load_llava_dir

        loaded = load_llava_dir(model_path).text  # the vision half runs in the ImageEmbedder
    else:
        loaded = load_weights(model_path)
    if cfg.engine.tensor_parallel_size > 1:
        from services.engine.tp.runner import TpRunner

        return TpRunner(loaded.arch, loaded.tensors, cfg.engine, model_path, cfg.engine.max_model_len,
                        loaded.quant)
    return TorchRunner(loaded.arch, loaded.tensors, cfg.engine, cfg.engine.max_model_len, loaded.quant)


def build_engine(
    cfg: ClusterConfig,
    worker_id: str = "",
    on_kv_event: Callable[[KvEvent], None] | None = None,
    prefill_worker: bool = False,
) -> EngineParts:
    """The engine for ``cfg``. The torch runner needs the model; the mock runner uses the
    model's tokenizer when the model is present (so text still round-trips) and runs
    without one otherwise. ``prefill_worker``: a prefill worker's engine (where
    ``engine.prefill_order`` auto means fifo)."""
    model_path: Path | None
    if cfg.engine.runner == "torch":
        model_path = resolve_model_path(cfg.model.path)
    else:
        try:
            model_path = resolve_model_path(cfg.model.path)
        except FileNotFoundError:
            model_path = None
    tokenizer = Tokenizer.from_path(model_path) if model_path is not None else None
    runner = build_runner(cfg, model_path)
    if tokenizer is not None:
        eos: tuple[int, ...] = tokenizer.stop_token_ids
    else:
        eos = (cfg.engine.mock.eos_token_id,)
    grammar = None
    if tokenizer is not None and runner.supports_grammar:
        from services.engine.grammar.compiler import GrammarCompiler, default_threads

        try:
            grammar = GrammarCompiler(tokenizer.to_json(), runner.vocab_size, eos,
                                      threads=cfg.engine.grammar_threads or default_threads())
        except ValueError as e:
            # A tokenizer llguidance cannot read (no decoder, say) still serves free text;
            # structured requests then get validate()'s clear 400 instead of a dead worker.
            log.warning("structured output disabled: llguidance cannot use this tokenizer (%s)", e)
    engine = LLMEngine(runner, cfg.engine, eos, worker_id=worker_id, on_kv_event=on_kv_event,
                       grammar=grammar, prefill_worker=prefill_worker)
    name = cfg.model.name or served_model_name(cfg.model.path)
    return EngineParts(engine, tokenizer, name, model_path)
