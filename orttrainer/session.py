"""ONNX Runtime sessions bound to torch tensor memory.

Device strings follow torch (``"cpu"``, ``"cuda"``, ``"cuda:1"``); ``device_providers``
turns one into the execution providers to ask for, and :class:`TorchBoundSession` runs
a graph whose inputs and outputs are torch tensors, bound by pointer (no copies).
"""

import numpy as np
import onnx
import onnxruntime
import torch
from torch.utils.dlpack import from_dlpack

_NUMPY_DTYPES = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}

_TORCH_DTYPES_BY_ONNX = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.DOUBLE: torch.float64,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
    onnx.TensorProto.INT16: torch.int16,
    onnx.TensorProto.INT8: torch.int8,
    onnx.TensorProto.UINT8: torch.uint8,
    onnx.TensorProto.BOOL: torch.bool,
}


def torch_dtype(onnx_elem_type: int) -> torch.dtype:
    """The torch dtype of an ONNX tensor element type."""
    if onnx_elem_type not in _TORCH_DTYPES_BY_ONNX:
        raise TypeError(f"ONNX element type {onnx.TensorProto.DataType.Name(onnx_elem_type)} has no torch equivalent here")
    return _TORCH_DTYPES_BY_ONNX[onnx_elem_type]


def resolve_device(device_id: str) -> torch.device:
    """``device.id`` -> torch.device, refusing devices this machine does not have."""
    try:
        device = torch.device(device_id)
    except RuntimeError as error:
        raise ValueError(f"options device.id: {device_id!r} is not a torch device string") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"options device.id is {device_id!r} but torch sees no CUDA/ROCm device; use 'cpu' or leave device.id unset"
            )
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        raise ValueError(f"options device.id: {device_id!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    return device


def device_providers(device: torch.device, mem_limit: int = 0, provider_options=None, available=None, is_rocm=None):
    """Execution providers (name, options) for ``device``, CPU last as fallback.

    CUDA devices use the CUDA provider, or the ROCm one when torch was built for ROCm.
    ``provider_options`` ({provider name: options}) replaces this choice entirely.
    """
    available = onnxruntime.get_available_providers() if available is None else available
    if provider_options:
        unknown = [name for name in provider_options if name not in available]
        if unknown:
            raise RuntimeError(f"options provider_options names providers this onnxruntime lacks: {unknown}; it has {available}")
        return list(provider_options.items())
    if device.type == "cpu":
        return [("CPUExecutionProvider", {})]
    is_rocm = torch.version.hip is not None if is_rocm is None else is_rocm
    name = "ROCMExecutionProvider" if is_rocm else "CUDAExecutionProvider"
    if name not in available:
        raise RuntimeError(
            f"device.id '{device}' needs onnxruntime's {name}, but this onnxruntime-training build only has {available}"
        )
    options = {"device_id": str(device.index or 0)}
    if mem_limit > 0:
        options["gpu_mem_limit"] = str(mem_limit)
    return [(name, options), ("CPUExecutionProvider", {})]


def session_options(base=None, deterministic=False, optimized_model_path="", threads=None) -> onnxruntime.SessionOptions:
    """SessionOptions that share the CPU with torch instead of fighting it.

    ONNX Runtime's intra-op threads spin by default and then stall torch's own threads
    in the optimizer step (DESIGN.md), so spinning is turned off. Intra-op threads are
    ``threads`` (default: torch's) unless ``base`` sets them.
    """
    options = base if base is not None else onnxruntime.SessionOptions()
    if options.intra_op_num_threads == 0:
        options.intra_op_num_threads = threads or torch.get_num_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.use_deterministic_compute = deterministic
    if base is None:  # errors reach the caller as exceptions: ONNX Runtime need not print them too
        options.log_severity_level = 4
    if optimized_model_path:
        options.optimized_model_filepath = optimized_model_path
    return options


def _ort_device(device: torch.device):
    return ("cuda" if device.type == "cuda" else "cpu"), (device.index or 0)


class TorchBoundSession:
    """An InferenceSession whose inputs and outputs are torch tensors bound by pointer.

    Bindings persist across runs, so tensors whose storage never changes (weights,
    gradient buffers) are bound once; per-step inputs are re-bound before each run.
    """

    def __init__(self, model: onnx.ModelProto, device: torch.device, providers, options: onnxruntime.SessionOptions):
        self.device = device
        names = [name for name, _ in providers]
        provider_options = [opts for _, opts in providers]
        self.session = onnxruntime.InferenceSession(
            model.SerializeToString(), sess_options=options, providers=names, provider_options=provider_options
        )
        self.input_names = {graph_input.name for graph_input in self.session.get_inputs()}
        self.output_names = [output.name for output in self.session.get_outputs()]
        self._binding = self.session.io_binding()
        self._device_type, self._device_index = _ort_device(device)
        self._allocated_outputs = []
        self._output_positions = {}  # ONNX Runtime lists outputs in the order first bound

    def _bind_output(self, name, *args):
        self._binding.bind_output(name, self._device_type, self._device_index, *args)
        self._output_positions.setdefault(name, len(self._output_positions))

    def bind_input(self, name: str, tensor: torch.Tensor) -> None:
        """Bind a contiguous tensor on the session's device as input ``name``."""
        self._binding.bind_input(
            name, self._device_type, self._device_index, _NUMPY_DTYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr()
        )

    def bind_output(self, name: str, tensor: torch.Tensor) -> None:
        """Have the session write output ``name`` straight into ``tensor``."""
        self._bind_output(name, _NUMPY_DTYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def allocate_outputs(self, names) -> None:
        """Let ONNX Runtime allocate these outputs on the device; :meth:`run` returns them."""
        self._allocated_outputs = list(names)
        for name in names:
            self._bind_output(name)

    def run(self):
        """Run once; return the outputs named in :meth:`allocate_outputs` as torch tensors."""
        for name in self._allocated_outputs:  # fresh buffers: a returned tensor must not be overwritten later
            self._bind_output(name)
        self.session.run_with_iobinding(self._binding)
        values = self._binding._iobinding.get_outputs()  # raw OrtValues: no Python wrapper per output
        return [from_dlpack(values[self._output_positions[name]].to_dlpack()) for name in self._allocated_outputs]
