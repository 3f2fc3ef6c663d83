"""Provider selection, device strings and binding arguments (CUDA/ROCm logic checked on the CPU)."""

import pytest
import torch

from orttrainer.session import device_providers, resolve_device, session_options

CUDA_AND_CPU = ["CUDAExecutionProvider", "CPUExecutionProvider"]
ROCM_AND_CPU = ["ROCMExecutionProvider", "CPUExecutionProvider"]


def test_cpu_device_uses_the_cpu_provider():
    assert device_providers(torch.device("cpu")) == [("CPUExecutionProvider", {})]


def test_cuda_device_index_and_memory_limit_reach_the_provider():
    providers = device_providers(torch.device("cuda", 1), mem_limit=2**30, available=CUDA_AND_CPU, is_rocm=False)
    assert providers == [
        ("CUDAExecutionProvider", {"device_id": "1", "gpu_mem_limit": str(2**30)}),
        ("CPUExecutionProvider", {}),
    ]


def test_rocm_build_of_torch_selects_the_rocm_provider():
    providers = device_providers(torch.device("cuda", 0), available=ROCM_AND_CPU, is_rocm=True)
    assert providers[0] == ("ROCMExecutionProvider", {"device_id": "0"})


def test_missing_gpu_provider_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"needs onnxruntime's CUDAExecutionProvider, but .* only has \['CPUExecutionProvider'\]"):
        device_providers(torch.device("cuda", 0), available=["CPUExecutionProvider"], is_rocm=False)


def test_provider_options_replace_device_logic():
    chosen = device_providers(torch.device("cuda", 3), provider_options={"CPUExecutionProvider": {"x": "1"}},
                              available=CUDA_AND_CPU)
    assert chosen == [("CPUExecutionProvider", {"x": "1"})]
    with pytest.raises(RuntimeError, match=r"names providers this onnxruntime lacks: \['TensorrtExecutionProvider'\]"):
        device_providers(torch.device("cpu"), provider_options={"TensorrtExecutionProvider": {}}, available=CUDA_AND_CPU)


def test_device_strings():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device.id: 'tpu' is not a torch device string"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match=r"'meta' is not supported"):
        resolve_device("meta")


def test_session_options_turn_spinning_off_and_match_torch_threads():
    options = session_options(deterministic=True)
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert options.intra_op_num_threads == torch.get_num_threads()
    assert options.use_deterministic_compute is True
