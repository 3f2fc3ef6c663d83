"""ORTTrainerOptions: the legacy option tree, its defaults, and validation.

The schema is the legacy one (docs/legacy_api.md §2). Errors are collected for every key
and raised together as one ValueError whose message names each key by its full path
(``mixed_precision.enabled``), what was expected, and what was given.
"""

import copy
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import onnxruntime
import torch
from onnxruntime.training import PropagateCastOpsStrategy

from ..update import amp
from ..optim import lr_scheduler

MIN_OPSET = 12
MAX_OPSET = 20  # the TorchScript exporter's highest opset in torch 2.13
CHECK_MODES = ("error", "warn", "off")  # debug.check_against_torch
CONVOLUTION_KERNELS = ("auto", "torch", "onnxruntime")  # utils.convolution_kernels and utils.bfloat16_matmul_kernels
MIXED_PRECISION_DTYPES = (torch.float16, torch.bfloat16)  # mixed_precision.dtype


@dataclass(frozen=True)
class _Option:
    """One leaf of the schema: accepted type(s), default and bounds."""

    kind: Any
    default: Any
    min: Optional[int] = None
    max: Optional[int] = None
    nullable: bool = False
    check: Optional[Callable[[Any], Optional[str]]] = None  # extra rule, returns an error or None
    hint: str = ""  # what to pass instead, added to a type error


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _list_of_str(value):
    if not all(isinstance(item, str) for item in value):
        return "must be a list of strings"
    return None


def _dict_of(key_type, value_check):
    def check(value):
        for key, item in value.items():
            if not isinstance(key, key_type) or not value_check(item):
                return f"has an invalid entry {key!r}: {item!r}"
        return None

    return check


def _is_int_list(value):
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


_SCHEMA = {
    "batch": {"gradient_accumulation_steps": _Option(int, 1, min=1)},
    "device": {
        "id": _Option(str, _default_device),
        "mem_limit": _Option(int, 0, min=0),
    },
    "distributed": {
        "world_rank": _Option(int, 0, min=0),
        "world_size": _Option(int, 1, min=1),
        "local_rank": _Option(int, 0, min=0),
        "data_parallel_size": _Option(int, 1, min=1),
        "horizontal_parallel_size": _Option(int, 1, min=1),
        "pipeline_parallel": {
            "pipeline_parallel_size": _Option(int, 1, min=1),
            "num_pipeline_micro_batches": _Option(int, 1, min=1),
            "pipeline_cut_info_string": _Option(str, ""),
            "sliced_schema": _Option(dict, dict, check=_dict_of(str, _is_int_list)),
            "sliced_axes": _Option(dict, dict, check=_dict_of(str, _is_int)),
            "sliced_tensor_names": _Option(list, list, check=_list_of_str),
        },
        "allreduce_post_accumulation": _Option(bool, False),
        "deepspeed_zero_optimization": {"stage": _Option(int, 0, min=0, max=1)},
        "enable_adasum": _Option(bool, False),
    },
    "lr_scheduler": _Option(lr_scheduler._LRScheduler, None, nullable=True,
                            hint="orttrainer.optim's schedulers take the place of torch's: LinearWarmupLRScheduler, "
                                 "CosineWarmupLRScheduler, PolyWarmupLRScheduler, ConstantWarmupLRScheduler, whose "
                                 "total_steps counts optimizer updates; or set trainer.optim_config.lr before a step"),
    "mixed_precision": {
        "enabled": _Option(bool, False),
        "loss_scaler": _Option(amp.LossScaler, None, nullable=True,
                               hint="orttrainer.amp.DynamicLossScaler() takes the place of torch's GradScaler"),
        # orttrainer's own: float16 (the legacy route, loss scaled) or bfloat16 (torch.autocast's, no loss scale)
        "dtype": _Option(torch.dtype, torch.float16, check=lambda value: None if value in MIXED_PRECISION_DTYPES
                         else f"must be one of {list(MIXED_PRECISION_DTYPES)}, got {value!r}"),  # fmt: skip
    },
    "graph_transformer": {
        "attn_dropout_recompute": _Option(bool, False),
        "gelu_recompute": _Option(bool, False),
        "transformer_layer_recompute": _Option(bool, False),
        "number_recompute_layers": _Option(int, 0, min=0),
        "propagate_cast_ops_config": {
            "strategy": _Option(PropagateCastOpsStrategy, PropagateCastOpsStrategy.FLOOD_FILL, nullable=True),
            "level": _Option(int, 1, min=-1),
            "allow": _Option(list, list, check=_list_of_str),
        },
    },
    "utils": {
        "frozen_weights": _Option(list, list, check=_list_of_str),
        "grad_norm_clip": _Option(bool, True),
        "memory_efficient_gradient": _Option(bool, False),
        "run_symbolic_shape_infer": _Option(bool, False),
        # orttrainer's own: where a CPU graph's convolutions run (torch_convolutions.py)
        "convolution_kernels": _Option(str, "auto", check=lambda value: None if value in CONVOLUTION_KERNELS else f"must be one of {list(CONVOLUTION_KERNELS)}, got {value!r}"),
        # orttrainer's own: where a CPU bfloat16 graph's matrix products run (torch_products.py)
        "bfloat16_matmul_kernels": _Option(str, "auto", check=lambda value: None if value in CONVOLUTION_KERNELS else f"must be one of {list(CONVOLUTION_KERNELS)}, got {value!r}"),
    },
    "debug": {
        "deterministic_compute": _Option(bool, False),
        "check_model_export": _Option(bool, False),
        # orttrainer's own: compare the first step of every graph with torch autograd (verify.py)
        "check_against_torch": _Option(str, "error", check=lambda value: None if value in CHECK_MODES else f"must be one of {list(CHECK_MODES)}, got {value!r}"),
        "graph_save_paths": {
            "model_after_graph_transforms_path": _Option(str, ""),
            "model_with_gradient_graph_path": _Option(str, ""),
            "model_with_training_graph_path": _Option(str, ""),
            "model_with_training_graph_after_optimization_path": _Option(str, ""),
        },
    },
    "_internal_use": {
        "enable_internal_postprocess": _Option(bool, True),
        "extra_postprocess": _Option(Callable, None, nullable=True),
        "onnx_opset_version": _Option(int, 17, min=MIN_OPSET, max=MAX_OPSET),
        "enable_onnx_contrib_ops": _Option(bool, True),
    },
    "provider_options": _Option(dict, dict, check=_dict_of(str, lambda v: isinstance(v, dict))),
    "session_options": _Option(onnxruntime.SessionOptions, None, nullable=True),
}

# Options the legacy schema accepts that change nothing in orttrainer, with the reason. Options that
# orttrainer does not implement yet and refuses (check_implemented) are not listed here.
IGNORED_OPTIONS = {
    "distributed.data_parallel_size": "orttrainer derives it as world_size // horizontal_parallel_size",
    "distributed.allreduce_post_accumulation": "gradients are always all-reduced once per update, after accumulation",
    "distributed.pipeline_parallel.num_pipeline_micro_batches": "pipeline parallelism is not implemented",
    "distributed.pipeline_parallel.pipeline_cut_info_string": "pipeline parallelism is not implemented",
    "distributed.pipeline_parallel.sliced_schema": "pipeline parallelism is not implemented",
    "distributed.pipeline_parallel.sliced_axes": "pipeline parallelism is not implemented",
    "distributed.pipeline_parallel.sliced_tensor_names": "pipeline parallelism is not implemented",
    "graph_transformer.propagate_cast_ops_config.strategy": "mixed precision places its own casts",
    "graph_transformer.propagate_cast_ops_config.level": "mixed precision places its own casts",
    "graph_transformer.propagate_cast_ops_config.allow": "mixed precision places its own casts",
    "utils.memory_efficient_gradient": "the gradient graph builder has no memory-efficient variant",
    "utils.run_symbolic_shape_infer": "orttrainer does not run symbolic shape inference",
    "_internal_use.enable_internal_postprocess": "orttrainer has no legacy post-processing pass to switch",
    "_internal_use.enable_onnx_contrib_ops": "orttrainer always exports with its own symbolic functions",
}

_TYPE_NAMES = {bool: "boolean", int: "integer", str: "string", list: "list", dict: "dict", Callable: "callable",
               torch.dtype: "torch.dtype"}


def _type_error(option: _Option, value) -> Optional[str]:
    """Return why ``value`` does not match ``option``, or None when it does."""
    if value is None:
        return None if option.nullable else "null value not allowed"
    kind = option.kind
    if kind is Callable:
        ok = callable(value)
    elif kind is int:
        ok = _is_int(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        name = _TYPE_NAMES.get(kind, kind.__name__)
        return f"must be of {name} type, got {type(value).__name__} {value!r}" + (f" ({option.hint})" if option.hint else "")
    if option.min is not None and value < option.min:
        return f"min value is {option.min}, got {value}"
    if option.max is not None and value > option.max:
        return f"max value is {option.max}, got {value}"
    return option.check(value) if option.check else None


def _default_value(option: _Option):
    return option.default() if callable(option.default) else option.default


def _copy_tree(value):
    """``value`` with every dict and list in it copied; other objects (schedulers, scalers, ...) are shared."""
    if isinstance(value, dict):
        return {key: _copy_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_tree(item) for item in value]
    return value


def _normalize(schema: dict, given, path: str, errors: list) -> dict:
    """Fill defaults into ``given`` following ``schema``; append 'path: reason' errors."""
    if not isinstance(given, dict):
        errors.append(f"{path or 'options'}: must be of dict type, got {type(given).__name__}")
        return {}
    for key in given:
        if key not in schema:
            errors.append(f"{path}{key}: unknown field")
    result = {}
    for key, spec in schema.items():
        if isinstance(spec, dict):
            result[key] = _normalize(spec, given.get(key, {}), f"{path}{key}.", errors)
            continue
        if key in given:
            value = _copy_tree(given[key])
            problem = _type_error(spec, value)
            if problem:
                errors.append(f"{path}{key}: {problem}")
        else:
            value = _default_value(spec)
        result[key] = value
    return result


class _OptionGroup:
    """Attribute view of one group of options (``opts.mixed_precision.enabled``)."""

    def __init__(self, values: dict, schema: dict):
        for key, spec in schema.items():
            value = values[key]
            setattr(self, key, _OptionGroup(value, spec) if isinstance(spec, dict) else value)

    def __repr__(self):
        return f"{type(self).__name__}({vars(self)!r})"


class ORTTrainerOptions(_OptionGroup):
    """Options of an ORTTrainer, given as a (partial, nested) dict.

    Every group is filled with its defaults; unknown keys and wrong types raise one
    ``ValueError`` listing each offending key path. Each option of ``IGNORED_OPTIONS`` set
    to a non-default value gets a UserWarning. The given dict is copied, never changed.
    """

    def __init__(self, options: Optional[dict] = None):
        self._original_opts = _copy_tree(options) if options is not None else {}  # the caller's dict is never changed
        errors: list = []
        self._validated_opts = _normalize(_SCHEMA, self._original_opts, "", errors)
        errors += _conflicts(self._validated_opts)
        if errors:
            raise ValueError("Invalid options: " + "; ".join(errors))
        super().__init__(self._validated_opts, _SCHEMA)
        _warn_ignored(self)


def _conflicts(values: dict) -> list:
    """'path: reason' errors of options valid one by one but not together."""
    mixed_precision = values.get("mixed_precision", {})
    if mixed_precision.get("dtype") == torch.bfloat16 and mixed_precision.get("loss_scaler") is not None:
        return ["mixed_precision.loss_scaler: must be None with mixed_precision.dtype torch.bfloat16 (bfloat16 has "
                "float32's range: its gradients are not scaled, as under torch.autocast), got "
                f"{type(mixed_precision['loss_scaler']).__name__}"]
    return []


# Options read at every step, or only by the built-in check and for debug files: they may change between steps
# (batch.gradient_accumulation_steps, where a window ends: ORTTrainer._accumulation_steps).
_READ_AT_EVERY_STEP = ("batch.gradient_accumulation_steps", "lr_scheduler", "mixed_precision.loss_scaler",
                       "debug.check_against_torch", "debug.graph_save_paths")  # fmt: skip


def settings_read_once(options, schema=_SCHEMA, path="", skipped=_READ_AT_EVERY_STEP) -> list:
    """[(key path, the group's __dict__, key, value)] of every option the trainer takes when it builds its graphs and
    update (all but ``skipped``), lists and dicts copied, to compare at later steps."""
    entries = []
    for key, spec in schema.items():
        where = path + key
        if where in skipped:
            continue
        value = getattr(options, key)
        if isinstance(spec, dict):
            entries += settings_read_once(value, spec, where + ".", skipped)
        else:
            entries.append((f"options {where}", vars(options), key,
                            copy.deepcopy(value) if isinstance(value, (list, dict)) else value))  # fmt: skip
    return entries


def _option_at(path: str) -> _Option:
    return functools.reduce(lambda group, key: group[key], path.split("."), _SCHEMA)


def _value_at(options: ORTTrainerOptions, path: str):
    return functools.reduce(getattr, path.split("."), options)


def ignored_options(options: ORTTrainerOptions) -> list:
    """Key paths of the options in ``IGNORED_OPTIONS`` that ``options`` sets to a non-default value."""
    return [path for path in IGNORED_OPTIONS if _value_at(options, path) != _default_value(_option_at(path))]


def _warn_ignored(options: ORTTrainerOptions) -> None:
    """One UserWarning per option that is set but has no effect, pointing at the caller's line."""
    for path in ignored_options(options):
        warnings.warn(
            f"options {path}={_value_at(options, path)!r} has no effect in orttrainer ({IGNORED_OPTIONS[path]}); "
            f"remove it from the options to silence this warning",
            UserWarning,
            stacklevel=3,
        )


def check_implemented(options) -> None:
    """Options the schema accepts for compatibility but orttrainer does not implement yet."""
    unsupported = {
        "distributed.horizontal_parallel_size": options.distributed.horizontal_parallel_size > 1,
        "distributed.pipeline_parallel.pipeline_parallel_size": options.distributed.pipeline_parallel.pipeline_parallel_size > 1,
        "distributed.enable_adasum": options.distributed.enable_adasum,
    }
    used = [key for key, is_set in unsupported.items() if is_set]
    if used:
        raise NotImplementedError(
            f"orttrainer does not implement these options yet: {', '.join(used)}. "
            "Remove them from the options: their defaults turn these features off."
        )


def own_copy(options):
    """A copy of the option tree the trainer may change; leaf objects (scheduler, loss scaler,
    session options) are shared, lists copied."""
    copied = copy.copy(options)
    for key, value in vars(options).items():
        if hasattr(value, "__dict__") and type(value).__module__ == options.__module__:  # a nested option group
            setattr(copied, key, own_copy(value))
        elif isinstance(value, (list, dict)):
            setattr(copied, key, copy.copy(value))
    return copied
