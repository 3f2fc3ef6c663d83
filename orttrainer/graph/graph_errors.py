"""Errors of the graph stage that say where in the graph they happen: the node, and the torch module it
came from (read from the exporter's scoped node names). GradientBuildError: the training graph cannot be built
or run on this device; RunError: ONNX Runtime failed on a batch."""

import re

import onnx
from onnxruntime.capi import onnxruntime_pybind11_state as _ort

from . import rewrites


class GradientBuildError(RuntimeError):
    """The gradient graph cannot be built; the message names the op types, nodes and modules."""


class RunError(RuntimeError):
    """ONNX Runtime failed on a batch; the message names the op and the torch module it came from."""


def module_path(node_name: str) -> str:
    """The torch module a node came from, from the TorchScript exporter's scoped name.

    Each scope level is an attribute name, except numbered children, which carry their
    parent's name: ``/model/layer/self_attn/Softmax`` -> ``layer.self_attn``,
    ``/model/features/features.1/Conv`` -> ``features.1``; ``""`` when unknown.
    """
    levels = [part for part in node_name.split("/") if part][:-1]
    if levels and levels[0] == "model":  # the attribute under which as_trained.py wraps the user's module
        levels = levels[1:]
    numbered_root = bool(levels) and levels[0].startswith("model.")  # children of a Sequential root: model.0, ...
    path = ""
    for level in levels:
        path = level if not path or level.startswith(path + ".") else f"{path}.{level}"
    return path[len("model.") :] if numbered_root else path


def describe_node(node: onnx.NodeProto) -> str:
    where = module_path(node.name)
    return f"{node.op_type} (node '{node.name}'" + (f", module '{where}')" if where else ")")


def where_in_graph(model: onnx.ModelProto, names) -> dict:
    """{name: the node that produces it (an output) or first reads it (a weight), with its torch module}."""
    producers = {output: node for node in model.graph.node for output in node.output}
    readers = {}
    for node in model.graph.node:
        for name in node.input:
            readers.setdefault(name, node)
    found = {}
    for name in names:
        if name in producers:
            found[name] = f"from {describe_node(producers[name])}"
        elif name in readers:
            found[name] = f"read by {describe_node(readers[name])}"
    return found


def run_error(error: Exception, empty_inputs=()) -> RunError:
    """ONNX Runtime's 'Non-zero status code returned while running X node. Name:...' as one readable line;
    ``empty_inputs`` (descriptions of the batch's inputs with a dimension of size 0) are named as the likely cause."""
    found = re.search(r"running (\S+) node\. Name:'([^']*)' Status Message: (.*)", str(error), re.DOTALL)
    if not found:
        message = f"ONNX Runtime failed on this batch: {error}"
    else:
        op_type, node_name, status = found.groups()
        where = module_path(node_name.split("_Grad/")[0])
        status = status.strip().split(" ", 1)[-1] if status.startswith("/onnxruntime_src") else status.strip()
        message = (f"ONNX Runtime failed on this batch in {op_type} (node '{node_name}'"
                   + (f", module '{where}'" if where else "") + f"): {status}")  # fmt: skip
    if empty_inputs:
        message = (f"{message.rstrip('.')}. The batch is empty ({', '.join(empty_inputs)}): ONNX Runtime's kernels do "
                   "not all take a dimension of size 0, where torch's do; leave empty batches out")  # fmt: skip
    return RunError(message)


# What ONNX Runtime raises: its C++ exceptions become RuntimeError, its failed statuses its own classes.
ONNX_RUNTIME_ERRORS = (RuntimeError, _ort.Fail, _ort.InvalidArgument, _ort.InvalidGraph, _ort.RuntimeException,
                       _ort.EPFail)  # fmt: skip

# How ONNX Runtime's messages name the node it failed on, its op and why.
_NODE_FAILURES = (
    r"Node \((?P<node>[^)]*)\) Op \((?P<op>[^)]*)\) (?P<reason>.*)",  # shape and type inference
    r'In Node, \("(?P<node>[^"]*)", (?P<op>[^,]*), .*?, Error (?P<reason>.*)',  # the graph's checks (an unknown op)
    r"(?P<reason>Type Error: .*? (?:operator|Optype) \((?P<op>[^)]*)\).* in node \((?P<node>[^)]*)\).*)",  # types
)


def node_error(error: Exception, doing: str):
    """GradientBuildError for ONNX Runtime's ``error`` while ``doing`` (building the gradient graph, opening a session)
    naming the op, the node, its torch module, ONNX Runtime's reason and what the user can do; None when the message
    names no node."""
    for pattern in _NODE_FAILURES:
        found = re.search(pattern, str(error), re.DOTALL)
        if found:
            break
    else:
        return None
    node_name, op_type, reason = found.group("node", "op", "reason")
    where = module_path(node_name.split("_Grad/")[0])  # a gradient node: its forward node's module
    module = f"module '{where}'" if where else "the model"
    step = "ONNX Runtime's gradient of a step" if "_Grad/" in node_name else "a step"
    return GradientBuildError(
        f"ONNX Runtime failed {doing} at {op_type} (node '{node_name}'" + (f", {module})" if where else ")")
        + f": {reason.strip().rstrip('.')}. The node is {step} of the forward of {module} as the exporter wrote it: "
        "compute that step with other torch ops, or train this model with torch"
    )


def missing_kernel_error(error: Exception, device, model: onnx.ModelProto) -> GradientBuildError:
    """ONNX Runtime found no kernel for a (gradient) node of ``model`` on this device: say which op and module, and
    whether the graph casts to bfloat16 (torch.autocast inside forward)."""
    found = re.search(r"implementation for (\S+)\(\d+\) node with name '([^']*)'", str(error))
    if not found:
        return GradientBuildError(f"ONNX Runtime cannot run the training graph on {device}: {error}")
    op_type, node_name = found.groups()
    where = module_path(node_name.split("_Grad/")[0])  # '/model/layer/Op_Grad/OpGrad_0' -> the forward node
    bfloat16 = any(node.op_type == "Cast" and rewrites.node_attribute(node, "to") == onnx.TensorProto.BFLOAT16
                   for node in model.graph.node)  # fmt: skip
    return GradientBuildError(
        f"ONNX Runtime has no {device.type.upper()} kernel for {op_type} (node '{node_name}'"
        + (f", module '{where}')" if where else ")")
        + ("; the graph casts to bfloat16 (torch.autocast inside forward?), for which ONNX Runtime has few kernels: "
           "compute in float32, or use the option mixed_precision.enabled (float16)" if bfloat16 else "")
    )
