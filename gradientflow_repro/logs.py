"""The library's one logging setup: loggers under ``gradientflow_repro``, one formatter with the prefix.

Every module logs through ``logging.getLogger(__name__)``; nothing in the library prints. An entry
point (``train.py``, a script, a benchmark) calls ``configure`` once, which puts one handler on the
package's logger with ``PrefixFormatter``:

- information: ``[PREFIX] message`` on stdout (the run's first lines, its progress), where PREFIX
  names the run (``experiment/run``) and, on every rank but 0, the rank;
- warnings: ``[PREFIX] warning: message`` on stdout;
- errors: ``error: message`` on stderr (one line a user or a requeue script reads).

Only rank 0 says what the run does; other ranks log warnings and errors only, so that 512 ranks do
not repeat each line. The handler does not propagate to the root logger, which Hydra configures with
its own format (time and logger name on every line): the run's lines stay short and the same with or
without Hydra. Without ``configure`` (the library used from other code) records go where that code's
logging sends them.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, TextIO

PACKAGE = "gradientflow_repro"


class PrefixFormatter(logging.Formatter):
    """``[prefix] message`` (``[prefix] warning: message`` for warnings), ``error: message`` for errors."""

    def __init__(self, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.ERROR:
            return f"error: {message}"
        head = f"[{self.prefix}] " if self.prefix else ""
        return f"{head}warning: {message}" if record.levelno >= logging.WARNING else head + message


class _ByLevel(logging.Handler):
    """Errors to ``err``, the rest to ``out``, each flushed as written (logs are read while a run runs)."""

    def __init__(self, out: Optional[TextIO] = None, err: Optional[TextIO] = None) -> None:
        super().__init__()
        self.out, self.err = out, err

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = (self.err or sys.stderr) if record.levelno >= logging.ERROR else (self.out or sys.stdout)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a failed record never raises
            self.handleError(record)


def configure(prefix: str = "", rank: int = 0, out: Optional[TextIO] = None,
              err: Optional[TextIO] = None) -> logging.Logger:
    """The package's logger with one handler formatting with ``prefix`` (and, off rank 0, the rank):
    information on rank 0 only, warnings and errors on every rank. Called again, it replaces the
    handler (a run names itself once its run name is known). ``out``/``err``: streams (None: the
    process's own at each record, so that a test's captured streams see them)."""
    logger = logging.getLogger(PACKAGE)
    for handler in [h for h in logger.handlers if isinstance(h, _ByLevel)]:
        logger.removeHandler(handler)
    handler = _ByLevel(out, err)
    handler.setFormatter(PrefixFormatter(prefix if not rank else f"{prefix} rank {rank}".strip()))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def set_prefix(prefix: str, rank: int = 0) -> None:
    """Rename the prefix of the configured handler (``configure`` with the same streams)."""
    logger = logging.getLogger(PACKAGE)
    handlers = [h for h in logger.handlers if isinstance(h, _ByLevel)]
    configure(prefix, rank, handlers[0].out if handlers else None, handlers[0].err if handlers else None)
