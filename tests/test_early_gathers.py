"""Gathers of rows moved above the row-wise ops that computed those rows (graph/early_gathers.py).

Each graph is run before and after the move by ONNX Runtime on the same inputs, boundary values among them: the moved
graph must give the same outputs. Where a move would change what the graph computes (rows read elsewhere, indices
computed from the rows, an axis the op mixes), nothing moves. End to end, a BERT classifier's last layer computes the
pooled token only and trains like torch at every padded length (test_dynamic_lengths, test_hf_models).
"""

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import zoo
from parity import cpu_options

from orttrainer import ORTTrainer, optim
from orttrainer.graph.early_gathers import gather_rows_early
from orttrainer.graph.graph_edits import sort_topologically

BATCH, LENGTH, WIDTH, HIDDEN = 3, 5, 4, 6


def _model(nodes, outputs, initializers=(), inputs=(("x", [BATCH, LENGTH, WIDTH]),)):
    graph = helper.make_graph(
        nodes, "rows", [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in inputs],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(value), name) for name, value in initializers],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _weights(seed=0):
    generator = np.random.default_rng(seed)
    return [("w", generator.standard_normal((WIDTH, HIDDEN)).astype(np.float32)),
            ("b", generator.standard_normal(HIDDEN).astype(np.float32)),
            ("v", generator.standard_normal((HIDDEN, WIDTH)).astype(np.float32)),
            ("scale", generator.standard_normal(WIDTH).astype(np.float32)),
            ("shift", generator.standard_normal(WIDTH).astype(np.float32))]  # fmt: skip


def _block(index, extra=()):
    """A transformer feed-forward block on ``x`` (MatMul, bias, erf, MatMul, residual, LayerNorm), then a Gather of
    ``index`` along the length axis; ``extra`` more nodes."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Erf", ["hb"], ["e"]),
        helper.make_node("Mul", ["hb", "e"], ["g"]),
        helper.make_node("MatMul", ["g", "v"], ["f"]),
        helper.make_node("Add", ["f", "x"], ["r"]),
        helper.make_node("LayerNormalization", ["r", "scale", "shift"], ["n"], axis=-1),
        helper.make_node("Constant", [], ["i"], value=numpy_helper.from_array(np.asarray(index, dtype=np.int64))),
        helper.make_node("Gather", ["n", "i"], ["y"], axis=1, name="pool"),
    ]
    return nodes + list(extra)


def _run(model, feeds):
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def _moved_like_before(model, feeds, sample=None):
    """How many moves ``gather_rows_early`` made, after checking the moved graph gives the outputs of the original."""
    before = _run(model, feeds)
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    moves = gather_rows_early(moved, sample or {name: list(value.shape) for name, value in feeds.items()})
    for expected, got in zip(before, _run(moved, feeds)):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    return moves, moved


def _inputs(seed=1, length=LENGTH):
    x = np.random.default_rng(seed).standard_normal((BATCH, length, WIDTH)).astype(np.float32)
    x[0, 0, :2] = [0.0, -0.0]
    x[1, -1, 0] = 1e-38
    x[2, -1, 1] = 3e38
    return {"x": x}


@pytest.mark.parametrize("index", [0, -1, [0, 3], [4, 4, 0], []], ids=["first", "last", "two", "repeated", "none"])
def test_a_pooled_row_is_computed_alone_with_the_values_of_every_row(index):
    """The feed-forward block moves under the Gather: both MatMuls read gathered rows; the residual's two reads of x
    are one Gather."""
    moves, moved = _moved_like_before(_model(_block(index), ["y"], _weights()), _inputs())
    assert moves == 7  # LayerNorm, Add, MatMul, Mul, Erf, Add, MatMul
    nodes = list(moved.graph.node)
    (gather,) = [node for node in nodes if node.op_type == "Gather"]
    rows = {gather.output[0]} | {node.output[0] for node in nodes if node.op_type == "Identity" and node.input[0] in gather.output}
    assert gather.input[0] == "x" and nodes.index(gather) == min(index for index, node in enumerate(nodes) if node.op_type != "Constant")
    assert [node.input[0] in rows for node in nodes if node.op_type == "MatMul"] == [True, False]  # the second reads the first's


def test_not_at_infinite_or_nan_rows_either():
    feeds = _inputs()
    feeds["x"][0, 0, 0], feeds["x"][1, 0, 1], feeds["x"][2, 0, 2] = np.inf, -np.inf, np.nan
    moves, _ = _moved_like_before(_model(_block(0), ["y"], _weights()), feeds)
    assert moves == 7


def test_rows_read_elsewhere_are_all_computed():
    """The LayerNorm's output is a graph output too (hidden states returned): nothing moves."""
    moves, _ = _moved_like_before(_model(_block(0), ["y", "n"], _weights()), _inputs())
    assert moves == 0


def test_rows_that_also_choose_which_row_is_read_are_all_computed():
    """Which row is read depends on the rows themselves (the argmax of their first feature)."""
    nodes = _block(0)[:-2] + [
        helper.make_node("Gather", ["n", "zero"], ["first"], axis=2),
        helper.make_node("ArgMax", ["first"], ["best"], axis=1, keepdims=0),
        helper.make_node("Gather", ["n", "best"], ["y"], axis=1),
    ]
    model = _model(nodes, ["y"], _weights() + [("zero", np.asarray(0, dtype=np.int64))])
    assert _moved_like_before(model, _inputs())[0] == 0


@pytest.mark.parametrize(("index", "moves"), [([1, 2], 1), (1, 0)], ids=["kept axis", "dropped axis"])
def test_an_input_broadcast_along_the_axis_is_read_whole(index, moves):
    """x + m with m of length 1: m is added to every gathered row as it is; a 0-d index (which drops the axis m
    is broadcast along) does not move."""
    nodes = [helper.make_node("Add", ["x", "m"], ["s"]),
             helper.make_node("Constant", [], ["i"], value=numpy_helper.from_array(np.asarray(index, dtype=np.int64))),
             helper.make_node("Gather", ["s", "i"], ["y"], axis=1)]  # fmt: skip
    model = _model(nodes, ["y"], inputs=(("x", [BATCH, LENGTH, WIDTH]), ("m", [BATCH, 1, WIDTH])))
    feeds = {**_inputs(), "m": np.random.default_rng(2).standard_normal((BATCH, 1, WIDTH)).astype(np.float32)}
    assert _moved_like_before(model, feeds)[0] == moves


@pytest.mark.parametrize(("op", "axis", "moves"), [("Softmax", 1, 0), ("Softmax", -1, 1), ("LayerNormalization", 1, 0),
                                                   ("MatMul", None, 0)], ids=["softmax over the gathered axis",
                                                   "softmax over another", "layer norm over it", "matmul's columns"])  # fmt: skip
def test_an_op_mixing_the_gathered_axis_keeps_the_gather_after_it(op, axis, moves):
    """Softmax and LayerNorm over the gathered axis, a Gather of a MatMul's columns (the last axis)."""
    if op == "MatMul":
        nodes = [helper.make_node("MatMul", ["x", "w"], ["s"])]
        gathered_axis, initializers = 2, _weights()[:1]
    else:
        extra = [_weights()[3], _weights()[4]] if op == "LayerNormalization" else []
        inputs = ["x"] + (["scale5", "shift5"] if extra else [])
        nodes = [helper.make_node(op, inputs, ["s"], axis=axis)]
        gathered_axis = 1
        initializers = [("scale5", np.ones((LENGTH, WIDTH), np.float32)), ("shift5", np.zeros((LENGTH, WIDTH), np.float32))] if extra else []
    nodes += [helper.make_node("Constant", [], ["i"], value=numpy_helper.from_array(np.asarray([0, 2], dtype=np.int64))),
              helper.make_node("Gather", ["s", "i"], ["y"], axis=gathered_axis)]  # fmt: skip
    assert _moved_like_before(_model(nodes, ["y"], initializers), _inputs())[0] == moves


def test_two_dimensional_indices_stay():
    nodes = _block([[0, 1], [2, 3]])
    assert _moved_like_before(_model(nodes, ["y"], _weights()), _inputs())[0] == 0


def test_a_length_of_one_at_the_built_batch_moves_nothing():
    """At length 1 a broadcast input and one that has the axis look alike: nothing moves."""
    model = _model(_block(0), ["y"], _weights(), inputs=(("x", [BATCH, "length", WIDTH]),))
    moves, _ = _moved_like_before(model, _inputs(length=1))
    assert moves == 0


def test_a_kept_gather_stays():
    model = _model(_block(0), ["y"], _weights())
    assert gather_rows_early(model, {"x": [BATCH, LENGTH, WIDTH]}, kept={"pool"}) == 0


def test_the_moved_graph_serves_other_lengths():
    """Moved at length 5, run at lengths 2 and 9 (dynamic length axis)."""
    model = _model(_block(0), ["y"], _weights(), inputs=(("x", [BATCH, "length", WIDTH]),))
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    assert gather_rows_early(moved, {"x": [BATCH, LENGTH, WIDTH]}) == 7
    for length in (2, 9):
        feeds = _inputs(length=length)
        np.testing.assert_allclose(_run(moved, feeds)[0], _run(model, feeds)[0], rtol=1e-6, atol=1e-6)


def test_a_bert_classifier_computes_its_last_layer_for_the_pooled_token_only(monkeypatch):
    """The training graph's last-layer feed-forward MatMul reads the gathered first token; it trains like torch
    (test_dynamic_lengths compares every step)."""
    pytest.importorskip("transformers", reason="the Hugging Face zoo needs transformers (the test extra)")
    from orttrainer.graph import training_graph

    built, build = [], training_graph.build_training_graphs
    monkeypatch.setattr(training_graph, "build_training_graphs", lambda *args, **kwargs: built.append(build(*args, **kwargs)) or built[-1])
    torch.manual_seed(0)
    trainer = ORTTrainer(zoo.bert_classifier(), None, optim.SGDConfig(lr=0.1), options=cpu_options())
    trainer.train_step(zoo.classification_batch(2, 8, generator=torch.Generator().manual_seed(0)))
    nodes = built[0].train.graph.node
    last = max(int(node.name.split("layer.")[1].split("/")[0]) for node in nodes if "encoder/layer." in node.name)
    first_dense = [node for node in nodes if f"layer.{last}/intermediate/dense/MatMul" in node.name and "_Grad" not in node.name]
    assert first_dense and all("/rows/" in node.input[0] for node in first_dense)


def _int64(values):
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64))


def _last_token_classifier():
    """GPT-2's and Llama's classifier shape: Conv1D blocks (flatten to rows, Gemm, reshape back to the input's leading
    sizes), a residual, an RMSNorm (a mean over the last axis), the logits of every position flattened to rows and
    each sequence's row ``last`` gathered at ``batch_index * length + last``, the length read from the logits'
    shape."""
    def constant(name, values):
        return helper.make_node("Constant", [], [name], value=_int64(values))

    def conv1d(prefix, source, weight, bias, width):  # GPT-2's Conv1D: view(-1, in), addmm, view(*leading, out)
        return [helper.make_node("Shape", [source], [f"{prefix}_shape"]),
                constant(f"{prefix}_zero", 0), constant(f"{prefix}_one", 1), constant(f"{prefix}_axes", [0]),
                helper.make_node("Gather", [f"{prefix}_shape", f"{prefix}_zero"], [f"{prefix}_batch"], axis=0),
                helper.make_node("Gather", [f"{prefix}_shape", f"{prefix}_one"], [f"{prefix}_length"], axis=0),
                helper.make_node("Unsqueeze", [f"{prefix}_batch", f"{prefix}_axes"], [f"{prefix}_batch1"]),
                helper.make_node("Unsqueeze", [f"{prefix}_length", f"{prefix}_axes"], [f"{prefix}_length1"]),
                constant(f"{prefix}_width", [width]),
                helper.make_node("Concat", [f"{prefix}_batch1", f"{prefix}_length1", f"{prefix}_width"], [f"{prefix}_target"],
                                 axis=0),
                constant(f"{prefix}_rows", [-1, WIDTH if prefix == "up" else HIDDEN]),
                helper.make_node("Reshape", [source, f"{prefix}_rows"], [f"{prefix}_2d"]),
                helper.make_node("Gemm", [f"{prefix}_2d", weight, bias], [f"{prefix}_gemm"]),
                helper.make_node("Reshape", [f"{prefix}_gemm", f"{prefix}_target"], [f"{prefix}_out"])]  # fmt: skip

    nodes = conv1d("up", "x", "w", "b", HIDDEN) + [helper.make_node("Erf", ["up_out"], ["e"])] + conv1d("down", "e", "v", "shift", WIDTH)
    nodes += [
        helper.make_node("Add", ["down_out", "x"], ["s"]),
        helper.make_node("Mul", ["s", "s"], ["squares"]),
        helper.make_node("ReduceMean", ["squares"], ["mean"], axes=[-1], keepdims=1),
        helper.make_node("Add", ["mean", "epsilon"], ["shifted"]),
        helper.make_node("Sqrt", ["shifted"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["inverse"]),
        helper.make_node("Mul", ["s", "inverse"], ["normalized"]),
        helper.make_node("Mul", ["normalized", "scale"], ["n"]),
        helper.make_node("MatMul", ["n", "head"], ["logits"]),
        helper.make_node("Flatten", ["logits"], ["flat"], axis=2),
        helper.make_node("Shape", ["logits"], ["logits_shape"]),
        constant("zero", 0), constant("one", 1),
        helper.make_node("Gather", ["logits_shape", "zero"], ["batch"], axis=0),
        helper.make_node("Gather", ["logits_shape", "one"], ["length"], axis=0),
        helper.make_node("Range", ["zero", "batch", "one"], ["sequences"]),
        helper.make_node("Mul", ["sequences", "length"], ["starts"]),
        helper.make_node("Add", ["starts", "last"], ["rows"]),
        helper.make_node("Gather", ["flat", "rows"], ["y"], axis=0, name="pool"),
    ]
    weights = _weights() + [("epsilon", np.float32(1e-6)), ("head", np.random.default_rng(3).standard_normal((WIDTH, 3)).astype(np.float32))]
    model = _model(nodes, ["y"], weights, inputs=(("x", [BATCH, "length", WIDTH]),))
    model.graph.input.append(helper.make_tensor_value_info("last", TensorProto.INT64, [BATCH]))
    return model


@pytest.mark.parametrize("length", [5, 2, 9])
def test_the_last_token_of_each_sequence_is_computed_alone_with_the_values_of_every_row(length):
    """Moved at length 5: the Gather of the flattened logits moves above the head, the RMSNorm, the residual and both
    Conv1D blocks (through their reshapes) to the rows of x; the length the indices read comes from x's shape. Run at
    lengths 5, 2 and 9 (boundary values in x) against the original."""
    model = _last_token_classifier()
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    assert gather_rows_early(moved, {"x": [BATCH, LENGTH, WIDTH], "last": [BATCH]}) > 10
    rows = [node for node in moved.graph.node if node.op_type == "Gather" and "/rows/" in node.output[0]]
    assert rows and all(node.input[0] == "up_2d" or node.input[0].startswith("x/flattened/") for node in rows)  # x's rows
    feeds = {**_inputs(length=length), "last": np.asarray([length - 1, 0, length // 2], dtype=np.int64)}
    np.testing.assert_allclose(_run(moved, feeds)[0], _run(model, feeds)[0], rtol=1e-6, atol=1e-6)
    assert not any(node.op_type == "MatMul" and node.input[0] == "n" for node in moved.graph.node)


@pytest.mark.parametrize("target", [[0, -1], [0, 0, -1], [-1, 4], [2, 0, 2, 2], [3, -1, 4], [24]],
                         ids=["copy-then-infer", "copies", "inferred-first", "copy-inside", "inferred-inside", "flat"])
def test_a_reshape_s_shape_from_its_input_and_target(target):
    """A Shape of a Reshape's output (what GPT-2's index arithmetic reads once the rows move) computed from the
    Reshape's input and target: a 0 copies the input's size, a -1 takes what is left of its count."""
    from orttrainer.graph.early_gathers import _shape_from_inputs

    nodes = [helper.make_node("Reshape", ["x", "target"], ["y"], name="reshape"), helper.make_node("Shape", ["y"], ["s"])]
    graph = helper.make_graph(nodes, "reshape", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("s", TensorProto.INT64, None)],
                              [numpy_helper.from_array(np.asarray(target, dtype=np.int64), "target")])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert _shape_from_inputs(model.graph, model.graph.node[1], model.graph.node[0], {})
    assert "y" not in model.graph.node[1].input
    copied = [(2, 3, 4)[axis] if size == 0 else size for axis, size in enumerate(target)]  # ONNX's 0: the input's size
    sort_topologically(model.graph)
    assert list(_run(model, {"x": np.zeros((2, 3, 4), np.float32)})[0]) == list(np.zeros((2, 3, 4)).reshape(copied).shape)


def test_a_shape_of_an_elementwise_result_of_unknown_sizes_stays_where_it_is():
    """Sizes the built batch does not tell (a mask expanded to a shape computed in the run): the Shape keeps
    reading the result, and the Gather above it does not move."""
    from orttrainer.graph.early_gathers import _shape_from_inputs

    nodes = [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Shape", ["s"], ["size"])]
    graph = helper.make_graph(nodes, "add", [], [])
    assert not _shape_from_inputs(graph, graph.node[1], graph.node[0], {"s": [2, None], "a": [2, None], "b": [2, None]})
    assert list(graph.node[1].input) == ["s"] and graph.node[1].op_type == "Shape"
