"""What ORTTrainer's constructor accepts: a TypeError for a wrong type, a ValueError for a wrong value, each naming
the argument, the value and a fix, before anything is built."""

import difflib
import inspect

import onnx
import torch

from ..argument_checks import argument_error, check_argument
from ..optim._from_torch import equivalent_config
from ..optim.config import _OptimizerConfig
from .options import ORTTrainerOptions


def check_trainer_arguments(model, model_desc, optim_config, loss_fn, options):
    """ORTTrainer's argument checks, in the legacy order: TypeError for a wrong type, ValueError for a wrong value."""
    model_fix = "Pass the torch.nn.Module to train, or onnx.load(path) for an ONNX file."
    if model is None:
        raise argument_error(TypeError, "'model' is required and must be either a 'torch.nn.Module' or ONNX model",
                              model, model_fix)
    check_argument(model_desc, (dict, type(None)), "'model_desc' must be a 'dict' (or None to infer it)",
                    "Pass {'inputs': [(name, shape), ...], 'outputs': [(name, shape, is_loss), ...]} or None.")
    if isinstance(optim_config, torch.optim.Optimizer):
        raise argument_error(TypeError, "'optim_config' must be an orttrainer.optim config, not a torch optimizer",
                              optim_config, equivalent_config(optim_config, model)[2])  # fmt: skip
    check_argument(optim_config, _OptimizerConfig,
                    "'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig'",
                    "Pass e.g. optim.SGDConfig(lr=0.001) or optim.AdamConfig(lr=0.001) from orttrainer.optim.")
    if loss_fn is not None and not (callable(loss_fn) and _accepts_two_arguments(loss_fn)):
        raise argument_error(TypeError, "'loss_fn' must be either 'None' or a callable taking two arguments (output, label)",
                              loss_fn, "Pass a function such as loss_fn(output, label) -> scalar loss tensor, or None.")
    check_argument(options, (ORTTrainerOptions, type(None)), "'options' must be an 'ORTTrainerOptions'",
                    "Wrap the option dict: options=ORTTrainerOptions({...}).")
    if isinstance(model, onnx.ModelProto):
        if loss_fn is not None:
            raise argument_error(ValueError, "'loss_fn' must not be specified when 'model' is an ONNX model", loss_fn,
                                  "Compute the loss inside the ONNX graph (flag its output is_loss=True in model_desc) "
                                  "and pass loss_fn=None.")
    elif not isinstance(model, torch.nn.Module):
        raise argument_error(ValueError, "'model' must be either 'torch.nn.Module' or 'onnx.ModelProto'", model, model_fix)
    else:
        _refuse_wrapped_module(model)
    _check_weight_names(model, optim_config, options)


def _refuse_wrapped_module(model: torch.nn.Module) -> None:
    """torch.compile's and data parallelism's wrappers change how torch runs a module, not what it computes, and
    orttrainer does both jobs itself: the module to pass is the one inside (its state_dict names have no wrapper's
    prefix). (A TorchScript module is refused at the export, with its scripted submodules: export/refusals.py.)"""
    inner = getattr(model, "_orig_mod", None) if type(model).__name__ == "OptimizedModule" else None
    if isinstance(inner, torch.nn.Module):
        raise argument_error(TypeError, "'model' must be the module to train, not torch.compile's wrapper of it", model,
                              f"Pass model._orig_mod (the {type(inner).__name__} it wraps): orttrainer runs the "
                              "module with ONNX Runtime in torch.compile's place.")  # fmt: skip
    if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        raise argument_error(TypeError, f"'model' must be the module to train, not a {type(model).__name__} wrapper of "
                              "it", model, f"Pass model.module (the {type(model.module).__name__} it wraps): under "
                              "torchrun, orttrainer averages the ranks' gradients itself.")  # fmt: skip


def _check_weight_names(model, optim_config, options) -> None:
    """Every weight a params group of ``optim_config`` or ``utils.frozen_weights`` names must be one of the model's
    parameters (an ONNX model's initializers): a misspelled name would leave its weight trained with the defaults,
    without a word."""
    if isinstance(model, onnx.ModelProto):
        known = [init.name for init in model.graph.initializer]
    else:
        known = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    named = [(f"optim_config.params[{index}]['params']", name)
             for index, group in enumerate(optim_config.params) for name in group["params"]]  # fmt: skip
    if options is not None:
        named += [("options utils.frozen_weights", name) for name in options.utils.frozen_weights]
    for where, name in named:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=3)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"its parameters are {_first_names(known)}"
            raise ValueError(f"{where} names {name!r}, which is not a parameter of {type(model).__name__}: {hint}")


def _first_names(names, shown=6) -> str:
    listed = ", ".join(map(repr, names[:shown]))
    return f"{listed}, ... ({len(names)} in all)" if len(names) > shown else listed or "none"


def _accepts_two_arguments(function) -> bool:
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (some builtins): let the call decide
        return True
    return True
