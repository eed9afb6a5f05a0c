"""Logging for the engine: one `logging` logger per module, levels from environment variables.

Loggers (all children of `engine`, so the standard `logging` API configures them too):

    engine.plan        the planner: the chosen plan as a stage table (INFO), rejected layouts (DEBUG)
    engine.split       the splitter's decisions: stages that recompute activations (INFO)
    engine.runtime     step construction: this rank's program listing (INFO)
    engine.launch      bootstrap: rank, world size, device (INFO)
    engine.calibrate   op timing on the device (DEBUG: ops that could not be timed)
    engine.plancache   plan cache hits and misses, and why an entry was not used (INFO)
    engine.report      predicted-vs-measured tables logged by engine.report.log_compare (INFO)
    engine.checkpoint  checkpoints: old manifests loaded without shard digests, directories `latest` skips (WARNING)

Environment variables (read once, when `engine` is imported; `configure()` reads them again):

    ENGINE_LOG_LEVEL=INFO          level of every engine logger (DEBUG, INFO, WARNING, ERROR, CRITICAL
                                   or a number); unset: the engine's records go to your logging setup
                                   (Python's default shows WARNING and above)
    ENGINE_LOG_LEVEL_<MODULE>=...  level of one logger, overriding ENGINE_LOG_LEVEL for it: <MODULE>
                                   is the part after `engine.` in capitals (ENGINE_LOG_LEVEL_SPLIT,
                                   ENGINE_LOG_LEVEL_RUNTIME, ENGINE_LOG_LEVEL_PLAN, ENGINE_LOG_LEVEL_LAUNCH,
                                   ENGINE_LOG_LEVEL_CALIBRATE, ENGINE_LOG_LEVEL_PLANCACHE,
                                   ENGINE_LOG_LEVEL_REPORT, ENGINE_LOG_LEVEL_CHECKPOINT), as RaNNC's
                                   RANNC_* variables do
    ENGINE_LOG_FORMAT=...          a `logging.Formatter` format for the engine's stderr handler; default
                                   `[%(asctime)s rank %(rank)s %(name)s %(levelname)s] %(message)s`
    ENGINE_PROGRESS=0|1            progress bars for planning and calibration past 2 s (engine.progress):
                                   0 never, 1 on every rank; unset: on rank 0 only

When any ENGINE_LOG_LEVEL* variable is set, the `engine` logger gets its own stderr handler and stops
propagating to the root logger, so the engine's records are printed once whether or not the program
configured logging. `%(rank)s` is the launcher's rank (RANK, OMPI_COMM_WORLD_RANK, PMI_RANK), `-` alone.
A value that is not a level is ignored with a warning naming the variable.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Mapping

ROOT = "engine"
PREFIX = "ENGINE_LOG_LEVEL"
MODULES = ("plan", "split", "runtime", "launch", "calibrate", "plancache", "report", "checkpoint")
DEFAULT_FORMAT = "[%(asctime)s rank %(rank)s %(name)s %(levelname)s] %(message)s"
RANK_ENV = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


class _RankFilter(logging.Filter):
    def __init__(self, rank: str) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


class _EngineHandler(logging.StreamHandler):
    """The handler `configure` installs (so a second call replaces it instead of adding another)."""


def _level(name: str, value: str) -> int | None:
    text = value.strip().upper()
    if text.lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text)
    if isinstance(level, int):
        return level
    warnings.warn(f"{name}={value!r} is not a log level; use DEBUG, INFO, WARNING, ERROR, CRITICAL or a number "
                  "(ignored)", stacklevel=3)
    return None


def levels(env: Mapping[str, str]) -> dict[str, int]:
    """Logger name -> level from ENGINE_LOG_LEVEL and ENGINE_LOG_LEVEL_<MODULE> in `env`."""
    out: dict[str, int] = {}
    if env.get(PREFIX):
        level = _level(PREFIX, env[PREFIX])
        if level is not None:
            out[ROOT] = level
    for key in sorted(env):
        if not key.startswith(PREFIX + "_") or not env[key]:
            continue
        module = key[len(PREFIX) + 1:].lower()
        if module not in MODULES:
            warnings.warn(f"{key}: no logger engine.{module}; known: "
                          f"{', '.join(f'{PREFIX}_{m.upper()}' for m in MODULES)}", stacklevel=3)
        level = _level(key, env[key])
        if level is not None:
            out[f"{ROOT}.{module}"] = level
    return out


def _rank(env: Mapping[str, str]) -> str:
    return next((env[k] for k in RANK_ENV if env.get(k)), "-")


def configure(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """Apply the ENGINE_LOG_* variables of `env` (default os.environ); returns the levels set."""
    env = os.environ if env is None else env
    root = logging.getLogger(ROOT)
    ours = [h for h in root.handlers if isinstance(h, _EngineHandler)]
    for h in ours:
        root.removeHandler(h)
    if ours:  # undo a previous configure
        root.propagate = True
    found = levels(env)
    if not found:
        return found
    for name in (ROOT, *(f"{ROOT}.{m}" for m in MODULES)):
        logging.getLogger(name).setLevel(found.get(name, logging.NOTSET))
    for name, level in found.items():
        logging.getLogger(name).setLevel(level)
    if ROOT not in found:  # only per-module levels: the others still show warnings
        root.setLevel(logging.WARNING)
    handler = _EngineHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(env.get("ENGINE_LOG_FORMAT") or DEFAULT_FORMAT))
    handler.addFilter(_RankFilter(_rank(env)))
    root.addHandler(handler)
    root.propagate = False
    return found


configure()
