"""Benchmarks behind ``make bench``: each measures into a JSON document (``render.write_data``) that
names the machine, world size, commit and command (``provenance``), beside any CSV of raw rows;
``render/bench.py`` makes the Markdown under results/ from it.

The library (trainer, comm, data, models, config) never imports this package."""

from __future__ import annotations

from typing import Any, Mapping, Optional


def provenance(command: str, world: Any, environment: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """What produced a document (``render.provenance_line``'s keys), with the full environment facts
    (``provenance.environment_facts``, read now unless given) under ``environment``."""
    if environment is None:
        from gradientflow_repro.provenance import environment_facts

        environment = environment_facts()
    machine = environment.get("gpu") or f"{environment.get('cpu')}, {environment.get('cpu_count')} cores"
    return {"machine": machine, "world": world, "commit": environment.get("git_commit"), "command": command,
            "environment": dict(environment)}
