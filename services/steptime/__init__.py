"""Step-time models: seconds per engine step from the batch's shape (the mock runner's costs or a
fitted profile of the real engine), used by the simulator as its device and by the router and
the decode worker to predict time."""
