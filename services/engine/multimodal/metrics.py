"""``tandem_worker_mm_*`` metrics of a worker's embedding blocks."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from services.engine.multimodal.blocks import EmbeddingBlockAllocator


class MmBlocksCollector:
    """Reads the allocator at scrape time; register with a CollectorRegistry."""

    def __init__(self, allocator: EmbeddingBlockAllocator) -> None:
        self.allocator = allocator

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("tandem_worker_mm_blocks_used", "Image-embedding blocks held",
                                value=self.allocator.used_blocks)
        yield GaugeMetricFamily("tandem_worker_mm_blocks_total", "Image-embedding blocks",
                                value=self.allocator.num_blocks)
