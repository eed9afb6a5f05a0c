"""Training: what a user needs around the step: modules as pure functions, optimizers, checkpoints, precision.

Owns: `functionalize` of an nn.Module (`module`), the pure optimizers over local leaves (`optim`),
sharded checkpoints that verify themselves (`checkpoint`, with `checkpoint_manifest` and
`checkpoint_files`), and mixed precision as a wrapper of the loss function (`precision`).

May import: `ir` and engine's shared leaves (`engine.errors`, `engine.names`, `engine.logs`,
`engine.version`).

Must not import: `engine.planning`, `engine.execution`, `engine.parallelize` or `engine.testing`: each
of these works on plain pytrees of tensors and is usable without a pipeline.
"""
