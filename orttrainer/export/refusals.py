"""What a module or its forward does that an ONNX graph cannot hold, refused before any graph is built.

Everything that would make the graph train something other than the module is either handled or refused:
weights the gradient builder cannot train, hooks the graph cannot hold, layers that change themselves in forward
(spectral_norm, Embedding's max_norm), custom autograd Functions (but those whose backward is the gradient of their
forward), derivatives taken inside forward, state a forward changes, random draws the trace cannot see. What the
exporter's warnings say is judged in exporter_warnings.py.
"""

import contextlib
import functools
import sys

import torch
from torch.overrides import TorchFunctionMode

from . import forward_effects


class ExportError(ValueError):
    """The module cannot be exported as a graph that trains like it; the message says why and where."""


def refuse_unexportable(model: torch.nn.Module) -> None:
    """Refuse, before anything runs, a module whose weights or layers the graph cannot train as torch does."""
    refuse_weight_dtypes(model)
    refuse_untrainable_modules(model)


def _backward_hook_owners(model: torch.nn.Module) -> list:
    owners = []
    if torch.nn.modules.module._global_backward_hooks or torch.nn.modules.module._global_backward_pre_hooks:
        owners.append("a global module backward hook (torch.nn.modules.module.register_module_full_backward_hook)")
    for path, layer in model.named_modules():
        if layer._backward_hooks or layer._backward_pre_hooks:
            owners.append(f"module '{path or type(model).__name__}' ({type(layer).__name__}) has a backward hook")
    for name, parameter in model.named_parameters():
        if parameter._backward_hooks or getattr(parameter, "_post_accumulate_grad_hooks", None):
            owners.append(f"parameter '{name}' has a gradient hook")
    return owners


def refuse_weight_dtypes(model: torch.nn.Module) -> None:
    """Refuse trainable weights that are not float32: onnxruntime-training's gradient builder
    seeds and combines gradients in float32 only, and fails on float64, float16 and bfloat16 weights."""
    others = [f"'{name}' is {parameter.dtype}" for name, parameter in model.named_parameters()
              if parameter.requires_grad and parameter.dtype != torch.float32]
    if others:
        shown = ", ".join(others[:3]) + (f" (and {len(others) - 3} more)" if len(others) > 3 else "")
        raise TypeError(
            f"trainable weights must be float32, and {shown} (ONNX Runtime's gradient builder makes float32 "
            "gradients only); convert the module with model.float(), and for float16 compute keep float32 weights "
            "and set mixed_precision.enabled"
        )


def refuse_untrainable_modules(model: torch.nn.Module) -> None:
    """Refuse, by inspecting the module, what the ONNX graph would silently drop."""
    problems = [f"{owner}: ONNX Runtime computes the gradients, so it would never run" for owner in _backward_hook_owners(model)]
    scripted = []  # path prefixes of the torch.jit.script modules found
    for path, layer in model.named_modules():
        trains = layer.training or not model.training  # a root in eval() is trained in train() mode (as_trained.as_trained)
        if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and layer.track_running_stats and layer.momentum is None \
                and trains:  # fmt: skip
            raise NotImplementedError(
                f"module '{path}' ({type(layer).__name__}) uses momentum=None (cumulative average); set a momentum"
            )
        if isinstance(layer, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and layer.max_norm is not None:
            problems.append(
                f"module '{path}' ({type(layer).__name__}) has max_norm={layer.max_norm}: torch renormalises rows in place "
                "during forward, which an ONNX graph cannot do; remove max_norm (or renormalise the weight yourself "
                "between steps)"
            )
        if isinstance(layer, torch.jit.ScriptModule) and not any(path.startswith(outer) for outer in scripted):
            scripted.append(f"{path}." if path else "")  # its submodules are scripted with it
            problems.append(
                f"module '{path or getattr(layer, 'original_name', 'model')}' is a torch.jit.script module, which torch's exporter cannot "
                "trace as part of a model: give the trainer the plain module (before torch.jit.script)"
            )
        if isinstance(layer, torch.nn.modules.lazy.LazyModuleMixin) and layer.has_uninitialized_params():
            problems.append(
                f"module '{path}' ({type(layer).__name__}) creates its parameters at its first forward: run the model once "
                "on a batch before creating the trainer, so that the trainer starts from your module's weights"
            )
    if problems:
        raise ExportError("cannot train this model the way torch would:\n- " + "\n- ".join(problems))


class DifferentiationRefused(TorchFunctionMode):
    """Refuses ``torch.autograd.grad`` and ``Tensor.backward`` inside forward or the loss (a gradient
    penalty): the exporter cannot trace a derivative, and the training graph is the gradient of
    forward + loss as a whole."""

    _NAMES = {torch.autograd.grad: "torch.autograd.grad", torch.Tensor.backward: "Tensor.backward"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self._NAMES:
            raise ExportError(
                f"forward or the loss function differentiates ({self._NAMES[func]} at "
                f"{forward_effects.user_location()}): ONNX Runtime trains with one gradient graph of forward + loss, which cannot "
                "hold a derivative taken inside them; train this model with torch"
            )
        return func(*args, **(kwargs or {}))


class HookAndFunctionSpy(TorchFunctionMode):
    """Records ``Tensor.register_hook`` calls made while forward runs."""

    def __init__(self):
        super().__init__()
        self.hooks = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook):
            self.hooks.append(forward_effects.user_location())
        return func(*args, **(kwargs or {}))



# Custom autograd Functions whose hand-written backward is the gradient of their forward (checked at edge values
# by tests/test_same_as_torch.py against autograd of the forward): exported as their forward, they train as torch.
GRADIENT_OF_THEIR_FORWARD = {
    "transformers.models.bloom.modeling_bloom.GeLUFunction",  # BLOOM's tanh GELU, always through this Function
}


class _Context:
    """What a custom Function's forward may call on its ctx, doing nothing (``functions_as_their_forward``)."""

    def save_for_backward(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass


@contextlib.contextmanager
def functions_as_their_forward():
    """The ``GRADIENT_OF_THEIR_FORWARD`` Functions of the modules loaded, applied as their forward with autograd on:
    a Function's forward runs without autograd, which ``trace._NoGradResultsDetached`` would record as detaches."""
    patched = []
    for name in GRADIENT_OF_THEIR_FORWARD:
        module_name, _, qualname = name.rpartition(".")
        function = getattr(sys.modules.get(module_name), qualname, None)
        if function is not None:
            patched.append((function, function.__dict__.get("apply")))
            function.apply = staticmethod(functools.partial(function.forward, _Context()))
    try:
        yield
    finally:
        for function, apply in patched:
            if apply is None:
                del function.apply
            else:
                function.apply = apply


def _custom_functions(output) -> list:
    """Names of the custom torch.autograd.Functions in the autograd graph of ``output``, but those in
    ``GRADIENT_OF_THEIR_FORWARD``."""
    seen, found, stack = set(), [], [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            function = node._forward_cls
            name = f"{function.__module__}.{function.__qualname__}"
            own = getattr(function, "graph_marker", False)  # orttrainer's (buffer_writes.in_training)
            if name not in found and name not in GRADIENT_OF_THEIR_FORWARD and not own:
                found.append(name)
        stack.extend(child for child, _ in node.next_functions)
    return found


def refuse_custom_backward(loss, hooks: list) -> None:
    """Refuse what carries a hand-written backward in the traced forward + loss (``loss``, ``hooks``: where forward
    registered a tensor hook, ``HookAndFunctionSpy``).

    A custom ``torch.autograd.Function`` is exported as its forward ops, so its backward
    (a straight-through estimator, a gradient reversal) would be replaced by the
    gradient of those ops; a hook registered on a tensor inside forward would never run.
    """
    problems = [f"tensor.register_hook at {where}: ONNX Runtime computes the gradients, so the hook would never run"
                for where in hooks]  # fmt: skip
    functions = _custom_functions(loss) if isinstance(loss, torch.Tensor) else []
    problems += [f"custom torch.autograd.Function {name}: its backward would be replaced by the gradient of the ops "
                 "in its forward" for name in functions]  # fmt: skip
    if problems:
        raise ExportError(
            "cannot train this model the way torch would:\n- " + "\n- ".join(problems) + "\nTrain it with plain torch, "
            "or express the computation with standard differentiable ops."
        )


def refuse_draws_outside_torch(before: tuple, model, call, inputs, devices, serialized: bytes, export_again) -> None:
    """Refuses a forward (or loss) that drew from Python's random module or numpy's global generator while traced,
    unless the graph (``serialized``) is the same with every draw forced to either end of its range
    (``forward_effects.draws_decide_nothing``; ``export_again()`` exports once more).

    The trace cannot see such a draw: it keeps the first one's result as a constant, so every step would reuse it
    (older transformers drew LayerDrop with ``random.uniform``; Wav2Vec2's SpecAugment draws its masks with numpy)."""
    drawn = forward_effects.generators_drawn(before, forward_effects.generator_states())
    if not drawn or forward_effects.draws_decide_nothing(serialized, export_again, call.model):
        return
    locations = forward_effects.draw_locations(call, inputs, devices) or [
        "no line drew when forward ran again under a tracer: the draw depends on something forward changed, or "
        "another thread of the program drew from the generator during the export"]
    raise ExportError(
        f"{type(model).__name__}'s forward or loss draws from {' and '.join(drawn)} at:\n- " + "\n- ".join(locations)
        + "\nThe trace cannot see such a draw: it keeps the first draw as a constant, so every step would reuse it (a "
        "layer skipped always or never, the same mask on every batch) where torch draws anew each step. Draw with torch "
        "and keep the draw in tensor ops (a mask from torch.rand), turn the random behaviour off (transformers: "
        "config.layerdrop, mask_time_prob, mask_feature_prob = 0.0), or train this model with torch."
    )


def refuse_state_changes(before: dict, model, loss_fn, unseen_only=False, written=()) -> None:
    """Refuses a forward that changed its modules' state in a way the graph cannot: torch carries the change into
    the next step (a counter in an attribute that later takes a branch, a buffer reassigned, a clamped weight), the
    graph starts every step from the state it was traced with. ``unseen_only``, ``written`` (the buffers the graph
    writes): see ``forward_effects.state_changes``."""
    changes = forward_effects.state_changes(before, model, loss_fn, unseen_only, written)
    if changes:
        raise ExportError(
            f"{type(model).__name__}'s forward or loss changes its own state, which the graph cannot: torch would carry "
            "the change into the next step, the graph starts every step from the state of the first:\n- "
            + "\n- ".join(changes)
            + "\nKeep such state out of forward (update it in the training loop, between steps), or train this model "
            "with torch."
        )


def refuse_writes_in_eval_mode(written: list, model_name: str) -> None:
    """Refuses a forward that writes buffers in place in eval mode too (``written``: their names), as a counter with no
    ``if self.training`` does: the training graph carries such writes into the buffers (trace._WeightsAsInputs), the
    eval graph, the trace's forward with dropout off and BatchNorm on its statistics, writes nothing."""
    if written:
        raise ExportError(
            f"{model_name}'s forward writes the buffers {written} in place in eval mode too: orttrainer carries what a "
            "training forward writes into the buffers after each train_step, but eval_step writes nothing, where torch's "
            "eval-mode forward would; write them under `if self.training:` (as BatchNorm updates its statistics), or "
            "train this model with torch"
        )
