"""Recompute: the training graph computes chosen forward activations again in its backward part instead of
keeping them from the forward part (the legacy ``graph_transformer`` switches, ``torch.utils.checkpoint``).

The training graph holds forward and gradient nodes in one ONNX graph, run as one session: every forward
tensor a gradient node reads lives from its forward node to that gradient node. A *region* is a set of
forward nodes (a Gelu, an attention dropout, a transformer layer, a checkpointed module). ``apply`` clones the
region's nodes whose outputs the backward reads, points the backward at the clones, and feeds the clones
from the region's inputs, so the originals are freed as soon as the forward is done with them. Two things
make it real in ONNX Runtime:

- the clones' inputs pass through one ``PassThrough`` (com.microsoft; its outputs are its inputs, no copy)
  together with a gradient tensor their first backward reader needs (the *trigger*): the clones cannot run
  before the backward reaches the region, whatever order the session picks. Because the clones read other
  tensors than the originals, common-subexpression elimination cannot merge them back.
- a Dropout is not drawn again: its clone is a ``DropoutGrad`` of the clone's input with the forward's mask
  (kept, one byte per value), which computes the forward's ``input * mask / (1 - ratio)`` bit for bit, so the
  losses and weights are those without recompute.

The rewritten graph lists each clone just before its first reader and asks its session to run the nodes in
that order (``IN_LISTED_ORDER``, which the session reads): ONNX Runtime's default order runs every weight's gradient at the end
of the run, which would hold the recomputed activations until then.

Which modules ``torch.utils.checkpoint`` wraps is recorded while the module is traced
(``checkpointed_modules``) and carried to the build in the forward graph's metadata.
"""

import contextlib
import functools
import heapq
import itertools
import json
import re
import warnings
from dataclasses import dataclass

import onnx
import torch
from onnx import helper

from .dropout import RANDOM_OPS
from .graph_errors import module_path

# Metadata of a graph whose nodes must run in the order they are listed (the session runs it so: recomputed nodes
# stand just before their first reader): ONNX Runtime's default order runs every weight's gradient at the very end of
# the run, holding the recomputed activations it reads until then (benchmarks/NOTES.md, "Recompute").
IN_LISTED_ORDER = "orttrainer.run_in_listed_order"

CHECKPOINTED_KEY = "orttrainer.checkpointed_modules"  # forward graph metadata: JSON, the module names per checkpoint call
GELU_OPS = ("Gelu", "FastGelu", "BiasGelu")  # (QuickGelu is spelled out as torch's formula on the CPU: cpu_kernels.py)
_VIEW_OPS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose")  # followed from a region's node
_SHAPE_OPS = ("Shape", "Size")  # read no values: their outputs are not activations
_NOT_CLONED = (*RANDOM_OPS, "BatchNormalization", "BatchNormInternal", "If", "Loop", "Scan")  # draws, state, subgraphs
_MS_DOMAIN = "com.microsoft"


@dataclass
class _Region:
    """Forward nodes to recompute. ``closed``: what leaves it for other forward nodes (a layer's output, an
    attention mask its successors read) is kept, not recomputed, so no other region's backward waits for it."""

    what: str  # for messages
    nodes: list
    closed: bool = False


# ------------------------------------------------------------------ which modules torch.utils.checkpoint wraps
def _checkpointed_module(function):
    """The module whose whole forward ``function`` is, or None: the module itself, its bound ``forward``, or
    ``partial(forward, module, ...)`` (transformers' ``GradientCheckpointingLayer`` checkpoints that)."""
    if isinstance(function, torch.nn.Module):
        return function
    if isinstance(function, functools.partial) and function.args and isinstance(function.args[0], torch.nn.Module):
        return function.args[0] if getattr(function.func, "__name__", "") == "forward" else None
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) and getattr(function, "__name__", "") == "forward" else None


@contextlib.contextmanager
def checkpointed_modules(root: torch.nn.Module):
    """Record, while ``root`` runs inside the block, which of its modules run under a non-reentrant
    ``torch.utils.checkpoint`` (the reentrant one is refused by the export): per checkpoint call, the module
    checkpointed whole, or else the modules the checkpointed function calls directly (what it computes outside
    any module is not seen). Yields the list of name lists it fills."""
    names = {id(module): name for name, module in root.named_modules() if name}
    found, running, open_calls = [], [], []  # open_calls: (len(running) at the call, its module names)

    def entering(module, _args):
        if open_calls and len(running) == open_calls[-1][0] and id(module) in names:
            open_calls[-1][1].append(names[id(module)])
        running.append(module)

    def leaving(_module, _args, _output):
        running.pop()

    original = torch.utils.checkpoint._checkpoint_without_reentrant_generator

    def recording(function, *args, **kwargs):
        whole = _checkpointed_module(function)
        call = (len(running), [names[id(whole)]] if id(whole) in names else [])
        open_calls.append(call)
        try:
            yield from original(function, *args, **kwargs)
        finally:
            open_calls.pop()
            if call[1] and call[1] not in found:
                found.append(list(dict.fromkeys(call[1])))

    handles = [torch.nn.modules.module.register_module_forward_pre_hook(entering),
               torch.nn.modules.module.register_module_forward_hook(leaving, always_call=True)]  # fmt: skip
    torch.utils.checkpoint._checkpoint_without_reentrant_generator = recording
    try:
        yield found
    finally:
        torch.utils.checkpoint._checkpoint_without_reentrant_generator = original
        for handle in handles:
            handle.remove()


def mark_checkpointed(model: onnx.ModelProto, calls) -> None:
    """Write the checkpointed modules (a list of module names per checkpoint call) into the forward graph's metadata."""
    if calls:
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, CHECKPOINTED_KEY: json.dumps(calls)})


def checkpointed(model: onnx.ModelProto) -> list:
    """The checkpoint calls ``mark_checkpointed`` wrote into ``model``: a list of module names each."""
    return next((json.loads(prop.value) for prop in model.metadata_props if prop.key == CHECKPOINTED_KEY), [])


# ------------------------------------------------------------------ regions
def _scope(node: onnx.NodeProto) -> str:
    """The torch module a node came from; a node ONNX Runtime fused and renamed has it in its output's name."""
    return module_path(node.name if node.name.startswith("/") else next((o for o in node.output if o), ""))


def _in_scope(node, scope: str) -> bool:
    path = _scope(node)
    return path == scope or path.startswith(scope + ".")


def _with_views(nodes, forward, consumers) -> list:
    """``nodes`` and the forward view ops (reshapes, transposes) that follow them."""
    region, stack, taken = list(nodes), list(nodes), {id(node) for node in nodes}
    while stack:
        for name in stack.pop().output:
            for reader in consumers.get(name, []):
                if reader.op_type in _VIEW_OPS and id(reader) in forward and id(reader) not in taken:
                    taken.add(id(reader))
                    region.append(reader)
                    stack.append(reader)
    return region


def _layers(nodes) -> list:
    """[(layer module name, its nodes)] of the model's main stack of numbered layers (``transformer.h.0``,
    ``encoder.layer.1``, ...): the numbered module list holding the most nodes; [] if there is none."""
    stacks = {}  # list name -> {index: [nodes]}
    for node in nodes:
        path = _scope(node)
        for match in re.finditer(r"\.(\d+)(?=\.|$)", path):
            stacks.setdefault(path[: match.start()], {}).setdefault(int(match.group(1)), []).append(node)
    stacks = {name: layers for name, layers in stacks.items() if len(layers) > 1}
    if not stacks:
        return []
    name, layers = max(stacks.items(), key=lambda item: sum(len(nodes) for nodes in item[1].values()))
    return [(f"{name}.{index}", layers[index]) for index in sorted(layers)]


def _attention_dropouts(forward_nodes, producers) -> list:
    """Dropouts of attention probabilities: their input is a Softmax's output, through view ops."""
    found = []
    for node in forward_nodes:
        if node.op_type != "Dropout":
            continue
        source = producers.get(node.input[0])
        while source is not None and source.op_type in _VIEW_OPS:
            source = producers.get(source.input[0])
        if source is not None and source.op_type == "Softmax":
            found.append(node)
    return found


def _regions(graph_transformer, checkpointed_calls, forward_nodes, consumers, producers, float16=False) -> list:
    """The regions the switches and the checkpoint calls (module names each) ask for; a switch that finds nothing to
    recompute in this model says so (UserWarning). ``float16``: the graph computes in float16, where no Dropout
    is recomputed (``_Rewrite._cloneable``)."""
    forward = {id(node) for node in forward_nodes}
    regions = []
    for names in checkpointed_calls:
        described = f"checkpointed module{'s' if len(names) > 1 else ''} {', '.join(repr(name) for name in names)}"
        nodes = [node for node in forward_nodes if any(_in_scope(node, name) for name in names)]
        if nodes:
            regions.append(_Region(described, nodes, closed=True))
        else:
            _warn("torch.utils.checkpoint", f"nothing recomputed for the {described}: no node of the graph comes from it")
    if graph_transformer.transformer_layer_recompute:
        regions += _layer_regions(forward_nodes, graph_transformer.number_recompute_layers)
    elif graph_transformer.number_recompute_layers:
        _warn("graph_transformer.number_recompute_layers", "has no effect: it counts the layers of "
              "graph_transformer.transformer_layer_recompute, which is off")  # fmt: skip
    if graph_transformer.gelu_recompute:
        gelus = [node for node in forward_nodes if node.op_type in GELU_OPS]
        regions += [_Region(f"Gelu '{node.name}'", _with_views([node], forward, consumers)) for node in gelus]
        if not gelus:
            _warn("graph_transformer.gelu_recompute", f"nothing to recompute: the training graph has no GELU "
                  f"({', '.join(GELU_OPS)} node)")
    if graph_transformer.attn_dropout_recompute:
        dropouts = _attention_dropouts(forward_nodes, producers)
        if not dropouts:
            _warn("graph_transformer.attn_dropout_recompute", "nothing to recompute: the training graph has no dropout "
                  "of a softmax's output (attention dropout with p > 0)")  # fmt: skip
        elif float16:
            _warn("graph_transformer.attn_dropout_recompute", "nothing recomputed under mixed precision: ONNX Runtime's "
                  "float16 DropoutGrad does not round as its Dropout does, so a recomputed dropout would differ")  # fmt: skip
        else:
            regions += [_Region(f"attention dropout '{node.name}'", _with_views([node], forward, consumers)) for node in dropouts]
    return _disjoint(regions)


def _layer_regions(forward_nodes, count: int) -> list:
    """The first ``count`` layers (0: all but the last, as the legacy option), never the last: its
    activations are read as soon as the backward starts."""
    layers = _layers(forward_nodes)
    if len(layers) < 2:
        _warn("graph_transformer.transformer_layer_recompute", "nothing to recompute: the graph has no stack of two or "
              "more numbered layers (module names such as 'encoder.layer.0', 'encoder.layer.1')")  # fmt: skip
        return []
    last = len(layers) - 1
    if count > last:
        _warn("graph_transformer.number_recompute_layers", f"{count} layers asked, the model has {len(layers)} and the "
              f"last is never recomputed (its activations are read as soon as the backward starts): recomputing {last}")  # fmt: skip
    chosen = layers[: min(count, last) if count else last]
    return [_Region(f"transformer layer '{name}'", nodes, closed=True) for name, nodes in chosen]


def _disjoint(regions) -> list:
    """Each node in the first region that names it (checkpoints, then layers, then single ops)."""
    taken, kept = set(), []
    for region in regions:
        region.nodes = [node for node in region.nodes if id(node) not in taken]
        taken.update(id(node) for node in region.nodes)
        if region.nodes:
            kept.append(region)
    return kept


def _warn(switch: str, message: str) -> None:
    warnings.warn(f"{switch}: {message}", UserWarning, stacklevel=2)


# ------------------------------------------------------------------ the rewrite
def apply(model: onnx.ModelProto, graph_transformer, checkpointed_calls=(), batch_inputs=()) -> int:
    """Rewrite the training graph ``model`` in place to recompute the regions the ``graph_transformer`` options
    and the ``checkpointed_calls`` (``checkpointed``) ask for; return how many were rewritten. ``batch_inputs``: the graph
    inputs that carry the batch (what the activations are computed from)."""
    switches = (graph_transformer.gelu_recompute, graph_transformer.attn_dropout_recompute,
                graph_transformer.transformer_layer_recompute, graph_transformer.number_recompute_layers)  # fmt: skip
    if not checkpointed_calls and not any(switches):
        return 0
    rewrite = _Rewrite(model, batch_inputs)
    regions = _regions(graph_transformer, checkpointed_calls, rewrite.forward_nodes, rewrite.consumers, rewrite.producers,
                          rewrite.float16)  # fmt: skip
    done = sum(rewrite.recompute(region, index) for index, region in enumerate(regions))
    if done:
        rewrite.sort()
        helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, IN_LISTED_ORDER: "1"})
    return done


class _Rewrite:
    """The training graph with what the rewrite asks of it: producers, readers, which nodes are the forward
    part, which gradient nodes follow the loss's gradient, which tensors carry values computed from the batch."""

    def __init__(self, model: onnx.ModelProto, batch_inputs):
        self.model, self.graph = model, model.graph
        self.position = {id(node): index for index, node in enumerate(self.graph.node)}
        self.producers = {name: node for node in self.graph.node for name in node.output if name}
        self.consumers = {}
        for node in self.graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {initializer.name for initializer in self.graph.initializer}
        seeds = [name for name in self.initializers if name.endswith("_grad") and name[: -len("_grad")] in self.producers]
        self.after_loss_gradient = self._downstream(seeds)  # the loss gradient's seed and the gradients made from it
        forward, stack = set(), [o.name for o in self.graph.output if o.name not in self.after_loss_gradient]
        while stack:
            node = self.producers.get(stack.pop())
            if node is not None and id(node) not in forward:
                forward.add(id(node))
                stack.extend(name for name in node.input if name)
        self.forward = forward
        self.forward_nodes = [node for node in self.graph.node if id(node) in forward]
        self.activations = self._downstream(batch_inputs, through=lambda node: node.op_type not in _SHAPE_OPS)
        self.float16 = any(node.op_type == "Cast" and attribute.name == "to" and attribute.i == onnx.TensorProto.FLOAT16
                           for node in self.graph.node for attribute in node.attribute)  # mixed precision  # fmt: skip
        self.added = {}  # id(new node) -> its sort key
        self.cloned = set()  # names of the clones' outputs

    def _downstream(self, names, through=lambda node: True) -> set:
        """Tensor names reachable from ``names`` (included) through nodes ``through`` accepts."""
        seen, stack = set(names), list(names)
        while stack:
            for node in self.consumers.get(stack.pop(), []):
                if through(node):
                    for name in node.output:
                        if name and name not in seen:
                            seen.add(name)
                            stack.append(name)
        return seen

    def _cloneable(self, node, region_ids, closed: bool) -> bool:
        """A node worth and safe to compute again: it makes activations, draws nothing (a Dropout keeps its mask;
        not in float16, where ONNX Runtime's DropoutGrad rounds otherwise than its Dropout), holds no state, gives
        no graph output and, in a closed region, nothing other forward nodes read."""
        if node.op_type in _NOT_CLONED or not any(name in self.activations for name in node.output):
            return False
        if node.op_type == "Dropout" and (self.float16 or len(node.output) < 2 or not node.output[1]):
            return False
        outputs = {o.name for o in self.graph.output}
        if any(name in outputs for name in node.output):
            return False
        return not closed or all(id(reader) in region_ids or id(reader) not in self.forward
                                 for name in node.output for reader in self.consumers.get(name, []))  # fmt: skip

    def _backward_readers(self, name: str) -> list:
        return [reader for reader in self.consumers.get(name, [])
                if id(reader) not in self.forward and id(reader) not in self.added and name in reader.input]  # fmt: skip

    def recompute(self, region: _Region, index: int) -> bool:
        """Clone what the backward reads of ``region``; False (and a warning) when it cannot be delayed."""
        region_ids = {id(node) for node in region.nodes}
        cloneable = {id(node) for node in region.nodes if self._cloneable(node, region_ids, region.closed)}
        needed = [name for node in region.nodes if id(node) in cloneable
                  for name in (node.output[:1] if node.op_type == "Dropout" else node.output)
                  if name and self._backward_readers(name)]  # fmt: skip
        if not needed:
            return False
        clones = self._closure(needed, cloneable)
        renamed = {name: f"{name}/recompute" for node in clones for name in self._cloned_outputs(node)}
        readers = sorted({id(r): r for name in needed for r in self._backward_readers(name)}.values(), key=self._key)
        for reader in readers:
            reader.input[:] = [renamed.get(name, name) for name in reader.input]
            for name in reader.input:
                self.consumers.setdefault(name, []).append(reader)
        self.cloned.update(renamed.values())
        trigger = self._trigger(readers)
        if trigger is None:  # undo: every gradient the readers take already depends on the clones
            for reader in readers:
                reader.input[:] = [next((old for old, new in renamed.items() if new == name), name) for name in reader.input]
            self.cloned.difference_update(renamed.values())
            _warn(region.what, "not recomputed: no gradient reaches it before its recomputed values would be needed")
            return False
        produced = {name for node in clones for name in node.output}
        external = list(dict.fromkeys(name for node in clones for name in self._clone_inputs(node)
                                      if name and name not in produced and name not in self.initializers))  # fmt: skip
        delayed = {name: f"{name}/recompute{index}" for name in external}
        key = self._key(readers[0])
        new_nodes = [helper.make_node("PassThrough", [trigger, *external], [f"{trigger}/recompute{index}", *delayed.values()],
                                      name=f"recompute{index}/PassThrough", domain=_MS_DOMAIN)]  # fmt: skip
        new_nodes += [self._clone(node, {**delayed, **renamed}) for node in clones]
        for offset, built in enumerate(new_nodes):
            self.graph.node.append(built)
            node = self.graph.node[-1]  # the graph's own copy
            self.added[id(node)] = (key[0], offset - len(new_nodes))
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
            for name in node.output:
                self.producers[name] = node
        return True

    def _key(self, node):
        return self.added.get(id(node), (self.position.get(id(node), 0), 0))

    def _closure(self, needed, cloneable) -> list:
        """The cloneable nodes that compute ``needed``, in graph order."""
        chosen, stack = {}, [self.producers[name] for name in needed]
        while stack:
            node = stack.pop()
            if id(node) in chosen:
                continue
            chosen[id(node)] = node
            for name in self._clone_inputs(node):
                source = self.producers.get(name)
                if source is not None and id(source) in cloneable:
                    stack.append(source)
        return sorted(chosen.values(), key=self._key)

    @staticmethod
    def _clone_inputs(node) -> list:
        """What a node's clone reads: a Dropout's clone reads its input and the forward's mask, ratio and mode."""
        if node.op_type == "Dropout":
            return [node.input[0], node.output[1], *node.input[1:3]]
        return [name for name in node.input if name]

    @staticmethod
    def _cloned_outputs(node) -> list:
        return [node.output[0]] if node.op_type == "Dropout" else [name for name in node.output if name]

    def _clone(self, node, renamed: dict) -> onnx.NodeProto:
        """The node computing again, reading ``renamed`` inputs; a Dropout as ``DropoutGrad`` of its kept mask."""
        if node.op_type == "Dropout":
            inputs = [renamed.get(name, name) for name in self._clone_inputs(node)]
            return helper.make_node("DropoutGrad", inputs, [renamed[node.output[0]]], name=f"{node.name}/recompute",
                                    domain=_MS_DOMAIN)  # fmt: skip
        clone = onnx.NodeProto()
        clone.CopyFrom(node)
        clone.name = f"{node.name}/recompute"
        clone.input[:] = [renamed.get(name, name) for name in node.input]
        clone.output[:] = [renamed.get(name, name) if name else "" for name in node.output]
        return clone

    def _trigger(self, readers):
        """The gradient of the loss nearest to ``readers`` (the first of them in graph order that has one, then
        upstream) that no recomputed value feeds: the clones wait for it. Gradients that went through a shape of
        a recomputed value (a broadcast's reduction axes) are passed for the gradient they were made from."""
        fed = self._downstream(self.cloned)
        for reader in readers:
            seen, queue = set(), [name for name in reader.input if name in self.after_loss_gradient]
            while queue:
                name = queue.pop(0)
                if name in seen or name in self.initializers:
                    continue
                seen.add(name)
                if name not in fed:
                    return name
                queue.extend(n for n in self.producers[name].input if n in self.after_loss_gradient)
        return None

    def sort(self) -> None:
        """Order the nodes topologically, each as close to its original place as its inputs allow (new nodes
        just before their first reader)."""
        nodes = list(self.graph.node)
        waiting = {id(node): sum(1 for name in set(node.input) if name in self.producers) for node in nodes}
        ready = [(self._key(node), index, node) for index, node in enumerate(nodes) if not waiting[id(node)]]
        heapq.heapify(ready)
        ordered, pushed = [], itertools.count(len(nodes))
        while ready:
            *_, node = heapq.heappop(ready)
            ordered.append(node)
            for name in set(node.output):
                for reader in {id(r): r for r in self.consumers.get(name, [])}.values():
                    if name in reader.input:
                        waiting[id(reader)] -= 1
                        if not waiting[id(reader)]:
                            heapq.heappush(ready, (self._key(reader), next(pushed), reader))
        if len(ordered) != len(nodes):
            raise RuntimeError("orttrainer's recompute rewrite left a cycle in the training graph (a bug: please report it)")
        del self.graph.node[:]
        self.graph.node.extend(ordered)
        if not any(opset.domain == _MS_DOMAIN for opset in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
