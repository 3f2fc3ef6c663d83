"""LSTMs on torch's kernels inside the training graph (orttrainer/torch_lstm.py).

The training graph's LSTMTraining/LSTMGrad nodes run as torch's aten::lstm and its autograd;
trained models equal a plain torch loop (loss and every state_dict key, step by step). The
layout conversions (gate order, directions) are checked against ONNX Runtime's own LSTM kernel.
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

from orttrainer import optim
from orttrainer.torch_convolutions import SplitSession
from orttrainer.torch_lstm import lstm


class Tagger(nn.Module):
    """Embedding -> LSTM (``lstm`` keyword arguments) -> per-token classes."""

    def __init__(self, initial_state=False, **lstm):
        super().__init__()
        self.tokens = nn.Embedding(50, 12)
        self.lstm = nn.LSTM(12, 10, batch_first=True, **lstm)
        width = 10 * (2 if lstm.get("bidirectional") else 1)
        self.head = nn.Linear(width, 5)
        directions = (2 if lstm.get("bidirectional") else 1) * lstm.get("num_layers", 1)
        self.initial = nn.Parameter(torch.randn(2, directions, 1, 10) * 0.1) if initial_state else None

    def forward(self, tokens):
        if self.initial is None:
            states, _ = self.lstm(self.tokens(tokens))
        else:
            batch = tokens.shape[0]
            initial = (self.initial[0].expand(-1, batch, -1).contiguous(), self.initial[1].expand(-1, batch, -1).contiguous())
            states, _ = self.lstm(self.tokens(tokens), initial)
        return self.head(states)


def _loss(scores, labels):
    return F.cross_entropy(scores.reshape(-1, scores.shape[-1]), labels.reshape(-1))


def _batches(shapes):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 50, shape, generator=generator), torch.randint(0, 5, shape, generator=generator))
            for shape in shapes]  # fmt: skip


@pytest.mark.parametrize("settings", [{}, {"bidirectional": True, "num_layers": 2}, {"bias": False},
                                      {"initial_state": True, "bidirectional": True}],
                         ids=["one-layer", "two-layer-bidirectional", "no-bias", "trained-initial-state"])  # fmt: skip
def test_lstm_trains_like_torch_on_torchs_kernels(settings):
    torch.manual_seed(0)
    trainer, _ = run_parity(Tagger(**settings), _batches([(4, 9), (3, 6), (4, 9)]), optim.SGDConfig(lr=0.5),
                            functools.partial(torch.optim.SGD, lr=0.5), loss_fn=_loss)  # fmt: skip
    train_session = list(trainer._graphs._graphs.values())[-1].runtime.train_session
    assert isinstance(train_session, SplitSession), "the LSTM's gradient must not run on ONNX Runtime's LSTMGrad"
    on_torch = {node.op_type for node in train_session._model.graph.node if node.name in train_session.on_torch}
    assert on_torch == {"LSTMTraining", "LSTMGrad"}, on_torch


def test_lstm_with_convolutions_left_to_onnx_runtime_still_runs_on_torch():
    """``utils.convolution_kernels: "onnxruntime"`` concerns convolutions only."""
    torch.manual_seed(0)
    options = cpu_options({"utils": {"convolution_kernels": "onnxruntime"}})
    run_parity(Tagger(), _batches([(2, 5), (2, 5)]), optim.SGDConfig(lr=0.1), functools.partial(torch.optim.SGD, lr=0.1),
               loss_fn=_loss, options=options)  # fmt: skip


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("with_bias_and_state", [True, False])
def test_torch_lstm_computes_onnx_lstm(direction, with_bias_and_state):
    """torch_lstm.lstm against ONNX Runtime's LSTM kernel on the same ONNX-layout weights: Y, Y_h, Y_c."""
    directions, hidden, size, sequence, batch = 2 if direction == "bidirectional" else 1, 6, 4, 7, 3
    generator = np.random.default_rng(0)
    values = {"X": generator.standard_normal((sequence, batch, size)), "W": generator.standard_normal((directions, 4 * hidden, size)),
              "R": generator.standard_normal((directions, 4 * hidden, hidden)) * 0.5}  # fmt: skip
    if with_bias_and_state:
        values.update(B=generator.standard_normal((directions, 8 * hidden)), initial_h=generator.standard_normal((directions, batch, hidden)),
                      initial_c=generator.standard_normal((directions, batch, hidden)))  # fmt: skip
    values = {name: value.astype(np.float32) for name, value in values.items()}
    order = ["X", "W", "R", "B", "", "initial_h", "initial_c"] if with_bias_and_state else ["X", "W", "R"]
    node = helper.make_node("LSTM", order, ["Y", "Y_h", "Y_c"], direction=direction, hidden_size=hidden)
    graph = helper.make_graph([node], "lstm", [helper.make_tensor_value_info(name, TensorProto.FLOAT, value.shape)
                                                for name, value in values.items()],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("Y", "Y_h", "Y_c")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    expected = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, values)
    tensors = {name: torch.from_numpy(value) for name, value in values.items()}
    actual = lstm(tensors["X"], tensors["W"], tensors["R"], tensors.get("B"), tensors.get("initial_h"), tensors.get("initial_c"),
                  direction, hidden)  # fmt: skip
    for name, result, wanted in zip(("Y", "Y_h", "Y_c"), actual, expected):
        # ONNX Runtime's kernel approximates the sigmoid (docs/stack_facts.md): ~1e-6 apart
        np.testing.assert_allclose(result.numpy(), wanted, atol=2e-5, rtol=1e-4, err_msg=name)
