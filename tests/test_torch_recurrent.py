"""LSTMs, GRUs and RNNs on torch's kernels inside the training graph (orttrainer/runtime/torch_recurrent.py).

The training graph's LSTMTraining/LSTMGrad and GRUTraining/GRUGrad nodes, and an RNN with its
gradient placeholder, run as torch's aten::lstm / aten::gru / aten::rnn_tanh / aten::rnn_relu and
their autograd; trained models equal a plain torch loop (loss and every state_dict key, step by
step). The layout conversions (gate order, directions) are checked against ONNX Runtime's own LSTM,
GRU and RNN kernels.
"""

import functools

import numpy as np
import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper
from parity import cpu_options, run_parity

from orttrainer import ORTTrainer, optim
from orttrainer.runtime import torch_ops
from orttrainer.graph.graph_errors import GradientBuildError
from orttrainer.runtime.torch_convolutions import SplitSession
from orttrainer.graph.nodes_for_torch import GRU, LSTM, RNN
from orttrainer.runtime.torch_recurrent import onnx_parameter_gradients, recurrent, torch_parameters


class Tagger(nn.Module):
    """Embedding -> LSTM or GRU (``lstm`` keyword arguments) -> per-token classes."""

    def __init__(self, initial_state=False, layer=nn.LSTM, **lstm):
        super().__init__()
        self.tokens = nn.Embedding(50, 12)
        self.lstm = layer(12, 10, batch_first=True, **lstm)
        width = 10 * (2 if lstm.get("bidirectional") else 1)
        self.head = nn.Linear(width, 5)
        directions = (2 if lstm.get("bidirectional") else 1) * lstm.get("num_layers", 1)
        states = 2 if layer is nn.LSTM else 1
        self.initial = nn.Parameter(torch.randn(states, directions, 1, 10) * 0.1) if initial_state else None

    def forward(self, tokens):
        if self.initial is None:
            states, _ = self.lstm(self.tokens(tokens))
        else:
            initial = [state.expand(-1, tokens.shape[0], -1).contiguous() for state in self.initial]
            states, _ = self.lstm(self.tokens(tokens), tuple(initial) if len(initial) == 2 else initial[0])
        return self.head(states)


def _loss(scores, labels):
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), labels.reshape(-1))


def _batches(shapes):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 50, shape, generator=generator), torch.randint(0, 5, shape, generator=generator))
            for shape in shapes]  # fmt: skip


RELU_RNN = functools.partial(nn.RNN, nonlinearity="relu")
LAYERS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn-tanh": nn.RNN, "rnn-relu": RELU_RNN}
KIND_OF_LAYER = {"lstm": LSTM, "gru": GRU, "rnn-tanh": RNN, "rnn-relu": RNN}

SETTINGS = {"one-layer": {}, "two-layer-bidirectional": {"bidirectional": True, "num_layers": 2}, "no-bias": {"bias": False},
            "trained-initial-state": {"initial_state": True, "bidirectional": True}}  # fmt: skip


@pytest.mark.parametrize("layer_name", LAYERS)
@pytest.mark.parametrize("name", SETTINGS)
def test_recurrent_layer_trains_like_torch_on_torchs_kernels(layer_name, name):
    """(ONNX Runtime's own GRU gradient takes one direction only, and it has none for RNN: the bidirectional GRU and
    every RNN could not train before.)"""
    settings = {**SETTINGS[name], "layer": LAYERS[layer_name]}
    torch.manual_seed(0)
    trainer, _ = run_parity(Tagger(**settings), _batches([(4, 9), (3, 6), (4, 9)]), optim.SGDConfig(lr=0.5),
                            functools.partial(torch.optim.SGD, lr=0.5), loss_fn=_loss)  # fmt: skip
    train_session = list(trainer._graphs._graphs.values())[-1].runtime.train_session
    assert isinstance(train_session, SplitSession), "the gradient must not run on ONNX Runtime's LSTMGrad/GRUGrad"
    on_torch = {node.op_type for node in train_session._model.graph.node
                if node.name in train_session.on_torch and not torch_ops.runs_on_torch(node)}  # fmt: skip
    kind = KIND_OF_LAYER[layer_name]
    assert on_torch == {kind.forward, kind.backward}, on_torch


@pytest.mark.parametrize("layer", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
@pytest.mark.parametrize("name", SETTINGS)
def test_the_exporters_gate_reordering_is_folded_for_one_direction(layer, name):
    """A one-direction layer's W and R reach the torch steps as torch's weights (the exporter's Split/Concat and its
    gradient's SplitTraining/Concat taken out), and their gradients leave as torch computed them; a bidirectional
    layer keeps the reordering. Both train like torch (the parity test above)."""
    settings = {**SETTINGS[name], "layer": layer}
    torch.manual_seed(0)
    trainer, _ = run_parity(Tagger(**settings), _batches([(4, 9), (3, 6)]), optim.SGDConfig(lr=0.5),
                            functools.partial(torch.optim.SGD, lr=0.5), loss_fn=_loss)  # fmt: skip
    session = list(trainer._graphs._graphs.values())[-1].runtime.train_session
    kind = LSTM if layer is nn.LSTM else GRU
    forwards = [node for node in session._model.graph.node if node.op_type == kind.forward]
    if settings.get("bidirectional"):
        assert session._folded == {}
        return
    assert session._folded == {forwards[0].name: {"W", "R"}}
    assert list(forwards[0].input[1:3]) == ["lstm.weight_ih_l0", "lstm.weight_hh_l0"]
    reordering = [node.op_type for node in session._model.graph.node if node.op_type in ("Split", "SplitTraining")]
    assert len(reordering) == (5 if settings.get("bias", True) else 0)  # the biases' reordering is kept (2 + 3)


def test_a_reordering_read_elsewhere_or_in_another_order_is_kept(monkeypatch):
    """The fold's guards, on the training graph it was handed: a reordered W that another node reads, and an R
    concatenated in an order that is not the gate permutation, stay in the graph; the other weight is folded."""
    import copy

    from orttrainer.runtime import torch_recurrent

    handed = []
    fold = torch_recurrent.fold_gate_reordering
    monkeypatch.setattr(torch_recurrent, "fold_gate_reordering", lambda model: handed.append(copy.deepcopy(model)) or fold(model))
    torch.manual_seed(0)
    trainer = ORTTrainer(Tagger(), None, optim.SGDConfig(lr=0.5), loss_fn=_loss, options=cpu_options())
    trainer.train_step(*_batches([(4, 9)])[0])
    graph = handed[0].graph
    forward = next(node for node in graph.node if node.op_type == LSTM.forward)
    graph.node.append(helper.make_node("Identity", [forward.input[1]], ["w_read_elsewhere"], name="w_read_elsewhere"))
    assert fold(copy.deepcopy(handed[0])) == {forward.name: {"R"}}

    model = copy.deepcopy(handed[0])
    del model.graph.node[-1]
    producers = {name: node for node in model.graph.node for name in node.output}
    concat = producers[producers[forward.input[2]].input[0]]  # R's Unsqueeze <- Concat
    concat.input[0], concat.input[1] = concat.input[1], concat.input[0]
    assert fold(model) == {forward.name: {"W"}}


def test_recurrent_layers_run_on_torch_when_convolutions_are_left_to_onnx_runtime():
    """``utils.convolution_kernels: "onnxruntime"`` concerns convolutions only."""
    torch.manual_seed(0)
    options = cpu_options({"utils": {"convolution_kernels": "onnxruntime"}})
    run_parity(Tagger(), _batches([(2, 5), (2, 5)]), optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
               loss_fn=_loss, options=options)  # fmt: skip


@pytest.mark.parametrize("kind, activation", [(LSTM, None), (GRU, None), (RNN, "Tanh"), (RNN, "Relu")],
                         ids=["lstm", "gru", "rnn-tanh", "rnn-relu"])  # fmt: skip
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("with_bias_and_state", [True, False])
def test_torch_computes_the_onnx_layer(kind, activation, direction, with_bias_and_state):
    """torch_recurrent.recurrent against ONNX Runtime's LSTM / GRU / RNN kernel on the same ONNX-layout weights:
    Y, Y_h[, Y_c]."""
    directions, hidden, size, sequence, batch = 2 if direction == "bidirectional" else 1, 6, 4, 7, 3
    gates, states = len(kind.gates), ["initial_h", "initial_c"][: kind.results - 1]
    generator = np.random.default_rng(0)
    values = {"X": generator.standard_normal((sequence, batch, size)), "W": generator.standard_normal((directions, gates * hidden, size)),
              "R": generator.standard_normal((directions, gates * hidden, hidden)) * 0.5}  # fmt: skip
    if with_bias_and_state:
        values["B"] = generator.standard_normal((directions, 2 * gates * hidden))
        values.update({state: generator.standard_normal((directions, batch, hidden)) for state in states})
    values = {name: value.astype(np.float32) for name, value in values.items()}
    order = ["X", "W", "R", "B", "", *states] if with_bias_and_state else ["X", "W", "R"]
    outputs = ["Y", "Y_h", "Y_c"][: kind.results]
    extra = {"linear_before_reset": 1} if kind is GRU else {}  # nn.GRU's form
    if activation:
        extra["activations"] = [activation] * directions
    node = helper.make_node(kind.forward.replace("Training", ""), order, outputs, direction=direction, hidden_size=hidden, **extra)
    graph = helper.make_graph([node], "recurrent", [helper.make_tensor_value_info(name, TensorProto.FLOAT, value.shape)
                                                     for name, value in values.items()],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, values)
    tensors = {name: torch.from_numpy(value) for name, value in values.items()}
    call = {"Tanh": torch.rnn_tanh, "Relu": torch.rnn_relu}.get(activation)
    actual = recurrent(kind, tensors["X"], tensors["W"], tensors["R"], tensors.get("B"), [tensors.get(state) for state in states],
                       direction, hidden, call)  # fmt: skip
    for name, result, wanted in zip(outputs, actual, expected):
        # ONNX Runtime's kernel approximates the sigmoid (docs/stack_facts.md): ~1e-6 apart
        np.testing.assert_allclose(result.numpy(), wanted, atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("kind", [LSTM, GRU, RNN], ids=["lstm", "gru", "rnn"])
@pytest.mark.parametrize("directions", [1, 2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_weight_gradients_go_back_to_onnx_layout(kind, directions, with_bias):
    """The gradient step reorders the torch-layout weights' gradients into ONNX's W, R, B: the inverse of the forward's
    reordering, element for element (a gradient equal to its weight round-trips to the ONNX tensor)."""
    gates, hidden, size = len(kind.gates), 3, 2
    numbered = functools.partial(torch.arange, dtype=torch.float32)
    onnx_weights = {"W": numbered(directions * gates * hidden * size).reshape(directions, gates * hidden, size),
                    "R": numbered(directions * gates * hidden * hidden).reshape(directions, gates * hidden, hidden) + 1000}  # fmt: skip
    if with_bias:
        onnx_weights["B"] = numbered(directions * 2 * gates * hidden).reshape(directions, 2 * gates * hidden) + 2000
    parameters = torch_parameters(kind, onnx_weights["W"], onnx_weights["R"], onnx_weights.get("B"), hidden)
    assert len(parameters) == directions * (4 if with_bias else 2)
    assert torch.equal(parameters[0], onnx_weights["W"][0]) == (kind is RNN), "the forward reorders the gates (an RNN has one)"
    back = onnx_parameter_gradients(kind, parameters, with_bias)
    assert back.keys() == onnx_weights.keys()
    for role, tensor in onnx_weights.items():
        assert torch.equal(back[role], tensor), role


@pytest.mark.parametrize("layer", [nn.LSTM, nn.GRU], ids=["lstm", "gru"])
def test_bidirectional_layer_kept_on_onnx_runtime_is_refused_with_a_clear_error(layer):
    """Under mixed precision the graph stays on ONNX Runtime, whose LSTM/GRU gradient kernels go forward only."""
    model = Tagger(layer=layer, bidirectional=True)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=_loss,
                         options=cpu_options({"mixed_precision": {"enabled": True}}))  # fmt: skip
    for _ in range(2):  # refused again, not half-built
        with pytest.raises(GradientBuildError, match=r"module 'lstm'.*bidirectional .* trains only on torch's kernels"):
            trainer.train_step(*_batches([(2, 5)])[0])
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items()), "the user's module changed"


class NameClassifier(nn.Module):
    """PyTorch's character-level RNN tutorial: one-hot letters, sequence first, classes from the last hidden
    state only (the output sequence unused), here two layers and a given initial state."""

    def __init__(self, letters=20, hidden=16, classes=4):
        super().__init__()
        self.rnn = nn.RNN(letters, hidden, num_layers=2)
        self.h2o = nn.Linear(hidden, classes)

    def forward(self, letters, initial):
        _, hidden = self.rnn(letters, initial)
        return self.h2o(hidden[-1])


def test_an_rnn_read_by_its_last_hidden_state_only_trains_like_torch():
    generator = torch.Generator().manual_seed(5)
    batches = []
    for length in (7, 4, 7):  # names of other lengths: another graph, the same weights
        letters = F.one_hot(torch.randint(0, 20, (length, 3), generator=generator), 20).float()
        batches.append((letters, torch.randn(2, 3, 16, generator=generator) * 0.1, torch.randint(0, 4, (3,), generator=generator)))
    torch.manual_seed(0)
    run_parity(NameClassifier(), batches, optim.SGDConfig(lr=0.5), functools.partial(torch.optim.SGD, lr=0.5),
               loss_fn=F.cross_entropy)  # fmt: skip


@pytest.mark.parametrize("options", [{"mixed_precision": {"enabled": True}},
                                     {"debug": {"graph_save_paths": {"model_with_training_graph_after_optimization_path": "x"}}}],
                         ids=["mixed-precision", "optimized-graph-saved"])  # fmt: skip
def test_an_rnn_kept_on_onnx_runtime_is_refused_with_a_clear_error(options):
    """onnxruntime-training has no RNN gradient: where the graph is not split for torch's kernels, the RNN is refused
    by module, with what would let it train, before anything is built (and again at the next step)."""
    model = Tagger(layer=nn.RNN)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=_loss, options=cpu_options(options))
    for _ in range(2):
        with pytest.raises(GradientBuildError, match=r"RNN \(node .*module 'lstm'\) \(an RNN trains on torch's kernels only.*"
                                                     "in float32, without mixed precision or debug.graph_save_paths"):
            trainer.train_step(*_batches([(2, 5)])[0])
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items()), "the user's module changed"


def test_an_rnn_in_a_graph_left_whole_is_refused_before_onnx_runtime_runs_its_placeholder(tmp_path):
    """The RNN's gradient node is a placeholder only torch runs: a training graph that stays on ONNX Runtime
    (one the split cannot cut) is refused by the RNN's module, not left to fail inside a run."""
    import onnx

    from orttrainer.graph import training_graph

    path = tmp_path / "train.onnx"
    trainer = ORTTrainer(Tagger(layer=nn.RNN), None, optim.SGDConfig(lr=0.1), loss_fn=_loss,
                         options=cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": str(path)}}}))  # fmt: skip
    trainer.train_step(*_batches([(2, 5)])[0])
    with pytest.raises(GradientBuildError, match=r"RNN \(node '/model/lstm/RNN', module 'lstm'\): this graph cannot be split"):
        training_graph.refuse_recurrent_layers_onnx_runtime_cannot_train(onnx.load(path))


class Encoder(nn.Module):
    """The layer's outputs themselves are the model's output (no ONNX Runtime op after them)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer(6, 8, batch_first=True, bidirectional=True)

    def forward(self, x):
        return self.layer(x)[0]


@pytest.mark.parametrize("layer", list(LAYERS.values()), ids=list(LAYERS))
def test_eval_step_computes_torchs_layer_bit_for_bit(layer):
    """The eval graph's LSTM/GRU/RNN runs as torch's call too: the same values as the module, to the bit
    (ONNX Runtime's kernels, with their approximate sigmoid, differ in the last digits)."""
    torch.manual_seed(0)
    model = Encoder(layer)
    x = torch.randn(3, 5, 6) * 3
    with torch.no_grad():
        expected = model.eval()(x)
    trainer = ORTTrainer(model.train(), None, optim.SGDConfig(lr=0.0), loss_fn=lambda y, t: (y * t).sum(), options=cpu_options())
    output = trainer.eval_step(x, torch.ones_like(expected))[1]
    assert torch.equal(output, expected), (output - expected).abs().max()
