"""ONNX Runtime's on-device training API, set up the way its documentation shows."""

import tempfile
from pathlib import Path

import onnx


def on_device_training(exported: onnx.ModelProto, requires_grad, loss, frozen=None):
    """generate_artifacts (AdamW) for ``exported``, then a ready (Module, Optimizer) pair; the
    artifacts' folder is removed once they are loaded.

    The artifacts are written at IR 14 by onnx 1.23, which ONNX Runtime 1.19 refuses to
    load, so they are patched down to IR 10 first (a user of the API has to do the same).
    """
    from onnxruntime.training import api, artifacts

    with tempfile.TemporaryDirectory() as directory:
        artifacts.generate_artifacts(exported, requires_grad=requires_grad, frozen_params=frozen, loss=loss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=directory)
        for path in Path(directory).glob("*.onnx"):
            artifact = onnx.load(path)
            artifact.ir_version = min(artifact.ir_version, 10)
            onnx.save(artifact, path)
        state = api.CheckpointState.load_checkpoint(f"{directory}/checkpoint")
        module = api.Module(f"{directory}/training_model.onnx", state, f"{directory}/eval_model.onnx")
        optimizer = api.Optimizer(f"{directory}/optimizer_model.onnx", module)
    module.train()
    return module, optimizer
