"""ONNX Runtime sessions bound to torch tensor memory.

Device strings follow torch (``"cpu"``, ``"cuda"``, ``"cuda:1"``); ``device_providers``
turns one into the execution providers to ask for, and :class:`TorchBoundSession` runs
a graph whose inputs and outputs are torch tensors, bound by pointer (no copies).

On a GPU, torch and ONNX Runtime share those tensors but each queues its kernels on a
stream; :class:`TorchBoundSession` orders every run after torch's work on its current
stream and returns only once the run is finished (see ``run``).
"""

import contextlib
import ctypes
import functools
import os

import numpy as np
import onnx
import onnxruntime
import torch
from onnxruntime.capi import _pybind_state
from torch.utils.dlpack import from_dlpack, to_dlpack

from . import cuda_libraries
from ..graph.graph_edits import MAX_IR_VERSION
from ..graph.recompute import IN_LISTED_ORDER

GPU_PROVIDERS = ("CUDAExecutionProvider", "ROCMExecutionProvider")
STREAM_OPTION = "user_compute_stream"  # a CUDA and ROCm provider option in ONNX Runtime 1.19
SYNCHRONIZE_OPTION = "disable_synchronize_execution_providers"

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


def onnx_elem_type(dtype: torch.dtype) -> int:
    """The ONNX tensor element type of a torch dtype."""
    for elem_type, torch_type in _TORCH_DTYPES_BY_ONNX.items():
        if torch_type == dtype:
            return elem_type
    raise TypeError(f"torch dtype {dtype} has no ONNX element type here")


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
        index = device.index if device.index is not None else torch.cuda.current_device()
        _check_gpu_index(device_id, index, torch.cuda.device_count())
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"options device.id: {device_id!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    return device


def _check_gpu_index(device_id: str, index: int, count: int) -> None:
    """A GPU index past the GPUs torch sees is an error saying how many there are (and, under torchrun, what to do)."""
    if index < count:
        return
    under_torchrun = ""
    if "LOCAL_RANK" in os.environ:
        under_torchrun = (
            f" Under torchrun a bare 'cuda' means cuda:LOCAL_RANK (LOCAL_RANK={os.environ['LOCAL_RANK']} here): start at "
            f"most {count} process(es) per node (torchrun --nproc_per_node={count}), or set device.id per rank."
        )
    raise RuntimeError(
        f"options device.id {device_id!r} asks for GPU {index}, but torch sees {count} GPU(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}).{under_torchrun}"
    )


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


# ONNX Runtime graph transformers no session of the trainer runs. MatMulScaleFusion: with it, the gradient of
# Wav2Vec2's attention came out wrong (about half the out_proj weight gradient's norm) whenever the
# gradients were written into the trainer's own buffers, and right when ONNX Runtime allocated them
# (docs/stack_facts.md); the scalar multiplications it would fold cost nothing measurable (NOTES.md §37). Most likely
# the cause was ONNX Runtime's grouped 1-d ConvGrad writing past its end (Wav2Vec2's positional convolution), which
# rewrites.convolutions.grouped_convolution now avoids; the transformer stays off, as it costs nothing. Pad_Fusion (the rule of
# PadFusion; "PadFusion" is ignored) folds a zero Pad into the MaxPool or AveragePool after it as the pool's own
# padding, which a MaxPool takes as -inf and an AveragePool without count_include_pad leaves out of its count: a
# ZeroPad2d before a MaxPool2d evaluated 0.57 off torch (the eval graph keeps ONNX Runtime's MaxPool under mixed
# precision), and one before an AvgPool2d with padding failed to open ("pad should be smaller than kernel").
_DISABLED_OPTIMIZERS = ["MatMulScaleFusion", "Pad_Fusion"]
# Off in the sessions of graphs holding a cubic Resize: ONNX Runtime's CPU layout transformer moves a Transpose through
# a cubic Resize of constant sizes or scales where the inverse Transpose follows (a table of position embeddings
# resized: permute, interpolate, permute back), and leaves a Resize the cubic kernel refuses ("'Cubic' mode only
# support ... outermost 2 scale values being 1"; docs/stack_facts.md).
_BREAKS_CUBIC_RESIZE = ["TransposeOptimizer_CPUExecutionProvider"]
# Off in the sessions of float16 (mixed precision) graphs: with it, ONNX Runtime 1.19.2 crashed at session creation
# (a segmentation fault) on a float16 training graph where a MatMul's output gets a bias computed from a weight, as in
# cdist's matrix-product form (docs/stack_facts.md).
_BREAKS_FLOAT16_GEMMS = ["GemmTransposeFusion"]
# Off in the sessions of bfloat16 graphs: with it, ONNX Runtime 1.19.2 crashed at session creation (a segmentation
# fault) on a split segment of a bfloat16 transformer's gradient (attention's FusedMatMuls between Transposes and
# Casts to and from bfloat16); with it off the segment opens and trains as torch.autocast (test_bfloat16).
_BREAKS_BFLOAT16_MATMULS = ["MatmulTransposeFusion"]
_SPINNING_ENTRIES = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")


def disabled_optimizers(model: onnx.ModelProto) -> list:
    """The graph transformers a session of ``model`` runs without: ``_DISABLED_OPTIMIZERS``,
    ``_BREAKS_CUBIC_RESIZE`` if it holds a cubic Resize, ``_BREAKS_FLOAT16_GEMMS`` if it computes in float16,
    ``_BREAKS_BFLOAT16_MATMULS`` in bfloat16."""
    cubic = any(node.op_type == "Resize" and attribute.name == "mode" and attribute.s == b"cubic"
                for node in model.graph.node for attribute in node.attribute)  # fmt: skip
    casts = {attribute.i for node in model.graph.node if node.op_type == "Cast" for attribute in node.attribute
             if attribute.name == "to"}  # fmt: skip
    return (_DISABLED_OPTIMIZERS + (_BREAKS_CUBIC_RESIZE if cubic else [])
            + (_BREAKS_FLOAT16_GEMMS if onnx.TensorProto.FLOAT16 in casts else [])
            + (_BREAKS_BFLOAT16_MATMULS if onnx.TensorProto.BFLOAT16 in casts else []))


def session_options(base=None, deterministic=False, optimized_model_path="", threads=None) -> onnxruntime.SessionOptions:
    """SessionOptions that share the CPU with torch instead of fighting it (set on ``base`` if given).

    ONNX Runtime's intra-op threads spin by default and then stall torch's own threads
    in the optimizer step (docs/stack_facts.md), so spinning is turned off. Intra-op threads are
    ``threads`` (default: torch's) unless ``base`` sets them.
    """
    options = base if base is not None else onnxruntime.SessionOptions()
    if options.intra_op_num_threads == 0:
        options.intra_op_num_threads = threads or torch.get_num_threads()
    for entry in _SPINNING_ENTRIES:  # a choice the user made is theirs
        if base is None or _config_entry(options, entry) is None:
            options.add_session_config_entry(entry, "0")
    options.use_deterministic_compute = deterministic
    if base is None:  # errors reach the caller as exceptions: ONNX Runtime need not print them too
        options.log_severity_level = 4
        _share_one_cpu_arena(options)
    if optimized_model_path:
        options.optimized_model_filepath = optimized_model_path
    return options


_ENV_ALLOCATORS = "session.use_env_allocators"
_ARENA_SHRINKAGE = "memory.enable_memory_arena_shrinkage"
_shared_arena = []  # the process's one CPU arena, once registered


def _share_one_cpu_arena(options: onnxruntime.SessionOptions) -> None:
    """The sessions made with ``options`` take their CPU memory from one arena, the process's, registered at the
    first call: each session's own arena keeps the most it ever held, so the training and eval sessions of every
    graph would each keep their peak; one arena keeps the largest peak of any (benchmarks/NOTES.md §53)."""
    if not _shared_arena:
        memory = onnxruntime.OrtMemoryInfo("Cpu", onnxruntime.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                           onnxruntime.OrtMemType.DEFAULT)  # fmt: skip
        onnxruntime.create_and_register_allocator(memory, None)
        _shared_arena.append(memory)
    options.add_session_config_entry(_ENV_ALLOCATORS, "1")


@functools.cache
def _arena_releaser() -> onnxruntime.InferenceSession:
    """A session of one Identity node on the process's CPU arena: ONNX Runtime gives an arena's free regions back only
    at the end of a run, and a run of this one (``_give_back_free_arena_memory``) costs nothing."""
    value = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "arena_releaser", [value],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])  # fmt: skip
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=MAX_IR_VERSION)
    return onnxruntime.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


def _give_back_free_arena_memory() -> None:
    """Give the process's CPU arena's free regions, and the C heap's free pages, back to the system, between runs."""
    _arena_releaser().run(None, {"x": np.zeros(1, np.float32)}, run_options(release_arena=True))
    _give_back_free_heap_memory()


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


def _give_back_free_heap_memory() -> None:
    """Give the C heap's free pages back to the system. Building a graph (the export, the gradient graph, a split
    graph's segment sessions) frees hundreds of MiB of blocks below glibc's mmap threshold, which glibc keeps in its
    heap; ONNX Runtime's arena then grows by mapping new regions beside them, and a bfloat16 GPT-2's step peaked
    ~450 MiB higher for it (benchmarks/NOTES.md §59). Trimming moves no block and costs ~1 ms."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def options_for_one_session(user=None, deterministic=False, optimized_model_path="", threads=None):
    """The SessionOptions to create one session with: :func:`session_options` of a new object, or of
    the user's ``user`` for as long as the session is created, then undone.

    ONNX Runtime copies the options into the session it creates, and a SessionOptions cannot be
    copied beforehand; what the user passed in is theirs. Config entries are the exception: one
    cannot be removed, and overwriting one makes ONNX Runtime log a warning (for every session), so
    the spinning entries are added once where the user has not set them, and kept.
    """
    if user is None:
        yield session_options(None, deterministic, optimized_model_path, threads)
        return
    attributes = ("intra_op_num_threads", "use_deterministic_compute", "optimized_model_filepath")
    saved = {name: getattr(user, name) for name in attributes}
    try:
        yield session_options(user, deterministic, optimized_model_path, threads)
    finally:
        for name, value in saved.items():
            setattr(user, name, value)


@contextlib.contextmanager
def _in_listed_order(options: onnxruntime.SessionOptions, listed: bool):
    """``options`` running the nodes in the order they are listed, while the session is created, if ``listed``.
    ONNX Runtime's PRIORITY_BASED order takes, of the nodes ready to run, the one listed first."""
    chosen = options.execution_order
    if listed:
        options.execution_order = onnxruntime.ExecutionOrder.PRIORITY_BASED
    try:
        yield
    finally:
        options.execution_order = chosen


def _config_entry(options: onnxruntime.SessionOptions, key: str):
    """The value of config entry ``key``, or None if it is not set."""
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # "does not have configuration with key"
        return None


def gpu_provider(providers):
    """The GPU execution provider among ``providers`` ([(name, options)]), or None."""
    return next((name for name, _ in providers if name in GPU_PROVIDERS), None)


def with_compute_stream(providers, stream_handle: int):
    """``providers`` with the GPU provider told to queue all its work on the CUDA/HIP stream ``stream_handle``.

    A stream the options already name (``provider_options``) is kept.
    """
    return [(name, {STREAM_OPTION: str(stream_handle), **options} if name in GPU_PROVIDERS else options)
            for name, options in providers]  # fmt: skip


def session_stream(device: torch.device, provider_options: dict):
    """The torch stream a GPU session will run on: the one its provider options name, else torch's current
    stream on ``device``, else a new one.

    torch's default stream has handle 0, which ONNX Runtime reads as "no stream given" (it then
    runs on non-blocking streams of its own, unordered with torch's default stream): a session
    created while torch is on its default stream gets a stream of its own instead, one torch knows.
    """
    named = provider_options.get(STREAM_OPTION)
    if named is not None:
        if int(named) == 0:
            raise ValueError(
                f"options provider_options: {STREAM_OPTION}='{named}' is torch's default stream, which ONNX Runtime "
                "ignores (it would run on streams of its own); leave it out and orttrainer picks a stream"
            )
        return torch.cuda.ExternalStream(int(named), device=device)
    current = torch.cuda.current_stream(device)
    return current if current.cuda_stream != 0 else torch.cuda.Stream(device)


def run_options(release_arena: bool = False) -> onnxruntime.RunOptions:
    """RunOptions under which a run returns only once the GPU has finished it; with ``release_arena``, the CPU
    arena's memory the run no longer holds is given back to the system at its end.

    ``disable_synchronize_execution_providers`` = "0" is ONNX Runtime's default, set explicitly
    because the trainer relies on it: at the end of a run the GPU provider synchronises its
    stream with the host, so outputs are complete for torch whatever stream reads them, and
    ONNX Runtime is done with the inputs before torch overwrites them (the next batch, the
    optimizer update).
    """
    options = onnxruntime.RunOptions()
    options.add_run_config_entry(SYNCHRONIZE_OPTION, "0")
    if release_arena:
        options.add_run_config_entry(_ARENA_SHRINKAGE, "cpu:0")
    return options


class ProviderFallbackError(RuntimeError):
    """ONNX Runtime built the session without the GPU provider asked for (it falls back to the CPU silently)."""


def check_provider_in_use(requested, in_use, device: torch.device) -> None:
    """Refuse a session that runs on the CPU although a GPU provider was asked for."""
    gpu = gpu_provider(requested)
    if gpu is None or gpu in in_use:
        return
    raise ProviderFallbackError(
        f"asked ONNX Runtime for {gpu} on {device}, but the session runs on {in_use}: the provider's libraries load, "
        "yet it failed to start (e.g. a driver too old for CUDA 11.8, or a cuDNN other than 8). ONNX Runtime logs the "
        "reason as a warning: pass options session_options with log_severity_level=2 to see it (docs/gpu.md)"
    )


def _ort_device(device: torch.device):
    """ONNX Runtime's name for the memory of ``device`` (a GPU's, under CUDA and ROCm alike)."""
    ort_device = onnxruntime.capi._pybind_state.OrtDevice
    kind = ort_device.cuda() if device.type == "cuda" else ort_device.cpu()
    return ort_device(kind, ort_device.default_memory(), device.index or 0)


def _ort_value(tensor: torch.Tensor):
    """An OrtValue over ``tensor``'s memory, by DLPack: binding by pointer takes a numpy dtype, and numpy has no
    bfloat16 (a bfloat16 graph's products on torch, torch_products.py, hand bfloat16 tensors to the segments)."""
    return _pybind_state.OrtValue.from_dlpack(to_dlpack(tensor), False)


class TorchBoundSession:
    """An InferenceSession whose inputs and outputs are torch tensors bound by pointer.

    Bindings persist across runs, so tensors whose storage never changes (weights,
    gradient buffers) are bound once; per-step inputs are re-bound before each run.

    On a GPU, the session's kernels run on a torch stream (:func:`session_stream`): torch's
    current stream when it is a real one, so that a run needs no synchronisation at all.
    A GPU provider that cannot load, or a session that fell back to the CPU, is an error.
    """

    def __init__(self, model: onnx.ModelProto, device: torch.device, providers, options: onnxruntime.SessionOptions):
        self.device = device
        gpu = gpu_provider(providers)
        if gpu is not None:
            cuda_libraries.check_provider_loads(gpu)
        self._stream = session_stream(device, dict(providers)[gpu]) if gpu is not None and device.type == "cuda" else None
        if self._stream is not None:
            providers = with_compute_stream(providers, self._stream.cuda_stream)
        names = [name for name, _ in providers]
        provider_options = [opts for _, opts in providers]
        with _in_listed_order(options, any(prop.key == IN_LISTED_ORDER for prop in model.metadata_props)):
            self.session = onnxruntime.InferenceSession(
                model.SerializeToString(), sess_options=options, providers=names, provider_options=provider_options,
                disabled_optimizers=disabled_optimizers(model),
            )
        check_provider_in_use(providers, self.session.get_providers(), device)
        self._run_options = run_options()
        # The first run, a graph's checked one, gives back at its end what the arena no longer holds, its outputs
        # copied out of the shared arena: torch takes its own step next. Later runs keep what they freed, ready for the
        # next run, at any shapes: giving it back at every new length cost T5 7% of its step, and its peak nothing
        # (benchmarks/NOTES.md §54). A user's options may turn the arena off, and then there is nothing to give back.
        self._arena = device.type == "cpu" and options.enable_cpu_mem_arena
        self._on_shared_arena = self._arena and _config_entry(options, _ENV_ALLOCATORS) == "1"
        self._releasing_run_options = run_options(release_arena=True) if self._arena else None
        self._release_after_run = self._arena
        self.input_names = {graph_input.name for graph_input in self.session.get_inputs()}
        self.output_names = [output.name for output in self.session.get_outputs()]
        self._bool_outputs = {output.name for output in self.session.get_outputs() if output.type == "tensor(bool)"}
        self._binding = self.session.io_binding()
        # binds go to ONNX Runtime's binding object itself: the public wrapper makes an OrtDevice per call, half
        # the cost of a bind, and a split graph binds ~500 tensors per step
        self._raw_binding, self._device = self._binding._iobinding, _ort_device(device)
        self._allocated_outputs = []
        self._output_positions = {}  # ONNX Runtime lists outputs in the order first bound

    def _bind_output(self, name, *args):
        self._raw_binding.bind_output(name, self._device, *args)
        self._output_positions.setdefault(name, len(self._output_positions))

    def bind_input(self, name: str, tensor: torch.Tensor) -> None:
        """Bind a contiguous tensor on the session's device as input ``name``."""
        if not tensor.is_contiguous():  # ONNX Runtime would read its storage as if it were (a caller's bug)
            raise RuntimeError(f"input '{name}' of shape {list(tensor.shape)} is not contiguous in memory")
        if tensor.dtype == torch.bfloat16:
            self._raw_binding.bind_ortvalue_input(name, _ort_value(tensor))
            return
        self._raw_binding.bind_input(name, self._device, _NUMPY_DTYPES[tensor.dtype], list(tensor.shape), tensor.data_ptr())

    def bind_output(self, name: str, tensor: torch.Tensor) -> None:
        """Have the session write output ``name`` straight into ``tensor``. An empty tensor (the gradient of an empty
        parameter) has no memory to bind, and no value to write: the session allocates that output itself."""
        if tensor.numel() == 0:
            self._bind_output(name)
            return
        if tensor.dtype == torch.bfloat16:
            self._raw_binding.bind_ortvalue_output(name, _ort_value(tensor))
            self._output_positions.setdefault(name, len(self._output_positions))
            return
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
        if self._stream is not None:
            self._wait_for_torch()
        release, self._release_after_run = self._release_after_run, False
        self.session.run_with_iobinding(self._binding, self._releasing_run_options if release else self._run_options)
        if release and self._on_shared_arena:
            return self._outputs_out_of_the_arena()
        return self._outputs()

    def _outputs(self) -> list:
        values = self._raw_binding.get_outputs()  # raw OrtValues: no Python wrapper per output
        return [self._as_torch(name, values[self._output_positions[name]]) for name in self._allocated_outputs]

    def _outputs_out_of_the_arena(self) -> list:
        """The outputs, copied into torch's memory, ONNX Runtime's own released and the arena's free regions given
        back: an output left in the arena keeps the whole region it was cut from (T5's logits, 229 MiB, kept 730 MiB
        more of a 1 GiB region through torch's checked step; benchmarks/NOTES.md §55)."""
        copies = [output.clone() for output in self._outputs()]
        for name in self._allocated_outputs:
            self._bind_output(name)
        _give_back_free_arena_memory()
        return copies

    def _as_torch(self, name, value) -> torch.Tensor:
        tensor = from_dlpack(value.to_dlpack())
        # ONNX Runtime hands bool tensors over DLPack as uint8
        return tensor.view(torch.bool) if name in self._bool_outputs and tensor.dtype == torch.uint8 else tensor

    def _wait_for_torch(self):
        """Start the run after the work torch has queued on its current stream.

        That work wrote the inputs (the batch copied with non_blocking=True, the weights the
        optimizer just updated) and may still read what the run overwrites (gradient buffers).
        On the session's own stream this order is CUDA's; from another stream (the default
        one, or one the user switched to after the session was built) the session's stream
        waits for it on the GPU, without blocking the host. The other direction, torch
        reading the outputs, is ordered by the end-of-run synchronisation (:func:`run_options`).
        """
        current = torch.cuda.current_stream(self.device)
        if current != self._stream:
            self._stream.wait_stream(current)
