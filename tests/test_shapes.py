"""Batches of changing shapes: one graph per shape signature where the trace needs it, one set of weights.

Each test trains over a sequence of shapes (some repeated later) and compares with torch
step by step: losses and every state_dict key.
"""

import copy
import warnings

import onnxruntime
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import CNN, MLP, SeqFirstEncoder, cnn_batch, lm_loss, mlp_batch
from parity import assert_close_state, cpu_options, run_parity

from orttrainer import ORTTrainer, optim
from orttrainer.runtime import graph_cache

VOCAB = 30
# (seq, batch): new shapes, the first one again, and a last smaller batch
SHAPES = [(12, 4), (12, 3), (7, 4), (12, 4), (16, 2), (7, 4)]


def token_batches(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, shape, generator=generator), torch.randint(0, VOCAB, shape, generator=generator))
            for shape in shapes]  # fmt: skip


def sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1)


def test_seq_first_encoder_trains_like_torch_over_changing_shapes():
    torch.manual_seed(0)
    trainer, _ = run_parity(SeqFirstEncoder(), token_batches(SHAPES), optim.SGDConfig(lr=0.1), sgd, loss_fn=lm_loss)
    # the trace holds seq in its Reshape shapes, not the batch: one graph per sequence length
    assert trainer._graphs.built == len({seq for seq, _ in SHAPES})


def test_mlp_with_a_last_partial_batch_reuses_one_graph():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [mlp_batch(batch=size, generator=generator) for size in (8, 8, 5, 8, 3, 5)]
    trainer, _ = run_parity(MLP(), data, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)
    assert trainer._graphs.built == 1


def test_cnn_with_batchnorm_at_two_batch_sizes_matches_torch_including_statistics():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [cnn_batch(batch=size, generator=generator) for size in (8, 4, 8, 4)]
    trainer, _ = run_parity(CNN(), data, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)
    assert trainer._graphs.built == 1


class PadsShortRows(nn.Module):
    """A Python `if` on a shape: rows shorter than 8 are zero-padded to 8."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x):
        if x.shape[1] < 8:
            x = F.pad(x, (0, 8 - x.shape[1]))
        return self.fc(x)


def test_python_if_on_a_shape_trains_like_torch():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    shapes = [(4, 8), (4, 5), (3, 8), (4, 5), (2, 6), (4, 8)]
    data = [(torch.randn(*shape, generator=generator), torch.randn(shape[0], 3, generator=generator)) for shape in shapes]
    trainer, _ = run_parity(PadsShortRows(), data, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.mse_loss)
    assert trainer._graphs.built == 3  # width 8, and widths 5 and 6 (the pad width is frozen too)


class LastState(nn.Module):
    """The state at each row's length: squeeze(1) of a gathered dimension the exporter cannot size, an ONNX
    If on a size the graph's inputs fix (``rewrites.fold_static_sizes`` decides it)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x, lengths):
        index = (lengths - 1).view(-1, 1, 1).expand(-1, 1, x.shape[-1])
        return self.fc(x.gather(1, index).squeeze(1))


def test_an_if_on_a_fixed_size_trains_like_torch_at_every_sequence_length():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, seq, 8, generator=generator), torch.randint(1, seq + 1, (4,), generator=generator),
             torch.randint(0, 3, (4,), generator=generator)) for seq in (7, 7, 5, 7)]  # fmt: skip
    trainer, _ = run_parity(LastState(), data, optim.SGDConfig(lr=0.1), sgd, loss_fn=F.cross_entropy)
    assert trainer._graphs.built == 2


def test_gradient_accumulation_across_a_shape_change_inside_the_window():
    torch.manual_seed(0)
    model = SeqFirstEncoder()
    reference = copy.deepcopy(model)
    optimizer = sgd(reference.parameters())
    options = cpu_options({"batch": {"gradient_accumulation_steps": 2}})
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=lm_loss, options=options)
    data = token_batches([(12, 4), (7, 3), (7, 3), (12, 4)], seed=2)
    for window in range(2):
        optimizer.zero_grad()
        for tokens, labels in data[2 * window : 2 * window + 2]:
            trainer.train_step(tokens, labels)
            (lm_loss(reference(tokens), labels) / 2).backward()
        optimizer.step()
        assert_close_state(trainer, reference, step=window)
    assert trainer._graphs.built == 2


def test_graph_bound_drops_the_least_recently_used_and_warns_once(monkeypatch):
    monkeypatch.setattr(graph_cache, "MAX_GRAPHS", 2)
    torch.manual_seed(0)
    shapes = [(5, 2), (6, 2), (7, 2), (5, 2), (8, 2), (6, 2)]
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        trainer, _ = run_parity(SeqFirstEncoder(d_model=8), token_batches(shapes), optim.SGDConfig(lr=0.1), sgd,
                                loss_fn=lm_loss)  # fmt: skip
    assert trainer._graphs.built == 6  # (5, 2) and (6, 2) were dropped before they came back
    assert len(trainer._graphs._graphs) == 2
    messages = [str(w.message) for w in heard if "batch shapes keep changing" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "3 graphs built so far" in messages[0] and "pad_to_multiple_of" in messages[0]


def test_eval_step_at_a_new_shape_matches_torch_eval():
    torch.manual_seed(0)
    trainer, reference = run_parity(SeqFirstEncoder(), token_batches(SHAPES[:2]), optim.SGDConfig(lr=0.1), sgd,
                                    loss_fn=lm_loss)  # fmt: skip
    tokens, labels = token_batches([(9, 5)], seed=4)[0]
    loss, logits = trainer.eval_step(tokens, labels)
    reference.eval()
    with torch.no_grad():
        expected = reference(tokens)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, lm_loss(expected, labels), atol=1e-5, rtol=1e-5)
    assert trainer._graphs.built == 2  # sequence lengths 12 (batches of 4 and 3) and 9


def test_checkpoint_after_several_graphs_resumes_at_any_shape(tmp_path):
    torch.manual_seed(0)
    data = token_batches(SHAPES[:4] + [(9, 2)], seed=5)
    trainer, reference = run_parity(SeqFirstEncoder(), data[:4], optim.SGDConfig(lr=0.1), sgd, loss_fn=lm_loss)
    trainer.save_checkpoint(tmp_path / "run.ortcp")
    state = trainer.state_dict()
    assert set(state["model"]["full_precision"]) == set(reference.state_dict())  # one set of weights for 3 graphs
    resumed = ORTTrainer(SeqFirstEncoder(), None, optim.SGDConfig(lr=0.1), loss_fn=lm_loss, options=cpu_options())
    resumed.load_checkpoint(tmp_path / "run.ortcp")
    losses = [run.train_step(*data[4])[0] for run in (trainer, resumed)]  # a shape neither has a graph for
    torch.testing.assert_close(losses[1], losses[0], atol=0, rtol=0)
    expected = SeqFirstEncoder()
    expected.load_state_dict(trainer.state_dict(pytorch_format=True))
    assert_close_state(resumed, expected, atol=0, rtol=0)
    path = str(tmp_path / "model.onnx")
    resumed.save_as_onnx(path)  # the graph of the last batch, at that batch's shapes
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    loss = session.run(None, {"tokens": data[4][0].numpy(), "label": data[4][1].numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(loss), resumed.eval_step(*data[4])[0], atol=1e-5, rtol=1e-5)
