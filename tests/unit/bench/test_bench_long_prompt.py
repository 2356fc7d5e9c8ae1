"""bench long-prompt reads the workers' /metrics text: the parser keeps tandem's series with
their labels and sums nothing it should not."""

from __future__ import annotations

from services.bench.long_prompt import _delta, _metrics

TEXT = """# HELP tandem_prefill_jobs_total Prefill jobs by outcome
# TYPE tandem_prefill_jobs_total counter
tandem_prefill_jobs_total{outcome="delivered"} 3.0
tandem_prefill_jobs_total{outcome="withdrawn"} 1.0
tandem_prefill_jobs_created{outcome="delivered"} 1.7e+09
tandem_worker_kv_blocks_total 128.0
python_gc_objects_collected_total{generation="0"} 5.0
"""


def test_metrics_text_is_read_by_series_and_labels() -> None:
    m = _metrics(TEXT)
    assert m['tandem_prefill_jobs_total{outcome="delivered"}'] == 3.0
    assert m["tandem_worker_kv_blocks_total{}"] == 128.0
    assert not any(k.startswith("python_") for k in m)
    after = {**m, 'tandem_prefill_jobs_total{outcome="delivered"}': 4.0}
    assert _delta(after, m, 'tandem_prefill_jobs_total{outcome="delivered"}') == 1.0
    assert _delta(after, m, 'tandem_prefill_jobs_total{outcome="failed"}') == 0.0
