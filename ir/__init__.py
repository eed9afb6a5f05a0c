"""fnpipe's functional IR: trace pure loss functions, print, check, run, cost, slice, and differentiate stages."""
from __future__ import annotations

from . import random
from .autodiff import Part, StageAD, recomputable, stage_autodiff
from .batch_rows import MixedRows, batch_rows, mixed_rows
from .check import check
from .compile import compile_graph, to_fx
from .dropout import keyed_dropout, row_keys
from .core import AbstractValue, Eqn, Graph, Literal, Var
from .deferred import Deferred, deferred, deferred_of
from .device import require_runnable
from .costs import EqnCost, eqn_cost, format_costs, graph_costs
from .errors import IRError, TraceError
from .evaluate import evaluate, interpret
from .liveness import RunBytes, output_inputs, output_storage, output_views, run_bytes
from .loss import aux_names, check_loss, returns_aux
from .printer import format_graph, program_digest
from .slicing import Stage, slice_graph, split
from .trace import TensorSpec, trace

__all__ = [
    "AbstractValue", "Deferred", "Eqn", "EqnCost", "Graph", "IRError", "Literal", "MixedRows", "Part", "RunBytes", "Stage", "StageAD", "TensorSpec",
    "TraceError", "Var", "aux_names", "batch_rows", "check", "check_loss", "compile_graph", "deferred", "deferred_of", "eqn_cost", "evaluate", "format_costs", "format_graph",
    "graph_costs", "interpret", "keyed_dropout", "mixed_rows", "program_digest", "random", "row_keys", "recomputable", "require_runnable", "returns_aux", "output_inputs", "output_storage", "output_views", "run_bytes", "slice_graph", "split", "stage_autodiff", "to_fx", "trace",
]
