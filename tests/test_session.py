"""Provider selection, device strings and binding arguments (CUDA/ROCm logic checked on the CPU)."""

import ctypes
import os

import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from orttrainer import ORTTrainer, ORTTrainerOptions, optim
from orttrainer.runtime import session as bound
from orttrainer.runtime.session import device_providers, resolve_device, session_options

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


def _session_threads(model, images, session_options=None, convolution_kernels="onnxruntime"):
    """Intra-op threads of the training and eval sessions (of every segment, when the convolutions run on torch)."""
    options = {"device": {"id": "cpu"}, "utils": {"convolution_kernels": convolution_kernels}}
    options |= {"session_options": session_options} if session_options else {}
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=ORTTrainerOptions(options))
    trainer.train_step(images, torch.zeros(len(images), dtype=torch.int64))
    trainer.eval_step(images, torch.zeros(len(images), dtype=torch.int64))
    sessions = (trainer._train_session, trainer._eval_session)
    if convolution_kernels == "torch":
        return [[step.session.session.get_session_options().intra_op_num_threads for step in bound._steps
                 if hasattr(step, "session")] for bound in sessions]  # fmt: skip
    return [bound.session.get_session_options().intra_op_num_threads for bound in sessions]


def _cnn(channels, width):
    """Two 3x3 convolutions and a linear head on ``width``-pixel images."""
    return nn.Sequential(nn.Conv2d(channels[0], channels[1], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(channels[1], channels[2], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(channels[2] * (width // 4) ** 2, 10))  # fmt: skip


def test_graphs_of_small_convolutions_run_on_one_thread_others_on_torchs():
    """Below ~1M multiply-accumulates per image Conv/ConvGrad run faster on one thread (benchmarks/NOTES.md §8)."""
    if torch.get_num_threads() == 1:
        pytest.skip("with one torch thread every graph gets one thread; the rule is not visible")
    small = _cnn((1, 6, 16), 28)  # 6*9*784 and 16*54*196 multiply-accumulates per image
    assert _session_threads(small, torch.randn(4, 1, 28, 28)) == [1, 1]
    large = _cnn((3, 32, 64), 32)  # the 64-channel convolution does 4.7M per image, most of the work
    assert _session_threads(large, torch.randn(4, 3, 32, 32)) == [torch.get_num_threads()] * 2
    mlp = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    assert _session_threads(mlp, torch.randn(4, 64)) == [torch.get_num_threads()] * 2


def test_segments_between_torch_convolutions_run_on_one_thread():
    """Next to torch's OpenMP threads, a second ONNX Runtime thread only contends (benchmarks/NOTES.md §18)."""
    train, evaluation = _session_threads(_cnn((3, 32, 64), 32), torch.randn(4, 3, 32, 32), convolution_kernels="torch")
    assert train and evaluation
    assert set(train) == set(evaluation) == {1}


def test_threads_set_by_the_user_are_kept():
    user = onnxruntime.SessionOptions()
    user.intra_op_num_threads = 2
    assert _session_threads(_cnn((1, 6, 16), 28), torch.randn(4, 1, 28, 28), user) == [2, 2]
    segments = _session_threads(_cnn((1, 6, 16), 28), torch.randn(4, 1, 28, 28), user, convolution_kernels="torch")
    assert {threads for graph in segments for threads in graph} == {2}
    assert session_options(threads=1).intra_op_num_threads == 1


def test_the_users_session_options_serve_every_session_and_are_left_as_they_were(tmp_path):
    user = onnxruntime.SessionOptions()
    user.add_session_config_entry("session.inter_op.allow_spinning", "1")
    attributes = ("intra_op_num_threads", "use_deterministic_compute", "optimized_model_filepath", "log_severity_level")
    before = {name: getattr(user, name) for name in attributes}
    saved = tmp_path / "optimized.onnx"
    debug = {"deterministic_compute": True, "graph_save_paths": {"model_with_training_graph_after_optimization_path": str(saved)}}
    options = ORTTrainerOptions({"device": {"id": "cpu"}, "session_options": user, "debug": debug})
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    trainer = ORTTrainer(mlp, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=options)
    batch = (torch.randn(4, 8), torch.zeros(4, dtype=torch.int64))
    trainer.train_step(*batch)
    trainer.eval_step(*batch)
    for bound in (trainer._train_session, trainer._eval_session):  # what ONNX Runtime copied into each session
        used = bound.session.get_session_options()
        assert used.intra_op_num_threads == torch.get_num_threads() and used.use_deterministic_compute
        assert used.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert used.get_session_config_entry("session.inter_op.allow_spinning") == "1"  # the user's choice
    assert saved.exists() and trainer._eval_session.session.get_session_options().optimized_model_filepath == ""
    assert {name: getattr(user, name) for name in attributes} == before
    assert user.get_session_config_entry("session.inter_op.allow_spinning") == "1"
    # not set by the user: added (an entry cannot be removed, and overwriting one logs a warning per session)
    assert user.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_a_non_contiguous_tensor_is_refused_not_read_as_if_it_were():
    """IO binding passes a pointer, shape and dtype: a transposed view would be read in the wrong order."""
    from onnx import TensorProto, helper

    from orttrainer.runtime.session import TorchBoundSession

    square = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3]) for name in ("x", "y")]
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "identity", square[:1], square[1:])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    bound = TorchBoundSession(model, torch.device("cpu"), [("CPUExecutionProvider", {})], session_options())
    with pytest.raises(RuntimeError, match=r"input 'x' of shape \[2, 3\] is not contiguous"):
        bound.bind_input("x", torch.arange(6.0).reshape(3, 2).t())
    x = torch.arange(6.0).reshape(2, 3)  # bound by pointer: kept alive here
    bound.bind_input("x", x)
    bound.allocate_outputs(["y"])
    assert torch.equal(bound.run()[0], x)


def test_a_users_session_options_without_an_arena_train():
    """A session's first run gives its arena's free memory back (run option memory.enable_memory_arena_shrinkage),
    which ONNX Runtime refuses for a session without an arena: the user's options may turn it off."""
    user = onnxruntime.SessionOptions()
    user.enable_cpu_mem_arena = False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "session_options": user}))  # fmt: skip
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    losses = [float(trainer.train_step(x, y)[0]) for _ in range(2)]
    assert losses[1] < losses[0]


def test_only_the_first_run_gives_back_the_arena_memory_it_no_longer_holds(monkeypatch):
    """The first run (the checked one, after which torch takes its step) gives back what the arena no longer holds;
    later runs keep their freed memory for the next run at any shapes (a batch of another length): the run options
    say so."""
    released = []
    run = onnxruntime.InferenceSession.run_with_iobinding

    def recording(self, binding, options=None):
        released.append(options is not None and _config(options, "memory.enable_memory_arena_shrinkage") == "cpu:0")
        return run(self, binding, options)

    monkeypatch.setattr(onnxruntime.InferenceSession, "run_with_iobinding", recording)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(0, 1), nn.Linear(8, 3))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "debug": {"check_against_torch": "off"}}))
    for length in (5, 5, 7, 7, 5):
        tokens = torch.randint(0, 20, (2, length), generator=torch.Generator().manual_seed(length))
        trainer.train_step(tokens, torch.randint(0, 3, (2 * length,), generator=torch.Generator().manual_seed(1)))
    assert released == [True, False, False, False, False]


def _config(options, key):
    try:
        return options.get_run_config_entry(key)
    except RuntimeError:
        return None


class _MallocInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                      "uordblks", "fordblks", "keepcost")]  # fmt: skip


def _malloc_in_use() -> float:
    """MiB glibc's malloc has handed out and not had back (heap and mmapped blocks): ONNX Runtime's arena regions
    and torch's tensors among them."""
    mallinfo2 = ctypes.CDLL(None).mallinfo2
    mallinfo2.restype = _MallocInfo
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="measured with glibc's mallinfo2 (glibc 2.33+)")
def test_the_first_run_leaves_nothing_of_the_arena_beyond_its_outputs():
    """An output left in the arena kept the whole region it was cut from after the first run, which gives the rest
    back (T5's logits kept 730 MiB more than their own 229 through torch's checked step): the first run's outputs are
    copied out of the arena and its free regions given back. Here 59 MiB of logits kept 73 MiB more before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 30000))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "debug": {"check_against_torch": "off"}}))
    x, y = torch.randn(512, 64), torch.randint(0, 30000, (512,))
    trainer.eval_step(x, y)  # the graph built, its eval session run
    before = _malloc_in_use()
    outputs = trainer.train_step(x, y)
    held = _malloc_in_use() - before - sum(output.numel() * output.element_size() for output in outputs) / 2**20
    assert held < 8


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim") or not os.path.exists("/proc/self/statm"),
                    reason="glibc's malloc_trim and Linux's /proc: elsewhere nothing is trimmed")  # fmt: skip
def test_giving_back_the_arenas_memory_gives_back_the_c_heaps_free_pages_too():
    """Blocks freed below glibc's mmap threshold stay in its heap, resident (a graph's build frees hundreds of MiB so,
    and a bfloat16 GPT-2's step then peaked ~450 MiB higher): the first run's give-back returns their pages."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    size = 64 * 1024
    blocks = [libc.malloc(size) for _ in range(4096)]  # 256 MiB of heap blocks, each written
    for block in blocks:
        ctypes.memset(block, 1, size)
    kept = blocks[15::16]  # every 16th stays, so the freed runs between them cannot leave from the heap's top
    for index, block in enumerate(blocks):
        if index % 16 != 15:
            libc.free(block)
    before = _resident_mib()
    bound._give_back_free_arena_memory()
    after = _resident_mib()
    for block in kept:
        libc.free(block)
    assert before - after > 128, (before, after)
