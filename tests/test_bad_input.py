"""Bad input: a specific exception naming the culprit, raised before any state changes."""

import logging
import re

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import MLP, CNN, cnn_batch, mlp_batch
from parity import cpu_options, run_parity

from orttrainer import GradientBuildError, ORTTrainer, ORTTrainerOptions, RunError, optim
from orttrainer.export.refusals import ExportError

MLP_DESC = {"inputs": [("x", ["batch", 32]), ("label", ["batch"])], "outputs": [("loss", [], True), ("logits", ["batch", 10])]}


def make_trainer(model_desc=None, model=None, **kwargs):
    torch.manual_seed(0)
    return ORTTrainer(model or MLP(), model_desc, optim.SGDConfig(lr=0.1), loss_fn=kwargs.pop("loss_fn", F.cross_entropy),
                      options=cpu_options(), **kwargs)


def assert_untouched(trainer, before):
    info = trainer._train_step_info
    assert (info.step, info.optimization_step) == before[0]
    if trainer._training_session is not None:
        for name, tensor in trainer.state_dict(pytorch_format=True).items():
            assert torch.equal(tensor, before[1][name]), f"{name} changed"


def snapshot(trainer):
    info = trainer._train_step_info
    weights = trainer.state_dict(pytorch_format=True) if trainer._training_session is not None else {}
    return (info.step, info.optimization_step), weights


@pytest.mark.parametrize("initialized", [False, True])
def test_wrong_number_of_inputs(initialized):
    trainer = make_trainer(MLP_DESC)
    if initialized:
        trainer.train_step(*mlp_batch())
    before = snapshot(trainer)
    x, _ = mlp_batch()
    with pytest.raises(ValueError, match=r"expected 2 inputs \['x', 'label'\], got 1"):
        trainer.train_step(x)
    assert_untouched(trainer, before)


def test_a_batch_without_its_label_says_the_last_positional_input_is_the_label():
    """train_step(x) with a loss_fn and no model_desc: x went to the loss as the label, and the first step failed with
    torch's "forward() missing 1 required positional argument: 'x'", naming the input the user did pass."""
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    x, _ = mlp_batch()
    with pytest.raises(ValueError, match=r"MLP.forward needs \['x'\], which this batch does not give; with a loss_fn the "
                                         r"last positional input is the label"):  # fmt: skip
        trainer.train_step(x)


def test_float64_input_for_float32_is_refused_with_names():
    trainer = make_trainer(MLP_DESC)
    x, y = mlp_batch()
    trainer.train_step(x, y)
    before = snapshot(trainer)
    with pytest.raises(TypeError, match=r"input 'x' must be torch.float32, got torch.float64"):
        trainer.train_step(x.double(), y)
    assert_untouched(trainer, before)


def test_int32_labels_for_int64_are_refused_with_a_fix():
    trainer = make_trainer(MLP_DESC)
    x, y = mlp_batch()
    trainer.train_step(x, y)
    with pytest.raises(TypeError, match=r"input 'label' must be torch.int64, got torch.int32; convert it"):
        trainer.eval_step(x, y.int())


def test_shape_contradicting_a_static_dim():
    trainer = make_trainer(MLP_DESC)
    with pytest.raises(ValueError, match=r"input 'x' dimension 1 must be 32 .* got shape \[8, 31\]"):
        trainer.train_step(torch.randn(8, 31), torch.zeros(8, dtype=torch.long))
    assert trainer._training_session is None, "nothing may be built from a rejected batch"


def test_wrong_rank_and_inconsistent_symbolic_dims():
    trainer = make_trainer(MLP_DESC)
    with pytest.raises(ValueError, match=r"input 'x' must have 2 dimensions"):
        trainer.train_step(torch.randn(8, 32, 1), torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input 'label' dimension 0 \('batch'\) is 7, but another input has 'batch' = 8"):
        trainer.train_step(torch.randn(8, 32), torch.zeros(7, dtype=torch.long))


def test_non_scalar_loss():
    trainer = make_trainer(loss_fn=lambda output, label: F.cross_entropy(output, label, reduction="none"))
    with pytest.raises(ValueError, match=r"the loss output 'loss' must be a floating-point scalar, got shape \[8\]"):
        trainer.train_step(*mlp_batch())


def test_unknown_option_keys_name_their_path():
    with pytest.raises(ValueError, match=r"Invalid options: mixed_precision.enabeld: unknown field"):
        ORTTrainerOptions({"mixed_precision": {"enabeld": True}})
    with pytest.raises(ValueError, match=r"batch.gradient_accumulation_steps: min value is 1, got 0"):
        ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 0}})


def test_unknown_fetch_names():
    trainer = make_trainer(MLP_DESC)
    trainer.train_step(*mlp_batch())
    before = snapshot(trainer)
    trainer._train_step_info.fetches = ["logits", "logitz"]
    with pytest.raises(RuntimeError, match=r"invalid output names \['logitz'\]; outputs are \['loss', 'logits'\]"):
        trainer.train_step(*mlp_batch())
    trainer._train_step_info.fetches = []
    assert_untouched(trainer, before)


def test_fetches_select_outputs():
    trainer = make_trainer(MLP_DESC)
    trainer._train_step_info.fetches = ["logits"]
    logits = trainer.train_step(*mlp_batch())
    assert logits.shape == (8, 10)
    trainer._train_step_info.fetches = ["logits", "loss"]
    logits, loss = trainer.eval_step(*mlp_batch())
    assert logits.shape == (8, 10) and loss.shape == ()


def test_loss_fn_with_wrong_arity():
    with pytest.raises(TypeError, match=r"'loss_fn' must be either 'None' or a callable taking two arguments"):
        make_trainer(loss_fn=lambda output: output.sum())
    with pytest.raises(TypeError, match=r"'loss_fn'"):
        make_trainer(loss_fn=lambda a, b, c: a)


def test_export_failure_is_wrapped_and_chained():
    class Unexportable(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x) + torch.kthvalue(x, 2, 0).values.sum()  # aten::kthvalue has no ONNX symbolic

    from orttrainer.export.refusals import ExportError

    trainer = make_trainer(model=Unexportable(), loss_fn=F.mse_loss)
    with pytest.raises(ExportError, match=r"torch.onnx.export of Unexportable failed: .*aten::kthvalue") as caught:
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 2))
    assert caught.value.__cause__ is not None
    assert "\n" not in str(caught.value)  # one line: the exporter's dump of the traced graph stays in the cause
    assert trainer._training_session is None


class _KthValue(nn.Module):
    """torch.kthvalue, which the exporter cannot write (aten::kthvalue has no ONNX symbolic); prints while traced."""

    def forward(self, x):
        if torch.jit.is_tracing():
            print("forward printed this while traced")
        return x + torch.kthvalue(x, 2, 0).values.sum()


class _Repeat(nn.Module):
    def forward(self, x):
        return x.repeat(1, 2)  # a Tile node


class _WithBlock(nn.Module):
    """A Linear, then ``block`` (a ``_KthValue`` or ``_Repeat``)."""

    def __init__(self, block):
        super().__init__()
        self.fc, self.block = nn.Linear(4, 4), block

    def forward(self, x):
        return self.block(self.fc(x))


def test_an_op_the_exporter_cannot_write_is_named_with_its_module_and_line_and_nothing_printed(capfd, monkeypatch,
                                                                                                caplog):  # fmt: skip
    """torch's exporter printed its whole traced graph from C++ on stdout (hundreds of lines for a transformer) and
    named the op only. The error names the op, the module by its qualified name and the user's line; the graph goes
    to the 'orttrainer' logger at DEBUG; what forward prints still reaches stdout."""
    from orttrainer import progress

    monkeypatch.setattr(progress.logger, "handlers", [caplog.handler])
    caplog.set_level(logging.DEBUG, logger=progress.logger.name)
    trainer = make_trainer(model=_WithBlock(_KthValue()), loss_fn=F.mse_loss)
    message = (r"torch.onnx.export of _WithBlock failed: Exporting the operator 'aten::kthvalue' to ONNX opset version "
               r"17 is not supported, in module 'block' \(_KthValue\) at \S*test_bad_input.py:\d+: return x \+ "
               r"torch.kthvalue\(x, 2, 0\).values.sum\(\). torch's exporter has no ONNX form for aten::kthvalue: compute it "
               r"with other torch ops, or train this model with torch \(torch's traced graph is logged at DEBUG by the "
               r"'orttrainer' logger\)$")  # fmt: skip
    with pytest.raises(ExportError, match=message):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))
    printed = capfd.readouterr()
    assert printed.out == "forward printed this while traced\n" and printed.err == "", printed
    graph = [record.getMessage() for record in caplog.records if record.levelno == logging.DEBUG]
    assert len(graph) == 1 and graph[0].startswith("torch.onnx.export failed on this") and "aten::kthvalue" in graph[0]


def _bad_repeats(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its Tile repeated by a 2-d tensor, which ONNX Runtime's shape inference rejects."""
    tile = next(node for node in model.graph.node if node.op_type == "Tile")
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([[1, 2]], dtype=np.int64), "bad_repeats"))
    tile.input[1] = "bad_repeats"
    return model


_REJECTED_TILE = (r"at Tile \(node '/model/block/Tile', module 'block'\): \[ShapeInferenceError\] 'Repeats' input must "
                  r"be 1D tensor of type int64. The node is a step of the forward of module 'block' as the exporter "
                  r"wrote it: compute that step with other torch ops, or train this model with torch$")  # fmt: skip


def test_a_node_onnx_runtime_rejects_at_the_gradient_build_is_named_with_its_module():
    """ONNX Runtime's raw error (Mamba's: 'onnxruntime::python::addObjectMethodsForTraining(...) ... Node
    (/model/.../mixer/Tile_1) Op (Tile) [ShapeInferenceError] ...') names the op, node, module and what to do."""
    options = cpu_options({"_internal_use": {"extra_postprocess": _bad_repeats}})
    trainer = ORTTrainer(_WithBlock(_Repeat()), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=options)
    with pytest.raises(GradientBuildError, match=rf"^ONNX Runtime failed building the gradient graph {_REJECTED_TILE}"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 8))
    assert trainer._training_session is None


def test_a_node_onnx_runtime_rejects_at_session_creation_is_named_with_its_module(monkeypatch):
    """The same at a session's creation, ONNX Runtime's own exception class (Fail) then; the build's graphs passed."""
    from orttrainer.runtime import session

    class Rejecting(session.TorchBoundSession):
        def __init__(self, model, *args):
            super().__init__(_bad_repeats(model), *args)

    monkeypatch.setattr(session, "TorchBoundSession", Rejecting)
    trainer = ORTTrainer(_WithBlock(_Repeat()), None, optim.SGDConfig(lr=0.1), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(GradientBuildError, match=rf"^ONNX Runtime failed opening a session {_REJECTED_TILE}"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 8))


def _one_node_model(op_type, name, inputs, initializers=()):
    """A graph of one ``op_type`` node named ``name`` over ``inputs`` ({name: element type}, shape [3])."""
    node = onnx.helper.make_node(op_type, list(inputs) + [tensor.name for tensor in initializers], ["y"], name=name)
    graph = onnx.helper.make_graph([node], "g", [onnx.helper.make_tensor_value_info(input_name, elem_type, [3])
                                                 for input_name, elem_type in inputs.items()],
                                   [onnx.helper.make_empty_tensor_value_info("y")], list(initializers))  # fmt: skip
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)


_FLOAT, _INT64, _STRING = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64, onnx.TensorProto.STRING


@pytest.mark.parametrize("model, message", [
    (_one_node_model("Tile", "/model/block/Tile", {"x": _FLOAT},
                     [onnx.numpy_helper.from_array(np.array([[1, 2]], dtype=np.int64), "r")]),
     r"at Tile \(node '/model/block/Tile', module 'block'\): \[ShapeInferenceError\] 'Repeats' input must be 1D tensor "
     r"of type int64. The node is a step of the forward of module 'block'"),
    (_one_node_model("Tilex", "/model/block/Tilex", {"x": _FLOAT}),
     r"at Tilex \(node '/model/block/Tilex', module 'block'\): No Op registered for Tilex with domain_version of 17"),
    (_one_node_model("Relu", "/model/block/Relu_Grad/Relu_0", {"x": _STRING}),
     r"at Relu \(node '/model/block/Relu_Grad/Relu_0', module 'block'\): Type Error: Type 'tensor\(string\)' of input "
     r"parameter \(x\) of operator \(Relu\) in node \(/model/block/Relu_Grad/Relu_0\) is invalid. The node is ONNX "
     r"Runtime's gradient of a step of the forward of module 'block'"),
    (_one_node_model("Add", "/model/Add", {"x": _FLOAT, "z": _INT64}),
     r"at Add \(node '/model/Add'\): Type Error: Type parameter \(T\) of Optype \(Add\) bound to different types .* "
     r"The node is a step of the forward of the model as the exporter wrote it: compute that step with other torch ops"),
], ids=["shape-inference", "unknown-op", "input-type", "types-bound"])  # fmt: skip
def test_each_way_onnx_runtime_names_a_node_it_rejects_is_read(model, message):
    """ONNX Runtime's messages for a node its checks reject, as a session's creation raises them (Fail, InvalidGraph)."""
    from orttrainer.graph import graph_errors

    with pytest.raises(graph_errors.ONNX_RUNTIME_ERRORS) as raised:
        onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    error = graph_errors.node_error(raised.value, "opening a session")
    assert isinstance(error, GradientBuildError) and re.search(rf"^ONNX Runtime failed opening a session {message}",
                                                               str(error)), error  # fmt: skip
    assert graph_errors.node_error(RuntimeError("no node named here"), "opening a session") is None


def test_op_without_gradient_names_op_and_module():
    class Sampler(nn.Module):  # grid_sample: onnxruntime-training has no gradient for GridSample
        def forward(self, x):
            image = x.reshape(x.shape[0], 1, 5, 8)
            grid = torch.tanh(x[:, :, :4]).reshape(x.shape[0], 5, 2, 2)
            return F.grid_sample(image, grid, align_corners=False).reshape(x.shape[0], 5, 2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.sampler = Sampler()
            self.out = nn.Linear(2, 8)

        def forward(self, x):
            return self.out(self.sampler(x))

    class WithRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 8)
            self.block = Block()
            self.head = nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.block(self.fc(x))).squeeze(-1)


    trainer = make_trainer(model=WithRNN(), loss_fn=F.mse_loss)
    with pytest.raises(GradientBuildError, match=r"no gradient for these ops .*: GridSample \(node "
                                                 r"'/model/block/sampler/GridSample', module 'block.sampler'\)"):
        trainer.train_step(torch.randn(3, 5, 4), torch.randn(3, 5))
    assert trainer._training_session is None


def test_wrong_constructor_arguments():
    with pytest.raises(TypeError, match="'optim_config' is required"):
        ORTTrainer(MLP(), None, {"lr": 0.1})
    with pytest.raises(ValueError, match="'model' must be either 'torch.nn.Module' or 'onnx.ModelProto', got str"):
        ORTTrainer("model.onnx", None, optim.SGDConfig())
    with pytest.raises(ValueError, match=r"Invalid model_desc: inputs\[0\]: must be a tuple with size 2"):
        ORTTrainer(MLP(), {"inputs": [["x", [1]]], "outputs": [("loss", [], True)]}, optim.SGDConfig())


@pytest.mark.parametrize("wrap, message", [
    (torch.compile, r"'model' must be the module to train, not torch.compile's wrapper of it, got OptimizedModule .*"
                    r"Pass model._orig_mod \(the MLP it wraps\)"),
    (nn.DataParallel, r"'model' must be the module to train, not a DataParallel wrapper of it, got DataParallel .*"
                      r"Pass model.module \(the MLP it wraps\)"),
], ids=["torch.compile", "DataParallel"])  # fmt: skip
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch.compile's import
def test_a_wrapped_module_is_refused_naming_the_module_inside(wrap, message):
    """A torch loop often holds its model as torch.compile(model) or DataParallel(model); the trainer failed at the
    first step with an error about forward's positional inputs and a model_desc, which named neither the wrapper nor
    the fix."""
    with pytest.raises(TypeError, match=message):
        ORTTrainer(wrap(MLP()), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())


def test_cuda_device_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the error is for machines without it")
    with pytest.raises(RuntimeError, match=r"device.id is 'cuda' but torch sees no CUDA/ROCm device"):
        ORTTrainer(MLP(), None, optim.SGDConfig(), loss_fn=F.cross_entropy, options=ORTTrainerOptions({"device": {"id": "cuda"}}))


def test_batchnorm_with_cumulative_average_is_refused():
    model = CNN()
    model.features[1].momentum = None
    trainer = make_trainer(model=model)
    with pytest.raises(NotImplementedError, match=r"module 'features.1' \(BatchNorm2d\) uses momentum=None"):
        trainer.train_step(*cnn_batch())


def test_a_frozen_batchnorm_with_cumulative_average_trains_like_torch():
    """In eval() it never updates its statistics, so its momentum=None means nothing (it was refused)."""
    torch.manual_seed(0)
    model = CNN()
    model.features[1].momentum = None
    model.features[1].eval()
    generator = torch.Generator().manual_seed(0)
    run_parity(model, [cnn_batch(generator=generator) for _ in range(3)], optim.SGDConfig(lr=0.1),
               lambda parameters: torch.optim.SGD(parameters, lr=0.1), loss_fn=F.cross_entropy)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_weights_that_are_not_float32_are_refused_with_names(dtype):
    """ONNX Runtime's gradient builder fails on them with a C++ message naming its own nodes."""
    model = MLP()
    model.fc2.to(dtype)
    trainer = make_trainer(model=model)
    with pytest.raises(TypeError, match=rf"must be float32, and 'fc2.weight' is {dtype}, 'fc2.bias' is {dtype} .*model.float\(\)"):
        trainer.train_step(*mlp_batch())
    assert model.fc2.weight.dtype == dtype


@pytest.mark.parametrize(
    "node_name, module",
    [
        ("/model/layer/self_attn/Softmax", "layer.self_attn"),
        ("/model/features/features.1/Conv", "features.1"),
        ("/model/model.0/Conv", "0"),
        ("/model/model.0/model.0.1/Conv", "0.1"),
        ("/model/model/layers.0/self_attn/Softmax", "model.layers.0.self_attn"),  # an attribute named model (Llama)
        ("/model/model/model.2/Gemm", "model.2"),
        ("/model/block/rnn/RNN", "block.rnn"),
        ("/model/Einsum", ""),
        ("MatMul_0", ""),
    ],
)
def test_module_path_from_exporter_scopes(node_name, module):
    from orttrainer.graph.graph_errors import module_path

    assert module_path(node_name) == module


@pytest.mark.parametrize("which, value, message", [
    ("token", 50, r"input 'tokens' holds 50 at index \[0, 0\], outside 0..49: it is read by Gather \(node '/model/tokens/Gather', module 'tokens'\)"),
    ("token", -1, r"input 'tokens' holds -1 at index \[0, 0\], outside 0..49"),
    ("label", 77, r"input 'label' holds 77 at index \[0, 0\], outside 0..49 or -100 \(ignore_index\): it is read by SoftmaxCrossEntropyLoss"),
])  # fmt: skip
def test_out_of_range_ids_and_targets_name_the_input_and_range_and_change_nothing(which, value, message, capfd):
    from models import Encoder, lm_loss, token_batch

    trainer = make_trainer(model=Encoder(), loss_fn=lm_loss)
    tokens, labels = token_batch()
    trainer.train_step(tokens, labels)
    before = snapshot(trainer)
    capfd.readouterr()
    (tokens if which == "token" else labels)[0, 0] = value
    with pytest.raises(ValueError, match=message):
        trainer.train_step(tokens, labels)
    with pytest.raises(ValueError, match=message):
        trainer.eval_step(tokens, labels)
    assert_untouched(trainer, before)
    assert "onnxruntime" not in capfd.readouterr().err


class Folds(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        return self.fc(x).reshape(-1, 3, 4)


def test_onnx_runtime_failure_names_the_op_and_module_and_changes_nothing(capfd, tmp_path):
    """A failure no check catches before the run (here a reshape that does not fit) reads as one line.
    A torch module's new batch shape is exported first, so torch's own error comes first."""
    trainer = make_trainer(model=Folds(), loss_fn=lambda out, y: (out * y).sum())
    trainer.train_step(torch.randn(2, 6), torch.randn(1, 3, 4))
    with pytest.raises(RuntimeError, match=r"shape '\[-1, 3, 4\]' is invalid for input of size 18"):
        trainer.train_step(torch.randn(3, 6), torch.randn(1, 3, 4))
    path = tmp_path / "folds.onnx"
    torch.onnx.export(Folds(), (torch.randn(2, 6),), path, dynamo=False, input_names=["x"], output_names=["loss"],
                      dynamic_axes={"x": {0: "batch"}})  # fmt: skip
    graph_only = ORTTrainer(onnx.load(path), {"inputs": [("x", ["batch", 6])], "outputs": [("loss", [1, 3, 4], True)]},
                            optim.SGDConfig(lr=0.1), options=cpu_options())  # fmt: skip
    before = snapshot(graph_only)
    capfd.readouterr()
    with pytest.raises(RuntimeError, match=r"ONNX Runtime failed on this batch in Reshape \(node '/Reshape'"):
        graph_only.train_step(torch.randn(3, 6))
    assert_untouched(graph_only, before)
    assert "onnxruntime" not in capfd.readouterr().err


def test_an_empty_batch_that_onnx_runtime_refuses_is_named_and_changes_nothing():
    """torch trains on a batch of 0 rows; ONNX Runtime's Gemm gradient refuses one. The RunError says the
    batch is empty and which input, the trainer is as it was, and the next batch trains."""
    trainer = make_trainer()
    x, label = mlp_batch()
    trainer.train_step(x, label)
    before = snapshot(trainer)
    with pytest.raises(RunError, match=r"in Gemm .* The batch is empty \(input 'x' of shape \(0, 32\), input 'label' "
                                       r"of shape \(0,\)\): .* leave empty batches out"):  # fmt: skip
        trainer.train_step(x[:0], label[:0])
    assert_untouched(trainer, before)
    loss, logits = trainer.eval_step(x[:0], label[:0])  # evaluation runs, and gives torch's NaN mean over no rows
    assert torch.isnan(loss) and logits.shape == (0, 10)
    trainer.train_step(x, label)
    assert trainer._train_step_info.step == before[0][0] + 1


def test_missing_loss_fn_for_a_model_returning_logits_says_what_is_missing():
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), options=cpu_options())
    with pytest.raises(ValueError, match=r"no loss_fn was given, so the model's first output is taken as the loss, but it has "
                                         r"shape \[8, 10\]"):  # fmt: skip
        trainer.train_step(mlp_batch()[0])


def test_extra_postprocess_is_called_on_the_exported_graph_and_its_result_checked():
    seen = []
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"extra_postprocess": seen.append}})
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=options)
    trainer.train_step(*mlp_batch())
    assert len(seen) == 1 and {value.name for value in seen[0].graph.input} >= {"fc1.weight", "head.bias"}
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "_internal_use": {"extra_postprocess": lambda model: "oops"}})
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=options)
    with pytest.raises(TypeError, match=r"extra_postprocess must change the onnx.ModelProto in place or return one, got str"):
        trainer.train_step(*mlp_batch())


@pytest.mark.parametrize("config, settings, message", [
    (optim.AdamConfig(params=[{"params": ["fc1.weight", "fc2.wieght"], "lambda_coef": 0.1}]), {},
     r"optim_config.params\[0\]\['params'\] names 'fc2.wieght', which is not a parameter of MLP: did you mean "
     r"'fc2.weight'"),
    (optim.SGDConfig(lr=0.1), {"utils": {"frozen_weights": ["fc1.bais"]}},
     r"options utils.frozen_weights names 'fc1.bais', which is not a parameter of MLP: did you mean 'fc1.bias'"),
    (optim.SGDConfig(lr=0.1), {"utils": {"frozen_weights": ["encoder.layer.0"]}},
     r"names 'encoder.layer.0', which is not a parameter of MLP: its parameters are 'fc1.weight', 'fc1.bias'"),
], ids=["group", "frozen", "nothing-near"])  # fmt: skip
def test_weight_names_that_are_not_the_models_are_refused_at_construction(config, settings, message):
    """A misspelled name in a parameter group or in utils.frozen_weights trained that weight with the defaults (or
    not frozen), without a word; the legacy code let it go too."""
    with pytest.raises(ValueError, match=message):
        ORTTrainer(MLP(), None, config, loss_fn=F.cross_entropy, options=cpu_options(settings))


def test_weight_names_of_an_onnx_model_are_its_initializers(tmp_path):
    from models import WithLoss, training_onnx

    proto = training_onnx(WithLoss(MLP()), mlp_batch(), tmp_path / "mlp.onnx")
    frozen = [proto.graph.initializer[0].name]
    ORTTrainer(proto, None, optim.SGDConfig(lr=0.1), options=cpu_options({"utils": {"frozen_weights": frozen}}))
    with pytest.raises(ValueError, match=r"utils.frozen_weights names 'fc9.weight', which is not a parameter of ModelProto"):
        ORTTrainer(proto, None, optim.SGDConfig(lr=0.1), options=cpu_options({"utils": {"frozen_weights": ["fc9.weight"]}}))


class Checkpointed(nn.Module):
    def __init__(self, reentrant=True):
        super().__init__()
        self.fc, self.out, self.reentrant = nn.Linear(32, 32), nn.Linear(32, 10), reentrant

    def forward(self, x):
        return self.out(torch.utils.checkpoint.checkpoint(lambda h: torch.tanh(self.fc(h)), x, use_reentrant=self.reentrant))


class Lazy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.LazyLinear(16), nn.Linear(16, 10)

    def forward(self, x):
        return self.out(torch.relu(self.fc(x)))


def _scripted_mlp(whole):
    model = MLP()
    if whole:
        return torch.jit.script(model)
    model.fc2 = torch.jit.script(model.fc2)
    return model


@pytest.mark.parametrize("make, error, message", [
    (Checkpointed, ExportError, r"unordered_map::at\. torch's exporter fails this way on "
                                r"torch.utils.checkpoint\(\.\.\., use_reentrant=True\).*pass use_reentrant=False"),
    (Lazy, ExportError, r"module 'fc' \(LazyLinear\) creates its parameters at its first forward: run the model once"),
    (lambda: _scripted_mlp(whole=False), ExportError, r"module 'fc2' is a torch.jit.script module"),
    (lambda: _scripted_mlp(whole=True), ExportError, r"module 'MLP' is a torch.jit.script module"),
], ids=["reentrant-checkpoint", "lazy-module", "scripted-submodule", "scripted-model"])  # fmt: skip
def test_modules_the_exporter_or_runtime_fail_on_are_refused_saying_what_to_change(make, error, message):
    trainer = ORTTrainer(make(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(error, match=message):
        trainer.train_step(*mlp_batch())


def test_checkpoint_without_reentrance_trains_like_torch():
    """The fix the reentrant checkpoint's refusal names."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    run_parity(Checkpointed(reentrant=False), [mlp_batch(generator=generator) for _ in range(3)], optim.SGDConfig(lr=0.1),
               lambda parameters: torch.optim.SGD(parameters, lr=0.1), loss_fn=F.cross_entropy)  # fmt: skip


def test_a_loss_listed_after_other_outputs_with_a_loss_fn_is_refused_saying_to_list_it_first():
    desc = {"inputs": [("x", ["batch", 32]), ("label", ["batch"])], "outputs": [("logits", ["batch", 10]), ("loss", [], True)]}
    trainer = ORTTrainer(MLP(), desc, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(ValueError, match=r"with a loss_fn the loss is the first output .* model_desc lists 'loss' at "
                                         r"position 1 of its outputs: list it first"):  # fmt: skip
        trainer.train_step(*mlp_batch())


def test_eval_step_on_a_single_sample_of_a_batch_norm_model_says_why_and_what_to_do():
    """torch's eval mode takes one sample; the graphs of a new batch shape come from a training-mode trace, where
    BatchNorm refuses it: torch's bare ValueError came out of the trainer."""
    model = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    with pytest.raises(ExportError, match=r"Expected more than 1 value per channel when training.*eval_step's too, from "
                                          r"forward in training mode.*use batches of two or more"):  # fmt: skip
        trainer.eval_step(*mlp_batch(batch=1))


def test_what_the_user_passed_in_is_never_changed(tmp_path):
    import copy

    from models import CNN, WithLoss, training_onnx

    settings = {"device": {"id": "cpu"}, "mixed_precision": {"enabled": True}, "utils": {"frozen_weights": []}}
    options = ORTTrainerOptions(copy.deepcopy(settings))
    model = CNN()
    trainer = ORTTrainer(model, None, optim.AdamConfig(lr=1e-3), loss_fn=F.cross_entropy, options=options)
    trainer.train_step(*cnn_batch())
    assert options.mixed_precision.loss_scaler is None and options.utils.frozen_weights == []
    assert trainer.options.mixed_precision.loss_scaler is not None
    proto = training_onnx(WithLoss(CNN()), cnn_batch(), tmp_path / "cnn.onnx")
    original = proto.SerializeToString()
    onnx_trainer = ORTTrainer(proto, None, optim.SGDConfig(lr=0.1), options=cpu_options())
    onnx_trainer.train_step(*cnn_batch())
    assert proto.SerializeToString() == original


class SqueezedBatch(nn.Module):
    """squeeze(0) of the batch dimension, dynamic in the graph: the exporter writes an ONNX If on its size."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc(x.squeeze(0))


def test_control_flow_before_the_loss_is_refused_instead_of_aborting_the_process():
    """onnxruntime-training 1.19's gradient builder kills the process on an If (a C++ assertion)."""
    trainer = ORTTrainer(SqueezedBatch(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    with pytest.raises(GradientBuildError, match=r"If \(node '/model/If'\): control flow, which the exporter writes e\.g\. "
                                                 r"for squeeze\(\)"):
        trainer.train_step(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
