"""The buffers a training forward writes in place, made values the graph holds: in training the written value, in
eval mode the buffer as it was (torch's eval-mode forward writes none).

The trace (trace._WeightsAsInputs) returns each written buffer's last value, which the trainer copies into the
buffer after the step. ``BufferWrites`` follows each write into a buffer while forward is traced (an in-place op,
``out=``), and makes the buffer's value after it ``in_training(written, as before)``: a Where on
``eval_graph.IN_TRAINING`` that the training graph resolves to the written value and the eval graph to the old one,
so a forward that reads the buffer after writing it (an EMA codebook, spectral_norm's u and v) evaluates as torch's
eval mode. The written value is detached, as torch's write under no_grad leaves it. InstanceNorm's running statistics,
which ``F.instance_norm`` writes inside one op the trace cannot see into, are written so by torch's formula
(``_instance_norm``); other writes the trace cannot see are refused (``refuse_unseen_writes``).
"""

import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import forward_effects
from .as_trained import WRAPPED
from .refusals import ExportError
from .symbolics import DOMAIN


class _InTraining(torch.autograd.Function):
    """``training`` (in torch, and in the training graph), ``evaluated`` in the eval graph: exported as a marker
    (exported_graph.resolve_markers). Its gradient is the training value's: the graph's is the same."""

    graph_marker = True  # refusals._custom_functions: no hand-written backward that the graph would replace

    @staticmethod
    def forward(ctx, training, evaluated):
        return training.clone()

    @staticmethod
    def backward(ctx, gradient):
        return gradient, None

    @staticmethod
    def symbolic(g, training, evaluated):
        marked = g.op(f"{DOMAIN}::InTraining", training, evaluated)
        marked.setType(training.type())  # else torch's exporter warns that it cannot infer the marker's shape
        return marked


def in_training(training: torch.Tensor, evaluated: torch.Tensor) -> torch.Tensor:
    """``training``, which the eval graph replaces by ``evaluated`` (a value of the same shape)."""
    return _InTraining.apply(training, evaluated)


def changes_in_place(func) -> bool:
    """``Tensor.add_``, ``Tensor.__iadd__``, ``Tensor.__setitem__`` and the like."""
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))


def _written_tensor(func, args, kwargs):
    """The tensor ``func`` writes into: an in-place op's own, or its ``out=``; None for others."""
    if isinstance(kwargs.get("out"), torch.Tensor):
        return kwargs["out"]
    if changes_in_place(func) and args and isinstance(args[0], torch.Tensor):
        return args[0]
    return None


class BufferWrites(TorchFunctionMode):
    """While forward is traced, each write into one of ``buffers`` ({traced name: tensor}, persistent buffers the
    trace returns when written) made ``in_training`` (module docstring); ``marked`` names the buffers so written.
    A write given as ``out=`` is computed out of place and copied. A write into a view of one is refused: the trace
    holds it as a write of the view; so is F.batch_norm given them as running statistics in training, which writes
    them inside one op."""

    def __init__(self, buffers: dict):
        super().__init__()
        self.names = {id(tensor): name for name, tensor in buffers.items()}
        self.storages = {tensor.untyped_storage().data_ptr(): name for name, tensor in buffers.items()}
        self.marked = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._get_tracing_state() is None:
            return func(*args, **kwargs)
        if func is F.instance_norm:
            return self._instance_norm(*args, **kwargs)
        if func is F.batch_norm:
            self._refuse_own_statistics(args, kwargs)
        target = _written_tensor(func, args, kwargs)
        if target is None or id(target) not in self.names:
            if target is not None and target.untyped_storage().data_ptr() in self.storages:
                self._refuse_view_write(self.storages[target.untyped_storage().data_ptr()])
            return func(*args, **kwargs)
        before = target.clone()
        if kwargs.get("out") is target:  # computed out of place: the exporter has no form for most out= variants
            self._write(target, func(*args, **{key: value for key, value in kwargs.items() if key != "out"}), before)
            return target
        result = func(*args, **kwargs)
        self._write(target, target, before)
        return result

    def _write(self, buffer, value, before) -> None:
        """``buffer`` holds ``in_training(value, before)``, ``value`` detached (a write under no_grad)."""
        with torch.no_grad():
            buffer.copy_(in_training(value.detach(), before))
        self.marked.add(self.names[id(buffer)])

    def _instance_norm(self, x, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats=True,
                       momentum=0.1, eps=1e-5):  # fmt: skip
        """F.instance_norm; with running statistics and the instance's statistics (InstanceNorm with
        track_running_stats in training), their update written as torch's ``instance_norm`` does (each instance's
        ``momentum`` step, averaged over the batch; the variance unbiased), and the output in eval mode from them."""
        tracked = running_mean is not None and running_var is not None and id(running_mean) in self.names
        if not (tracked and use_input_stats):
            return F.instance_norm(x, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)
        output = F.instance_norm(x, None, None, weight, bias, True, momentum, eps)
        evaluated = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
        with torch.no_grad():
            values = x.detach().flatten(2)
            for buffer, statistic in ((running_mean, values.mean(-1)), (running_var, values.var(-1))):
                before = buffer.clone()
                self._write(buffer, (momentum * statistic + (1 - momentum) * buffer).mean(0), before)
        return in_training(output, evaluated)

    def _refuse_own_statistics(self, args, kwargs) -> None:
        """Refuses ``F.batch_norm`` in training given buffers as its running statistics (a module's own, not a
        BatchNorm module's): it writes them inside one op, which the trace holds as reading them only (and torch's
        kernel does not count the write in their version counters)."""
        bound = inspect.signature(F.batch_norm).bind(*args, **kwargs)
        statistics = [bound.arguments.get(name) for name in ("running_mean", "running_var")]
        written = [self.names[id(tensor)] for tensor in statistics if tensor is not None and id(tensor) in self.names]
        if written and bound.arguments.get("training", False):
            where = f"F.batch_norm, given them as its running statistics in training, at {forward_effects.user_location()}"
            raise ExportError(f"forward {_written_inside_one_op(written, where)}")

    @staticmethod
    def _refuse_view_write(name: str):
        raise ExportError(
            f"forward writes into a view of the buffer '{_state_name(name)}' at {forward_effects.user_location()}: orttrainer "
            "carries a write into a buffer itself to the next step (buffer.add_(...), buffer[index] = ..., "
            "out=buffer), not one through a view of it; write into the buffer, or train this model with torch"
        )


def refuse_unseen_writes(written, marked) -> None:
    """Refuses buffers forward wrote (``written``, by their version counters) where ``BufferWrites`` saw no write
    (``marked``): inside one op, which the trace holds as reading the buffer only."""
    unseen = [name for name in written if name not in marked]
    if unseen:
        raise ExportError(f"forward {_written_inside_one_op(unseen)}")


def _state_name(name: str) -> str:
    """A traced buffer's name as the model's state_dict has it (without the wrapper's prefix)."""
    return name[len(WRAPPED) :] if name.startswith(WRAPPED) else name


_UNSEEN_OP = ("an op the trace cannot see into (F.batch_norm or F.instance_norm given a module's own running "
              "statistics, in training)")


def _written_inside_one_op(names, op=_UNSEEN_OP) -> str:
    """Why the buffers ``names`` (traced names), written inside ``op``, cannot be so, and what the user can do."""
    return (
        f"writes the buffers {[_state_name(name) for name in names]} inside {op}: the graph would "
        "hold the op but not its write. Use nn.BatchNorm*d / nn.InstanceNorm*d modules, write the buffer with "
        "tensor ops (buffer.mul_(...).add_(...)), or train this model with torch"
    )
