"""Cost rules of convolutional networks: convolution forward and backward, batch norm, pooling.

A convolution is a matrix product: each output element is a dot product over in_channels/groups x
kernel elements, 2 FLOPs each. Its backward (`convolution_backward`, one op for both grads) makes the
input grad (the same product transposed) and the weight grad (the same count again) as its output_mask
asks, plus a row sum for the bias: 2x the forward when both grads are made, as for a matmul. Without this
rule the backward counted about one FLOP per element and a ResNet stage's backward was predicted at
1.1-1.5x its forward instead of ~2x (issue 24).

Batch norm is bandwidth-bound: in train mode the forward reads its input twice (statistics, then
normalising) and the backward reads the output grad and the input twice (two reductions, then the
elementwise pass). Pooling reads its input once; a max pool compares kernel-size elements per output.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from .core import Eqn, Var


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(x.aval.shape) if isinstance(x, Var) else ()


def _arg(e: Eqn, index: int, name: str, default: Any) -> Any:
    if len(e.args) > index:
        return e.args[index]
    return dict(e.kwargs).get(name, default)


def _conv_product(out: tuple[int, ...], x: tuple[int, ...], w: tuple[int, ...], transposed: bool) -> int:
    """2 x the multiply-adds of one convolution: a transposed one scatters each input element instead."""
    return 2 * math.prod(x if transposed else out) * math.prod(w[1:])


def conv_flops(e: Eqn) -> int:
    """aten.convolution / _convolution / conv1d-3d: (input, weight, bias, stride, padding, dilation,
    transposed, ...); the conv2d family has no `transposed` (conv_transpose ops are their own names)."""
    generic = e.op.split(".")[1] in ("convolution", "_convolution")
    transposed = bool(_arg(e, 6, "transposed", False)) if generic else False
    out = _shape(e.outputs[0])
    return _conv_product(out, _shape(e.args[0]), _shape(e.args[1]), transposed) + (
        math.prod(out) if _arg(e, 2, "bias", None) is not None else 0)


def conv_transpose_flops(e: Eqn) -> int:
    return _conv_product(_shape(e.outputs[0]), _shape(e.args[0]), _shape(e.args[1]), True)


def conv_backward_flops(e: Eqn) -> int:
    """aten.convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation,
    transposed, output_padding, groups, output_mask)."""
    grad_out, x, w = (_shape(e.args[i]) for i in range(3))
    transposed = bool(_arg(e, 7, "transposed", False))
    mask = list(_arg(e, 10, "output_mask", (True, True, True)))
    one = _conv_product(grad_out, x, w, transposed)
    return one * (int(bool(mask[0])) + int(bool(mask[1]))) + (math.prod(grad_out) if mask[2] else 0)


def _numel(x: Any) -> int:
    return math.prod(_shape(x))


def _per_element(k: int, index: int = 0) -> Callable[[Eqn], int]:
    return lambda e: k * _numel(e.args[index])


def _training(e: Eqn, index: int) -> bool:
    return bool(_arg(e, index, "training", True))


def _bn_flops(e: Eqn, training_at: int) -> int:
    """About 5 per element in train mode (two reductions, then scale and shift), 2 in eval mode."""
    return (5 if _training(e, training_at) else 2) * _numel(e.args[0])


def _kernel_area(e: Eqn) -> int:
    k = _arg(e, 1, "kernel_size", (1,))
    return math.prod(k) if isinstance(k, (list, tuple)) else int(k) ** 2


def _pool_flops(e: Eqn) -> int:
    return _numel(e.outputs[0]) * _kernel_area(e)


CONV_RULES: dict[str, Callable[[Eqn], int]] = {
    "convolution": conv_flops, "_convolution": conv_flops, "conv1d": conv_flops, "conv2d": conv_flops,
    "conv3d": conv_flops, "conv_transpose1d": conv_transpose_flops, "conv_transpose2d": conv_transpose_flops,
    "conv_transpose3d": conv_transpose_flops, "convolution_backward": conv_backward_flops,
    "batch_norm": lambda e: _bn_flops(e, 5), "native_batch_norm": lambda e: _bn_flops(e, 5),
    "_native_batch_norm_legit": lambda e: _bn_flops(e, 3 if e.op.endswith("no_stats") else 5),
    "_native_batch_norm_legit_functional": lambda e: _bn_flops(e, 5),
    "_native_batch_norm_legit_no_training": _per_element(2),
    "native_batch_norm_backward": _per_element(8, 1), "var_mean": _per_element(3),
    "max_pool2d": _pool_flops, "max_pool2d_with_indices": _pool_flops, "avg_pool2d": _pool_flops,
    "max_pool2d_with_indices_backward": _per_element(1, 1), "avg_pool2d_backward": _per_element(1, 1),
    "adaptive_avg_pool2d": _per_element(1), "_adaptive_avg_pool2d": _per_element(1),
}

# extra passes over an input beyond reading it once: op -> ((arg index, passes), ...); `training` at arg index
_TWICE_TRAINING = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                   "_native_batch_norm_legit_functional": 5}


def extra_read_bytes(base: str, e: Eqn) -> int:
    """Bytes read beyond each input once: batch norm's second pass (see the module docstring)."""
    if base in _TWICE_TRAINING and _training(e, 3 if e.op.endswith("no_stats") else _TWICE_TRAINING[base]):
        return _nbytes(e.args[0])
    if base == "native_batch_norm_backward" and _training(e, 7):
        return _nbytes(e.args[0]) + _nbytes(e.args[1])
    return 0


def _nbytes(x: Any) -> int:
    return x.aval.nbytes if isinstance(x, Var) else 0
