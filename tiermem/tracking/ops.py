"""The aten ops producer tracking sorts: views, random ops, and the recompute
allow-list.

The allow-list (:data:`RECOMPUTABLE_OPS`) holds cheap ops that are
deterministic on CPU and CUDA: pointwise math and activations, casts, views,
layer/RMS/group norm, softmax, concatenation, embedding lookups, and the
random ops whose generator state is captured (:data:`RANDOM_OPS`). Matmuls and
attention are left out on purpose (their cost is what recomputing avoids;
checkpointing covers them). Ops with a mutable schema (in-place, ``out=``) are
never recomputable.
"""

from __future__ import annotations

import torch

__all__ = ["RECOMPUTABLE_OPS", "RANDOM_OPS", "VIEW_OPS"]

_aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


#: Ops that return a view of their first argument (zero FLOPs). ``op`` in
#: :class:`~tiermem.TensorInfo` looks through them to the op that computed the values.
VIEW_OPS = _packets(
    "view", "_unsafe_view", "_reshape_alias", "reshape", "expand", "transpose", "t",
    "permute", "slice", "select", "split", "split_with_sizes", "unsqueeze", "squeeze",
    "unbind", "chunk", "narrow", "as_strided", "alias", "detach", "flatten", "unflatten",
    "view_as_real", "view_as_complex", "diagonal", "unfold")

_VIEW_NAMES = frozenset(p.__name__ for p in VIEW_OPS)

#: Ops that draw random numbers from a generator; recomputed exactly by replaying
#: the generator state captured just before they ran (no device sync).
RANDOM_OPS = _packets("native_dropout", "bernoulli", "rand_like", "randn_like",
                      "randint_like")

_RANDOM_NAMES = frozenset(p.__name__ for p in RANDOM_OPS)

#: Views that take an *absolute* storage offset or raw strides: replaying them
#: on an input restored at another offset or with other strides (a copy) would
#: read other elements, so they are named but never recomputed.
_ABSOLUTE_VIEWS = _packets("as_strided", "_reshape_alias")

#: Cheap, deterministic ops whose outputs the recompute tier may drop.
RECOMPUTABLE_OPS = (VIEW_OPS - _ABSOLUTE_VIEWS) | RANDOM_OPS | _packets(
    # activations and pointwise math
    "relu", "gelu", "silu", "sigmoid", "tanh", "hardtanh", "leaky_relu", "elu", "celu",
    "selu", "softplus", "mish", "hardswish", "hardsigmoid", "glu", "log_sigmoid_forward",
    "exp", "log", "sqrt", "rsqrt", "reciprocal", "neg", "abs", "sin", "cos", "erf", "square",
    "add", "sub", "rsub", "mul", "div", "pow", "maximum", "minimum", "clamp", "clamp_min",
    "clamp_max", "where", "masked_fill", "lt", "le", "gt", "ge", "eq", "ne",
    "logical_not", "logical_and", "logical_or",
    # casts and copies
    "_to_copy", "clone", "contiguous", "cat", "stack",
    # normalisation and softmax (deterministic row-wise reductions)
    "native_layer_norm", "_fused_rms_norm", "native_group_norm", "_softmax", "_safe_softmax",
    "_log_softmax",
    # lookups
    "embedding", "index_select")


class _OpInfo:
    """What producer tracking needs to know of one op overload, worked out once."""

    __slots__ = ("name", "recomputable", "random", "view", "written")

    def __init__(self, func) -> None:
        packet = func.overloadpacket
        self.name = packet.__name__
        self.view = packet in VIEW_OPS
        self.random = packet in RANDOM_OPS
        schema = func._schema
        self.recomputable = packet in RECOMPUTABLE_OPS and not schema.is_mutable
        #: (position, name) of the arguments the op writes to (in-place, out=).
        self.written = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                             if a.alias_info is not None and a.alias_info.is_write)
