"""orttrainer: train PyTorch models with ONNX Runtime through the legacy ORTTrainer API."""

try:
    import onnxruntime.training  # noqa: F401
except ImportError as error:  # the plain onnxruntime package replaced onnxruntime-training
    raise ImportError(
        "orttrainer needs onnxruntime-training, but the installed 'onnxruntime' has no 'onnxruntime.training' "
        "(the plain onnxruntime package was installed over it). Fix: pip uninstall -y onnxruntime "
        "onnxruntime-training && pip install onnxruntime-training==1.19.2"
    ) from error

from . import amp, checkpoint, optim
from .checkpoint import CheckpointError
from .cuda_libraries import GPULibraryError
from .distributed import RankWriteError
from .export import ExportError
from .graph import GradientBuildError, RunError
from .options import ORTTrainerOptions
from .session import ProviderFallbackError
from .step_info import TrainStepInfo
from .trainer import ORTTrainer
from .verify import TorchMismatchError

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
