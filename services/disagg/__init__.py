"""What decode and prefill workers share for disaggregation: the prefill queue and its job
message, the KV wire format and the same-host shared-memory transport."""
