"""The scaling model (perfmodel) and what feeds and checks it: a model's backward profile (profile),
the network as the ring sees it (netbench), the model against the emulated cluster (cluster_check),
and any published setup projected (projection).

The library (trainer, comm, data, models, config) never imports this package."""
