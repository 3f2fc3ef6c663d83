"""Which graph serves which batch of a torch module: one graph for every batch shape its trace is generic in.

The TorchScript exporter traces the module at one batch. The trace declares dynamic the batch dimension of every
input, every axis of integer and bool inputs (token ids, masks, labels: padded lengths) and the height and width of
images (float inputs of 4 dims or more; model_desc.free_axes), and it can hold sizes of its batch: in constants (the Reshape shapes of seq-first attention, a ``len()``), or in the
branch a Python decision on a size took (``if q_length > 1:``). It always holds what the step's constants chose
(``return_loss=True``: keywords forward gets as Python values). So a graph serves a batch of another shape signature
(the inputs' names, shapes and dtypes, and the constants' names, types and values) in one of two ways:

- without an export (``_Graph.serves``): the batch differs from the graph's first one only in axes at whose other
  sizes an export already gave the same graph (``_Graph.varying``), and every Python decision the trace took on sizes
  comes out the same at the new sizes (its guards, export/size_guards.py, computed on meta tensors in milliseconds).
  Two exports at different sizes that give the same graph show that no size of those axes is held in it; the guards
  show that no branch the module's Python takes changes at the new sizes. A trace that read a size as a plain int
  (``len(tensor)``) or froze a value of unknown origin serves no new signature without an export.
- with an export at the new batch, compared with the graphs already built, without their weights: the same graph
  serves the new signature too (and its ``varying`` axes grow where its guards hold; where a built graph's guards
  hold and it declares the batch's inputs alike, the export takes that graph's names and dynamic axes and skips the
  eval-mode run that would infer them: ``_probe``); another graph is built over
  the same weight tensors (``build.from_torch(..., shared=)``), so one optimizer, one set of gradient buffers,
  BatchNorm statistics, scales and checkpoint serve all graphs.

A graph that cannot be exported or trained with those sizes dynamic (an op whose export reads an image's size, a
rewrite written for a fixed size, a pool whose windows depend on it) is exported again with them fixed, image sizes
first, then lengths, for this and every later batch (``_export``, ``_build``). At most ``MAX_GRAPHS``
built graphs are kept; the least recently used is dropped with its sessions, and a warning says once that the shapes
keep changing.

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
from ..export.refusals import ExportError
from ..graph.graph_errors import GradientBuildError
from ..graph.rewrites import SizesNeeded

MAX_GRAPHS = 8  # built graphs kept (each holds a training and an eval session)


class _Graph:
    """A built graph, the structure it is recognised by (``_structure``), the model_desc the trainer shows while it
    serves (``_any_size`` of an inferred one), and what lets it serve a batch of other sizes without an export.

    ``signature`` is the batch it was traced at; ``guards`` (``size_guards.Guards``) the decisions its trace took on
    sizes; ``varying`` the (input, axis) pairs at whose other sizes an export gave this same graph. A batch that
    differs from ``signature`` in those axes alone and takes every guard as the trace did is served as it is
    (``serves``); ``generic`` is False where no guard can tell (a size read as a plain int, a frozen value of unknown
    origin), and then every new signature is exported and compared.
    """

    def __init__(self, runtime, structure: bytes, desc, signature, exported):
        self.runtime, self.structure, self.desc, self.signature = runtime, structure, desc, signature
        self.exported_desc = exported.desc  # the names and dynamic axes it was exported with
        trace_facts = exported.trace_facts
        self.guards = trace_facts.guards
        self.generic = not trace_facts.frozen_values and not trace_facts.sizes_read_untraced
        self.varying = set()

    def serves(self, signature, inputs) -> bool:
        """Whether a batch of this new ``signature`` (``inputs`` its tensors) is this graph's without an export."""
        differing = _differing_axes(self.signature, signature)
        return self.generic and differing is not None and differing <= self.varying and self.guards.hold(inputs)

    def sizes_to_try(self, signature, inputs) -> set:
        """The axes a batch of this new ``signature`` (``inputs`` its tensors) differs in from the graph's first, where
        it differs in sizes alone and takes every guard as the trace did: an export at it that gives this same graph
        makes them ``varying``. Empty otherwise."""
        differing = _differing_axes(self.signature, signature)
        if not self.generic or not differing or not self.guards.hold(inputs):
            return set()
        return differing


class _ValuesCheck:
    """A signature whose trace froze values of its first batch: at the first batch of other values,
    one more export (with the signature's constants), which must give the same graph."""

    def __init__(self, exported, structure: bytes):
        self.locations, self.first_inputs, self.structure = exported.trace_facts.frozen_values, exported.inputs, structure
        self.constants, self.desc = exported.constants, exported.desc

    def done(self, source, input_names, inputs) -> bool:
        """Whether the check ran (then the signature needs no other); ExportError if the graph differs."""
        if all(torch.equal(first, now.to(first.device)) for first, now in zip(self.first_inputs, inputs)):
            return False
        again = source.export(input_names, inputs, self.constants, compared_with=self.desc)
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
        self._probing = True  # until a probe's export differs: then this module's trace holds sizes of its batch

    def runtime_for(self, input_names, inputs, constants) -> build.Runtime:
        """The Runtime of this batch's signature; the first batch of a new one is served by a graph that
        ``serves`` it, or exported (and maybe built)."""
        signature = _signature(input_names, inputs, constants)
        entry = self._signatures.get(signature)
        if entry is None:
            serving = next((graph for graph in reversed(self._graphs.values()) if graph.serves(signature, inputs)), None)
            entry = [serving, None] if serving is not None else self._add(signature, input_names, inputs, constants)
            self._signatures[signature] = entry
        elif entry[1] is not None and entry[1].done(self._source, input_names, inputs):
            entry[1] = None
        self._graphs.move_to_end(entry[0].structure)
        self.model_desc = entry[0].desc
        return entry[0].runtime

    def _add(self, signature, input_names, inputs, constants) -> list:
        """Export at this batch and constants; reuse the built graph it equals, or build one over the same weights."""
        model, loss_fn, options, model_desc = self._given
        if self._source is None:
            self._source = build.TorchSource(model, loss_fn, input_names, options, model_desc, self._where[0])
        probed = self._probe(signature, input_names, inputs, constants)
        if probed is not None:
            graph, exported = probed
        else:
            exported = self._export(input_names, inputs, constants)
            graph = self._graphs.get(_structure(exported.onnx_model))
            if graph is None:
                graph, exported = self._new_graph(signature, exported, input_names)
            else:
                graph.varying |= graph.sizes_to_try(signature, inputs)
        frozen = exported.trace_facts.frozen_values
        return [graph, _ValuesCheck(exported, graph.structure) if frozen else None]

    def _probe(self, signature, input_names, inputs, constants):
        """(graph, export) where a built graph serves this batch once an export at its sizes, declared as the graph
        declares its inputs, gives the same graph; None where no graph could (``_Graph.sizes_to_try``,
        ``TorchSource.declares_alike``) or the export differs or fails (the full export follows, and no batch is probed
        again: the trace holds sizes of its batch). Such an export skips the module's eval-mode run
        (``TorchSource.export``'s ``compared_with``)."""
        for graph in reversed(self._graphs.values()) if self._probing else ():
            differing = graph.sizes_to_try(signature, inputs)
            if differing and self._source.declares_alike(graph.exported_desc, input_names, inputs):
                try:
                    again = self._source.export(input_names, inputs, constants, compared_with=graph.exported_desc)
                except (ExportError, SizesNeeded):
                    again = None
                if again is None or _structure(again.onnx_model) != graph.structure:
                    self._probing = False
                    return None
                graph.varying |= differing
                return graph, again
        return None

    def _new_graph(self, signature, exported, input_names):
        """(the _Graph built from ``exported``, the export it was built from), over the weights of the graphs built."""
        model_desc = self._given[3]
        shared = next(reversed(self._graphs.values())).runtime if self._graphs else None
        runtime, exported = self._build(exported, shared, input_names)
        structure = _structure(exported.onnx_model)
        desc = runtime.model_desc if model_desc is not None else _any_size(runtime.model_desc)
        graph = self._graphs[structure] = _Graph(runtime, structure, desc, signature, exported)
        self.built += 1
        self._drop_least_recently_used()
        return graph, exported

    def _export(self, input_names, inputs, constants):
        """The export at this batch. Where it fails with image sizes free (``ExportError``: an op whose export reads
        them, such as an adaptive pool to sizes other than 1) or with sizes free that a rewrite of the export needs
        fixed (``SizesNeeded``: a ceil_mode pool whose window count depends on them), those are fixed, for this and
        every later export."""
        try:
            return self._source.export(input_names, inputs, constants)
        except ExportError:
            if not self._source.fix_sizes(inputs, kinds=["spatial"]):
                raise
        except SizesNeeded:
            if not self._source.fix_sizes(inputs):
                raise
        return self._export(input_names, inputs, constants)

    def _build(self, exported, shared, input_names):
        """The Runtime of ``exported`` and the export it was built from: where the graph cannot train with sizes of the
        batch dynamic (a rewrite that needs a fixed size along them: ``GradientBuildError``), they are fixed in this and
        every later export (image sizes first, then lengths), and the graph is built per size."""
        try:
            runtime = build.from_torch(self._source, exported, *self._where, shared=shared)
        except GradientBuildError:
            if not self._source.fix_sizes(exported.inputs):
                raise
            again = self._export(input_names, exported.inputs, exported.constants)
            return self._build(again, shared, input_names)
        runtime.check_export()
        return runtime, exported

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
                f"build each), at most {MAX_GRAPHS} kept: this model's trace holds sizes of its batch; pad batches to a "
                "few fixed lengths (e.g. a tokenizer's pad_to_multiple_of=16) or image sizes so that fewer graphs are built"
            )


def _signature(input_names, inputs, constants) -> tuple:
    """What decides the graph of a batch: each input's name, shape and dtype; each constant's name, type
    and repr (True, 1 and 1.0 are equal in Python but not to the trace; repr makes a NaN equal itself)."""
    tensors = tuple((name, tuple(tensor.shape), tensor.dtype) for name, tensor in zip(input_names, inputs))
    return tensors, tuple(sorted((name, type(value), repr(value)) for name, value in constants.items()))


def _differing_axes(first, other):
    """{(input index, axis)} where signature ``other``'s sizes differ from ``first``'s; None if they differ in more
    than sizes (names, ranks, dtypes or constants)."""
    (first_tensors, first_constants), (other_tensors, other_constants) = first, other
    if first_constants != other_constants or len(first_tensors) != len(other_tensors):
        return None
    differing = set()
    for index, ((name, shape, dtype), (other_name, other_shape, other_dtype)) in enumerate(zip(first_tensors, other_tensors)):
        if (name, len(shape), dtype) != (other_name, len(other_shape), other_dtype):
            return None
        differing |= {(index, axis) for axis, (size, other_size) in enumerate(zip(shape, other_shape)) if size != other_size}
    return differing


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
