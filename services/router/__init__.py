"""The KV-aware router: prefix index, load tracking, worker selection, gRPC `Route`."""
