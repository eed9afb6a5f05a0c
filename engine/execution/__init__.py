"""Execution: a Plan's programs assembled, emitted for this rank, and run over a transport.

Owns: the instruction set and Program data (`program`), assembly of a plan into stage programs and
this rank's program (`assemble`, the one function the Step, the in-process runner, `engine.testing`
and the GPU benchmark call), program emission from a lowered table (`emit`), which rank runs which
pipeline position and microbatches with replicas per stage (`routing`), the executor with its
dispatch table (`executor`), transports (torch.distributed P2P, the in-process hub: `transport`), the
launch and bootstrap of a world (`launch`), the Step (`step`) and the checks of what it is given
(`inputs`: each rank's params and batch against the plan, and fingerprints across ranks), in-process
runs of every rank (`inprocess`), execution spans and their `schedules.Timeline` (`spans`; the writers
are in `schedules`) and program replay for memory (`footprint`).

May import: `ir`, `schedules`, `engine.planning` (the Plan and the artefacts it carries), and
engine's shared leaves (`engine.errors`, `engine.names`, `engine.logs`, `engine.progress`,
`engine.setup_clock`, `engine.units`).

Must not import: `engine.training`, `engine.parallelize`, `engine.report` or `engine.testing`.
"""
