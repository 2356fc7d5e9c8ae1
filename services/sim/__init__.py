"""`tandem sim`: a discrete-event simulation of a whole cluster on a virtual clock.

It drives the production router, schedulers, block pools and KV cache managers with only
the model forward replaced by a step-time model (docs/simulator.md)."""
