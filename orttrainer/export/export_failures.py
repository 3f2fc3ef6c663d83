"""A failed torch.onnx.export told so that the user can act on it, with nothing printed.

When a conversion fails, torch's TorchScript exporter prints the whole traced graph ("Torch IR graph at exception: ",
hundreds of lines for a transformer) from C++ to the process's stdout, which Python's ``sys.stdout`` never sees:
``PrintedOutput`` holds file descriptors 1 and 2 in temporary files during the export, logs that graph at DEBUG on
the ``orttrainer`` logger and passes on whatever else was printed (a ``print`` in forward). ``where`` finds the op
the exporter names in the traced graph: the node's scope names the module that called it, its source range (the
Python stack of the call) the user's line.
"""

import os
import re
import sys
import tempfile

import torch

from ..api.options import MAX_OPSET
from ..progress import logger
from .as_trained import WRAPPED
from .forward_effects import ORTTRAINER_DIRECTORY, is_users_code, source_line

_GRAPH_DUMP = b"Torch IR graph at exception: "  # torch's _model_to_graph prints it through torch._C._jit_onnx_log

# The exporter's error for an op it has no ONNX form for (UnsupportedOperatorError), naming the op.
_UNSUPPORTED = re.compile(r"Exporting the operator '([^']+)' to ONNX opset version \d+ is not supported"
                          r"(?:\. Support for this operator was added in version (\d+))?")  # fmt: skip
_FRAME = re.compile(r"^(.*)\((\d+)\): (\S+)$", re.MULTILINE)  # a line of a node's source range: 'file(line): function'


class PrintedOutput:
    """What the block prints to file descriptors 1 and 2 (stdout, stderr; torch's C++ writes there, not through
    ``sys.stdout``) held in temporary files, then written on to them, but for the traced graph the exporter prints
    when it fails: that goes to the ``orttrainer`` logger at DEBUG (``graph_logged``)."""

    def __init__(self):
        self.graph_logged = False
        self._held = []  # (file descriptor, a duplicate of it as it was, the temporary file it writes to meanwhile)

    def __enter__(self):
        _flush_python_streams()
        for descriptor in (1, 2):
            try:
                file = tempfile.TemporaryFile()
                saved = os.dup(descriptor)
            except OSError:  # no room for a temporary file, or the descriptor is closed (a daemon's): left as it is
                continue
            os.dup2(file.fileno(), descriptor)
            self._held.append((descriptor, saved, file))
        return self

    def __exit__(self, *exc_info):
        _flush_python_streams()
        for descriptor, saved, file in self._held:
            os.dup2(saved, descriptor)
            os.close(saved)
            file.seek(0)
            printed, _, graph = file.read().partition(_GRAPH_DUMP)
            file.close()
            if graph:
                self.graph_logged = True
                logger.debug("torch.onnx.export failed on this traced graph:\n%s", graph.decode(errors="replace"))
            while printed:
                printed = printed[os.write(descriptor, printed) :]
        self._held = []
        return False

    def note(self) -> str:
        """Where the traced graph went, for the error: '' when the exporter printed none."""
        if not self.graph_logged:
            return ""
        return " (torch's traced graph is logged at DEBUG by the 'orttrainer' logger)"


def _flush_python_streams() -> None:
    """Python's buffered stdout and stderr written out, so that what was printed before or during the block lands
    where it was printed."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()


def where(error: Exception, graph, wrapper: torch.nn.Module) -> str:
    """", in module '<qualified name>' (<class>) at <file>:<line>: <source>" of the op the exporter's ``error`` has no
    ONNX form for, found in ``graph`` (the trace of ``wrapper``, an ``as_trained._ModelWithLoss``; None if the trace
    did not end), as far as it is known; '' for another error. The first node of the op is the one the exporter
    failed on: it converts in graph order."""
    found = _UNSUPPORTED.search(str(error))
    node = None if found is None or graph is None else graph.findNode(found.group(1), True)
    if node is None:
        return ""
    name, module = _module_called(node.scopeName(), wrapper)
    line = _users_line(node.sourceRange())
    if name is None:
        called_in = ""
    elif name == WRAPPED[:-1]:
        called_in = f", in {type(module).__name__}.forward"
    elif name.startswith(WRAPPED):
        called_in = f", in module '{name[len(WRAPPED) :]}' ({type(module).__name__})"
    else:
        called_in = f", in the loss_fn ({type(module).__name__})"
    return called_in + (f" at {line}" if line else "")


def what_to_do(message: str) -> str:
    """What the user can do about an op the exporter cannot write (``message``: the exporter's first line), or ''."""
    found = _UNSUPPORTED.search(message)
    if found is None:
        return ""
    if found.group(2):
        return (f". Set options _internal_use.onnx_opset_version to {found.group(2)} or more (at most {MAX_OPSET}), or "
                "compute it with other torch ops")
    return (f". torch's exporter has no ONNX form for {found.group(1)}: compute it with other torch ops, or train this "
            "model with torch")


def _module_called(scope: str, wrapper: torch.nn.Module):
    """(qualified name in ``wrapper``, module) of the innermost module a node's scope names, or (None, None).

    A scope is 'class::name/class::name/...', from the traced root down the module calls, each name the
    qualified name from its last atom that is not a number (trace._scope_name): each level is the first module below
    the last one found whose class and name end that way."""
    path, found = None, None
    for level in scope.split("/")[1:]:  # the first: the traced root (trace._WeightsAsInputs)
        kind, _, name = level.rpartition("::")
        for qualified, layer in wrapper.named_modules():
            below = path is None or qualified.startswith(path + ".")
            if below and torch.typename(type(layer)) == kind and (qualified == name or qualified.endswith("." + name)):
                path, found = qualified, layer
                break
    return path, found


def _users_line(stack: str):
    """'file:line: source' of the innermost line of the user's code in a node's source range (the Python stack of the
    op's call, innermost first) inside the traced forward: past orttrainer's function modes (each torch call of the
    traced code passes them), before its wrapper's forward."""
    for filename, lineno, function in _FRAME.findall(stack):
        if filename.startswith(ORTTRAINER_DIRECTORY) and function != "__torch_function__":
            return None
        if is_users_code(filename):
            return source_line(filename, int(lineno))
    return None
