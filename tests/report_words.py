"""The report's sections as Markdown lines straight from runs, for tests that read the words: each
composes the data (``reproduction.measures``, ``report``, ``peers``, ``model_check``) with its
renderer (``render/reproduction*.py``), as ``write_report`` does through the document."""

from __future__ import annotations

from typing import Any, Optional

from gradientflow_repro.comm import knobs
from gradientflow_repro.render import reproduction as words
from gradientflow_repro.render import reproduction_model as model_words
from gradientflow_repro.render import reproduction_peers as peer_words
from gradientflow_repro.render import reproduction_study as study_words
from gradientflow_repro.reproduction import measures, peers, report
from gradientflow_repro.reproduction import model_check as model
from gradientflow_repro.reproduction.measures import decomposition, dense_agreement  # noqa: F401 - data already

Runs = dict[str, list[dict]]


def comparison_table(runs: Runs) -> list[str]:
    return words.comparison_table(measures.comparison(runs))


def clock_table(runs: Runs) -> list[str]:
    return words.clock_table(measures.clocks(runs))


def decomposition_table(runs: Runs, reference: str) -> list[str]:
    return words.decomposition_table(measures.decomposition_rows(runs, reference), reference)


def _decomposition_section(runs: Runs, checks: Optional[dict] = None) -> list[str]:
    return words.decomposition_section(report.decomposition_section(runs, checks))


def schedule_table(runs: Runs, reference: str) -> list[str]:
    return words.schedule_table(measures.schedule_rows(runs, reference), reference)


def _schedule_section(runs: Runs) -> list[str]:
    return words.schedule_section(report.schedule_section(runs))


def _final_gap_goal(runs: Runs, reference: str) -> list[str]:
    section = report.schedule_section(runs)
    assert section["reference"] == reference
    return words.final_gap_goal(section["goal"])


def sparsification_table(runs: Runs) -> list[str]:
    return study_words.sparsification_table(measures.sparsification_rows(runs))


def sparsification_section(runs: Runs) -> list[str]:
    return study_words.sparsification_section(measures.sparsification_rows(runs))


def falls_after_warmup(runs: Runs, warmup_epochs: Optional[float] = None) -> list[str]:
    return study_words.falls(measures.falls_after_warmup(runs, warmup_epochs))


def convergence_table(runs: Runs) -> tuple[list[str], float]:
    rows, budget = measures.convergence_rows(runs)
    return words.convergence_table(rows, budget), budget


def _convergence_section(runs: Runs) -> list[str]:
    return words.convergence_section(report.convergence_section(runs))


def peers_section(runs: Runs, *args: Any) -> list[str]:
    return peer_words.peers_section(peers.peers(runs, *args))


def model_check(*args: Any) -> list[str]:
    return model_words.model_check(model.model_check(*args))


def _hidden_communication(*args: Any, **kwargs: Any) -> list[str]:
    return model_words.hidden_communication(model.hidden_communication(*args, **kwargs))


def _network_table(network_by_world: dict[int, dict]) -> list[str]:
    return model_words.network_table(sorted(network_by_world.items()), knobs.SMALL_MESSAGE_BYTES)
