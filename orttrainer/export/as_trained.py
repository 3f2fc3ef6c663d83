"""The user's module run as the trainer runs it, and left as it was.

``with_loss`` makes module + loss one module that takes the graph's inputs and returns its outputs (the loss
first); ``as_trained`` gives the module the modes it trains in for a block, and afterwards its modes, attributes
and buffers back; ``sample_outputs`` runs it once in eval mode for the outputs' names and form;
``keeping_no_activations`` lets a forward run only to be traced or inspected keep no activations.
Submodules keep the train/eval mode the user gave them (a frozen BatchNorm stays frozen).
"""

import contextlib

import torch
from torch.utils import _pytree as pytree

from . import forward_effects
from .refusals import DifferentiationRefused, refuse_state_changes, refuse_writes_in_eval_mode
from ..api import model_outputs

WRAPPED = "model."  # prefix the wrapper adds to every weight name


class _ModelWithLoss(torch.nn.Module):
    """Passes the inputs to ``forward`` by keyword (so that forward's defaults hold for those
    the batch leaves out), with the step's ``constants`` (Python values the trace bakes in), and
    returns the graph's outputs: the loss first, then the model's outputs as tensors
    (model_outputs.flatten; ``form`` says how, after a call)."""

    def __init__(self, model, loss_fn, forward_names, constants):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.forward_names = forward_names
        self.constants = dict(constants or {})
        self.form = None

    def forward(self, *inputs):
        outputs = self.model(**dict(zip(self.forward_names, inputs)), **self.constants)
        loss = None
        if self.loss_fn is not None:
            given = outputs
            if isinstance(outputs, (tuple, list)):  # a 1-tuple is passed as its tensor, a namedtuple as itself
                given = outputs[0] if len(outputs) == 1 else outputs if isinstance(outputs, tuple) else tuple(outputs)
            loss = self.loss_fn(_aliases(given), inputs[-1])
        tensors, self.form = model_outputs.flatten(outputs, type(self.model).__name__, loss)
        return tuple(tensors)


def _aliases(outputs):
    """``outputs`` with each tensor an alias of it, for the loss_fn: the tracer gives a tensor the graph value of the
    last op that returned it, and an op may return its input itself (torch.broadcast_tensors of tensors of one shape,
    in F.mse_loss and F.l1_loss), which made the model's output the loss's Expand, reading the label. An alias
    exports as nothing (aten::alias is its input)."""
    return pytree.tree_map_only(torch.Tensor, torch.ops.aten.alias, outputs)


def with_loss(model, loss_fn, forward_names, constants=None) -> torch.nn.Module:
    """``model`` + ``loss_fn`` as one module taking the graph's inputs and returning its outputs;
    ``constants`` ({name: Python value}) go to forward with the inputs."""
    return _ModelWithLoss(model, loss_fn, forward_names, constants)


@contextlib.contextmanager
def as_trained(model: torch.nn.Module, eval_mode: bool = False):
    """``model`` in the modes it trains in during the block (or, with ``eval_mode``, in eval()), and afterwards as it
    was: its modes and the attributes forward assigns or installs (``_restore_attributes``: transformers' output
    capture hooks), and its buffers (``forward_effects.buffers_kept``: forward in training mode moves BatchNorm's
    statistics). The trainer runs the user's module itself, which no export or check may leave changed.

    Submodules the user put in ``eval()`` stay in eval (a frozen BatchNorm keeps its running statistics, as in a
    torch loop). A root module in ``eval()`` is trained in ``train()`` mode throughout, as the legacy ORTTrainer did.
    """
    attributes = {layer: _attributes_of(layer) for layer in model.modules()}  # the training flags among them
    if eval_mode:
        model.eval()
    elif not model.training:
        model.train()
    try:
        with forward_effects.buffers_kept(model):
            yield model
    finally:
        _restore_attributes(attributes)


def sample_outputs(model, loss_fn, forward_names, inputs, constants=None):
    """Run model (+ loss) once in eval mode without autograd, leaving the module as it was:
    (the graph's outputs, their model_outputs.OutputForm).

    "As it was" includes the attributes forward assigns: NLLB-MoE's router sets its expert capacity in
    eval mode only, and the training graph traced after this run trained with that capacity, other than
    torch, without a word (the check's torch side ran the same changed module). Attributes are restored
    by identity, dicts by their items (a list forward appends to in place is not).
    """
    wrapper = with_loss(model, loss_fn, forward_names, constants)
    attributes = {layer: _attributes_of(layer) for layer in model.modules()}  # the training flags among them
    tensors = forward_effects.module_state(model, loss_fn, attributes=False)
    model.eval()
    try:
        with torch.no_grad(), DifferentiationRefused():
            outputs = wrapper(*inputs)
        # a clamp makes its change at the first run only; in-place ops the version counter sees the export names
        refuse_state_changes(tensors, model, loss_fn, unseen_only=True)
        refuse_writes_in_eval_mode(forward_effects.buffers_written(tensors, model, loss_fn), type(model).__name__)
        return outputs, wrapper.form
    finally:
        _restore_attributes(attributes)


def _attributes_of(layer: torch.nn.Module) -> dict:
    """{name: (value, a copy of its items if it is a dict)}: what forward can reassign, and the dicts it can fill in
    place (hooks it installs, buffers it registers)."""
    return {name: (value, dict(value) if isinstance(value, dict) else None) for name, value in vars(layer).items()}


def _restore_attributes(saved: dict) -> None:
    """Give each module of ``saved`` ({module: ``_attributes_of`` it as it was}) its attributes back: what was
    reassigned gets its old value, what was added goes, a dict gets its old items. transformers' output capture
    marks its hooks installed in an attribute, the hooks in the module's hook dicts: both go together."""
    for layer, attributes in saved.items():
        current = vars(layer)
        for name in [name for name in current if name not in attributes]:
            del current[name]
        for name, (value, items) in attributes.items():
            if current.get(name, _ABSENT) is not value:
                current[name] = value
            if items is not None and _items_changed(value, items):
                value.clear()
                value.update(items)


def _items_changed(now: dict, then: dict) -> bool:
    return now.keys() != then.keys() or any(now[key] is not item for key, item in then.items())


_ABSENT = object()


def _unreachable_backward(_):
    raise RuntimeError("this forward ran only to be traced or inspected; orttrainer kept none of its activations")


def keeping_no_activations():
    """Autograd keeps none of the activations of a forward run only to be traced or inspected (it is never
    differentiated): GPT-2 of the benchmarks exports with 300 MB less. Grad mode, and every branch that
    reads it, stays as in training."""
    return torch.autograd.graph.saved_tensors_hooks(lambda tensor: None, _unreachable_backward)
