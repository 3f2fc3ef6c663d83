"""Run the training graph the trainer builds for one op, and compare it with torch in float64.

The graph goes through ``training_graph.build_training_graphs`` exactly as in the trainer (rewrites,
ONNX Runtime's optimizer and gradient builder, fast CPU kernels) and runs once in ONNX
Runtime. The reference is torch autograd in float64 on the same float32 inputs, rounded to
float32; an element also passes when it equals torch's own float32 result, because torch's
float32 and float64 kernels disagree in places (the gradient of ELU at NaN is 1 in
float32, NaN in float64; asinh's gradient at 1e20 is 0 in float32, where x * x overflows).
Loss = sum(outputs * upstream), so each input's gradient is the op's vector-Jacobian
product with ``upstream``. ``check_trainer_against_torch`` compares the same way through the
public API: an ORTTrainer's eval_step, train_step and saved model, batch after batch.
"""

import copy
import inspect
import io
import os
import warnings

import numpy as np
import onnx
import onnxruntime
import torch
from onnx import helper, numpy_helper

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.export import exported_graph, symbolics
from orttrainer.graph import training_graph

FLOAT32 = np.finfo(np.float32)
LOSS = "loss"
# float32 spacings allowed between a value and the float64 result rounded to float32
ULPS = 8
# absolute slack under every comparison: ONNX Runtime's kernels may flush denormals to 0
FLOOR = float(FLOAT32.tiny)
# hardsigmoid's and hardswish's kinks and their float32 neighbours
KINKS = [3.0, -3.0, 2.9999998, -2.9999998, 3.0000002, -3.0000002]


def edge_values(*extra):
    """0, -0, ±1e-30, ±a denormal, ±1, ±1e4, ±1e30, ±FLT_MAX, ±inf, NaN, then ``extra``."""
    magnitudes = [1e-30, 1e-40, 1.0, 1e4, 1e30, float(FLOAT32.max), np.inf]
    values = [0.0, -0.0] + [sign * magnitude for magnitude in magnitudes for sign in (1, -1)] + [np.nan]
    return np.array(values + list(extra), np.float32)


def spread(low, high, count=41):
    """``count`` values spaced evenly in log scale over [low, high], with both signs."""
    magnitudes = np.logspace(np.log10(low), np.log10(high), count)
    return np.concatenate([magnitudes, -magnitudes]).astype(np.float32)


def upstream_like(shape):
    """Distinct gradient weights, so that a permuted or misrouted gradient shows."""
    return (1.0 + np.arange(int(np.prod(shape))).reshape(shape) % 7 / 8).astype(np.float32)


def torch_reference(function, inputs: dict, upstream, differentiable, dtype=torch.float64):
    """(output, {name: gradient}) of ``function(**inputs)`` computed in ``dtype`` for the names in ``differentiable``."""
    tensors = {name: torch.tensor(np.asarray(value), dtype=dtype if np.asarray(value).dtype.kind == "f" else None,
                                  requires_grad=name in differentiable)
               for name, value in inputs.items()}  # fmt: skip
    output = function(**tensors)
    if differentiable:
        (output * torch.as_tensor(upstream, dtype=dtype)).sum().backward()
    gradients = {name: tensors[name].grad.numpy() for name in differentiable}
    return output.detach().numpy(), gradients


def single_op_model(op_type, input_names, values: dict, upstream, attributes=None, domain="", opset=17, constants=None,
                    before=()):  # fmt: skip
    """values (initializers) -> op(``input_names``) -> output; loss = sum(output * upstream).

    ``constants`` are initializers that stay constants (axes, indices, labels); ``before``
    are unary ops applied to the first input first (a Relu before a MaxPool). Each value
    passes an Identity first: ONNX Runtime 1.19's gradient builder emits a duplicate
    ``<weight>_grad`` when one node reads a graph input twice.
    """
    nodes = [helper.make_node("Identity", [name], [f"{name}.read"], name=f"{name}.read") for name in values]
    reads = [f"{name}.read" if name in values else name for name in input_names]
    for before_op in before:
        nodes.append(helper.make_node(before_op, [reads[0]], [f"{reads[0]}.{before_op}"], name=f"{reads[0]}.{before_op}"))
        reads[0] = f"{reads[0]}.{before_op}"
    nodes += [
        helper.make_node(op_type, reads, ["output"], name=op_type, domain=domain, **(attributes or {})),
        helper.make_node("Mul", ["output", "upstream"], ["weighted"], name="weighted"),
        helper.make_node("ReduceSum", ["weighted"], [LOSS], name=LOSS, keepdims=0),
    ]
    arrays = {**values, **(constants or {}), "upstream": np.asarray(upstream, np.float32)}
    initializers = [numpy_helper.from_array(np.asarray(value), name) for name, value in arrays.items()]
    outputs = [helper.make_tensor_value_info(LOSS, onnx.TensorProto.FLOAT, []), helper.make_empty_tensor_value_info("output")]
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(helper.make_graph(nodes, op_type, [], outputs, initializers), opset_imports=opsets, ir_version=8)


def exported_model(function, values: dict, upstream, trainable, opset=17):
    """torch ``function(**values)`` exported under orttrainer's symbolics (their markers resolved); the ``trainable``
    values are parameters (initializers named after them), loss = sum(output * upstream)."""

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, value in values.items():
                tensor = torch.tensor(np.asarray(value))
                if name in trainable:
                    self.register_parameter(name, torch.nn.Parameter(tensor))
                else:
                    self.register_buffer(name, tensor)
            self.register_buffer("upstream", torch.tensor(np.asarray(upstream, np.float32)))

        def forward(self):
            output = function(**{name: getattr(self, name) for name in values})
            return (output * self.upstream).sum(), output

    buffer = io.BytesIO()
    with symbolics.exporting(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice; tracer warnings on constants
        torch.onnx.export(Wrapped(), (), buffer, dynamo=False, opset_version=opset, do_constant_folding=False,
                          output_names=[LOSS, "output"])  # fmt: skip
    model = onnx.load_from_string(buffer.getvalue())
    exported_graph.resolve_markers(model)
    return model


def run_training_graph(model, values: dict, trainable):
    """Build the trainer's training graph for ``model`` and run it once: ({output or
    ``<name>_grad``: array}, the training graph). An embedding lookup's rows gradient is
    scatter-added into its weight's gradient, as the trainer does (outputs_for_trainer.EmbeddingGradient;
    lookups without a padding_idx or scale_grad_by_freq rule)."""
    frozen = [name for name in values if name not in trainable]
    graphs = training_graph.build_training_graphs(model, list(trainable), frozen, LOSS, [LOSS, "output"], on_cpu=True)
    session = onnxruntime.InferenceSession(graphs.train.SerializeToString(), providers=["CPUExecutionProvider"])
    lookups = {embedding.lookup_input: embedding.weight for embedding in graphs.embedding_gradients}
    feeds = {graph_input.name: np.asarray(values[lookups.get(graph_input.name, graph_input.name)]) for graph_input in session.get_inputs()}
    results = dict(zip([output.name for output in session.get_outputs()], session.run(None, feeds)))
    for embedding in graphs.embedding_gradients:
        gradient = results.setdefault(f"{embedding.weight}_grad", np.zeros_like(values[embedding.weight]))
        indices = results[embedding.indices_output].reshape(-1)
        np.add.at(gradient, indices, results[embedding.rows_gradient].reshape(indices.size, *gradient.shape[1:]))
    return results, graphs.train


def _matches(actual, expected, ulps, floor):
    """Per element: ``actual`` equals ``expected`` rounded to float32 (NaN for NaN, the same
    infinity, or within ``ulps`` float32 spacings at the expected magnitude plus ``floor``)."""
    with np.errstate(over="ignore"):
        rounded = np.asarray(expected).astype(np.float32)
    finite = np.isfinite(actual) & np.isfinite(rounded)
    magnitude = np.minimum(np.where(finite, np.abs(rounded), 0), np.float32(2.0**127))  # FLT_MAX's spacing is inf
    slack = ulps * np.spacing(magnitude.astype(np.float32)).astype(np.float64) + floor
    close = finite & (np.abs(actual - np.where(finite, rounded, 0)) <= slack)
    return close | (np.isnan(actual) & np.isnan(rounded)) | (~finite & (actual == rounded))


def assert_like_torch(actual, expected, expected_float32, what, ulps=ULPS, floor=FLOOR, inputs=None, unchecked=None):
    """Every element of ``actual`` matches torch's float64 result ``expected`` or its float32
    one, except where the mask ``unchecked`` holds."""
    actual = np.asarray(actual, np.float64)
    assert actual.shape == np.shape(expected), f"{what}: shape {actual.shape}, torch {np.shape(expected)}"
    same = _matches(actual, expected, ulps, floor) | _matches(actual, expected_float32, ulps, floor)
    if unchecked is not None:
        same |= unchecked
    if not same.all():
        shown = [f"at {tuple(int(i) for i in index)}"
                 + (f" input {np.asarray(inputs)[tuple(index)]!r}" if np.shape(inputs) == actual.shape else "")
                 + f": {actual[tuple(index)]!r}, torch {np.asarray(expected)[tuple(index)]!r}"
                 f" (float32 {np.asarray(expected_float32)[tuple(index)]!r})"
                 for index in np.argwhere(~same)[:6]]  # fmt: skip
        raise AssertionError(f"{what} differs from torch in {int((~same).sum())} places:\n  " + "\n  ".join(shown))


def check_against_torch(model, reference, values: dict, trainable, upstream, ulps=ULPS, floor=FLOOR):
    """Run ``model``'s training graph and torch's ``reference(**values)``; compare the output
    and the gradient of each of ``trainable``. Returns the training graph.

    The gradient at an input that is NaN itself is not compared (the value there is): torch
    has no single answer, its kernels give NaN on their vectorized path and a branch's
    derivative on their scalar one (ELU's is 1 on a tensor of 6 elements, NaN on one of 60).
    """
    results, train = run_training_graph(model, values, trainable)
    gradients = {name: results[f"{name}_grad"] for name in trainable}
    assert_results_like_torch({"value": results["output"]}, gradients, reference, values, upstream, ulps, floor)
    return train


def assert_results_like_torch(outputs: dict, gradients: dict, reference, values: dict, upstream, ulps=ULPS, floor=FLOOR):
    """Each of ``outputs`` ({what: array}) is torch's ``reference(**values)``, each of ``gradients``
    ({name: array}) torch's gradient of that value (at a NaN input itself not compared, see
    ``check_against_torch``)."""
    expected, expected_gradients = torch_reference(reference, values, upstream, list(gradients))
    expected32, gradients32 = torch_reference(reference, values, upstream, list(gradients), torch.float32)
    first = values[next(iter(gradients))] if gradients else None
    for what, output in outputs.items():
        assert_like_torch(output, expected, expected32, what, ulps, floor, first)
    for name, gradient in gradients.items():
        gradient = np.asarray(gradient).reshape(np.shape(expected_gradients[name]))
        assert_like_torch(gradient, expected_gradients[name], gradients32[name], f"gradient of {name}", ulps, floor, values[name],
                          np.isnan(np.asarray(values[name], np.float64)))  # fmt: skip


class _Shifted(torch.nn.Module):
    """``function(**batch, **weights)`` where each weight is a buffer, and each weight and each batch input in
    ``shifted`` has a parameter of zeros subtracted (``x - 0`` keeps -0, NaN and the infinities)."""

    def __init__(self, function, weights: dict, shifted: dict):
        super().__init__()
        self.function, self.weight_names, self.shifted = function, list(weights), list(shifted)
        for name, value in weights.items():
            self.register_buffer(name, torch.tensor(np.asarray(value)))
        for name, shape in shifted.items():
            self.register_parameter(f"{name}_shift", torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, **batch):
        values = {**batch, **{name: getattr(self, name) for name in self.weight_names}}
        return self.function(**{name: value - getattr(self, f"{name}_shift") if name in self.shifted else value
                                for name, value in values.items()})  # fmt: skip


def _shifted_module(function, batch_names, weights: dict, shifted: dict) -> torch.nn.Module:
    """A ``_Shifted`` whose forward's parameters are ``batch_names`` (the trainer names the inputs after them)."""

    def forward(self, **batch):
        return _Shifted.forward(self, **batch)

    parameters = ["self", *batch_names]
    forward.__signature__ = inspect.Signature([inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in parameters])
    return type("Shifted", (_Shifted,), {"forward": forward})(function, weights, shifted)


def _weighted_sum(output, upstream):
    return (output * upstream.reshape(output.shape)).sum()  # upstream flat: the label's rank does not follow the output's


def check_trainer_against_torch(function, batches, weights: dict, differentiable=(), ulps=ULPS, floor=FLOOR, saved_to=None):
    """Through the public API: an ORTTrainer trains ``function(**batch, **weights)`` with loss
    sum(output * upstream); at each batch (a dict of arrays) the value of eval_step, of the model
    saved by save_as_onnx (with ``saved_to``, a directory) and of train_step, and the gradient of
    each weight and of each batch input in ``differentiable``, are compared with torch's in float64
    (``assert_results_like_torch``). The weights are buffers, each with a parameter of zeros
    subtracted, as are the ``differentiable`` inputs (whose shape is then the same in every batch):
    SGD with lr 1 leaves such a parameter at the gradient, exactly; the parameters go back to 0
    (load_state_dict) before the next batch, which the same trainer takes (another shape: another
    graph). The first-step check against torch is off: this compares more. Returns the trainer."""
    batch_names = list(batches[0])
    shifted = {name: np.shape(batches[0][name]) for name in differentiable}
    shifted.update({name: np.shape(value) for name, value in weights.items()})
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "debug": {"check_against_torch": "off"}})
    trainer = ORTTrainer(_shifted_module(function, batch_names, weights, shifted), None, optim.SGDConfig(lr=1.0),
                         loss_fn=_weighted_sum, options=options)  # fmt: skip
    initial = None
    for batch in batches:
        values = {**batch, **weights}
        upstream = upstream_like(tuple(function(**{name: torch.tensor(np.asarray(value)) for name, value in values.items()}).shape))
        inputs = [torch.tensor(np.asarray(batch[name])) for name in batch_names] + [torch.tensor(upstream.reshape(-1))]
        outputs = {"eval_step value": trainer.eval_step(*inputs)[1].numpy()}
        if initial is None:
            initial = copy.deepcopy(trainer.state_dict())
        if saved_to is not None:
            path = os.path.join(saved_to, "saved.onnx")
            trainer.save_as_onnx(path, with_loss=False)
            session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
            feeds = {graph_input.name: np.asarray(batch[graph_input.name]) for graph_input in session.get_inputs()}
            saved = outputs["saved model's value"] = session.run(None, feeds)[0]
            declared = [dim.dim_value or None for dim in onnx.load(path).graph.output[0].type.tensor_type.shape.dim]
            assert all(size in (None, actual) for size, actual in zip(declared, saved.shape)), \
                f"the saved model declares its output {declared}, gives {saved.shape}"
        outputs["train_step value"] = trainer.train_step(*inputs)[1].detach().numpy()
        state = trainer.state_dict(pytorch_format=True)
        gradients = {name: state[f"{name}_shift"].numpy() for name in shifted}
        assert_results_like_torch(outputs, gradients, function, values, upstream, ulps, floor)
        trainer.load_state_dict(initial)
    return trainer


def op_types(model) -> set:
    return {node.op_type for node in model.graph.node}
