"""The planner's actuators on a live cluster: `tandem up`'s supervisor (local.py) and
Kubernetes Deployments (kubernetes.py); the simulator's lives in services/sim/."""
