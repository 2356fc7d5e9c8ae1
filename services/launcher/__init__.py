"""`tandem up`: start a whole cluster from one config as child processes and supervise it."""
