"""``tandem_worker_mm_*`` metrics of a worker's embedding blocks."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from services.engine.multimodal.blocks import EmbeddingBlockAllocator


class MmBlocksCollector:
    """Reads the allocators (a worker's receiving and, encoding locally, sending buffers)
    at scrape time; register with a CollectorRegistry."""

    def __init__(self, *allocators: EmbeddingBlockAllocator) -> None:
        self.allocators = allocators

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("tandem_worker_mm_blocks_used", "Image-embedding blocks held",
                                value=sum(a.used_blocks for a in self.allocators))
        yield GaugeMetricFamily("tandem_worker_mm_blocks_total", "Image-embedding blocks",
                                value=sum(a.num_blocks for a in self.allocators))
