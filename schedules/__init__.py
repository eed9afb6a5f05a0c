"""Pipeline schedules as plain data: actions, tables, registry, lowering, simulation, timelines."""

from __future__ import annotations

from schedules.action import (
    BW,
    COMM_KINDS,
    COMPUTE_KINDS,
    KINDS,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    W,
)
from schedules.costs import Costs
from schedules.dualpipev import dualpipev, overlapped_pairs
from schedules.errors import ScheduleError
from schedules.gpipe import gpipe
from schedules.from_costs import build_from_costs
from schedules.interleaved import interleaved_1f1b
from schedules.interleaved_zb import interleaved_zb
from schedules.looped_bfs import looped_bfs
from schedules.lower import lower
from schedules.one_f_one_b import one_f_one_b
from schedules.perfetto import save_perfetto, to_perfetto
from schedules.png import save_png
from schedules.registry import ScheduleFn, get, names, register
from schedules.render import render_ascii
from schedules.simulate import Simulation, simulate
from schedules.table import Table
from schedules.table_io import load_table, save_table
from schedules.timeline import Bar, Timeline, as_timeline
from schedules.validate import validate
from schedules.zb_h1 import zb_h1
from schedules.zbv import zbv

__all__ = [
    "B", "BW", "COMM_KINDS", "COMPUTE_KINDS", "F", "KINDS", "RECV_B", "RECV_F", "SEND_B",
    "SEND_F", "W",
    "Action", "Bar", "Costs", "ScheduleError", "ScheduleFn", "Simulation", "Table", "Timeline",
    "as_timeline", "build_from_costs", "dualpipev", "get", "gpipe", "interleaved_1f1b",
    "interleaved_zb", "load_table", "looped_bfs", "lower", "names", "one_f_one_b", "overlapped_pairs", "register", "render_ascii", "save_perfetto", "save_png", "save_table",
    "simulate", "to_perfetto", "validate", "zb_h1", "zbv",
]
