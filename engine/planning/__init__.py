"""Planning: from a traced graph to a Plan (cuts, layout, schedule, predictions), on one process.

Owns: the cost model of ops and links (`op_costs`, `devices`, `calibration`), model blocks and their
costs (`blocks`), stage costs from stage autodiff (`stage_costs`), the memory model (`memory`), the
exact splitter (`split`), the candidate layouts (`layout`) and unequal replicas per stage (`replicas`),
the search that picks one (`search`, whose
`plan` is `engine.plan`), the Plan data itself (`plan`), the stage programs it builds once and hands on
(`artifacts`), and the plan cache (`cache`).

May import: `ir`, `schedules`, and engine's shared leaves (`engine.errors`, `engine.names`,
`engine.logs`, `engine.progress`, `engine.setup_clock`, `engine.units`, `engine.version`).

Must not import: `engine.execution`, `engine.training`, `engine.parallelize`, `engine.report` or
`engine.testing`. A laptop plans for a cluster without a process group or a device. Calibration is the
one place that runs programs, and it is handed the runtime's program compiler by `engine.parallelize`
(`calibrate_training(..., compile_program=...)`); `tests/engine/test_layout.py` holds the rule.
"""
