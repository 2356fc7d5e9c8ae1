"""One codec each way per proto: the typed messages of services/engine/request.py,
services/processor/types.py and services/disagg/prefill_job.py to and from their protobufs.
Nothing else builds or reads these protobufs' fields."""
