"""Errors a user can act on: argument checks raise TypeError/ValueError (never a bare assert,
which ``python -O`` strips), name the argument, the value given and the fix; the error types
users catch are importable from ``orttrainer``."""

import ast
import pathlib
import subprocess
import sys

import onnx
import pytest
import torch
import torch.nn.functional as F

import orttrainer
from orttrainer import ORTTrainer, ORTTrainerOptions, TrainStepInfo, optim

PACKAGE = pathlib.Path(orttrainer.__file__).parent


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(model=None), TypeError,
         r"'model' is required and must be either a 'torch.nn.Module' or ONNX model, got None\. Pass the torch.nn.Module to train"),
        (dict(model="model.onnx"), ValueError,
         r"'model' must be either 'torch.nn.Module' or 'onnx.ModelProto', got str 'model.onnx'\. .*onnx.load\(path\)"),
        (dict(model_desc=[("x", [4])]), TypeError,
         r"'model_desc' must be a 'dict' \(or None to infer it\), got list \[\('x', \[4\]\)\]\. Pass \{'inputs'"),
        (dict(optim_config={"lr": 0.1}), TypeError,
         r"'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig', got dict \{'lr': 0.1\}\. "
         r"Pass e.g. optim.SGDConfig\(lr=0.001\)"),
        (dict(loss_fn=lambda output: output.sum()), TypeError,
         r"'loss_fn' must be either 'None' or a callable taking two arguments \(output, label\), got function .*\. "
         r"Pass a function such as loss_fn\(output, label\)"),
        (dict(loss_fn="mse"), TypeError, r"'loss_fn' must be either 'None' or a callable .*, got str 'mse'"),
        (dict(options={"device": {"id": "cpu"}}), TypeError,
         r"'options' must be an 'ORTTrainerOptions', got dict \{'device': \{'id': 'cpu'\}\}\. Wrap the option dict: "
         r"options=ORTTrainerOptions\(\{\.\.\.\}\)"),
        (dict(model=onnx.ModelProto(), loss_fn=F.mse_loss), ValueError,
         r"'loss_fn' must not be specified when 'model' is an ONNX model, got function .*mse_loss.*\. .*pass loss_fn=None"),
    ],
)
def test_trainer_constructor_checks(arguments, error, message):
    given = dict(model=torch.nn.Linear(4, 2), model_desc=None, optim_config=optim.SGDConfig(), loss_fn=F.mse_loss,
                 options=ORTTrainerOptions({"device": {"id": "cpu"}}))
    given.update(arguments)
    with pytest.raises(error, match=message):
        ORTTrainer(**given)


def test_unimplemented_options_say_how_to_turn_them_off():
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "distributed": {"enable_adasum": True}})
    with pytest.raises(NotImplementedError, match=r"not implement these options yet: distributed.enable_adasum\. Remove them"):
        ORTTrainer(torch.nn.Linear(4, 2), None, optim.SGDConfig(), loss_fn=F.mse_loss, options=options)


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        (dict(optimizer_config=None), TypeError, r"optimizer_config must be an optim config, got None\. Pass the trainer's optim_config"),
        (dict(all_finite=1), TypeError, r"all_finite must be a bool, got int 1\. Pass all_finite=True or False"),
        (dict(fetches="loss"), TypeError, r"fetches must be a list of str, got str 'loss'\. Pass output names, e.g. fetches=\['loss'\]"),
        (dict(fetches=["loss", 1]), TypeError, r"fetches\[1\] must be a str, got int 1\."),
        (dict(optimization_step=-1), ValueError, r"optimization_step must be an int >= 0, got int -1\. Pass a count of steps"),
        (dict(step=2.0), TypeError, r"step must be an int >= 0, got float 2.0\. Pass a count of steps, e.g. step=0"),
    ],
)
def test_train_step_info_checks(arguments, error, message):
    given = dict(optimizer_config=optim.SGDConfig())
    given.update(arguments)
    with pytest.raises(error, match=message):
        TrainStepInfo(**given)


def test_error_types_users_catch_are_exported():
    from orttrainer import checkpoint
    from orttrainer.runtime import cuda_libraries, session
    from orttrainer.update import distributed
    from orttrainer.export import refusals, verify
    from orttrainer.graph import graph_errors

    assert orttrainer.CheckpointError is checkpoint.CheckpointError
    assert orttrainer.ExportError is refusals.ExportError
    assert orttrainer.GradientBuildError is graph_errors.GradientBuildError
    assert orttrainer.RunError is graph_errors.RunError
    assert orttrainer.RankWriteError is distributed.RankWriteError
    assert orttrainer.TorchMismatchError is verify.TorchMismatchError
    assert orttrainer.GPULibraryError is cuda_libraries.GPULibraryError
    assert orttrainer.ProviderFallbackError is session.ProviderFallbackError
    assert {"CheckpointError", "ExportError", "GradientBuildError", "RunError", "RankWriteError", "TorchMismatchError",
            "GPULibraryError", "ProviderFallbackError"} <= set(orttrainer.__all__)


def test_no_assert_statements_in_the_package():
    """``python -O`` removes asserts, so a check written as one would silently stop checking."""
    found = [f"{path.relative_to(PACKAGE)}:{node.lineno}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Assert)]
    assert found == []


def test_checks_survive_python_dash_o():
    code = ("from orttrainer import optim\n"
            "try:\n    optim.AdamConfig(alpha=-1.0)\nexcept ValueError as error:\n    print(type(error).__name__, error)\n")
    result = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=300)
    assert result.stdout.startswith("ValueError 'alpha' must be a non-negative number, got float -1.0."), result.stderr
