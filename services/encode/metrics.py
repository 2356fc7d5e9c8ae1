"""The encode worker's Prometheus metrics (``tandem_encode_*``, ``tandem_worker_mm_*``)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from services.engine.multimodal.embedder import LocalEncodeChannel, VisionEncoder
from services.engine.multimodal.metrics import MmBlocksCollector


class _EncoderCollector:
    def __init__(self, encoder: VisionEncoder) -> None:
        self.encoder = encoder

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("tandem_encode_images", "Images encoded by the vision model",
                                  value=self.encoder.images_encoded)
        yield CounterMetricFamily("tandem_encode_cache_hits", "Images served from the embedding cache",
                                  value=self.encoder.cache_hits)


def encode_registry(encoder: VisionEncoder, channel: LocalEncodeChannel) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(MmBlocksCollector(channel.sender.allocator))
    reg.register(_EncoderCollector(encoder))
    return reg
