"""ORTTrainer: the one place that knows the order of a training step.

Construction validates everything it can; the first ``train_step``/``eval_step`` of a
torch model exports it with that batch and builds the sessions ("initialization").
A step then binds the batch, runs the training graph (gradients land in the trainer's
``.grad`` buffers), copies BatchNorm running statistics back, and on every N-th call
(gradient accumulation) applies the optimizer update to the same weight tensors the
sessions read, so no binding ever goes stale.
"""

import copy
import functools
import hashlib
import inspect
import warnings

import numpy as np
import onnx
import onnxruntime
import torch
from onnx import numpy_helper

from . import amp, checkpoint, distributed, export, graph, session, verify
from .model_desc import LABEL_NAME, _ORTTrainerModelDesc, forward_input_names, infer_model_desc
from .optim import _update
from .optim.config import _OptimizerConfig
from .options import ORTTrainerOptions


class TrainStepInfo:
    """Per-step state passed to LR schedulers and loss scalers (legacy record)."""

    def __init__(self, optimizer_config, all_finite=True, fetches=None, optimization_step=0, step=0):
        fetches = [] if fetches is None else fetches
        assert isinstance(optimizer_config, _OptimizerConfig), "optimizer_config must be an optim config"
        assert isinstance(all_finite, bool), "all_finite must be a bool"
        assert isinstance(fetches, list) and all(isinstance(name, str) for name in fetches), "fetches must be a list of str"
        assert isinstance(optimization_step, int) and optimization_step >= 0, "optimization_step must be an int >= 0"
        assert isinstance(step, int) and step >= 0, "step must be an int >= 0"
        self.optimizer_config = optimizer_config
        self.all_finite = all_finite
        self.fetches = fetches
        self.optimization_step = optimization_step
        self.step = step


def _check_constructor_arguments(model, model_desc, optim_config, loss_fn, options):
    assert model is not None, "'model' is required and must be either a 'torch.nn.Module' or ONNX model"
    assert model_desc is None or isinstance(model_desc, dict), "'model_desc' must be a 'dict' (or None to infer it)"
    assert isinstance(optim_config, _OptimizerConfig), (
        "'optim_config' is required and must be any of 'AdamConfig', 'LambConfig' or 'SGDConfig'"
    )
    if loss_fn is not None:
        assert callable(loss_fn) and _accepts_two_arguments(loss_fn), (
            f"'loss_fn' must be either 'None' or a callable taking two arguments (output, label), got {loss_fn!r}"
        )
    assert options is None or isinstance(options, ORTTrainerOptions), "'options' must be an 'ORTTrainerOptions'"
    if isinstance(model, onnx.ModelProto):
        assert loss_fn is None, "'loss_fn' must not be specified when 'model' is an ONNX model"
    elif not isinstance(model, torch.nn.Module):
        raise ValueError(f"'model' must be either 'torch.nn.Module' or 'onnx.ModelProto', got {type(model).__name__}")


def _accepts_two_arguments(function) -> bool:
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to inspect (some builtins): let the call decide
        return True
    return True


def _check_supported(options):
    """Options the schema accepts for compatibility but orttrainer does not implement yet."""
    unsupported = {
        "distributed.horizontal_parallel_size": options.distributed.horizontal_parallel_size > 1,
        "distributed.pipeline_parallel.pipeline_parallel_size": options.distributed.pipeline_parallel.pipeline_parallel_size > 1,
        "distributed.enable_adasum": options.distributed.enable_adasum,
        "graph_transformer.attn_dropout_recompute": options.graph_transformer.attn_dropout_recompute,
        "graph_transformer.gelu_recompute": options.graph_transformer.gelu_recompute,
        "graph_transformer.transformer_layer_recompute": options.graph_transformer.transformer_layer_recompute,
    }
    used = [key for key, is_set in unsupported.items() if is_set]
    if used:
        raise NotImplementedError(f"orttrainer does not implement these options yet: {', '.join(used)}")


class _BatchNormStatistics:
    """Carries one BatchNorm's running statistics back into the trainer's buffers as torch computes them.

    ONNX Runtime overwrites the running-stat inputs in place and uses the biased batch
    variance; torch uses the unbiased one. With the old variance saved before the run,
    ``new = ort + (ort - momentum * old) / (n - 1)`` is torch's value.
    """

    def __init__(self, stats, weights, bound_session):
        self.names = (stats.mean_input, stats.var_input)
        self.mean = weights[stats.mean_input]
        self.var = weights[stats.var_input]
        self.momentum = stats.momentum
        self.module = graph.module_path(stats.node_name)
        self.new_mean = torch.empty_like(self.mean)
        self.new_var = torch.empty_like(self.var)
        self.old_mean = torch.empty_like(self.mean)
        self.old_var = torch.empty_like(self.var)
        self.count = torch.empty((), dtype=torch.int64, device=self.var.device)
        bound_session.bind_output(stats.mean_output, self.new_mean)
        bound_session.bind_output(stats.var_output, self.new_var)
        bound_session.bind_output(stats.count_output, self.count)

    def save_old(self):
        self.old_mean.copy_(self.mean)
        self.old_var.copy_(self.var)

    def restore_old(self):
        """Undo the run: ONNX Runtime wrote the new statistics into the inputs in place."""
        self.mean.copy_(self.old_mean)
        self.var.copy_(self.old_var)

    def update(self):
        self.mean.copy_(self.new_mean)
        self.var.copy_(self.new_var + (self.new_var - self.momentum * self.old_var) / (self.count - 1))


def _check_values_per_channel(batch_norms) -> None:
    """torch refuses training-mode batch norm over one value per channel (its variance is undefined);
    so does the trainer, after undoing what the run did to the running statistics."""
    if not batch_norms or int(torch.stack([bn.count for bn in batch_norms]).min()) > 1:
        return
    for batch_norm in batch_norms:
        batch_norm.restore_old()
    modules = [f"'{bn.module}'" for bn in batch_norms if int(bn.count) <= 1]
    raise ValueError(
        f"Expected more than 1 value per channel when training: batch norm {', '.join(modules)} got 1 value per channel "
        "for this batch (e.g. a batch of 1 into BatchNorm1d); torch raises the same error. Drop or pad such batches."
    )


def _is_floating(elem_type: int) -> bool:
    return session.torch_dtype(elem_type).is_floating_point


class ORTTrainer:
    """Train a torch module (or a forward+loss ONNX model) in ONNX Runtime.

    ``model_desc`` may be None: it is then inferred from the first batch. With a
    ``loss_fn(output, label)``, the label is the last input and the loss the first output.
    """

    def __init__(self, model, model_desc, optim_config, loss_fn=None, options=None):
        _check_constructor_arguments(model, model_desc, optim_config, loss_fn, options)
        self.options = _own_copy(options) if options is not None else ORTTrainerOptions()  # the user's is never changed
        _check_supported(self.options)
        self.model_desc = _ORTTrainerModelDesc(model_desc) if model_desc is not None else None
        self.optim_config = optim_config
        self.loss_fn = loss_fn
        self._world = distributed.world_from(self.options)
        self._device = session.resolve_device(self._device_id(self.options))
        self._providers = session.device_providers(self._device, self.options.device.mem_limit, self.options.provider_options)
        self._train_step_info = TrainStepInfo(optim_config)
        self._torch_model = model if isinstance(model, torch.nn.Module) else None
        self._onnx_model = None
        self._training_session = None
        self._load_state_dict = None
        self._seed = torch.initial_seed() % (1 << 63)
        self._data_parallel = None
        self._reference_module = None  # (export copy, forward names) until the first train_step checked against torch
        self._frozen = None  # _FrozenValues when the trace froze values of the first batch
        self._index_ranges = None  # graph.index_ranges, found at the first batch
        if self._world.is_distributed:
            self._start_data_parallel()
        if self.options.mixed_precision.enabled and self.options.mixed_precision.loss_scaler is None:
            self.options.mixed_precision.loss_scaler = amp.DynamicLossScaler()
        if self._torch_model is None:
            self._onnx_model = copy.deepcopy(model)
            self._initialize_from_onnx()

    def _device_id(self, options):
        """device.id, with a bare 'cuda' meaning this process's local rank under torchrun."""
        device_id = options.device.id
        if device_id == "cuda" and self._world.is_distributed:
            return f"cuda:{self._world.local_rank}"
        return device_id

    def _start_data_parallel(self):
        world, settings = self._world, self.options.distributed
        settings.world_rank, settings.world_size, settings.local_rank = world.rank, world.size, world.local_rank
        settings.data_parallel_size = world.size // settings.horizontal_parallel_size
        distributed.ensure_process_group(world, self._device)
        self._data_parallel = distributed.DataParallel(world, settings.deepspeed_zero_optimization.stage)

    # ----------------------------------------------------------------- inputs
    def _gather_inputs(self, args, kwargs):
        """Positional inputs, then keyword inputs in model_desc order; validated, on the device."""
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = tuple(args[0])
        if self.model_desc is not None:
            names = [entry.name for entry in self.model_desc.inputs]
            unknown = [name for name in kwargs if name not in names]
            if unknown:
                raise ValueError(f"unknown keyword inputs {unknown}; model_desc inputs are {names}")
            tensors = list(args) + [kwargs[name] for name in names if name in kwargs]
            if len(tensors) != len(names):
                raise ValueError(f"expected {len(names)} inputs {names}, got {len(tensors)}")
        else:
            names, tensors = self._name_inputs(args, kwargs)
        for name, tensor in zip(names, tensors):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"input '{name}' must be a torch.Tensor, got {type(tensor).__name__}")
        if self.model_desc is not None:
            self._check_against_model_desc(tensors)
        return names, [tensor.to(self._device).contiguous() for tensor in tensors]

    def _name_inputs(self, args, kwargs):
        """Without model_desc: positional inputs named by forward's signature, keywords by
        their own name, and the label (last positional, or keyword 'label') last."""
        kwargs = dict(kwargs)
        label = []
        if self.loss_fn is not None:
            if LABEL_NAME in kwargs:
                label = [kwargs.pop(LABEL_NAME)]
            elif args:
                args, label = args[:-1], [args[-1]]
            else:
                raise ValueError(f"a loss_fn is set, so the batch needs a label: the last positional input or '{LABEL_NAME}='")
        names = forward_input_names(self._torch_model, len(args)) + list(kwargs) + [LABEL_NAME] * len(label)
        return names, list(args) + list(kwargs.values()) + label

    def _check_against_model_desc(self, tensors):
        bound = {}
        for entry, tensor in zip(self.model_desc.inputs, tensors):
            if len(entry.shape) != tensor.dim():
                raise ValueError(
                    f"input '{entry.name}' must have {len(entry.shape)} dimensions {entry.shape}, got shape {list(tensor.shape)}"
                )
            for index, (expected, actual) in enumerate(zip(entry.shape, tensor.shape)):
                if isinstance(expected, int) and expected != actual:
                    raise ValueError(
                        f"input '{entry.name}' dimension {index} must be {expected} (model_desc shape {entry.shape}), "
                        f"got shape {list(tensor.shape)}"
                    )
                if isinstance(expected, str) and bound.setdefault(expected, actual) != actual:
                    raise ValueError(
                        f"input '{entry.name}' dimension {index} ('{expected}') is {actual}, but another input "
                        f"has '{expected}' = {bound[expected]}"
                    )
            dtype = getattr(entry, "dtype", None)
            if dtype is not None and tensor.dtype != dtype:
                raise TypeError(
                    f"input '{entry.name}' must be {dtype}, got {tensor.dtype}; convert it (e.g. tensor.to({dtype}))"
                )

    # --------------------------------------------------------- initialization
    def _initialize_from_torch(self, input_names, inputs):
        """Export the torch model with this first batch and build the sessions."""
        module = export.module_for_export(self._torch_model)
        given_desc = self.model_desc
        label_count = 1 if self.loss_fn is not None else 0
        forward_names = input_names[: len(input_names) - label_count]
        signature = inspect.signature(module.forward).parameters
        not_in_forward = [name for name in forward_names if name not in signature]
        if not_in_forward:
            raise ValueError(f"inputs {not_in_forward} are not parameters of {type(module).__name__}.forward{tuple(signature)}")
        cpu_inputs = [tensor.cpu() for tensor in inputs]
        outputs = export.sample_outputs(module, self.loss_fn, forward_names, cpu_inputs)
        model_desc = given_desc or _ORTTrainerModelDesc(infer_model_desc(input_names, cpu_inputs, outputs))
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        loss_output = model_desc.loss_output
        loss_index = [entry.name for entry in model_desc.outputs].index(loss_output.name)
        if len(outputs) != len(model_desc.outputs):
            raise ValueError(
                f"model_desc lists {len(model_desc.outputs)} outputs but the model"
                + (" + loss_fn" if self.loss_fn else "")
                + f" returns {len(outputs)}"
            )
        loss = outputs[loss_index]
        if self.loss_fn is None and given_desc is None and (loss.dim() != 0 or not loss.is_floating_point()):
            raise ValueError(
                f"no loss_fn was given, so the model's first output is taken as the loss, but it has shape {list(loss.shape)} "
                f"dtype {loss.dtype}: pass loss_fn=(output, label) -> scalar loss (e.g. torch.nn.functional.cross_entropy) "
                "and the label as the batch's last input, or return the scalar loss first from forward"
            )
        if loss.dim() != 0 or not loss.is_floating_point():
            raise ValueError(
                f"the loss output '{loss_output.name}' must be a floating-point scalar, got shape {list(loss.shape)} "
                f"dtype {loss.dtype}; reduce it (e.g. .mean()) in the model or loss_fn"
            )
        export.refuse_custom_backward(module, self.loss_fn, forward_names, cpu_inputs, loss_index)
        state = {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}  # export runs BN
        export_arguments = (
            self.loss_fn,
            forward_names,
            [(entry.name, entry.shape) for entry in model_desc.inputs],
            [(entry.name, entry.shape) for entry in model_desc.outputs],
            self.options._internal_use.onnx_opset_version,
        )
        onnx_model, lookups, frozen_values = export.export_to_onnx(module, cpu_inputs, *export_arguments)
        if frozen_values:  # held to these shapes; re-exported once from a batch of other values (train_step)
            self._frozen = _FrozenValues(frozen_values, [list(t.shape) for t in cpu_inputs], cpu_inputs,
                                         (module, export_arguments), onnx_model)  # fmt: skip
        onnx_model = self._postprocess(onnx_model)
        initializers = {init.name for init in onnx_model.graph.initializer}
        frozen_names = set(self.options.utils.frozen_weights)
        requires_grad = [
            name
            for name, parameter in module.named_parameters()
            if parameter.requires_grad and name in initializers and name not in frozen_names
        ]
        if not requires_grad:
            raise ValueError(
                f"{type(module).__name__} has no parameter to train (none, all with requires_grad=False, or all in "
                "options utils.frozen_weights); torch's optimizers refuse an empty parameter list too"
            )
        # a weight that reaches only other outputs gets no gradient in torch (grad None): it is not trained
        trainable = graph.weights_reaching_loss(onnx_model, requires_grad, model_desc.loss_output.name)
        frozen = [name for name in state if name in initializers and name not in trainable]
        weights = {name: state[name].to(self._device).contiguous() for name in trainable + frozen}
        self._aliases = _aliases(module)
        self._unexported_state = {name: tensor for name, tensor in state.items()
                                  if name not in weights and name not in self._aliases}  # fmt: skip
        self._batch_counters = {
            f"{path}.num_batches_tracked": state[f"{path}.num_batches_tracked"]
            for path, layer in module.named_modules()
            if isinstance(layer, torch.nn.modules.batchnorm._BatchNorm) and layer.track_running_stats and layer.training
        }
        self._onnx_model, self.model_desc = onnx_model, model_desc
        try:
            self._build(onnx_model, weights, trainable, lookups)
        except Exception:
            self._onnx_model, self.model_desc = None, given_desc
            raise
        if self.options.debug.check_against_torch != "off":
            self._reference_module = (module, forward_names)  # the first train_step checks against it
        for index, tensor in enumerate(outputs):
            model_desc.add_type_to_output_description(index, tensor.dtype, getattr(model_desc.outputs[index], "dtype_amp", None))
        if self.options.debug.check_model_export:
            self._check_model_export(cpu_inputs, outputs)

    def _postprocess(self, onnx_model):
        """``_internal_use.extra_postprocess``: the user's function on the exported graph, which it
        may change in place or return changed (the first-step check compares the result with torch)."""
        postprocess = self.options._internal_use.extra_postprocess
        if postprocess is None:
            return onnx_model
        returned = postprocess(onnx_model)
        if returned is not None and not isinstance(returned, onnx.ModelProto):
            raise TypeError(
                f"options _internal_use.extra_postprocess must change the onnx.ModelProto in place or return one, "
                f"got {type(returned).__name__}"
            )
        return returned if returned is not None else onnx_model

    def _initialize_from_onnx(self):
        """An ONNX forward+loss model: float initializers that reach the loss are trained, unless
        frozen or BatchNorm statistics."""
        model = self._onnx_model
        graph.name_unnamed_nodes(model.graph)
        if self.model_desc is None:
            initializer_names = {init.name for init in model.graph.initializer}
            inputs = [(i.name, _shape_of(i)) for i in model.graph.input if i.name not in initializer_names]
            outputs = [(o.name, _shape_of(o), index == 0) for index, o in enumerate(model.graph.output)]
            self.model_desc = _ORTTrainerModelDesc({"inputs": inputs, "outputs": outputs})
        frozen_names = set(self.options.utils.frozen_weights)
        weights = {
            init.name: torch.from_numpy(numpy_helper.to_array(init).copy()).to(self._device)
            for init in model.graph.initializer
            if _is_floating(init.data_type)
        }
        buffers = graph.batch_norm_statistics(model)
        candidates = [name for name in weights if name not in frozen_names and name not in buffers]
        trainable = graph.weights_reaching_loss(model, candidates, self.model_desc.loss_output.name)
        self._batch_counters = {}
        self._aliases, self._unexported_state = {}, {}
        self._build(model, weights, trainable)

    def _build(self, onnx_model, weights, trainable, lookups=None):
        """Gradient/eval graphs, sessions, bindings of weights and gradient buffers."""
        loss_name = self.model_desc.loss_output.name
        output_names = [entry.name for entry in self.model_desc.outputs]
        frozen = [name for name in weights if name not in trainable]
        mixed_precision = self.options.mixed_precision.enabled
        graphs = graph.build_training_graphs(
            onnx_model, trainable, frozen, loss_name, output_names, mixed_precision, fast_cpu_kernels=self._device.type == "cpu",
            lookups=lookups,
        )
        self._save_debug_graphs(graphs)
        debug = self.options.debug
        one_thread = self._device.type == "cpu" and graph.small_convolutions_dominate(graphs.eval)
        options = session.session_options(
            self.options.session_options,
            debug.deterministic_compute,
            debug.graph_save_paths.model_with_training_graph_after_optimization_path,
            threads=1 if one_thread else None,
        )
        try:
            self._train_session = session.TorchBoundSession(graphs.train, self._device, self._providers, options)
        except onnxruntime.capi.onnxruntime_pybind11_state.NotImplemented as error:
            raise graph.missing_kernel_error(error, self._device) from error
        self._eval_session = session.TorchBoundSession(graphs.eval, self._device, self._providers, options)
        self._record_input_types(graphs.eval)
        self._weights = weights
        for bound in (self._train_session, self._eval_session):
            for name, tensor in weights.items():
                if name in bound.input_names:
                    bound.bind_input(name, tensor)
        self._flat_gradients, self._grads = _flat_buffers({name: weights[name] for name in trainable})
        self._gradient_outputs = graphs.gradient_outputs
        self._bind_gradients(self._grads)
        self._accumulation_scratch = None
        self._batch_norms = [_BatchNormStatistics(stats, weights, self._train_session) for stats in graphs.running_statistics]
        self._loss_scale = None
        if mixed_precision:
            self._loss_scale = torch.tensor(self.options.mixed_precision.loss_scaler.loss_scale, device=self._device)
            self._train_session.bind_input(graph.LOSS_SCALE_INPUT, self._loss_scale)
        self._dropout_scale = torch.tensor(1.0, device=self._device)
        if graph.DROPOUT_SCALE_INPUT in self._train_session.input_names:
            self._train_session.bind_input(graph.DROPOUT_SCALE_INPUT, self._dropout_scale)
        self._dropout_fixed = mixed_precision and any(node.op_type == "Dropout" for node in graphs.train.graph.node)
        self._embeddings = graphs.embedding_gradients
        for embedding in self._embeddings:
            self._train_session.bind_input(embedding.lookup_input, weights[embedding.weight])
        embedding_outputs = [name for e in self._embeddings for name in (e.rows_gradient, e.indices_output)]
        self._train_session.allocate_outputs(output_names + embedding_outputs)
        owned = trainable
        if self._data_parallel is not None:
            owned = self._data_parallel.start(weights, trainable, graphs.train.SerializeToString() + repr(self._comparable_options()).encode())
            self._seed = distributed.gather_objects(self._world, self._seed)[0]  # rank 0's, as a checkpoint keeps it
        self._all_grads = list(self._grads.values())  # views into the flat buffers: fixed for the trainer's life
        self._owned_grads = [self._grads[name] for name in owned]
        self._optimizer = _update.make_optimizer(
            self.optim_config, {name: weights[name] for name in owned}, self.options.utils.grad_norm_clip
        )
        self._training_session = self._train_session  # set last: a build that failed midway leaves it None
        if self._load_state_dict is not None:
            self._load_state_dict()

    def _comparable_options(self):
        """The options every rank must share (its own rank numbers aside)."""
        options = dict(self.options._validated_opts)
        options["distributed"] = {k: v for k, v in options["distributed"].items() if k not in ("world_rank", "local_rank")}
        return sorted((key, repr(value)) for key, value in options.items() if key not in ("session_options", "lr_scheduler"))

    def _bind_gradients(self, buffers):
        for name, tensor in buffers.items():
            if name in self._gradient_outputs:  # embeddings only looked up get theirs from _add_embedding_gradients
                self._train_session.bind_output(self._gradient_outputs[name], tensor)
        self._gradients_bound_to = buffers

    def _add_embedding_gradients(self, embedding_outputs):
        """Scatter-add each lookup's row gradients into its weight's gradient (see graph.EmbeddingGradient)."""
        cleared = set()
        for embedding, rows, indices in zip(self._embeddings, embedding_outputs[::2], embedding_outputs[1::2]):
            target = self._gradients_bound_to[embedding.weight]
            if embedding.weight not in self._gradient_outputs and embedding.weight not in cleared:
                target.zero_()
                cleared.add(embedding.weight)
            indices = indices.reshape(-1)
            rows = rows.reshape(indices.numel(), *target.shape[1:]).to(target.dtype)
            per_row = (-1,) + (1,) * (rows.dim() - 1)
            if embedding.scale_grad_by_freq:  # torch: each row's gradient divided by its count in this lookup
                rows = rows / torch.bincount(indices, minlength=target.shape[0])[indices].view(per_row).to(rows.dtype)
            if embedding.padding_idx >= 0:  # torch: the padding row gets nothing from this lookup
                rows = rows.masked_fill((indices == embedding.padding_idx).view(per_row), 0.0)
            target.index_add_(0, indices, rows)

    def _record_input_types(self, eval_model):
        """Input dtypes from the graph; outputs the graph computes in float16 get ``dtype_amp``."""
        types = {graph_input.name: graph_input.type.tensor_type.elem_type for graph_input in eval_model.graph.input}
        for index, entry in enumerate(self.model_desc.inputs):
            if entry.name in types:
                self.model_desc.add_type_to_input_description(index, session.torch_dtype(types[entry.name]))
        output_types = {output.name: output.type.tensor_type.elem_type for output in eval_model.graph.output}
        for index, entry in enumerate(self.model_desc.outputs):
            if output_types.get(entry.name) == onnx.TensorProto.FLOAT16:
                self.model_desc.add_type_to_output_description(index, getattr(entry, "dtype", torch.float32), torch.float16)

    def _save_debug_graphs(self, graphs):
        paths = self.options.debug.graph_save_paths
        if paths.model_with_gradient_graph_path:
            onnx.save(graphs.train, paths.model_with_gradient_graph_path)
        if paths.model_with_training_graph_path:
            onnx.save(graphs.train, paths.model_with_training_graph_path)
        if paths.model_after_graph_transforms_path:
            onnx.save(graphs.eval, paths.model_after_graph_transforms_path)

    def _check_model_export(self, inputs, torch_outputs):
        """debug.check_model_export: the eval graph must reproduce torch's eval-mode outputs."""
        onnx_outputs = self._run_eval([tensor.to(self._device) for tensor in inputs], [e.name for e in self.model_desc.outputs])
        for entry, expected, actual in zip(self.model_desc.outputs, torch_outputs, onnx_outputs):
            if not torch.allclose(expected, actual.cpu(), rtol=1e-2, atol=1e-6):
                difference = (expected - actual.cpu()).abs().max().item()
                raise AssertionError(
                    f"debug.check_model_export: ONNX output '{entry.name}' differs from torch (max abs difference {difference})"
                )

    def _ensure_initialized(self, args, kwargs):
        input_names, inputs = self._gather_inputs(args, kwargs)
        if self._training_session is None:
            self._initialize_from_torch(input_names, inputs)
            input_names, inputs = self._gather_inputs(args, kwargs)  # now checked against the typed model_desc
        if self._frozen is not None:
            self._frozen.check_batch(self.model_desc.inputs, inputs)
        self._check_index_ranges(inputs)
        return inputs

    def _check_index_ranges(self, inputs):
        """Token ids and class targets inside the range torch accepts (graph.index_ranges), before any run."""
        by_name = {entry.name: tensor for entry, tensor in zip(self.model_desc.inputs, inputs)}
        if self._index_ranges is None:
            self._index_ranges = graph.index_ranges(self._onnx_model, {name: list(t.shape) for name, t in by_name.items()})
        for bound in self._index_ranges:
            indices = by_name[bound.input]
            outside = (indices < 0) | (indices >= bound.size)
            if bound.ignore_index is not None:
                outside &= indices != bound.ignore_index
            if bool(outside.any()):
                position = tuple(int(i) for i in outside.nonzero()[0])
                allowed = f"0..{bound.size - 1}" + (f" or {bound.ignore_index} (ignore_index)" if bound.ignore_index is not None else "")
                raise ValueError(
                    f"input '{bound.input}' holds {int(indices[position])} at index {list(position)}, outside {allowed}: "
                    f"it is read by {bound.consumer}; torch would raise too (an id past the vocabulary, a class past the "
                    "number of classes)"
                )

    # ------------------------------------------------------------------ steps
    def _requested_outputs(self):
        names = [entry.name for entry in self.model_desc.outputs]
        fetches = self._train_step_info.fetches
        if not fetches:
            return names
        unknown = [name for name in fetches if name not in names]
        if unknown:
            raise RuntimeError(f"The specified fetches list contains invalid output names {unknown}; outputs are {names}")
        return list(fetches)

    def _bind_batch(self, bound, inputs):
        for entry, tensor in zip(self.model_desc.inputs, inputs):
            if entry.name in bound.input_names:
                bound.bind_input(entry.name, tensor)

    def _dropout_seed(self, step):
        digest = hashlib.sha256(f"{self._seed}:{step}:{self._world.rank}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def _gradient_buffers_for(self, starts_window):
        """Where a run writes gradients: the summed buffers at a window's start, a scratch set inside it."""
        if starts_window:
            return self._grads
        if self._accumulation_scratch is None:
            self._accumulation_scratch = {name: torch.empty_like(grad) for name, grad in self._grads.items()}
            self._scratch_list = list(self._accumulation_scratch.values())
        return self._accumulation_scratch

    def _run_training_graph(self, inputs, gradient_buffers):
        """Forward + backward of this batch, gradients into ``gradient_buffers``, BatchNorm statistics
        updated; returns the model_desc outputs. A run that fails leaves the statistics as they were."""
        self._bind_batch(self._train_session, inputs)
        if self._gradients_bound_to is not gradient_buffers:
            self._bind_gradients(gradient_buffers)
        if self._loss_scale is not None:
            self._loss_scale.fill_(self.options.mixed_precision.loss_scaler.loss_scale)
        for batch_norm in self._batch_norms:
            batch_norm.save_old()
        try:
            outputs = self._train_session.run()
        except RuntimeError as error:
            for batch_norm in self._batch_norms:
                batch_norm.restore_old()
            raise graph.run_error(error) from error
        _check_values_per_channel(self._batch_norms)
        outputs, embedding_outputs = outputs[: len(self.model_desc.outputs)], outputs[len(self.model_desc.outputs) :]
        self._add_embedding_gradients(embedding_outputs)
        for batch_norm in self._batch_norms:
            batch_norm.update()
        return outputs

    def _check_against_torch(self, inputs):
        """The built-in check (verify.py): this batch through the training graph and through the
        module in torch autograd, both without dropout; nothing of the trainer's state changes."""
        module, forward_names = self._reference_module
        self._reference_module = None
        if self._dropout_fixed:
            warnings.warn("debug.check_against_torch skipped: a float16 (mixed precision) graph with dropout cannot turn it off")
            return
        bound_before = self._gradients_bound_to
        gradients = {name: torch.empty_like(grad) for name, grad in self._grads.items()}
        self._dropout_scale.fill_(0.0)
        try:
            outputs = self._run_training_graph(inputs, gradients)
            buffers = {name: tensor.detach().cpu().clone()
                       for bn in self._batch_norms for name, tensor in zip(bn.names, (bn.mean, bn.var))}  # fmt: skip
        finally:
            self._dropout_scale.fill_(1.0)
            for batch_norm in self._batch_norms:
                batch_norm.restore_old()
            self._bind_gradients(bound_before)
        if self._loss_scale is not None:  # mixed precision: gradients of loss * scale; an overflow is the scaler's to handle
            if not all(bool(grad.isfinite().all()) for grad in gradients.values()):
                gradients = {}
            gradients = {name: grad.float() / self._loss_scale.item() for name, grad in gradients.items()}
        output_names = [entry.name for entry in self.model_desc.outputs]
        ort = verify.StepResult(dict(zip(output_names, outputs)), gradients, buffers)
        reference = verify.torch_step(module, self.loss_fn, forward_names, inputs, self._weights, output_names,
                                      self.model_desc.loss_output.name, list(gradients))  # fmt: skip
        dtype = torch.float16 if self.options.mixed_precision.enabled else torch.float32
        where = graph.where_in_graph(self._onnx_model, list(gradients) + output_names + list(buffers))
        verify.report(verify.compare(ort, reference, dtype, where), self.options.debug.check_against_torch)

    def train_step(self, *args, **kwargs):
        """One forward/backward on this batch; an optimizer update every N-th call.

        Returns the outputs in model_desc order (or ``fetches`` order), one tensor bare.
        """
        inputs = self._ensure_initialized(args, kwargs)
        requested = self._requested_outputs()
        if self._reference_module is not None:
            self._check_against_torch(inputs)
        info = self._train_step_info
        accumulation = self.options.batch.gradient_accumulation_steps
        starts_window = info.step % accumulation == 0
        onnxruntime.set_seed(self._dropout_seed(info.step + 1))
        outputs = self._run_training_graph(inputs, self._gradient_buffers_for(starts_window))
        info.step += 1
        for counter in self._batch_counters.values():
            counter += 1
        if self._data_parallel is not None and self._batch_norms:
            self._data_parallel.share_buffers([t for bn in self._batch_norms for t in (bn.mean, bn.var)])
        if not starts_window:
            torch._foreach_add_(self._all_grads, self._scratch_list)
        lr = self._learning_rate()
        if info.step % accumulation == 0 and self._update_weights(lr, accumulation):
            info.optimization_step += 1
        return self._select_outputs(outputs, requested)

    def _update_weights(self, lr, accumulation):
        """Sum over ranks, undo the loss scale (skipping non-finite steps), then the optimizer on
        the owned weights with the mean over micro-batches and ranks. Returns whether it updated."""
        if self._data_parallel is not None:
            self._data_parallel.reduce_gradients(self._flat_gradients)
        if self._loss_scale is not None and not self._unscale_and_check(self._all_grads):
            return False
        self._optimizer.step(self._owned_grads, lr, 1.0 / (accumulation * self._world.size), norm_grads=self._all_grads)
        if self._data_parallel is not None:
            self._data_parallel.share_updated_weights(self._weights)
        return True

    def _unscale_and_check(self, grads):
        """Divide the gradients by the loss scale and let the scaler see whether all are finite."""
        found_non_finite = torch.zeros(1, device=self._device)
        inverse_scale = torch.reciprocal(self._loss_scale.reshape(1))
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_non_finite, inverse_scale)
        info = self._train_step_info
        info.all_finite = not bool(found_non_finite.item())
        self.options.mixed_precision.loss_scaler.update(info)
        return info.all_finite

    def _learning_rate(self):
        scheduler = self.options.lr_scheduler
        if scheduler is None:
            return self.optim_config.lr
        return scheduler._step(self._train_step_info)[0]

    def _select_outputs(self, outputs, requested):
        by_name = dict(zip([entry.name for entry in self.model_desc.outputs], outputs))
        selected = [by_name[name] for name in requested]
        return selected[0] if len(selected) == 1 else selected

    def _run_eval(self, inputs, requested):
        self._bind_batch(self._eval_session, inputs)
        self._eval_session.allocate_outputs(requested)
        try:
            return self._eval_session.run()
        except RuntimeError as error:
            raise graph.run_error(error) from error

    def eval_step(self, *args, **kwargs):
        """Forward only, in inference mode (dropout off, BatchNorm on running statistics)."""
        inputs = self._ensure_initialized(args, kwargs)
        requested = self._requested_outputs()
        outputs = self._run_eval(inputs, requested)
        return outputs[0] if len(outputs) == 1 else outputs

    # ------------------------------------------------------------- state dict
    def _model_state(self):
        """{name: CPU copy} of every weight and buffer, named like torch's state_dict() (tied
        weights under their first name only)."""
        tensors = {**self._weights, **self._batch_counters, **self._unexported_state}
        return {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}

    def state_dict(self, pytorch_format=False):
        """The trainer's state in the legacy layout (numpy arrays), or with ``pytorch_format``
        the flat {name: tensor} that the torch module's ``load_state_dict`` accepts."""
        if self._training_session is None:
            warnings.warn(
                "ONNX Runtime training session is not initialized yet. Please run train_step or eval_step "
                "at least once before calling ORTTrainer.state_dict()."
            )
            return self._load_state_dict.args[0] if self._load_state_dict is not None else {}
        model_state = self._model_state()
        if pytorch_format:  # every name torch's state_dict() has: a tied weight under each of its names
            return {**model_state, **{alias: model_state[name] for alias, name in self._aliases.items()}}
        info = self._train_step_info
        distributed = self.options.distributed
        return {
            "model": {"full_precision": {name: tensor.numpy() for name, tensor in model_state.items()}},
            "optimizer": _to_numpy(self._optimizer.state_dict()),
            "trainer_options": {
                "mixed_precision": self.options.mixed_precision.enabled,
                "zero_stage": distributed.deepspeed_zero_optimization.stage,
                "world_rank": distributed.world_rank,
                "world_size": distributed.world_size,
                "optimizer_name": self.optim_config.name,
                "data_parallel_size": distributed.data_parallel_size,
                "horizontal_parallel_size": distributed.horizontal_parallel_size,
            },
            "train_step_info": {"optimization_step": info.optimization_step, "step": info.step, "dropout_seed": self._seed},
            **self._accumulation_state(),
            **self._partition_state(),
            **self._loss_scaler_state(),
        }

    @property
    def _optimizer_state_sharded(self):
        """ZeRO-1 on several ranks: each holds the optimizer state of the weights it owns."""
        return self._data_parallel is not None and bool(self._data_parallel.owner)

    def _loss_scaler_state(self):
        """Mixed precision: the scaler's position, so that a resumed run scales as the original."""
        scaler = self.options.mixed_precision.loss_scaler
        if not self.options.mixed_precision.enabled:
            return {}
        state = {"loss_scale": scaler.loss_scale}
        if hasattr(scaler, "_stable_steps_count"):
            state["stable_steps"] = scaler._stable_steps_count
        return {"loss_scaler": state}

    def _partition_state(self):
        """ZeRO-1: which rank holds each weight's optimizer state (legacy key ``partition_info``)."""
        if not self._optimizer_state_sharded:
            return {}
        return {
            "partition_info": {
                name: {"original_dim": np.array(self._weights[name].shape, dtype=np.int64), "owner_rank": np.int64(rank)}
                for name, rank in self._data_parallel.owner.items()
            }
        }

    def _accumulation_state(self):
        """Gradients summed so far when a checkpoint falls inside an accumulation window."""
        if self._train_step_info.step % self.options.batch.gradient_accumulation_steps == 0:
            return {}
        return {"gradient_accumulation": _to_numpy(self._grads)}

    def load_state_dict(self, state_dict, strict=True):
        """Restore weights, optimizer state and step counters from a ``state_dict()``.

        Before the first step the dict is kept and applied when the sessions are built.
        Everything is checked first (keys when ``strict``, shapes, optimizer name), so a
        bad dict leaves the trainer unchanged.
        """
        if self._training_session is None:
            self._load_state_dict = functools.partial(self._apply_state_dict, state_dict, strict)
            return
        self._apply_state_dict(state_dict, strict)

    def _apply_state_dict(self, state, strict):
        current = self.state_dict()
        for group in ("model", "optimizer", "train_step_info"):
            if group not in state:
                warnings.warn(f"Missing key: {group} in state_dict")
        model = {precision: {name: value for name, value in values.items() if name not in self._aliases}  # tied: same tensor
                 for precision, values in state.get("model", {}).items()}  # fmt: skip
        if strict and "model" in state:
            checkpoint.compare_keys(current["model"], model, "state_dict[model]")
        weights = {}
        for precision, values in model.items():
            if strict:
                checkpoint.compare_keys(current["model"]["full_precision"], values, f"state_dict[model][{precision}]")
            for name, value in values.items():
                if name in current["model"]["full_precision"]:
                    weights[name] = _checked_tensor(value, current["model"]["full_precision"][name], f"state_dict[model][{precision}][{name}]")
                elif strict:
                    raise RuntimeError(f"Unexpected key: {name} in state_dict[model][{precision}]")
        optimizer = state.get("optimizer")
        if optimizer is not None:
            given_name = state.get("trainer_options", {}).get("optimizer_name")
            if isinstance(given_name, bytes):
                given_name = given_name.decode()
            if given_name != self.optim_config.name:
                raise RuntimeError(f"Optimizer mismatch: expected {self.optim_config.name}, got {given_name}")
            if strict:  # a ZeRO rank holds part of the optimizer state: other ranks' entries are expected
                checkpoint.compare_keys(current["optimizer"], optimizer, "state_dict[optimizer]",
                                        allow_unexpected=self._optimizer_state_sharded)
            optimizer = {
                name: {key: _checked_tensor(value, current["optimizer"][name][key], f"state_dict[optimizer][{name}][{key}]")
                       for key, value in entry.items() if key in current["optimizer"].get(name, {})}
                for name, entry in optimizer.items() if name in current["optimizer"]
            }  # fmt: skip
        if "gradient_accumulation" in state and self._world.is_distributed:
            raise ValueError(
                "this checkpoint was taken inside a gradient-accumulation window; its partial gradient sum cannot be "
                f"split over {self._world.size} ranks (each would add all of it): resume it in one process, or save at a "
                "window boundary"
            )
        accumulated = {
            name: _checked_tensor(value, current["model"]["full_precision"][name], f"state_dict[gradient_accumulation][{name}]")
            for name, value in state.get("gradient_accumulation", {}).items()
        }
        # everything is checked: apply
        live = {**self._weights, **self._batch_counters, **self._unexported_state}
        for name, value in weights.items():
            live[name].copy_(value)
        if optimizer is not None:
            self._optimizer.load_state_dict(optimizer)
        for name, value in accumulated.items():
            self._grads[name].copy_(value)
        scaler_state = state.get("loss_scaler")
        if scaler_state is not None and self.options.mixed_precision.enabled:
            scaler = self.options.mixed_precision.loss_scaler
            scaler.loss_scale = float(scaler_state["loss_scale"])
            if "stable_steps" in scaler_state:
                scaler._stable_steps_count = int(scaler_state["stable_steps"])
        info = state.get("train_step_info")
        if info is not None:
            self._train_step_info.step = int(info["step"])
            self._train_step_info.optimization_step = int(info["optimization_step"])
            if "dropout_seed" in info:
                self._seed = int(info["dropout_seed"])
        self._load_state_dict = None

    def save_checkpoint(self, path, user_dict=None, include_optimizer_states=True, overwrite=False, consolidate=False):
        """Write ``state_dict()`` (+ ``user_dict``, stored natively, never pickled) to an HDF5 file atomically.

        On several ranks the weights are the same everywhere, so rank 0 writes; under ZeRO each
        rank holds part of the optimizer state: every rank writes its own file (put ``{rank}`` in
        ``path``), or with ``consolidate=True`` the parts are merged into one single-process
        checkpoint. All ranks must call this at the same step, one that completes a gradient-
        accumulation window; if any rank's write fails, every rank raises ``RankWriteError``.
        """
        state = dict(self.state_dict())
        if not include_optimizer_states:
            state.pop("optimizer", None)
        if user_dict:
            state["user_dict"] = user_dict
        if self._data_parallel is None:
            checkpoint.save(state, path, overwrite=overwrite)
            return
        per_rank = self._optimizer_state_sharded and not consolidate
        if per_rank and "{rank}" not in str(path):
            raise ValueError(f"ZeRO checkpoints are per rank: put '{{rank}}' in the path ({path}) or pass consolidate=True")
        checkpoint.check_not_mid_window(state, f"cannot save checkpoint {path}")
        if self._optimizer_state_sharded and not per_rank:
            state = checkpoint.merge_rank_states(distributed.gather_objects(self._world, state))
        target = str(path).format(rank=self._world.rank) if per_rank else path
        writes_here = per_rank or self._world.rank == 0  # otherwise rank 0 writes the one file
        write = functools.partial(checkpoint.save, state, target, overwrite=overwrite) if writes_here else None
        distributed.write_together(self._world, write, f"saving checkpoint {path} at step {self._train_step_info.step}")

    def load_checkpoint(self, *paths, strict=True, allow_pickle=False):
        """Load a checkpoint written by ``save_checkpoint`` (or by the legacy ORTTrainer); return its user_dict.

        Per-rank ZeRO checkpoints (several paths) are aggregated first. A legacy pickled
        user_dict is only unpickled with ``allow_pickle=True``.
        """
        if len(paths) == 1 and "{rank}" in str(paths[0]):
            paths = [str(paths[0]).format(rank=rank) for rank in range(self._world.size)]
        if len(paths) > 1:
            state = checkpoint.aggregate_checkpoints(list(paths), pytorch_format=False)
        else:
            state = checkpoint.load(paths[0])
        checkpoint.check_is_checkpoint(state, paths[0])
        user_dict = checkpoint.user_dict_from(state, paths[0], allow_pickle)
        self.load_state_dict(state, strict=strict)
        return user_dict

    # ----------------------------------------------------------------- export
    def save_as_onnx(self, path, with_loss=True):
        """Write the model with the current weights as an inference graph (dropout off, BatchNorm on
        running statistics) that runs in a plain ``onnxruntime.InferenceSession``.

        ``with_loss=True`` (the legacy form) keeps the label input and returns the loss first;
        ``with_loss=False`` keeps only the model's own inputs and outputs.
        """
        if self._training_session is None:
            raise RuntimeError(
                "save_as_onnx needs the graph that the first train_step or eval_step builds from a batch; run one "
                "(e.g. trainer.eval_step(*batch) right after load_checkpoint) before saving"
            )
        model = self._onnx_model
        for initializer in model.graph.initializer:
            if initializer.name in self._weights:
                initializer.CopyFrom(numpy_helper.from_array(self._weights[initializer.name].cpu().numpy(), initializer.name))
        inference_model = copy.deepcopy(model)
        graph.set_inference_mode(inference_model)
        if not with_loss:
            loss = self.model_desc.loss_output.name
            graph.keep_outputs(inference_model, [entry.name for entry in self.model_desc.outputs if entry.name != loss])
        onnx.save(inference_model, path)


class _FrozenValues:
    """The trace froze values of the first batch (``export._FROZEN_VALUE``): a width, or data.

    Batches must keep the first batch's shapes; the first batch with other values is
    exported again, and the graph must come out the same, or the trace depended on data.
    """

    def __init__(self, locations, shapes, first_inputs, export_from, first_graph):
        self.locations, self.shapes, self.first_inputs = locations, shapes, first_inputs
        self.export_from = export_from  # (module copy, the other export arguments)
        self.first_graph = _without_initializers(first_graph)

    def _check_shapes(self, entries, inputs):
        for entry, tensor, shape in zip(entries, inputs, self.shapes):
            if list(tensor.shape) != shape:
                raise ValueError(
                    f"input '{entry.name}' has shape {list(tensor.shape)}, but this model's graph only takes the first "
                    f"batch's shapes ({shape} for '{entry.name}'): its trace turned tensor values into Python numbers at\n- "
                    + "\n- ".join(self.locations)
                    + "\nKeep those computations in tensor ops (x.shape[0] rather than int(...)) to train other shapes."
                )

    def check_batch(self, entries, inputs):
        """The first batch's shapes, and one export from the first batch of other values (then the
        export copy of the module is let go)."""
        self._check_shapes(entries, inputs)
        cpu_inputs = [tensor.cpu() for tensor in inputs]
        if self.export_from is None or all(torch.equal(first, now) for first, now in zip(self.first_inputs, cpu_inputs)):
            return
        module, arguments = self.export_from
        again, _, _ = export.export_to_onnx(module, cpu_inputs, *arguments)
        export.refuse_data_dependent_trace(self.first_graph, _without_initializers(again), self.locations)
        self.export_from = self.first_inputs = self.first_graph = None


def _without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """The graph's structure and constants, without the weights (they change as training goes on)."""
    copied = onnx.ModelProto()
    copied.CopyFrom(model)
    del copied.graph.initializer[:]
    return copied


def _own_copy(options):
    """A copy of the option tree the trainer may change; leaf objects (scheduler, loss scaler,
    session options) are shared, lists copied."""
    copied = copy.copy(options)
    for key, value in vars(options).items():
        if hasattr(value, "__dict__") and type(value).__module__ == options.__module__:  # a nested option group
            setattr(copied, key, _own_copy(value))
        elif isinstance(value, (list, dict)):
            setattr(copied, key, copy.copy(value))
    return copied


def _aliases(module: torch.nn.Module) -> dict:
    """{alias: first name} of tensors the module's state_dict lists under several names (tied weights)."""
    first, aliases = {}, {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        aliases.update({name: first[id(tensor)]} if id(tensor) in first else {})
        first.setdefault(id(tensor), name)
    return aliases


def _flat_buffers(like: dict):
    """Zeroed buffers shaped like ``like``'s tensors, as views of one flat tensor per dtype
    (so that gradients can be all-reduced in one call); returns (flats, {name: view})."""
    by_dtype = {}
    for name, tensor in like.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    flats, views = [], {}
    for dtype, names in by_dtype.items():
        flat = torch.zeros(sum(like[name].numel() for name in names), dtype=dtype, device=next(iter(like.values())).device)
        offset = 0
        for name in names:
            size = like[name].numel()
            views[name] = flat[offset : offset + size].view(like[name].shape)
            offset += size
        flats.append(flat)
    return flats, {name: views[name] for name in like}


def _checked_tensor(value, current, where):
    """``value`` as a tensor shaped and typed like ``current``; a clear error otherwise."""
    tensor = torch.as_tensor(np.asarray(value))
    if tuple(tensor.shape) != tuple(np.shape(current)):
        raise RuntimeError(f"{where} has shape {list(tensor.shape)}, the trainer's has {list(np.shape(current))}")
    expected = torch.as_tensor(np.asarray(current)).dtype
    if tensor.dtype != expected:
        raise RuntimeError(f"{where} has dtype {tensor.dtype}, the trainer's has {expected}")
    return tensor


def _to_numpy(tree):
    """Copy every tensor of a nested dict to a CPU numpy array."""
    if isinstance(tree, dict):
        return {key: _to_numpy(value) for key, value in tree.items()}
    return tree.detach().cpu().numpy().copy()


def _shape_of(value_info):
    return [dim.dim_param if dim.dim_param else dim.dim_value for dim in value_info.type.tensor_type.shape.dim]
