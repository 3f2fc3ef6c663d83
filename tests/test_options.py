"""ORTTrainerOptions: legacy schema, defaults, validation naming key paths."""

import copy
import warnings

import onnx
import onnxruntime
import pytest
import torch
import torch.nn.functional as F
from models import MLP, mlp_batch
from onnxruntime.training import PropagateCastOpsStrategy

from orttrainer import ORTTrainer, ORTTrainerOptions, amp, optim
from orttrainer.api.options import IGNORED_OPTIONS, ignored_options


def test_defaults_fill_every_group():
    options = ORTTrainerOptions()
    assert options.batch.gradient_accumulation_steps == 1
    assert options.device.id == ("cuda" if torch.cuda.is_available() else "cpu")
    assert options.device.mem_limit == 0
    assert options.distributed.deepspeed_zero_optimization.stage == 0
    assert options.distributed.pipeline_parallel.sliced_schema == {}
    assert options.graph_transformer.propagate_cast_ops_config.strategy == PropagateCastOpsStrategy.FLOOD_FILL
    assert options.utils.grad_norm_clip is True
    assert options.utils.frozen_weights == []
    assert options._internal_use.onnx_opset_version == 17
    assert options.lr_scheduler is None and options.mixed_precision.loss_scaler is None
    assert options.session_options is None and options.provider_options == {}
    assert options._validated_opts["debug"]["graph_save_paths"]["model_with_gradient_graph_path"] == ""


def test_partial_nested_dict_keeps_given_values():
    scheduler = optim.LinearWarmupLRScheduler(100, 0.1)
    scaler = amp.DynamicLossScaler(loss_scale=128.0)
    session_options = onnxruntime.SessionOptions()
    options = ORTTrainerOptions({
        "batch": {"gradient_accumulation_steps": 4},
        "device": {"id": "cpu", "mem_limit": 1024},
        "lr_scheduler": scheduler,
        "mixed_precision": {"loss_scaler": scaler},
        "session_options": session_options,
        "provider_options": {"CPUExecutionProvider": {"anything": 1}},
        "distributed": {"pipeline_parallel": {"sliced_axes": {"x": 0}}},
    })
    assert options.batch.gradient_accumulation_steps == 4
    assert options.device.mem_limit == 1024
    assert options.lr_scheduler is scheduler and options.mixed_precision.loss_scaler is scaler
    assert options.session_options is session_options
    assert options.distributed.pipeline_parallel.sliced_axes == {"x": 0}
    assert options.distributed.world_size == 1


def test_attributes_are_mutable():
    options = ORTTrainerOptions()
    options.utils.run_symbolic_shape_infer = True
    assert options.utils.run_symbolic_shape_infer is True


@pytest.mark.parametrize(
    "given, message",
    [
        ({"mixed_precision": {"enabled": 1}}, "mixed_precision.enabled: must be of boolean type, got int 1"),
        ({"batch": {"gradient_accumulation_steps": True}}, "batch.gradient_accumulation_steps: must be of integer type"),
        ({"device": {"id": None}}, "device.id: null value not allowed"),
        ({"distributed": {"deepspeed_zero_optimization": {"stage": 2}}}, "distributed.deepspeed_zero_optimization.stage: max value is 1, got 2"),
        ({"_internal_use": {"onnx_opset_version": 11}}, "_internal_use.onnx_opset_version: min value is 12, got 11"),
        ({"lr_scheduler": "linear"}, "lr_scheduler: must be of _LRScheduler type"),
        ({"utils": {"frozen_weights": ["a", 1]}}, "utils.frozen_weights: must be a list of strings"),
        ({"devices": {}}, "devices: unknown field"),
        ({"debug": {"graph_save_paths": {"bogus": ""}}}, "debug.graph_save_paths.bogus: unknown field"),
        ({"batch": 3}, "batch.: must be of dict type"),
    ],
)
def test_invalid_options_name_the_key_path(given, message):
    with pytest.raises(ValueError, match="Invalid options: .*" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        ORTTrainerOptions(given)


def test_every_error_is_reported_at_once():
    with pytest.raises(ValueError) as caught:
        ORTTrainerOptions({"batch": {"gradient_accumulation_steps": 0}, "device": {"mem_limit": -1}})
    assert "batch.gradient_accumulation_steps" in str(caught.value) and "device.mem_limit" in str(caught.value)


def test_defaults_and_used_options_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options = ORTTrainerOptions({"utils": {"frozen_weights": ["fc.bias"]}, "_internal_use": {"extra_postprocess": lambda model: model},
                                     "debug": {"deterministic_compute": True}})
    assert ignored_options(options) == []


@pytest.mark.parametrize("path, value", [
    ("utils.run_symbolic_shape_infer", True),
    ("utils.memory_efficient_gradient", True),
    ("_internal_use.enable_internal_postprocess", False),
    ("_internal_use.enable_onnx_contrib_ops", False),
    ("graph_transformer.propagate_cast_ops_config.strategy", PropagateCastOpsStrategy.INSERT_AND_REDUCE),
    ("graph_transformer.propagate_cast_ops_config.allow", ["Gelu"]),
    ("distributed.allreduce_post_accumulation", True),
    ("distributed.data_parallel_size", 2),
    ("distributed.pipeline_parallel.pipeline_cut_info_string", "1:2"),
])
def test_an_ignored_option_warns_once_naming_its_key_path(path, value):
    *groups, key = path.split(".")
    given = {key: value}
    for group in reversed(groups):
        given = {group: given}
    with pytest.warns(UserWarning, match="has no effect in orttrainer") as caught:
        options = ORTTrainerOptions(given)
    ours = [warning for warning in caught if "has no effect" in str(warning.message)]
    assert [str(warning.message) for warning in ours] == [
        f"options {path}={value!r} has no effect in orttrainer ({IGNORED_OPTIONS[path]}); "
        "remove it from the options to silence this warning"]
    assert ours[0].filename == __file__, "the warning points at the caller's line"
    assert ignored_options(options) == [path]


def test_ignored_options_reads_the_current_attributes():
    options = ORTTrainerOptions()
    options.utils.run_symbolic_shape_infer = True
    assert ignored_options(options) == ["utils.run_symbolic_shape_infer"]


def test_the_given_dict_is_never_changed():
    scheduler = optim.LinearWarmupLRScheduler(100, 0.1)
    given = {
        "utils": {"frozen_weights": ["fc.bias"]},
        "distributed": {"pipeline_parallel": {"sliced_schema": {"x": [1, 2]}}},
        "provider_options": {"CPUExecutionProvider": {"arena": 1}},
        "lr_scheduler": scheduler,
    }
    expected = copy.deepcopy({key: value for key, value in given.items() if key != "lr_scheduler"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sliced_schema has no effect
        options = ORTTrainerOptions(given)
    options.utils.frozen_weights.append("running_mean")
    options.distributed.pipeline_parallel.sliced_schema["x"].append(3)
    options.provider_options["CPUExecutionProvider"]["arena"] = 0
    options._original_opts["utils"]["frozen_weights"].append("other")
    assert {key: value for key, value in given.items() if key != "lr_scheduler"} == expected
    assert given["lr_scheduler"] is scheduler and options.lr_scheduler is scheduler, "objects are shared, not copied"
    assert options._validated_opts["utils"]["frozen_weights"] == ["fc.bias", "running_mean"]


def test_a_trainer_leaves_the_given_dict_unchanged():
    given = {"device": {"id": "cpu"}, "utils": {"frozen_weights": []}, "mixed_precision": {"enabled": True}}
    expected = copy.deepcopy(given)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(), loss_fn=F.cross_entropy, options=ORTTrainerOptions(given))
    trainer.train_step(*mlp_batch())
    assert given == expected


def test_debug_graph_save_paths_write_the_graphs_they_name(tmp_path):
    """The training graphs have gradient outputs; the eval graph has none (the optimized training
    graph was once overwritten by the eval session's, which wrote to the same path)."""
    names = ["model_with_gradient_graph_path", "model_with_training_graph_path", "model_after_graph_transforms_path",
             "model_with_training_graph_after_optimization_path"]  # fmt: skip
    paths = {name: str(tmp_path / f"{name}.onnx") for name in names}
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy,
                         options=ORTTrainerOptions({"device": {"id": "cpu"}, "debug": {"graph_save_paths": paths}}))
    trainer.train_step(*mlp_batch())
    outputs = {name: [output.name for output in onnx.load(path).graph.output] for name, path in paths.items()}
    for name in names:
        gradients = [output for output in outputs[name] if output.endswith("_grad")]
        assert (name == "model_after_graph_transforms_path") == (not gradients), (name, outputs[name])


def test_torchs_scheduler_or_grad_scaler_as_an_option_names_what_takes_their_place():
    """A torch loop's LR scheduler or GradScaler passed as an option: the type error says which orttrainer object to
    pass instead."""
    layer = torch.nn.Linear(2, 2)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(torch.optim.AdamW(layer.parameters()), T_max=10)
    with pytest.raises(ValueError, match=r"lr_scheduler: must be of _LRScheduler type, got CosineAnnealingLR .*\(orttrainer"
                                         r".optim's schedulers take the place of torch's: LinearWarmupLRScheduler"):  # fmt: skip
        ORTTrainerOptions({"lr_scheduler": scheduler})
    with pytest.raises(ValueError, match=r"mixed_precision.loss_scaler: must be of LossScaler type, got GradScaler .*"
                                         r"\(orttrainer.amp.DynamicLossScaler\(\) takes the place of torch's GradScaler\)"):  # fmt: skip
        ORTTrainerOptions({"mixed_precision": {"enabled": True, "loss_scaler": torch.amp.GradScaler("cpu")}})
