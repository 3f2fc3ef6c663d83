"""Which graph serves which batch of a torch module: one graph per batch shape signature where the trace needs it.

The TorchScript exporter traces the module at one batch, and a trace can hold sizes of that
batch (the Reshape shapes of seq-first attention, the branch a Python ``if`` on a shape took):
right at that batch's shapes, wrong at others. It always holds what the step's constants chose
(``return_loss=True``, ``output_hidden_states``: keywords forward gets as Python values). So the
first batch of every new signature (the inputs' names, shapes and dtypes, and the constants'
names, types and values) is exported again and compared with the graphs already built,
without their weights: the same graph (a trace generic in those shapes: checked, not
assumed) serves the new signature too; another graph is built over the same weight tensors
(``build.from_torch(..., shared=)``), so one optimizer, one set of gradient buffers, BatchNorm
statistics, scales and checkpoint serve all graphs. At most ``MAX_GRAPHS`` built graphs are
kept; the least recently used is dropped with its sessions, and a warning says once that the
shapes keep changing.

A trace that froze values of its batch (``exporter_warnings._FROZEN_VALUE``: a tensor turned into a Python
number or bool) is right when those values come from shapes or constants, wrong when they come
from the data. The export refuses a value it traces back to the data or the weights
(``exporter_warnings.ValuesTurnedPython``); for the others (an iteration over a tensor, a ``torch.tensor``
made in forward) the first batch of the signature with other values is exported once more and
must give the same graph (``exporter_warnings.refuse_data_dependent_trace``).
"""

import collections
import copy
import warnings

import onnx
import torch

from . import build
from ..export import exporter_warnings

MAX_GRAPHS = 8  # built graphs kept (each holds a training and an eval session)


class _Graph:
    """A built graph, the structure it is recognised by (``_structure``) and the model_desc the trainer
    shows while it serves (``_any_size`` of an inferred one)."""

    def __init__(self, runtime, structure: bytes, desc):
        self.runtime, self.structure, self.desc = runtime, structure, desc


class _ValuesCheck:
    """A signature whose trace froze values of its first batch: at the first batch of other values,
    one more export (with the signature's constants), which must give the same graph."""

    def __init__(self, exported, structure: bytes):
        self.locations, self.first_inputs, self.structure = exported.frozen_values, exported.inputs, structure
        self.constants = exported.constants

    def done(self, source, input_names, inputs) -> bool:
        """Whether the check ran (then the signature needs no other); ExportError if the graph differs."""
        if all(torch.equal(first, now.to(first.device)) for first, now in zip(self.first_inputs, inputs)):
            return False
        again = source.export(input_names, inputs, self.constants, compared_only=True)
        exporter_warnings.refuse_data_dependent_trace(self.structure, _structure(again.onnx_model), self.locations)
        return True


class GraphCache:
    """The graphs of one trainer's torch module, by batch signature, least recently used first.

    ``model_desc`` is what the trainer accepts and returns: the user's, or the one inferred from the
    batch of the graph that served the last batch, with every size free (the module decides which
    shapes it accepts; constants may change the outputs). ``built`` counts the graphs built so far,
    dropped ones included.
    """

    def __init__(self, model, loss_fn, options, model_desc, device, providers, data_parallel):
        self._given = (model, loss_fn, options, model_desc)
        self._where = (device, providers, data_parallel)
        self._source = None  # build.TorchSource, made at the first batch
        self._graphs = collections.OrderedDict()  # structure -> _Graph
        self._signatures = {}  # signature -> [_Graph, _ValuesCheck or None]
        self.model_desc = None
        self.built = 0
        self._warned = False

    def runtime_for(self, input_names, inputs, constants) -> build.Runtime:
        """The Runtime of this batch's signature; the first batch of a new one exports (and maybe builds)."""
        signature = _signature(input_names, inputs, constants)
        entry = self._signatures.get(signature)
        if entry is None:
            entry = self._signatures[signature] = self._add(input_names, inputs, constants)
        elif entry[1] is not None and entry[1].done(self._source, input_names, inputs):
            entry[1] = None
        self._graphs.move_to_end(entry[0].structure)
        self.model_desc = entry[0].desc
        return entry[0].runtime

    def _add(self, input_names, inputs, constants) -> list:
        """Export at this batch and constants; reuse the built graph it equals, or build one over the same weights."""
        model, loss_fn, options, model_desc = self._given
        if self._source is None:
            self._source = build.TorchSource(model, loss_fn, input_names, options, model_desc, self._where[0])
        shared = next(reversed(self._graphs.values())).runtime if self._graphs else None
        exported = self._source.export(input_names, inputs, constants)
        structure = _structure(exported.onnx_model)
        graph = self._graphs.get(structure)
        if graph is None:
            runtime = build.from_torch(self._source, exported, *self._where, shared=shared)
            runtime.check_export()
            desc = runtime.model_desc if model_desc is not None else _any_size(runtime.model_desc)
            graph = self._graphs[structure] = _Graph(runtime, structure, desc)
            self.built += 1
            self._drop_least_recently_used()
        return [graph, _ValuesCheck(exported, structure) if exported.frozen_values else None]

    def _drop_least_recently_used(self) -> None:
        if len(self._graphs) <= MAX_GRAPHS:
            return
        while len(self._graphs) > MAX_GRAPHS:
            _, dropped = self._graphs.popitem(last=False)
            self._signatures = {key: entry for key, entry in self._signatures.items() if entry[0] is not dropped}
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"orttrainer: the batch shapes keep changing: {self.built} graphs built so far (an export and a graph "
                f"build each), at most {MAX_GRAPHS} kept; pad batches to a few fixed lengths (e.g. a tokenizer's "
                "pad_to_multiple_of=8) so that fewer graphs are built"
            )


def _signature(input_names, inputs, constants) -> tuple:
    """What decides the graph of a batch: each input's name, shape and dtype; each constant's name, type
    and repr (True, 1 and 1.0 are equal in Python but not to the trace; repr makes a NaN equal itself)."""
    tensors = tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in zip(input_names, inputs))
    return tensors, tuple(sorted((name, type(value), repr(value)) for name, value in constants.items()))


def _structure(model: onnx.ModelProto) -> bytes:
    """The exported graph, which holds no values of the module's weights and buffers (they change as training goes
    on; they are graph inputs): nodes, constants, declared inputs and outputs, the weights' types and shapes."""
    return model.graph.SerializeToString()


def _any_size(desc):
    """A copy of an inferred model_desc with every fixed size made symbolic ('<name>_dim<i>')."""
    free = copy.deepcopy(desc)
    for entries in (free.inputs, free.outputs):
        for index, entry in enumerate(entries):
            shape = [dim if isinstance(dim, str) else f"{entry.name}_dim{axis}" for axis, dim in enumerate(entry.shape)]
            entries[index] = entry._replace(shape=shape)
    return free
