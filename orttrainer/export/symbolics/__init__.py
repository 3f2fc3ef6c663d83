"""ONNX symbolics for torch ops the TorchScript exporter cannot export, or exports unlike torch.

``exporting()`` registers them with torch's exporter for the duration of one export, so
models using these losses and layers export without any change to user code. Each is
written with ops that onnxruntime-training can differentiate, and matches torch's value
and gradient, also at boundary values (tests/test_rewrites.py, tests/test_boundary_values.py).

One module per kind of op, each with the table of the aten ops it serves (``SYMBOLICS``):
elementwise.py, losses.py, reductions.py, indexing.py and layers.py; _graph.py holds what they
build with.
"""

import contextlib

import torch
from torch.onnx._internal.torchscript_exporter import registration
from torch.onnx._internal.torchscript_exporter import utils as exporter_utils

from ...api.options import MAX_OPSET, MIN_OPSET
from . import elementwise, indexing, layers, losses, reductions
from ._graph import DOMAIN, _bfloat16_in_float32

__all__ = ["DOMAIN", "exporting"]

_SYMBOLICS = {**elementwise.SYMBOLICS, **losses.SYMBOLICS, **reductions.SYMBOLICS, **indexing.SYMBOLICS, **layers.SYMBOLICS}
_OPSETS = range(MIN_OPSET, MAX_OPSET + 1)
# aten ops whose symbolics take bfloat16 inputs as they are: they move values (exact in any type; ONNX Runtime's
# bfloat16 kernels or graph/bfloat16.py run them), or refuse bfloat16 themselves (histc). The others compute in
# float32 between casts (_bfloat16_in_float32).
_GIVEN_BFLOAT16 = {"detach", "index", "index_put", "matrix_H", "mH", "split", "embedding", "one_hot", "channel_shuffle",
                   "diagonal", "diag", "repeat_interleave", "constant_pad_nd", "pad", "histc",
                   *(f"{kind}_pad{dims}d" for kind in ("reflection", "replication") for dims in (1, 2, 3))}  # fmt: skip


def _custom_symbolics() -> dict:
    """{aten op: {opset: custom symbolic}} for orttrainer's ops as torch's registry holds them
    now (None: no entry at all). Reads the registry's private state: torch's public API can
    register and unregister custom symbolics, but not list them."""
    exporter_utils._trigger_symbolic_function_registration()  # torch's own symbolics, otherwise added at the first export
    saved = {}
    for name in _SYMBOLICS:
        group = registration.registry.get_function_group(f"aten::{name}")
        saved[name] = None if group is None else dict(group._functions._overrides)
    return saved


def _restore(saved: dict) -> None:
    """Put back the custom symbolics ``_custom_symbolics`` saved for the opsets orttrainer registered."""
    for name, overrides in saved.items():
        if overrides is None:
            registration.registry._registry.pop(f"aten::{name}", None)  # the entry orttrainer created
            continue
        group = registration.registry.get_function_group(f"aten::{name}")
        for version in _OPSETS:
            if version in overrides:
                group.add_custom(overrides[version], version)
            else:
                group.remove_custom(version)


@contextlib.contextmanager
def exporting():
    """orttrainer's symbolics registered with torch's TorchScript exporter for the exports in
    this block; afterwards torch's registry is as it was.

    orttrainer's symbolic wins over one the user registered for the same aten op, during
    this block only: the trainer's graph has to compute what torch computes (a user's
    symbolic is written for inference elsewhere, e.g. an op of another runtime). The user's
    is registered again on exit. They are registered at every opset orttrainer exports at,
    so that neither torch's symbolics for a later opset nor a user's shadow them.
    """
    saved = _custom_symbolics()
    for name, function in _SYMBOLICS.items():
        function = function if name in _GIVEN_BFLOAT16 else _bfloat16_in_float32(function)
        for version in _OPSETS:
            torch.onnx.register_custom_op_symbolic(f"aten::{name}", function, version)
    try:
        yield
    finally:
        _restore(saved)
