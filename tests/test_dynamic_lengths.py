"""Batches padded to their own longest sequence, images of several sizes: one graph for every length and image size
where the trace is generic in it.

A graph serves a batch of other sizes without an export once an export at other sizes gave the same graph and
the Python decisions its trace took on sizes (its guards, export/size_guards.py) come out the same for the new
batch. Each test trains through the public API against a torch loop, losses and every state_dict key, and counts
the exports and graphs it took.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import zoo
from parity import assert_within_float32_error, cpu_options, run_parity, train_keywords_like_torch

from orttrainer import ORTTrainer, optim
from orttrainer.runtime import build

VOCAB = 30


@pytest.fixture
def exports(monkeypatch):
    """The number of exports the trainers of a test made: a list holding one count."""
    counted = [0]
    export = build.TorchSource.export

    def counting(self, *args, **kwargs):
        counted[0] += 1
        return export(self, *args, **kwargs)

    monkeypatch.setattr(build.TorchSource, "export", counting)
    return counted


@pytest.fixture
def eval_runs(monkeypatch):
    """The eval-mode runs of the module the exports of a test made to infer their model_desc: a list holding one count."""
    from orttrainer.export import as_trained

    counted = [0]
    sample_outputs = as_trained.sample_outputs

    def counting(*args, **kwargs):
        counted[0] += 1
        return sample_outputs(*args, **kwargs)

    monkeypatch.setattr(as_trained, "sample_outputs", counting)
    return counted


@pytest.fixture
def checks(monkeypatch):
    """The first-step checks the trainers of a test prepared (torch's side of each, taken at each graph's build)."""
    references = []
    torch_reference = build._torch_reference
    monkeypatch.setattr(build, "_torch_reference", lambda *args: references.append(1) or torch_reference(*args))
    return references


def _sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1)


def _compare_outputs(outputs, expected, expected64, where):
    assert_within_float32_error(outputs.loss, expected.loss.detach(), expected64.loss.detach(), f"{where} loss")
    assert_within_float32_error(outputs.logits, expected.logits.detach(), expected64.logits.detach(), f"{where} logits")


@pytest.mark.parametrize("make", [zoo.bert_classifier, zoo.gpt2_lm, zoo.gpt2_classifier, zoo.llama_classifier],
                         ids=["bert-classifier", "gpt2-lm", "gpt2-classifier", "llama-classifier"])  # fmt: skip
def test_one_graph_trains_every_padded_length_like_torch(exports, eval_runs, make):
    """Seven lengths and two batch sizes, each batch padded to its own longest: one graph, three exports (the first
    batch, one at a new length, one at a new batch size), the rest served by the guards. Only the first export runs
    the module in eval mode to infer the model_desc; the others take the graph's."""
    pytest.importorskip("transformers", reason="the Hugging Face zoo needs transformers (the test extra)")
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(7)
    batch = zoo.causal_lm_batch if make is zoo.gpt2_lm else zoo.classification_batch
    shapes = [(2, 8), (2, 12), (2, 9), (3, 20), (2, 5), (2, 31), (3, 2), (2, 8)]
    batches = [batch(*shape, generator=generator) for shape in shapes]
    model = make()
    reference, reference64 = copy.deepcopy(model), copy.deepcopy(model).double()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), options=cpu_options())
    train_keywords_like_torch(trainer, reference, reference64, batches, 0.1, _compare_outputs)
    assert trainer._graphs.built == 1
    assert exports[0] == 3 and eval_runs[0] == 1


class _TokenClassifier(nn.Module):
    """Token embeddings and a 3-class head; each subclass's forward reads the length its own way."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, 3)


class BranchesOnLength(_TokenClassifier):
    """A Python ``if`` on the padded length: sequences longer than 6 are read backwards and doubled."""

    def forward(self, tokens):
        states = self.tokens(tokens)
        if tokens.shape[1] > 6:
            states = states.flip(1) * 2
        return self.head(states.mean(1))


def _token_batches(shapes, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, shape, generator=generator), torch.randint(0, 3, shape[:1], generator=generator))
            for shape in shapes]  # fmt: skip


def test_a_branch_on_the_length_trains_like_torch_on_both_sides_of_it(exports):
    """The guard ``tokens.shape[1] > 6`` takes the other branch at 9 and 12: another graph, exported there; at 5 and
    4 the first graph again, without an export."""
    torch.manual_seed(0)
    shapes = [(4, 3), (4, 5), (4, 9), (4, 4), (4, 12), (4, 11), (4, 2)]
    trainer, _ = run_parity(BranchesOnLength(), _token_batches(shapes), optim.SGDConfig(lr=0.1), _sgd, loss_fn=F.cross_entropy)
    assert trainer._graphs.built == 2
    assert exports[0] == 4  # 3 (first), 5 (a new length), 9 (the guard fails), 12 (a second length of that graph)


class PoolsByLen(_TokenClassifier):
    """``len()`` of a tensor is a plain int to the tracer: no guard sees what it decides."""

    def forward(self, tokens):
        states = self.tokens(tokens).transpose(0, 1)
        kept = states[: len(states) // 2 + 1]
        return self.head(kept.mean(0))


def test_a_size_read_by_len_is_exported_at_every_new_length(exports):
    torch.manual_seed(0)
    shapes = [(4, 4), (4, 6), (4, 7), (4, 4), (4, 9)]
    trainer, _ = run_parity(PoolsByLen(), _token_batches(shapes, seed=1), optim.SGDConfig(lr=0.1), _sgd,
                            loss_fn=F.cross_entropy)  # fmt: skip
    assert exports[0] == 4  # every new signature
    assert trainer._graphs.built == 3  # the trace holds the slice's end: 3 at length 4, 4 at lengths 6 and 7, 5 at 9


class SequenceFirstAttention(_TokenClassifier):
    """torch's nn.MultiheadAttention over sequence-first states: its trace holds the traced length in constants, and
    no guard sees it."""

    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2)

    def forward(self, tokens):
        states = self.tokens(tokens).transpose(0, 1)
        attended, _ = self.attention(states, states, states, need_weights=False)
        return self.head(attended.mean(0))


def test_a_trace_holding_a_length_without_a_guard_gets_a_graph_per_length(exports, eval_runs):
    """At the second length the export taking the first graph's names and axes differs from it: the full export
    follows and builds another graph; from then on every new length is exported in full, as a trace that holds sizes
    needs, with no such probe first."""
    torch.manual_seed(0)
    shapes = [(4, 5), (4, 7), (4, 9), (4, 5), (4, 7)]
    trainer, _ = run_parity(SequenceFirstAttention(), _token_batches(shapes, seed=4), optim.SGDConfig(lr=0.1), _sgd,
                            loss_fn=F.cross_entropy)  # fmt: skip
    assert trainer._graphs.built == 3
    assert exports[0] == 4 and eval_runs[0] == 3  # 5; 7 probed, then in full; 9 in full


class CountsMaskedTokens(_TokenClassifier):
    """A decision on a size that depends on the data (how many tokens a boolean mask keeps): no guard can compute it
    from shapes, so it stays a frozen value checked against every new batch."""

    def forward(self, tokens):
        states = self.tokens(tokens)
        kept = states[tokens > 0]
        scale = 2.0 if kept.shape[0] > 12 else 1.0
        return self.head(states.mean(1) * scale)


def test_a_size_that_depends_on_the_data_is_no_guard(exports):
    torch.manual_seed(0)
    model = CountsMaskedTokens()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    tokens, labels = _token_batches([(4, 5)], seed=2)[0]
    trainer.train_step(tokens, labels)
    with pytest.raises(Exception, match="kept.shape"):  # the same shapes, fewer kept tokens: another branch
        trainer.train_step(torch.zeros_like(tokens), labels)


def test_the_first_step_check_runs_at_every_built_graph(checks):
    """Each graph is checked against torch at its first step; one serving many lengths, once."""
    torch.manual_seed(0)
    shapes = [(4, 3), (4, 5), (4, 4), (4, 9), (4, 12), (4, 2)]
    trainer, _ = run_parity(BranchesOnLength(), _token_batches(shapes), optim.SGDConfig(lr=0.1), _sgd, loss_fn=F.cross_entropy)
    assert trainer._graphs.built == 2 and len(checks) == 2


class CumulatesOverTokens(_TokenClassifier):
    """A cumulative sum along the sequence, whose gradient rewrite is written for a fixed length."""

    def forward(self, tokens):
        return self.head(self.tokens(tokens).cumsum(1)[:, -1])


def test_a_graph_that_needs_fixed_lengths_is_built_per_length(exports):
    """The first build fails with the lengths dynamic; the trainer fixes them and builds a graph per length."""
    torch.manual_seed(0)
    shapes = [(4, 5), (4, 7), (3, 5), (4, 7)]
    trainer, _ = run_parity(CumulatesOverTokens(), _token_batches(shapes, seed=3), optim.SGDConfig(lr=0.1), _sgd,
                            loss_fn=F.cross_entropy)  # fmt: skip
    assert trainer._graphs.built == 2  # lengths 5 and 7; the batch dimension stays dynamic
    assert exports[0] == 4  # the first batch twice (lengths dynamic, then fixed), then lengths 7 and the batch of 3


class DecidesOnSizes(nn.Module):
    """Python decisions of several kinds on sizes: a comparison, an int of a quotient, an equality of two lengths."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens, mask):
        states = self.tokens(tokens) * mask.unsqueeze(-1)
        half = int(tokens.shape[1] / 2)  # an int of a float: 2.5 and 2 give 2
        if tokens.shape[1] > 4 and mask.shape[1] == tokens.shape[1]:
            states = states[:, :half]
        return self.head(states.mean(1))


@pytest.mark.parametrize(
    ("traced", "other", "holds"),
    [((2, 5), (2, 5), True), ((2, 5), (7, 5), True), ((2, 5), (2, 4), False), ((2, 6), (2, 7), True),
     ((2, 6), (2, 8), False), ((2, 6), (1, 6), True), ((2, 6), (0, 6), True), ((2, 3), (2, 2), True),
     ((2, 3), (2, 1), False), ((2, 1), (2, 0), True), ((2, 5), (2, 5, "mask 4"), False)],
    ids=["same", "other batch", "at the threshold", "same half of 7", "another half", "batch of 1", "empty batch",
         "same half of 2", "half 0 at length 1", "empty length", "mask of another length"])  # fmt: skip
def test_guards_hold_exactly_where_every_decision_comes_out_the_same(traced, other, holds):
    """The guards of a trace at ``traced`` (batch, length), computed at ``other``'s shapes on meta tensors, against
    torch's own Python at those shapes."""
    from orttrainer.export import exporter_warnings

    model = DecidesOnSizes()
    batch = [torch.ones(traced, dtype=torch.long), torch.ones(traced)]
    values = exporter_warnings.ValuesTurnedPython()

    def traced_forward(tokens, mask, *weights):
        states = model(tokens, mask)
        guards.append(values.size_guards.compile(torch._C._get_tracing_state().graph(), [tokens, mask], list(weights)))
        return states

    guards = []
    with values:
        torch.jit.trace(traced_forward, (*batch, *model.parameters()), check_trace=False)
    (guards,) = guards
    mask_length = 4 if len(other) == 3 else other[1]
    shapes = [torch.empty(other[:2], dtype=torch.long), torch.empty(other[0], mask_length)]
    assert guards.hold(shapes) is holds
    assert len(values.size_guards.guarded) == 2  # the two lines that decide


class DecidesThroughLayers(nn.Module):
    """Decisions on sizes read after ops whose result has their input's shape (layer norm, gelu, softmax, dropout),
    which the guards pass their input on for, and after a Linear, which they run."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, tokens):
        states = F.dropout(F.gelu(self.norm(self.tokens(tokens))).softmax(-1), 0.1, self.training)
        if states.shape[1] > 4:  # the length, through four passed-on ops
            states = states * 2
        projected = self.head(states)
        if projected.shape[-1] * projected.shape[0] > 6:  # the Linear's width times the batch
            projected = projected + 1
        return projected.mean(1)


@pytest.mark.parametrize(("traced", "other"), [((2, 5), (2, 7)), ((3, 5), (4, 9)), ((2, 5), (2, 4)), ((2, 6), (3, 6)),
                                              ((3, 3), (2, 9))])
def test_guards_read_sizes_through_ops_that_keep_their_input_shape(traced, other):
    """The guards of a trace at ``traced`` hold at ``other`` exactly where torch's Python takes both decisions as
    the traced batch did."""
    from orttrainer.export import exporter_warnings

    model = DecidesThroughLayers().eval()
    values, guards = exporter_warnings.ValuesTurnedPython(), []

    def traced_forward(tokens, *weights):
        outputs = model(tokens)
        guards.append(values.size_guards.compile(torch._C._get_tracing_state().graph(), [tokens], list(weights)))
        return outputs

    with values:
        torch.jit.trace(traced_forward, (torch.ones(traced, dtype=torch.long), *model.parameters()), check_trace=False)
    decisions = [lambda shape: shape[1] > 4, lambda shape: 3 * shape[0] > 6]
    same = all(decide(other) == decide(traced) for decide in decisions)
    assert guards[0].hold([torch.empty(other, dtype=torch.long)]) is same
    assert len(values.size_guards.guarded) == 2


# ------------------------------------------------------------------ image sizes
def _image_batches(shapes, seed=0):
    """(images [batch, 3, height, width], a class per image) for each (batch, height, width) of ``shapes``."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, height, width, generator=generator),
             torch.randint(0, zoo.CLASSES, (batch,), generator=generator)) for batch, height, width in shapes]  # fmt: skip


def test_one_graph_trains_a_cnn_with_batchnorm_at_every_image_size_like_torch(exports, checks):
    """zoo.ResNet (BatchNorm after every convolution, global average pooling) at four image sizes, one of them not
    square, and two batch sizes: one graph, checked once; three exports (the first batch, a new image size, a new
    batch size), the rest served by it."""
    torch.manual_seed(0)
    shapes = [(4, 16, 16), (4, 24, 24), (4, 32, 32), (3, 16, 16), (4, 20, 28), (3, 24, 24), (4, 16, 16)]
    trainer, *_ = run_parity(zoo.ResNet(), _image_batches(shapes), optim.SGDConfig(lr=0.1), _sgd, loss_fn=F.cross_entropy,
                             float64=True)  # fmt: skip
    assert trainer._graphs.built == 1 and len(checks) == 1
    assert exports[0] == 3


class PooledFeatures(nn.Module):
    """A 3x3 convolution with BatchNorm and ReLU, then ``pool``, then a linear head over its ``features`` values."""

    def __init__(self, pool, features):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), pool)
        self.head = nn.Linear(features, zoo.CLASSES)

    def forward(self, images):
        return self.head(self.features(images).flatten(1))


def _then_mean(pool):
    return nn.Sequential(pool, nn.AdaptiveAvgPool2d(1))


@pytest.mark.parametrize(("pool", "features", "sizes", "built"), [
    (_then_mean(nn.MaxPool2d(2, stride=3, padding=1, ceil_mode=True)), 4, [6, 4, 5, 6], 3),
    (_then_mean(nn.MaxPool2d(3, stride=2, ceil_mode=True)), 4, [5, 6, 7, 5], 1),
    (_then_mean(nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True)), 4, [5, 6, 7, 5], 3),
    (nn.AdaptiveAvgPool2d((2, 2)), 16, [4, 6, 5, 4], 3),
], ids=["ceil_mode windows torch drops at 4 and 5", "ceil_mode windows no size drops", "ceil_mode average with padding",
        "adaptive to 2x2"])  # fmt: skip
def test_a_pool_whose_windows_depend_on_the_image_size_trains_like_torch(exports, checks, pool, features, sizes, built):
    """A pool whose window count or windows depend on the image size: torch's ceil_mode count is one short of ONNX's
    at some sizes (where a stride and an end padding outrun the kernel), an average's partial windows and an adaptive
    pool's windows are computed for known sizes. Where that can happen the graph is exported with the image sizes
    fixed, once per size, each checked at its first step; a ceil_mode pool that no size makes differ, once."""
    torch.manual_seed(0)
    batches = _image_batches([(4, size, size) for size in sizes], seed=4)
    trainer, *_ = run_parity(PooledFeatures(pool, features), batches, optim.SGDConfig(lr=0.1), _sgd,
                             loss_fn=F.cross_entropy, float64=True)  # fmt: skip
    assert trainer._graphs.built == built and len(checks) == built
    assert exports[0] == (2 if built == 1 else built + 1)  # with sizes fixed: the first batch again, then each size


def test_a_linear_over_flattened_images_refuses_other_sizes_as_torch_does():
    """A Linear whose in_features holds the image size (flatten, then Linear): torch's own error at another size."""
    torch.manual_seed(0)
    model = PooledFeatures(nn.MaxPool2d(2), 4 * 4 * 4)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    small, large = _image_batches([(2, 8, 8), (2, 10, 10)], seed=5)
    trainer.train_step(*small)
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        trainer.train_step(*large)


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation"), [
    (2, 3, 1, 1), (3, 2, 0, 1), (3, 2, 1, 1), (2, 2, 1, 1), (2, 2, 0, 1), (3, 3, 1, 1), (2, 1, 1, 1), (2, 3, 1, 2),
    (1, 2, 0, 1), (5, 4, 2, 1), (3, 3, 0, 1),
])  # fmt: skip
def test_a_ceil_mode_pool_drops_a_window_at_some_size_exactly_where_stride_and_end_padding_outrun_the_kernel(
        kernel, stride, padding, dilation):  # fmt: skip
    """pooling._can_drop_a_window, which lets a ceil_mode pool over dynamic sizes be ONNX's, against torch's own
    output lengths at every length up to 60."""
    from orttrainer.graph.rewrites import pooling

    span = (kernel - 1) * dilation + 1
    drops = False
    for length in range(max(1, span - 2 * padding), 61):
        pooled = F.max_pool1d(torch.zeros(1, 1, length), kernel, stride, padding, dilation, ceil_mode=True)
        drops |= pooled.shape[-1] < pooling._onnx_ceil_mode_count(length, span, stride, padding, padding)
    assert pooling._can_drop_a_window(span, stride, padding) is drops


@pytest.mark.parametrize(("shape", "dtype", "free"), [
    ((2, 5), torch.long, [1]), ((2, 5, 5), torch.bool, [1, 2]), ((2, 7), torch.float32, []),
    ((2, 5, 7), torch.float32, []), ((2, 3, 8, 9), torch.float32, [2, 3]), ((2, 3, 4, 8, 9), torch.float16, [2, 3, 4]),
], ids=["token ids", "a mask", "features", "a sequence's states", "images", "volumes"])  # fmt: skip
def test_the_inferred_model_desc_frees_lengths_and_image_sizes(shape, dtype, free):
    """Every axis of an integer or bool input, the axes after the channels of a float input of 4 dims or more."""
    from orttrainer.api.model_desc import free_axes

    assert free_axes(torch.zeros(shape, dtype=dtype)) == free
