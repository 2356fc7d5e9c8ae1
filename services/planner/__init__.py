"""`tandem planner`: sizes the prefill/decode split from the cluster's signals and moves it
through an actuator (local processes, Kubernetes, or the simulator). docs/planner.md."""
