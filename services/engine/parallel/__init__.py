"""What a model is built with to run split over tensor-parallel ranks: each rank's shard of
the heads and the MLP (``shard.py``) and the one collective the forward calls
(``comm.py``). The multi-process runtime that drives the ranks is ``engine/tp``."""
