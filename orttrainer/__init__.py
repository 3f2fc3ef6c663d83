"""orttrainer: train PyTorch models with ONNX Runtime through the legacy ORTTrainer API."""

try:
    import onnxruntime.training  # noqa: F401
except ImportError as error:  # the plain onnxruntime package replaced onnxruntime-training
    raise ImportError(
        "orttrainer needs onnxruntime-training, but the installed 'onnxruntime' has no 'onnxruntime.training' "
        "(the plain onnxruntime package was installed over it). Fix: pip uninstall -y onnxruntime "
        "onnxruntime-training && pip install onnxruntime-training==1.19.2"
    ) from error

from .update import amp, checkpoint
from . import optim
from .update.checkpoint import CheckpointError
from .runtime.cuda_libraries import GPULibraryError
from .update.distributed import RankWriteError
from .export.refusals import ExportError
from .graph.graph_errors import GradientBuildError, RunError
from .api.options import ORTTrainerOptions
from .runtime.session import ProviderFallbackError
from .update.step_info import TrainStepInfo
from .trainer import ORTTrainer
from .export.verify import TorchMismatchError

__all__ = [
    "ORTTrainer",
    "ORTTrainerOptions",
    "TrainStepInfo",
    "amp",
    "checkpoint",
    "optim",
    "CheckpointError",
    "ExportError",
    "GPULibraryError",
    "GradientBuildError",
    "ProviderFallbackError",
    "RankWriteError",
    "RunError",
    "TorchMismatchError",
]
