"""Probe the stack facts of docs/stack_facts.md; prints one line per fact.

    .venv/bin/python docs/stack_probe.py

Each check builds a tiny model and asks torch / onnx / onnxruntime-training directly;
nothing here uses orttrainer. Run it after upgrading any of the three.
"""

import contextlib
import inspect
import io
import os
import sys
import warnings

import numpy as np
import onnx
import onnxruntime
import torch
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.capi._pybind_state import GradientGraphBuilder, get_optimized_model


def report(fact, result):
    print(f"{fact}: {result}", flush=True)


def first_line(error):
    return f"{type(error).__name__}: {str(error).splitlines()[0][-140:]}"


def model_of(nodes, inputs, outputs, initializers=(), opset=17, ir_version=10):
    model = helper.make_model(helper.make_graph(nodes, "probe", inputs, outputs, list(initializers)),
                              opset_imports=[helper.make_opsetid("", opset)])
    if ir_version is not None:
        model.ir_version = ir_version
    return model


def session(model):
    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def quiet_options():
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return options


def export(module, args):
    buffer = io.BytesIO()
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        torch.onnx.export(module.train(), args, buffer, dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, opset_version=17)
    return onnx.load_from_string(buffer.getvalue()), [str(w.message) for w in heard]


@contextlib.contextmanager
def stdout_silenced():
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    try:
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def tensor(name, elem_type=TensorProto.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem_type, shape)


def main():
    report("versions", f"python {sys.version.split()[0]}, torch {torch.__version__}, onnx {onnx.__version__}, "
                       f"onnxruntime {onnxruntime.__version__}")
    report("providers listed", onnxruntime.get_available_providers())
    report("onnxruntime.training importable", hasattr(__import__("onnxruntime.training"), "training"))

    # IR versions
    relu = model_of([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", shape=[2])], [tensor("y", shape=[2])], ir_version=None)
    report("onnx helper.make_model IR version", relu.ir_version)
    try:
        session(relu)
        report(f"onnxruntime loads IR {relu.ir_version}", "yes")
    except Exception as error:
        report(f"onnxruntime loads IR {relu.ir_version}", "no, " + str(error)[:75])
    relu.ir_version = 10
    session(relu)
    report("onnxruntime loads IR 10", "yes")

    # exporter
    report("torch.onnx.export dynamo default", inspect.signature(torch.onnx.export).parameters["dynamo"].default)
    from torch.onnx import _constants

    report("TorchScript exporter max opset", _constants.ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET)
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.BatchNorm1d(4), torch.nn.LayerNorm(4))
    exported, heard = export(layers, (torch.randn(3, 4),))
    report("export warns legacy TorchScript", any("legacy TorchScript-based ONNX export" in m for m in heard))
    for node in exported.graph.node:
        if node.op_type in ("Dropout", "BatchNormalization", "LayerNormalization"):
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name == "training_mode"}
            report(f"training export {node.op_type}", f"{len(node.input)} inputs, {len(node.output)} outputs {attributes}")

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)

        def forward(self, q):
            return self.attention(q, q, q, need_weights=False)[0]

    exported, _ = export(Attention(), (torch.randn(2, 3, 8),))
    for node in exported.graph.node:
        if node.op_type == "Dropout":
            report("attention Dropout", f"{len(node.input)} inputs, {len(node.output)} outputs")

    class L1(torch.nn.Module):
        def forward(self, x, y):
            return torch.nn.functional.l1_loss(x, y)

    try:
        with stdout_silenced():  # the exporter prints its graph when it gives up
            export(L1(), (torch.randn(3), torch.randn(3)))
        report("F.l1_loss exports at opset 17", "yes")
    except Exception as error:
        report("F.l1_loss exports at opset 17", "no, " + first_line(error)[:100])

    # gradient builder
    def build(model, weights):
        GradientGraphBuilder(model.SerializeToString(), {"loss"}, set(weights), "loss", quiet_options()).build()

    def one_op(op_type, outputs=1):
        names = ["h"] + [f"extra{i}" for i in range(outputs - 1)]
        if op_type == "LayerNormalization":
            nodes = [helper.make_node(op_type, ["x", "w", "b"], names, name="probed")]
        else:
            nodes = [helper.make_node("Mul", ["x", "w"], ["xw"], name="mul"), helper.make_node(op_type, ["xw"], names, name="probed")]
        nodes.append(helper.make_node("ReduceSum", ["h"], ["loss"], name="sum", keepdims=0))
        return model_of(nodes, [tensor("x", shape=[2, 4]), tensor("w", shape=[4]), tensor("b", shape=[4])], [tensor("loss", shape=[])])

    for outputs in (1, 3):
        try:
            build(one_op("LayerNormalization", outputs), ["w", "b"])
            report(f"gradient of LayerNormalization with {outputs} output(s)", "builds")
        except Exception as error:
            report(f"gradient of LayerNormalization with {outputs} output(s)", "fails, " + first_line(error)[-80:])
    for op_type in ("Relu", "Softplus", "Elu", "HardSwish"):
        try:
            build(one_op(op_type), ["w"])
            report(f"gradient builder for {op_type}", "yes")
        except Exception as error:
            report(f"gradient builder for {op_type}", "no, " + first_line(error)[-70:])

    exported, _ = export(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), (torch.randn(3, 4),))
    weights = {i.name for i in exported.graph.initializer if i.name.endswith(("weight", "bias"))}
    optimized = onnx.load_from_string(get_optimized_model(exported.SerializeToString(), weights, quiet_options()))
    report("get_optimized_model BatchNorm", [(n.op_type, len(n.output)) for n in optimized.graph.node if "BatchNorm" in n.op_type])
    report("  its graph outputs", [o.name for o in optimized.graph.output])

    # BatchNorm running variance
    inits = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("s", [1, 1]), ("b", [0, 0]), ("m", [0, 0]), ("v", [1, 1]))]
    batch_norm = model_of([helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "mean", "var"], training_mode=1, momentum=0.0)],
                          [tensor("x", shape=[4, 2])], [tensor(n) for n in ("y", "mean", "var")], inits, opset=15)
    x = np.array([[0, 0], [1, 2], [2, 4], [3, 6]], np.float32)
    variance = session(batch_norm).run(None, {"x": x})[2]
    report("BatchNorm running var (momentum 0)", f"{variance.tolist()}; biased {x.var(0).tolist()}, unbiased {[round(float(v), 3) for v in x.var(0, ddof=1)]}")

    # dropout and set_seed
    inits = [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"), numpy_helper.from_array(np.array(True), "training")]
    dropout = session(model_of([helper.make_node("Dropout", ["x", "ratio", "training"], ["y"])], [tensor("x", shape=[1000])], [tensor("y")], inits))
    ones = {"x": np.ones(1000, np.float32)}
    first, second = dropout.run(None, ones)[0], dropout.run(None, ones)[0]
    report("dropout: first two runs give the same mask", bool((first == second).all()))
    onnxruntime.set_seed(7)
    first = dropout.run(None, ones)[0]
    onnxruntime.set_seed(7)
    second = dropout.run(None, ones)[0]
    report("dropout: same mask after the same set_seed", bool((first == second).all()))

    # float16 / bfloat16 on the CPU
    for elem_type, name in ((TensorProto.FLOAT16, "float16"), (TensorProto.BFLOAT16, "bfloat16")):
        matmul = model_of([helper.make_node("MatMul", ["a", "a"], ["c"])], [tensor("a", elem_type, [2, 2])], [tensor("c", elem_type)])
        try:
            session(matmul)
            report(f"CPU MatMul in {name}", "yes")
        except Exception as error:
            report(f"CPU MatMul in {name}", "no, " + first_line(error)[-90:])

    import onnxruntime.training as training

    report("onnxruntime.training.PropagateCastOpsStrategy", hasattr(training, "PropagateCastOpsStrategy"))
    try:
        from onnxruntime.training.ortmodule import ORTModule  # noqa: F401

        report("ORTModule imports", "yes")
    except Exception as error:
        report("ORTModule imports", "no, " + first_line(error)[:90])


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    main()
