"""The publisher refuses events that do not continue its id sequence."""

from __future__ import annotations

import pytest

from services.api.kv_events import KvCleared
from services.common.kv_publisher import KvEventPublisher
from services.common.nats_client import Subjects


def test_publisher_checks_ids_and_worker() -> None:
    pub = KvEventPublisher(None, Subjects("t"), "w", dump=list)  # type: ignore[arg-type]
    pub.on_events([KvCleared("w", 1), KvCleared("w", 2)])
    assert pub.last_event_id == 2
    with pytest.raises(ValueError, match="expected 3"):
        pub.on_event(KvCleared("w", 5))
    with pytest.raises(ValueError, match="worker"):
        pub.on_event(KvCleared("v", 3))
    assert pub.last_event_id == 2
