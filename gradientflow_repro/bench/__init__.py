"""Benchmarks behind ``make bench``: each writes a table under results/ naming machine, world size,
commit and command.

The library (trainer, comm, data, models, config) never imports this package."""
