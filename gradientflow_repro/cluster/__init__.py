"""The emulated cluster and launching ranks on it: network namespaces and shaped links (netemu), a
job's ranks started in them or on loopback (launch, preloaded), a function run in N local processes
(world).

The library (trainer, comm, data, models, config) never imports this package."""
