"""The GPU check as one command: its options, the budget over the items, the report file and the
exit status (what each line and the exit status mean: the package's docstring).

Time: every item has a nominal limit (``items.py``); an item's limit is its share of what is left
of the budget (default 180 s), in proportion to the nominal limits of the items still to run here,
and never more than its nominal limit, so the whole check ends within the budget whatever the GPU
count. An item given less than ``MIN_ITEM_S`` is SKIP (it could not even start CUDA and NCCL).

The report goes to ``--out`` (the log beside it): name a file in a folder of its own, ``--out
DIR/gpu_check.md``, so that a runner that brings back only an output folder brings both back (the
default, ``results/runs/gpu_check/gpu_check.md`` in the checkout, is for a run by hand; ``--report``
writes the committed ``results/gpu_check.md``). It is rewritten before
every item, so a check cut short (by its budget, a hang it could not recover from, Ctrl-C) still
leaves its file. Options are checked before anything runs, and a bad one is refused in one line
with exit status 2, leaving no report and no log.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import math
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from gradientflow_repro import REPO, logs
from gradientflow_repro.gpu_check.devices import gpu_gate
from gradientflow_repro.gpu_check.environment import gpu_environment, gpu_summary, versions_summary
from gradientflow_repro.gpu_check.hooks import limit_scale, test_hooks_problem, test_hooks_set
from gradientflow_repro.gpu_check.items import ITEM_BY_NAME, ITEMS
from gradientflow_repro.gpu_check.processes import run_here, run_in_child
from gradientflow_repro.gpu_check.results import Item, Result
from gradientflow_repro.provenance import git_commit

DESCRIPTION = "The GPU check: whether this project's CUDA path works on this machine, item by item."
DEFAULT_OUT = REPO / "results" / "runs" / "gpu_check" / "gpu_check.md"  # a run by hand
REPORT_OUT = REPO / "results" / "gpu_check.md"  # --report: the committed one
BUDGET_S = 180.0  # the whole check: 3 minutes even when items hang
MIN_ITEM_S = 15.0  # an item given less than this is SKIP: it could not even start CUDA and NCCL


def item_limit(item: Item, later: list[Item], left_s: float) -> float:
    """The limit of ``item`` when ``left_s`` of the budget is left and ``later`` will run after it:
    its nominal limit, or its share of what is left in proportion to the nominal limits still to
    run, whichever is less. Summed over the items this never exceeds the budget."""
    share = left_s * item.timeout_s / (item.timeout_s + sum(other.timeout_s for other in later))
    return min(item.timeout_s, share)


def header_lines(command: str) -> list[str]:
    """The report's header: when, where, on what, from which commit, by which command."""
    facts = gpu_environment()
    lines = [f"- date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
             f"- host: {socket.gethostname()}",
             f"- GPUs: {gpu_summary(facts)}",
             f"- versions: {versions_summary(facts)}, Python {facts['python']}",
             f"- git commit: {git_commit() or 'unknown'}",
             f"- command: `{command}`"]
    if test_hooks_set():
        lines.append(f"- TEST HOOKS SET (not a check of this machine): {test_hooks_set()}")
    return lines


def write_report(path: Path, header: list[str], results: list[Result], state: str,
                 limits: Optional[dict[str, float]] = None) -> None:
    """Write the report (through a temporary file, so a reader never sees half of one): the header,
    ``state``, the lines so far and the items with their limits."""
    limits = limits or {}

    def limit(item: Item) -> str:
        if not item.gpus:
            return "in the main process"
        return f"{limits[item.name]:.0f} s" if item.name in limits else f"{item.timeout_s:.0f} s nominal"

    lines = ["# GPU check", "", *header, f"- result: {state}", "", "```text",
             *(result.line() for result in results), "```", "", "Items (each with its own time limit):", "",
             *(f"- `{item.name}` ({limit(item)}): {item.doc}" for item in ITEMS), ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(lines))
    partial.replace(path)


def tally(results: list[Result]) -> str:
    """How many lines are PASS, FAIL and SKIP."""
    counts = collections.Counter(result.status for result in results)
    return ", ".join(f"{counts[s]} {s}" for s in ("PASS", "FAIL", "SKIP"))


class BadOption(Exception):
    """An option the check refuses before running anything (one line, exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override] - one line, not the usage
        raise BadOption(message)


def log_path(out: Path) -> Path:
    """The log beside the report: the children's full output."""
    return out.with_name(out.name + ".log") if out.suffix in ("", ".log") else out.with_suffix(".log")


def check_writable(path: Path, what: str) -> None:
    """Refuse, naming ``what``, a path that is a directory or cannot be written. Its directory is
    created; the file is opened for appending (what a write would need) and left as it was."""
    if path.is_dir():
        raise BadOption(f"{what} {path} is a directory: name a file (e.g. {path / 'gpu_check.md'})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists()
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as error:
        raise BadOption(f"{what} {path} cannot be written: {error.strerror or error}") from None


def parse_options(argv: Optional[list[str]]) -> argparse.Namespace:
    """The options, or BadOption naming the first bad one (nothing has run yet)."""
    parser = _Parser(prog="gradientflow_repro.gpu_check", description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="report file, e.g. DIR/gpu_check.md (default "
                        "results/runs/gpu_check/gpu_check.md in the checkout); the children's output goes to the "
                        ".log beside it")
    parser.add_argument("--report", action="store_true", help="write the committed results/gpu_check.md")
    parser.add_argument("--only", nargs="+", metavar="ITEM",
                        help=f"run only these items, of: {', '.join(ITEM_BY_NAME)}")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help=f"the whole check's time limit (default {BUDGET_S:.0f} s): each item gets its "
                             "share of what is left; items past it are SKIP")
    parser.add_argument("--strict", action="store_true", help="exit status 1 on a SKIP too (by default only a "
                        "FAIL makes it non-zero)")
    args = parser.parse_args(argv)
    if args.report and args.out is not None:
        raise BadOption("--report writes results/gpu_check.md: give --out or --report, not both")
    args.out = args.out or (REPORT_OUT if args.report else DEFAULT_OUT)
    unknown = [name for name in args.only or [] if name not in ITEM_BY_NAME]
    if unknown:
        raise BadOption(f"--only: unknown item(s) {', '.join(unknown)}; the items are {', '.join(ITEM_BY_NAME)}")
    if not (math.isfinite(args.budget_s) and args.budget_s >= MIN_ITEM_S):
        raise BadOption(f"--budget-s {args.budget_s:g}: give at least {MIN_ITEM_S:.0f} s")
    problem = test_hooks_problem()
    if problem:
        raise BadOption(problem)
    check_writable(args.out, "--out")
    check_writable(log_path(args.out), "the log beside --out,")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    """Run the chosen items in order, each within its share of the budget; write the report; return
    the exit status (the package's docstring says what each value means). The result lines, the
    closing line and a refusal are this command's output, printed as the report has them; what the
    library logs while an item runs in this process is logged with the prefix ``gpu_check``."""
    try:
        args = parse_options(argv)
    except BadOption as error:
        print(f"gpu_check: error: {error}", file=sys.stderr, flush=True)
        return 2
    logs.configure("gpu_check")
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(
        [sys.executable, "-m", "gradientflow_repro.gpu_check", *argv])
    started = time.monotonic()
    header = header_lines(command)
    results: list[Result] = []
    limits: dict[str, float] = {}
    budget_s = args.budget_s * limit_scale()  # (the test device's stand-ins: scaled with the limits)
    chosen = [dataclasses.replace(item, timeout_s=item.timeout_s * limit_scale())
              for item in ITEMS if not args.only or item.name in args.only]
    gates = {item.name: gpu_gate(item.gpus, item.on_test_cpu) for item in chosen}

    def emit(result: Result) -> None:
        print(result.line(), flush=True)
        results.append(result)

    with open(log_path(args.out), "w") as log_file:
        def log(line: str) -> None:
            log_file.write(line + "\n")
            log_file.flush()

        for index, item in enumerate(chosen):
            write_report(args.out, header, results, f"running {item.name} ({tally(results)} so far)", limits)
            left = budget_s - (time.monotonic() - started)
            later = [other for other in chosen[index + 1:] if other.gpus and not gates[other.name]]
            limit = item_limit(item, later, left) if item.gpus else min(item.timeout_s, left)
            reason = gates[item.name] or (None if limit >= MIN_ITEM_S else (
                f"the check's {budget_s:.0f} s budget is spent ({left:.0f} s left)"))
            try:
                if reason:
                    emit(Result("SKIP", item.name, reason))
                elif item.gpus == 0:
                    run_here(item, emit)
                else:
                    limits[item.name] = limit
                    run_in_child(dataclasses.replace(item, timeout_s=limit), emit, log)
            except KeyboardInterrupt:
                write_report(args.out, header, results, f"interrupted during {item.name} ({tally(results)})", limits)
                print(f"interrupted during {item.name}; partial report: {args.out}", flush=True)
                return 130
    failed = any(result.status == "FAIL" for result in results)
    skipped = [result.item for result in results if result.status == "SKIP"]
    status = 1 if failed or (args.strict and skipped) else 0
    state = (f"{tally(results)} in {time.monotonic() - started:.0f} s; exit status {status}"
             + (f"; not checked here: {', '.join(skipped)}" if skipped else ""))
    write_report(args.out, header, results, state, limits)
    print(f"{state}; report: {args.out}", flush=True)
    return status
