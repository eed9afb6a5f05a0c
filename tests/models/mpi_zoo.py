"""Run under mpirun: one zoo family per architecture on the real runtime (gloo), against torch.func.grad.

    mpirun -n 2 python tests/models/mpi_zoo.py gpt2 bert t5 vit cnn llama
Prints `OK rank <r> <case> <max rel err>` or `FAIL rank <r> <case> <error>` per case; a refused family
(a TraceError, raised alike on every rank before any communication) is a FAIL line, not an abort.
"""
from __future__ import annotations

import faulthandler
import sys

import engine
from engine.testing import assert_parallel_equivalent
from tests.models.zoo import FAMILIES, FLOAT32_LOSS

#: (name, family, dropout, layout): the decoder families keyed-dropout too, and one case with dp = 2
CASES = {
    "gpt2": [("gpt2-1f1b", False, dict(schedule="1f1b", stages=2)),
             ("gpt2-dropout-zbv", True, dict(schedule="zbv", stages=4)),
             ("gpt2-dropout-dp2", True, dict(schedule="gpipe", stages=1, dp=2))],
    "llama": [("llama-zb-h1", False, dict(schedule="zb-h1", stages=2)),
              ("llama-dropout-zbv", True, dict(schedule="zbv", stages=4))],
    "bert": [("bert-zbv", False, dict(schedule="zbv", stages=4)),
             ("bert-dropout-1f1b", True, dict(schedule="1f1b", stages=2))],
    "t5": [("t5-1f1b", False, dict(schedule="1f1b", stages=2))],
    "vit": [("vit-dropout-interleaved", True, dict(schedule="interleaved-1f1b", stages=4, stages_per_rank=2))],
    "cnn": [("cnn-zb-h1", False, dict(schedule="zb-h1", stages=2))],
}


def main(families: list[str]) -> int:
    faulthandler.dump_traceback_later(300, exit=True)
    rank = engine.init().rank
    for family in families:
        for name, dropout, layout in CASES[family]:
            try:
                rtol = 1e-6 if family in FLOAT32_LOSS else 1e-10
                result = assert_parallel_equivalent(FAMILIES[family](dropout=dropout), rtol=rtol, atol=1e-12,
                                                    microbatches=4, **layout)
                print(f"OK rank {rank} {name} {result.max_rel_error:.2e}", flush=True)
            except Exception as exc:  # noqa: BLE001 -- reported per case; every rank raises alike
                print(f"FAIL rank {rank} {name} {type(exc).__name__}: {str(exc).splitlines()[0][:300]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
