"""The scaling model against the reproduction's measured step times, as data: its predictions per
world size and strategy, how close the full stack comes to hiding all communication, and the
model against one allreduce per gradient measured alone. The goals are ``verdicts``; the renderer
(``render/reproduction_model.py``) words them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional, Sequence

from gradientflow_repro import variants
from gradientflow_repro.comm import knobs
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.reproduction import lineup, verdicts
from gradientflow_repro.reproduction.runs import compute_only_s
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.netbench import priced_network
from gradientflow_repro.scaling.profile import profile_from_json


def model_check(checks: dict[int, dict[str, dict]], calibration: dict,
                network_by_world: dict[int, dict], lars: bool = True,
                unshaped: Optional[dict[int, dict[str, dict]]] = None, cores: Optional[int] = None,
                allreduce_beside: Optional[dict[int, dict]] = None,
                short_runs: Optional[dict[int, Sequence[str]]] = None,
                global_batch: Optional[int] = None, peers: Optional[dict[int, dict[str, dict]]] = None) -> dict:
    """Predicted vs measured step times. The measured single-process profile is scaled, per world
    size, to the slowest rank's compute in the ``allreduce`` runs that are the strategy's reference
    (``compute_only_s``: their step less their wait, plus how much longer their slowest rank's
    forward and backward took): on a shared CPU the ranks slow each other, and every collective
    after backward waits for the last of them. That compute and its spread are all the model takes
    from the runs. Forward and backward scale with the per-rank batch (``global_batch`` over the
    world size, against the profile's), the work per gradient element (optimizer, local work) only
    with the ranks slowing each other. The network is the one measured at that world size. The
    reference is ``allreduce``'s runs beside the strategy's own (``compute_reference``:
    ``allreduce_beside``, ``short_runs``). ``lars``: the runs' Lars adapted their weight layers
    (``runs.sends_trust_sketches``); ``unshaped``: step times with the links unshaped, by world
    size (``hidden_communication``); ``cores``: the machine's. ``peers``: by world size, the measured
    steps of configurations outside the ladder (``lineup.PEERS``, from their runs to the target after
    their dense warm-up), shown below the ladder's where the model prices them and left out of the
    goal (``verdicts.model_within``), which is the ladder's."""
    allreduce_beside, short_runs, peers = allreduce_beside or {}, short_runs or {}, peers or {}
    profile = profile_from_json(calibration["profile"])
    profiled_batch = calibration["profile"].get("batch")  # (not in profiles from before it was written)
    rows: list[dict[str, Any]] = []
    errors = []
    for world, by_label in sorted(checks.items()):
        if "allreduce" not in by_label:
            continue
        net = priced_network(network_by_world[world])
        switch = network_by_world[world].get("small_message_kb")  # the runs' (none before it was measured)
        strategies = {label: pm.Strategy.from_plan(label, resolve(knobs.on_network(options, switch)), lars=lars)
                      for label, options in lineup.LADDER.items()}
        batch = (global_batch // world) / profiled_batch if global_batch and profiled_batch else 1.0
        checked = [(label, label, step, compute_reference(world, label, by_label, allreduce_beside, short_runs))
                   for label, step in by_label.items()]
        if world in allreduce_beside:  # allreduce's short runs beside the sparse rungs' check it too
            checked.append(("allreduce", "allreduce (short runs)", allreduce_beside[world], allreduce_beside[world]))
        ladder_rows, unpriced = len(checked), []
        for label, step in peers.get(world, {}).items():  # set against allreduce's runs to the target, as they are
            try:
                strategies[label] = pm.Strategy.from_plan(
                    label, resolve(knobs.on_network(lineup.COMPARED[label], switch)), lars=lars)
            except ValueError as error:  # a pricing rule the model does not know: said, not guessed
                unpriced.append({"world": world, "label": label, "peer": True, "measured_s": [step["step_s"]],
                                 "unpriced": str(error)})
                continue
            checked.append((label, label, step, by_label["allreduce"]))
        for index, (label, shown, measured, reference) in enumerate(checked):
            # its compute = (forward + backward) x contention x batch + optimizer x contention
            contention = compute_only_s(reference, slowest=True) / (
                (profile.forward_s + profile.backward_s) * batch + profile.optimizer_s)
            predicted = pm.predict_step(profile.scaled(contention * batch, contention), world, net, strategies[label])
            error = predicted.step_s / measured["step_s"] - 1
            if index < ladder_rows:
                errors.append(abs(error))
            rows.append({"world": world, "label": shown, "peer": index >= ladder_rows,
                         "measured_s": measured.get("step_s_each") or [measured["step_s"]],
                         "predicted_s": predicted.step_s, "exposed_s": predicted.exposed_comm_s, "error": error})
        rows += unpriced
    goal = verdicts.model_within(errors)
    return {"rows": rows, "goal": None if goal is None else goal.data(),
            "hidden": hidden_communication(checks, unshaped or {}, cores, allreduce_beside, short_runs),
            "alone": per_tensor_alone(profile, network_by_world)}


def compute_reference(world: int, label: str, by_label: dict[str, dict], allreduce_beside: dict[int, dict],
                      short_runs: dict[int, Sequence[str]]) -> dict:
    """The ``allreduce`` step that ``label``'s at ``world`` is set against: ``allreduce``'s short runs
    beside those of a rung with short runs at the ladder's world size (``short_runs[world]``; a
    reproduction from before there were any set them against the runs to the target), else
    ``by_label``'s, of the same kind as ``label``'s and side by side (runs to the target, or at the
    other world sizes short runs of every strategy)."""
    if label in short_runs.get(world, ()) and world in allreduce_beside:
        return allreduce_beside[world]
    return by_label["allreduce"]


def hidden_communication(checks: dict[int, dict[str, dict]], unshaped: dict[int, dict[str, dict]],
                         cores: Optional[int] = None, allreduce_beside: Optional[dict[int, dict]] = None,
                         short_runs: Optional[dict[int, Sequence[str]]] = None) -> list[dict[str, Any]]:
    """How close the full stack comes to hiding all communication: its step over the compute-only
    step (``compute_only_s`` of the ``allreduce`` runs beside it, ``compute_reference``), and where
    measured, the same step with the links unshaped: no wire time, so what remains over the
    compute-only step is CSC's local work, latency and the ranks waiting for each other, which no
    overlap of communication with backward can hide. Both over the same compute-only step, so the
    link's part is the difference of ``gradientflow``'s own steps; ``allreduce``'s unshaped beside
    them (where measured) shows how far the machine's speed moved between the two sets of runs.
    One entry per world size, with its goal (``verdicts.hidden_communication``)."""
    allreduce_beside, short_runs = allreduce_beside or {}, short_runs or {}
    found = []
    for world, by_label in sorted(checks.items()):
        if "allreduce" not in by_label or "gradientflow" not in by_label:
            continue
        base = compute_reference(world, "gradientflow", by_label, allreduce_beside, short_runs)
        compute = compute_only_s(base)
        ratio = by_label["gradientflow"]["step_s"] / compute
        entry: dict[str, Any] = {
            "world": world, "compute_s": compute, "ratio": ratio, "cores": cores,
            "in_runs_to_target": "gradientflow" in short_runs.get(world, ()) and world not in allreduce_beside,
            "behind": [[name, step["behind_slowest_s"]] for name, step in
                       (("allreduce", base), ("gradientflow", by_label["gradientflow"])) if "behind_slowest_s" in step],
            "goal": verdicts.hidden_communication(world, ratio).data(), "unshaped": None}
        free = unshaped.get(world, {}).get("gradientflow")
        if free:
            free_base = unshaped[world].get("allreduce")
            entry["unshaped"] = {"step_s": free["step_s"], "runs": len(free["step_s_each"]),
                                 "allreduce_compute_s": compute_only_s(free_base) if free_base else None}
        found.append(entry)
    return found


def per_tensor_alone(profile: pm.ModelProfile, network_by_world: dict[int, dict]) -> list[dict[str, Any]]:
    """The model against one allreduce per gradient measured alone on the same network: where a
    per-tensor strategy's step time is missed, this says whether the network's description is at
    fault (missed here too) or the training around the communication (not missed here). Per world
    size, per implementation: measured and modelled seconds (None: not measured)."""
    rows = []
    for world, measured in sorted(network_by_world.items()):
        if measured.get("per_tensor_builtin_s") is None:
            continue
        net = priced_network(measured)
        cells = []
        # our algorithms where they are asked for (as measured: ``implementation`` "ours")
        for key, strategy in (("per_tensor_builtin_s", pm.strategy_of("allreduce")),
                              ("per_tensor_ring_s", replace(pm.strategy_of("ring"), implementation="ours")),
                              ("per_tensor_ring_fp16_s", replace(pm.strategy_of(variants.RING_FP16),
                                                                 implementation="ours"))):
            model = pm.predict_step(profile, world, net, strategy).comm_s
            cells.append([measured[key], model] if measured.get(key) else None)
        rows.append({"world": world, "cells": cells})
    return rows


def per_tensor_alone_of(calibration: dict, network_by_world: dict[int, dict]) -> list[dict[str, Any]]:
    """``per_tensor_alone`` for the calibration's profile."""
    return per_tensor_alone(profile_from_json(calibration["profile"]), network_by_world)
