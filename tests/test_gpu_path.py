"""The CUDA path's logic, checked on a machine without a GPU (docs/gpu.md says what else was verified).

torch.cuda is faked where a test needs it; tests that need a real GPU, or the `cuda` install
extra, skip with the reason.
"""

import importlib.util
import types
from pathlib import Path

import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from onnxruntime.capi._pybind_state import OrtDevice

from models import MLP
from orttrainer import ORTTrainer, ORTTrainerOptions, amp, optim
from orttrainer.runtime import cuda_libraries, session
from orttrainer.update import distributed
from orttrainer.runtime.cuda_libraries import CUDA_PROVIDER, GPULibraryError
from orttrainer.runtime.session import ProviderFallbackError, TorchBoundSession, device_providers

ROOT = Path(__file__).parent.parent
CUDA_AND_CPU = ["CUDAExecutionProvider", "CPUExecutionProvider"]
ROCM_AND_CPU = ["ROCMExecutionProvider", "CPUExecutionProvider"]
NO_GPU = not torch.cuda.is_available()


class FakeStream:
    """A torch.cuda.Stream stand-in: its handle, and the streams it was told to wait for (into a shared log)."""

    def __init__(self, handle, log=None):
        self.cuda_stream = handle
        self.log = [] if log is None else log

    def wait_stream(self, other):
        self.log.append(("wait", other.cuda_stream))

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    __hash__ = None


def relu_model() -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


class FakeInferenceSession:
    """Records how a session was asked for; claims to run on the providers asked for."""

    created = []

    def __init__(self, model_bytes, sess_options, providers, provider_options, disabled_optimizers=()):
        self.providers, self.provider_options = providers, provider_options
        FakeInferenceSession.created.append(self)

    def get_providers(self):
        return self.providers

    def get_inputs(self):
        return []

    def get_outputs(self):
        return []

    def io_binding(self):
        return types.SimpleNamespace(_iobinding=None)


@pytest.fixture
def fake_gpu_session(monkeypatch):
    """Sessions on 'cuda:0' built without a GPU: the provider check passes, InferenceSession records."""
    FakeInferenceSession.created = []
    monkeypatch.setattr(cuda_libraries, "check_provider_loads", lambda provider: None)
    monkeypatch.setattr(session.onnxruntime, "InferenceSession", FakeInferenceSession)
    return FakeInferenceSession.created


def build_gpu_session(available, is_rocm, current, monkeypatch, created_stream=None):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: created_stream)
    device = torch.device("cuda", 0)
    providers = device_providers(device, available=available, is_rocm=is_rocm)
    bound = TorchBoundSession(relu_model(), device, providers, session.session_options())
    return bound, FakeInferenceSession.created[-1].provider_options


# ---------------------------------------------------------------- 1. stream order
def test_gpu_provider_runs_on_torchs_current_stream(fake_gpu_session, monkeypatch):
    bound, options = build_gpu_session(CUDA_AND_CPU, False, FakeStream(0xC0FFEE), monkeypatch)
    assert options == [{"device_id": "0", "user_compute_stream": str(0xC0FFEE)}, {}]
    assert bound._stream == FakeStream(0xC0FFEE)


def test_rocm_provider_runs_on_torchs_current_stream(fake_gpu_session, monkeypatch):
    _, options = build_gpu_session(ROCM_AND_CPU, True, FakeStream(77), monkeypatch)
    assert options == [{"device_id": "0", "user_compute_stream": "77"}, {}]


def test_tensors_are_bound_in_the_memory_of_their_gpu():
    """CUDA and ROCm tensors alike are torch 'cuda' devices: ONNX Runtime's GPU memory, at their index."""
    for device, kind, index in [(torch.device("cuda", 1), OrtDevice.cuda(), 1), (torch.device("cuda"), OrtDevice.cuda(), 0),
                                (torch.device("cpu"), OrtDevice.cpu(), 0)]:  # fmt: skip
        ort_device = session._ort_device(device)
        assert (ort_device.device_type(), ort_device.device_id()) == (kind, index), device


def test_torchs_default_stream_is_not_passed_a_session_stream_is_made(fake_gpu_session, monkeypatch):
    """Handle 0 would mean "no stream" to ONNX Runtime, which would then run unordered with torch."""
    bound, options = build_gpu_session(CUDA_AND_CPU, False, FakeStream(0), monkeypatch, created_stream=FakeStream(4242))
    assert options[0]["user_compute_stream"] == "4242"
    assert bound._stream == FakeStream(4242)


def test_a_stream_named_in_provider_options_is_kept(fake_gpu_session, monkeypatch):
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device=None: FakeStream(handle))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(1))
    device = torch.device("cuda", 0)
    named = {"CUDAExecutionProvider": {"device_id": "0", "user_compute_stream": "99"}}
    providers = device_providers(device, provider_options=named, available=CUDA_AND_CPU)
    bound = TorchBoundSession(relu_model(), device, providers, session.session_options())
    assert fake_gpu_session[-1].provider_options == [{"device_id": "0", "user_compute_stream": "99"}]
    assert bound._stream == FakeStream(99)
    with pytest.raises(ValueError, match=r"user_compute_stream='0' is torch's default stream, which ONNX Runtime ignores"):
        session.session_stream(device, {"user_compute_stream": "0"})


def test_runs_keep_onnx_runtimes_end_of_run_synchronisation():
    assert session.run_options().get_run_config_entry("disable_synchronize_execution_providers") == "0"


def recorded_run(monkeypatch, session_stream, current):
    """Run a CPU session as if on a GPU stream; return the order of stream waits and runs."""
    bound = TorchBoundSession(relu_model(), torch.device("cpu"), [("CPUExecutionProvider", {})], session.session_options())
    inputs = torch.tensor([-1.0, 2.0, -3.0, 4.0])  # bound by pointer: kept alive until the run
    bound.bind_input("x", inputs)
    bound.allocate_outputs(["y"])
    log = session_stream.log
    current.log = log
    bound._stream = session_stream
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    run_with_iobinding = bound.session.run_with_iobinding

    def logged_run(binding, run_options=None):
        log.append(("run", run_options.get_run_config_entry("disable_synchronize_execution_providers")))
        run_with_iobinding(binding, run_options)

    monkeypatch.setattr(bound.session, "run_with_iobinding", logged_run)
    (output,) = bound.run()
    assert output.tolist() == inputs.clamp(min=0).tolist()
    return log


def test_a_run_from_another_stream_waits_for_it_on_the_gpu_then_synchronises(monkeypatch):
    assert recorded_run(monkeypatch, FakeStream(5), FakeStream(9)) == [("wait", 9), ("run", "0")]


def test_a_run_on_the_sessions_own_stream_needs_no_wait(monkeypatch):
    assert recorded_run(monkeypatch, FakeStream(5), FakeStream(5)) == [("run", "0")]


# ------------------------------------------------------- 2. one device for the update
UPDATE_KERNELS = [name for name in dir(torch) if name.startswith("_foreach_")] + [
    "_fused_adamw_", "_fused_adam_", "_amp_foreach_non_finite_check_and_unscale_", "_amp_update_scale_",
]  # fmt: skip


def tensors_in(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from tensors_in(value)


def device_checked(name, kernel, device, calls):
    """``kernel`` refusing any tensor argument (also inside lists) that is not on ``device``."""

    def checked(*args, **kwargs):
        misplaced = [f"{tuple(t.shape)} on {t.device}" for t in tensors_in([*args, *kwargs.values()]) if t.device != device]
        if misplaced:
            pytest.fail(f"torch.{name} got tensors off the parameters' device {device}: {misplaced}; a tensor made "
                        "without device= lands on the default device (meta here, the CPU on a GPU run)")  # fmt: skip
        calls.add(name)
        return kernel(*args, **kwargs)

    return checked


def mixed_precision():
    return {"mixed_precision": {"enabled": True, "loss_scaler": amp.DynamicLossScaler(loss_scale=256.0)}}


UPDATES = {
    "adam (fused kernel)": (lambda: optim.AdamConfig(lr=1e-2, lambda_coef=0.01), {}, "_fused_adamw_"),
    "adam after-update decay, mixed precision": (
        lambda: optim.AdamConfig(lr=1e-2, lambda_coef=0.01, weight_decay_mode=optim.AdamConfig.DecayMode.AFTER_WEIGHT_UPDATE),
        mixed_precision(), "_foreach_addcdiv_"),
    "lamb, mixed precision": (lambda: optim.LambConfig(lr=1e-2, lambda_coef=0.01), mixed_precision(), "_foreach_norm"),
    "sgd": (lambda: optim.SGDConfig(lr=0.1), {}, "_foreach_add_"),
}  # fmt: skip


@pytest.mark.parametrize("update", UPDATES, ids=list(UPDATES))
def test_every_tensor_of_an_update_lives_on_the_parameters_device(update, monkeypatch):
    """Whole updates (accumulation 2, clipping, loss scaling) with every multi-tensor kernel checked.

    On the CPU a tensor created without ``device=`` is on the parameters' device by luck, and
    torch's CPU kernels accept scalar tensors anywhere; so after the build the steps run with
    torch's default device set to "meta": such a tensor then shows up as off-device, as it
    would on a GPU, where torch's fused/foreach CUDA kernels require device tensors.
    """
    make_config, extra_options, expected_kernel = UPDATES[update]
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "batch": {"gradient_accumulation_steps": 2},
                                 "utils": {"grad_norm_clip": True}, **extra_options})  # fmt: skip
    trainer = ORTTrainer(MLP(), None, make_config(), loss_fn=F.cross_entropy, options=options)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)) for _ in range(5)]
    trainer.train_step(*batches[0])  # builds the sessions (export, graphs: CPU work by design)
    before = {name: tensor.clone() for name, tensor in trainer.state_dict(pytorch_format=True).items()}
    calls = set()
    for name in UPDATE_KERNELS:
        monkeypatch.setattr(torch, name, device_checked(name, getattr(torch, name), torch.device("cpu"), calls))
    with torch.device("meta"):
        for batch in batches[1:]:
            trainer.train_step(*batch)
    assert expected_kernel in calls
    if "mixed_precision" in extra_options:
        assert "_amp_foreach_non_finite_check_and_unscale_" in calls
    after = trainer.state_dict(pytorch_format=True)
    assert any(not torch.equal(before[name], after[name]) for name in before)  # an update ran (no overflow skipped it)


# --------------------------------------------------------------- 3. torchrun on GPUs
@pytest.fixture
def torchrun_on_gpus(monkeypatch):
    """torchrun's environment on a node with 2 fake GPUs; records set_device / init_process_group / atexit in order."""
    events = []
    for name in ("MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: events.append(("set_device", str(device))))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, **kwargs: events.append(("init_process_group", backend)))  # fmt: skip
    monkeypatch.setattr(distributed.atexit, "register", lambda function: events.append(("atexit", function.__name__)))

    def start(rank, local_rank, world_size):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        return ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                          options=ORTTrainerOptions({"device": {"id": "cuda"}}))  # fmt: skip

    return start, events


def test_a_torchrun_rank_trains_on_its_local_gpu_set_before_nccl_starts(torchrun_on_gpus):
    start, events = torchrun_on_gpus
    start(rank=3, local_rank=1, world_size=4)  # device.id "cuda": the trainer's device is cuda:LOCAL_RANK
    assert events == [("set_device", "cuda:1"), ("init_process_group", "nccl"), ("atexit", "_destroy_process_group")]


def test_more_local_ranks_than_gpus_is_a_clear_error(torchrun_on_gpus):
    start, events = torchrun_on_gpus
    with pytest.raises(RuntimeError, match=r"device.id 'cuda:2' asks for GPU 2, but torch sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES="
                                           r"unset\)\. Under torchrun .*LOCAL_RANK=2 here.*--nproc_per_node=2"):  # fmt: skip
        start(rank=2, local_rank=2, world_size=3)
    assert events == []


def test_only_a_process_group_created_here_is_destroyed_at_exit(monkeypatch):
    registered, destroyed = [], []
    monkeypatch.setattr(distributed.atexit, "register", registered.append)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, **kwargs: None)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: destroyed.append(True))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    distributed.ensure_process_group(distributed.World(0, 2, 0), torch.device("cpu"))
    assert len(registered) == 1
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    registered[0]()
    assert destroyed == [True]
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    distributed.ensure_process_group(distributed.World(0, 2, 0), torch.device("cpu"))  # the user's group: left alone
    assert len(registered) == 1


# ------------------------------------------------------ 4. a provider that cannot load
def test_elf_reader_lists_the_cuda_providers_libraries():
    needed, folders = cuda_libraries.dynamic_entries(cuda_libraries.provider_library(CUDA_PROVIDER))
    assert needed[:6] == ["libcublasLt.so.11", "libcublas.so.11", "libcudnn.so.8", "libcurand.so.10", "libcufft.so.10",
                          "libcudart.so.11.0"]  # fmt: skip
    assert folders == ["/usr/local/cuda-11.8/lib"]


@pytest.mark.skipif(cuda_libraries.load_error(cuda_libraries.DRIVER_LIBRARY) is None and cuda_libraries.extra_installed(),
                    reason="this machine can load the CUDA provider (driver and libraries present)")
def test_asking_for_cuda_here_names_the_library_that_does_not_load():
    """Without the `cuda` extra the CUDA 11 libraries are missing; with it, the NVIDIA driver (this machine has no GPU)."""
    if cuda_libraries.extra_installed():
        missing = r"libcuda\.so\.1 does not load"
    else:
        missing = r"needs libcublasLt\.so\.11, .*libcudart\.so\.11\.0"
    device = torch.device("cuda", 0)
    providers = device_providers(device, available=CUDA_AND_CPU, is_rocm=False)
    with pytest.raises(GPULibraryError, match=missing + r".*Fix: install"):
        TorchBoundSession(relu_model(), device, providers, session.session_options())


def test_a_session_that_fell_back_to_the_cpu_is_an_error():
    requested = [("CUDAExecutionProvider", {"device_id": "0"}), ("CPUExecutionProvider", {})]
    with pytest.raises(ProviderFallbackError, match=r"asked ONNX Runtime for CUDAExecutionProvider on cuda:0, but the "
                                                    r"session runs on \['CPUExecutionProvider'\]"):  # fmt: skip
        session.check_provider_in_use(requested, ["CPUExecutionProvider"], torch.device("cuda", 0))
    session.check_provider_in_use(requested, ["CUDAExecutionProvider", "CPUExecutionProvider"], torch.device("cuda", 0))


# ------------------------------------------------------------ 5. the `cuda` install extra
@pytest.mark.skipif(not cuda_libraries.extra_installed(),
                    reason="the `cuda` extra is not installed (pip install '.[cuda]'); CI installs .[test,samples] only")
def test_with_the_cuda_extra_every_provider_dependency_resolves():
    """Everything libonnxruntime_providers_cuda.so needs loads, from the extra's folders (the driver is not among them:
    the CUDA runtime and the provider open libcuda.so.1 themselves, see test_asking_for_cuda_here...)."""
    loaded = cuda_libraries.preload_extra()
    assert [path.name for path in loaded] == [file for _, file in cuda_libraries.EXTRA_LIBRARIES]
    assert all("site-packages/nvidia/" in str(path) for path in loaded)
    assert cuda_libraries.unresolved_dependencies(cuda_libraries.provider_library(CUDA_PROVIDER)) == {}
    assert {path.name: cuda_libraries.unresolved_dependencies(path) for path in loaded} == {path.name: {} for path in loaded}


# ------------------------------------------------------------------- 6. the smoke test
def gpu_smoke():
    """benchmarks/gpu_smoke.py as a module (run in this process: torch is imported already)."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", ROOT / "benchmarks" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not NO_GPU, reason="a GPU is present: test_gpu_smoke_passes_on_a_gpu runs the smoke test")
def test_gpu_smoke_says_there_is_no_gpu_and_exits_0(capsys):
    assert gpu_smoke().main([]) == 0
    assert "no CUDA GPU visible to torch" in capsys.readouterr().out


@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU; torch sees none")
def test_gpu_smoke_passes_on_a_gpu(capsys):
    exit_code = gpu_smoke().main(["--steps", "4"])
    assert exit_code == 0, capsys.readouterr().out[-4000:]
