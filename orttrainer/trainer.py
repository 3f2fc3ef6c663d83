"""ORTTrainer: the public class, and the order of a training step.

Construction validates everything it can; the first ``train_step``/``eval_step`` of a torch
model builds the runtime from that batch ("initialization", build.py: export, training and
eval graphs, sessions). A step matches the batch to the graph's inputs
(model_desc.match_inputs), runs the training graph, which writes gradients into the
trainer's buffers (gradients.py) and BatchNorm running statistics into its weights, and on
every N-th call (gradient accumulation) applies the optimizer update to the same weight
tensors the sessions read, so no binding ever goes stale. What a checkpoint holds is
captured and restored by state.py.
"""

import copy
import functools
import hashlib
import warnings

import onnxruntime
import torch

from .update import amp, distributed
from .runtime import build, graph_cache, session
from .graph import dropout, graph_errors, onnx_file
from . import progress
from .export import verify
from .update.gradients import Gradients, window_size
from .api.model_desc import _ORTTrainerModelDesc, match_inputs
from .api.model_outputs import packed_outputs, requested_outputs, selected_outputs
from .export.module_edits import module_as_built, refuse_module_changes, refuse_setting_changes
from .optim import _update
from .optim.config import SGDConfig
from .update.step_info import TrainStepInfo
from .api.trainer_arguments import check_trainer_arguments
from .api.options import ORTTrainerOptions, check_implemented, own_copy, settings_read_once
from .update.state import TrainerState, check_against_module, read_checkpoint, write_checkpoint


def _attribute_of(owner: str, name: str):
    """A read-only attribute: ``self.<owner>.<name>``, None before the build."""
    return property(lambda self: None if getattr(self, owner) is None else getattr(getattr(self, owner), name))


def _raise(error: Exception):
    """Raise ``error``, caught before: a rank's failed action for distributed.run_together."""
    raise error


class ORTTrainer:
    """Train a torch module (or a forward+loss ONNX model) in ONNX Runtime.

    ``model_desc`` may be None: it is then inferred from the first batch. With a
    ``loss_fn(output, label)``, the label is the last input and the loss the first output.
    """

    def __init__(self, model, model_desc, optim_config, loss_fn=None, options=None):
        check_trainer_arguments(model, model_desc, optim_config, loss_fn, options)
        self.options = own_copy(options) if options is not None else ORTTrainerOptions()  # the user's is never changed
        # ... nor read again: what the user changes of it later reaches nothing (refused, _refuse_setting_edits)
        self._options_given = settings_read_once(options, skipped=()) if options is not None else []
        check_implemented(self.options)
        self.model_desc = _ORTTrainerModelDesc(model_desc) if model_desc is not None else None
        self.optim_config = optim_config
        self.loss_fn = loss_fn
        self._world = distributed.world_from(self.options)
        self._device = session.resolve_device(self._device_id(self.options))
        self._providers = session.device_providers(self._device, self.options.device.mem_limit, self.options.provider_options)
        self._train_step_info = TrainStepInfo(optim_config)
        self._torch_model = model if isinstance(model, torch.nn.Module) else None
        self._built_from = None  # module_edits.ModuleAsBuilt: the torch model as the graphs were built from it
        self._settings_as_built = []  # (key path, dict, key, value): the options and optim_config the build took
        self._window_steps = None  # batch.gradient_accumulation_steps at the last train_step
        self._said_eval_mode = False  # whether train_step warned of a model in eval() (_warn_of_eval_mode)
        self._runtime = self._gradients = self._optimizer = None  # set by the build
        self._load_state_dict = None  # a state_dict loaded before the build, which applies it
        self._seed = torch.initial_seed() % (1 << 63)
        self._data_parallel = None
        self._check_failure = None  # on several ranks, this rank's TorchMismatchError until the window ends
        if self._world.is_distributed:
            self._data_parallel = distributed.join(self._world, self.options.distributed, self._device)
        if amp.scales_loss(self.options.mixed_precision) and self.options.mixed_precision.loss_scaler is None:
            self.options.mixed_precision.loss_scaler = amp.DynamicLossScaler()
        self._graphs = None  # a torch model's graphs, one per batch shape signature that needs its own
        if self._torch_model is not None:
            self._graphs = graph_cache.GraphCache(model, loss_fn, self.options, self.model_desc, self._device,
                                                  self._providers, self._data_parallel)  # fmt: skip
        else:
            self._adopt(build.from_onnx(copy.deepcopy(model), self.options, self.model_desc, self._device, self._providers,
                                        self._data_parallel))  # fmt: skip

    # private names tests and benchmarks read, from before the runtime had its own module
    _training_session = _train_session = _attribute_of("_runtime", "train_session")
    _eval_session = _attribute_of("_runtime", "eval_session")
    _onnx_model = _attribute_of("_runtime", "onnx_model")
    _weights = _attribute_of("_runtime", "weights")
    _reference_module = _attribute_of("_runtime", "reference")
    _grads = _attribute_of("_gradients", "sums")

    def _device_id(self, options):
        """device.id, with a bare 'cuda' meaning this process's local rank under torchrun."""
        device_id = options.device.id
        if device_id == "cuda" and self._world.is_distributed:
            return f"cuda:{self._world.local_rank}"
        return device_id

    # --------------------------------------------------------- initialization
    def _ensure_initialized(self, args, kwargs):
        """The batch on the device, matched to the graph's inputs and checked; a torch model runs the
        graph of the batch's signature, its shapes and constants (graph_cache.py: the first batch of one
        exports and may build), and the trainer's model_desc becomes that graph's."""
        input_names, inputs, constants = self._match_inputs(args, kwargs)
        if self._graphs is not None:
            with torch.inference_mode(False):  # graphs are exported with autograd on, which inference tensors refuse
                exportable = [tensor.clone() if tensor.is_inference() else tensor for tensor in inputs]
                runtime = self._graphs.runtime_for(input_names, exportable, constants)
            if self._runtime is None:
                self._adopt(runtime)
                input_names, inputs, _ = self._match_inputs(args, kwargs)  # now checked against the typed model_desc
            elif runtime is not self._runtime:
                self._runtime, self.model_desc = runtime, self._graphs.model_desc
                self._gradients.attach(runtime)
        self._runtime.check_batch(inputs)
        return inputs

    def _match_inputs(self, args, kwargs):
        """(graph input names, tensors on the device, constants) of a step's arguments (model_desc.match_inputs)."""
        names, tensors, constants = match_inputs(args, kwargs, self.model_desc, self._torch_model,
                                                 has_label=self.loss_fn is not None)  # fmt: skip
        return names, [tensor.to(self._device).contiguous() for tensor in tensors], constants

    def _adopt(self, runtime):
        """Take a built runtime: gradient buffers and the optimizer of the weights this rank updates
        (on several ranks, rank 0's dropout seed), the model_desc batches are checked against; then
        apply a state_dict loaded before the build."""
        if self._data_parallel is not None:
            self._seed = distributed.gather_objects(self._world, self._seed)[0]  # rank 0's, as a checkpoint keeps it
        if self._torch_model is not None and self._runtime is None:  # the weights the graphs were built to train
            self._built_from = module_as_built(self._torch_model, self.loss_fn)
        if self._runtime is None:
            trainer = vars(self)
            self._settings_as_built = [("optim_config", trainer, "optim_config", self.optim_config),
                                       ("options", trainer, "options", self.options),
                                       ("loss_fn", trainer, "loss_fn", self.loss_fn),
                                       *settings_read_once(self.options), *self.optim_config.settings_read_once()]  # fmt: skip
        gradients = Gradients(runtime)
        optimizer = _update.make_optimizer(self.optim_config.naming_tied_weights(runtime.aliases),
                                           {name: runtime.weights[name] for name in runtime.owned},
                                           self.options.utils.grad_norm_clip)  # fmt: skip
        self._runtime, self._gradients, self._optimizer = runtime, gradients, optimizer
        self.model_desc = runtime.model_desc if self._graphs is None else self._graphs.model_desc
        if self._load_state_dict is not None:
            self._load_state_dict()

    # ------------------------------------------------------------------ steps
    def train_step(self, *args, **kwargs):
        """One forward/backward on this batch; an optimizer update every N-th call.

        Returns the outputs in model_desc order (or ``fetches`` order), one tensor bare.
        """
        self._warn_of_eval_mode()
        outputs, window_ends, accumulation = self._forward_backward(args, kwargs)
        lr = self._learning_rate()
        if window_ends and self._update_weights(lr, accumulation):
            self._train_step_info.optimization_step += 1
        return outputs

    def _warn_of_eval_mode(self) -> None:
        """Warn, once per trainer, when the model is in eval() at a train_step: orttrainer trains it in train() (as
        the legacy ORTTrainer did, ``as_trained.as_trained``), where a torch loop would step it in eval mode. A graph
        is traced in one mode, so following each step's mode would need a graph per mode; the warning keeps the legacy
        behaviour and says how to get torch's."""
        if self._said_eval_mode or self._torch_model is None or self._torch_model.training:
            return
        self._said_eval_mode = True
        warnings.warn(
            f"orttrainer: train_step with the model ({type(self._torch_model).__name__}) in eval mode (model.eval(), "
            "and no model.train() since): orttrainer trains it in train() mode, as the legacy ORTTrainer did (dropout "
            "on, BatchNorm normalising by the batch and updating its running statistics), where a torch loop would "
            "step it in eval mode. Call model.train() before train_step to train as now without this warning; to train "
            "as torch does in eval mode, put its submodules in eval() and the model in train() before the first step: "
            "model.train(); [child.eval() for child in model.children()]. Said once per trainer",
            UserWarning,
            stacklevel=3,
        )

    def _forward_backward(self, args, kwargs):
        """The batch's forward and backward: its gradients summed into the window's (``_gradients.sums``), BatchNorm
        statistics updated; returns (the outputs as train_step returns them, whether the window ends, its size)."""
        self._refuse_setting_edits()
        amp.refuse_other_autocast(self.options.mixed_precision, self._device, "train_step")
        inputs = self._ensure_initialized(args, kwargs)
        self._refuse_module_edits(training=True)
        requested = requested_outputs(self.model_desc, self._train_step_info.fetches)
        info = self._train_step_info
        steps = self.options.batch.gradient_accumulation_steps
        accumulation = self._window_steps = window_size(steps, self._window_steps, info.step)
        starts_window = info.step % accumulation == 0
        gradient_buffers = self._gradients.buffers_for(starts_window)
        outputs = None
        if self._runtime.reference is not None:
            with progress.phase("checked the first step against torch (debug.check_against_torch)"):
                outputs = self._check_against_torch(inputs, gradient_buffers)
        if outputs is None:
            onnxruntime.set_seed(self._dropout_seed(info.step + 1))
            outputs = self._run_training_graph(inputs, gradient_buffers)
        info.step += 1
        for counter in self._runtime.batch_counters.values():
            counter += 1
        if self._data_parallel is not None and self._runtime.buffer_writes:
            self._data_parallel.share_buffers(self._runtime.buffer_tensors())
        if not starts_window:
            self._gradients.add_scratch()
        returned = selected_outputs(self.model_desc, outputs, requested, info.fetches)
        return returned, info.step % accumulation == 0, accumulation

    def _refuse_setting_edits(self) -> None:
        """The options and optim_config as the build took them (module_edits.refuse_setting_changes)."""
        refuse_setting_changes(self._options_given, self._settings_as_built, self.optim_config)

    def _refuse_module_edits(self, training: bool) -> None:
        """The user's module as the graphs were built from it (module_edits.refuse_module_changes)."""
        if self._built_from is not None:
            refuse_module_changes(self._built_from, training)

    def _run_training_graph(self, inputs, gradient_buffers):
        """Forward + backward of this batch, gradients into ``gradient_buffers``, BatchNorm statistics
        updated; returns the model_desc outputs. A run that fails leaves the statistics as they were."""
        runtime = self._runtime
        runtime.bind_batch(runtime.train_session, inputs)
        self._gradients.bind(gradient_buffers)
        if runtime.loss_scale is not None:
            runtime.loss_scale.fill_(self.options.mixed_precision.loss_scaler.loss_scale)
        outputs, embedding_outputs = runtime.run_training()
        self._gradients.add_embedding_gradients(embedding_outputs)
        runtime.update_buffers()
        return outputs

    def _check_against_torch(self, inputs, gradient_buffers):
        """The built-in check (verify.py): this batch through the training graph and through the
        module in torch autograd, both without dropout; nothing of the trainer's state changes but
        ``gradient_buffers``, which the step's own run writes next (no second set of gradients).
        A graph without dropout draws nothing, so its checked run is the step's own: its outputs are
        returned and, once the check passed, its BatchNorm statistics written (None: the step runs the graph again).
        They are put back while the check compares: torch's step, taken after the run on ``runtime.weights`` (and the
        rounding excuse's), must start from the statistics the step started from."""
        runtime = self._runtime
        reference = runtime.reference
        runtime.reference = None
        if runtime.dropout_fixed:
            warnings.warn("debug.check_against_torch skipped: a float16 (mixed precision) graph with dropout cannot turn it off")
            return
        output_names = [entry.name for entry in self.model_desc.outputs]
        run_torch = self._as_the_graphs_compute(functools.partial(
            verify.torch_step, reference.module, self.loss_fn, reference.forward_names, inputs, output_names=output_names,
            loss_name=self.model_desc.loss_output.name, trained=list(self._gradients.sums), constants=reference.constants,
            projected=reference.projected))  # fmt: skip
        bound_before, gradients = self._gradients.bound, gradient_buffers
        is_the_step = dropout.DROPOUT_SCALE_INPUT not in runtime.train_session.input_names
        runtime.dropout_scale.fill_(0.0)
        try:
            outputs = self._run_training_graph(inputs, gradients)
            buffers = runtime.buffer_copies()
        finally:
            runtime.dropout_scale.fill_(1.0)
            runtime.restore_buffers()  # torch's side starts from the buffers the step starts from
            self._gradients.bind(bound_before)
        if runtime.loss_scale is not None:  # mixed precision: gradients of loss * scale; an overflow is the scaler's to handle
            if not all(bool(grad.isfinite().all()) for grad in gradients.values()):
                gradients = {}
            gradients = {name: grad.float() / runtime.loss_scale.item() for name, grad in gradients.items()}
        ort = verify.StepResult(dict(zip(output_names, outputs)), gradients, buffers)
        where = graph_errors.where_in_graph(runtime.onnx_model, list(gradients) + output_names + list(buffers))
        mode = self.options.debug.check_against_torch
        try:
            verify.check(ort, run_torch, runtime.weights, self._checked_dtype(), where, mode)
        except verify.TorchMismatchError as error:
            if self._data_parallel is None:
                raise
            self._check_failure = error  # raised on every rank at the window's end (_share_check_failures)
        if not is_the_step:
            return None
        runtime.update_buffers()  # the run's values, still in its outputs: those of the step
        return outputs

    def _update_weights(self, lr, accumulation):
        """Sum over ranks, undo the loss scale (skipping non-finite steps), then the optimizer on
        the owned weights with the mean over micro-batches and ranks. Returns whether it updated."""
        if self._data_parallel is not None:
            self._share_check_failures()
            self._gradients.reduce_over_ranks(self._data_parallel)
        if self._runtime.loss_scale is not None and not self._unscale_and_check():
            return False
        grads = self._gradients
        if grads.owned:  # else nothing to train here (a model without parameters: warned at the build)
            self._optimizer.step(grads.owned, lr, 1.0 / (accumulation * self._world.size), norm_grads=grads.all)
        if self._data_parallel is not None:
            self._data_parallel.share_updated_weights(self._runtime.weights)
        return True

    def _share_check_failures(self):
        """On several ranks, raise on every rank if any rank's check against torch failed in this window.

        A rank builds (and checks) a graph at the first batch of a new shape on that rank alone, so a collective
        in the check could wait for ranks that are not checking; the window's end is where every rank meets
        (its gradient all-reduce, next), so the failure waits for it and one number tells whether any rank
        holds one; only then do the ranks share their messages (distributed.run_together). The update is not
        taken: every rank raises TorchMismatchError naming the ranks whose check failed, and why."""
        if self._graphs is None or self.options.debug.check_against_torch != "error":  # no check can fail
            return
        failure, self._check_failure = self._check_failure, None
        if distributed.any_rank(failure is not None, self._device):
            distributed.run_together(self._world, None if failure is None else functools.partial(_raise, failure),
                                     "the first step's check against torch (debug.check_against_torch)",
                                     verify.TorchMismatchError)  # fmt: skip

    def _unscale_and_check(self):
        """Divide the gradients by the loss scale and let the scaler see whether all are finite."""
        info = self._train_step_info
        info.all_finite = self._gradients.unscale(self._runtime.loss_scale)
        self.options.mixed_precision.loss_scaler.update(info)
        return info.all_finite

    def _learning_rate(self):
        scheduler = self.options.lr_scheduler
        if scheduler is None:
            return self.optim_config.lr
        return scheduler._step(self._train_step_info)[0]

    def _dropout_seed(self, step):
        digest = hashlib.sha256(f"{self._seed}:{step}:{self._world.rank}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    def eval_step(self, *args, **kwargs):
        """Forward only, in inference mode (dropout off, BatchNorm on running statistics)."""
        self._refuse_setting_edits()
        amp.refuse_other_autocast(self.options.mixed_precision, self._device, "eval_step")
        inputs = self._ensure_initialized(args, kwargs)
        self._refuse_module_edits(training=False)
        requested = requested_outputs(self.model_desc, self._train_step_info.fetches)
        if self._runtime.eval_reference is None:
            return packed_outputs(self.model_desc, self._runtime.run_eval(inputs, requested), self._train_step_info.fetches)
        outputs = self._runtime.run_eval(inputs, [entry.name for entry in self.model_desc.outputs])
        self._check_eval_against_torch(inputs, outputs)
        return selected_outputs(self.model_desc, outputs, requested, self._train_step_info.fetches)

    def _check_eval_against_torch(self, inputs, outputs):
        """The built-in check at the first eval_step on a graph (verify.py): the eval graph's ``outputs`` on this
        batch against the module's in eval mode on the same weights; nothing of the trainer's state changes."""
        runtime = self._runtime
        reference, runtime.eval_reference = runtime.eval_reference, None
        output_names = [entry.name for entry in self.model_desc.outputs]
        run_torch = self._as_the_graphs_compute(functools.partial(
            verify.torch_eval, reference.module, self.loss_fn, reference.forward_names, inputs, output_names=output_names,
            constants=reference.constants))  # fmt: skip
        ort = verify.StepResult(dict(zip(output_names, outputs)), {})
        where = graph_errors.where_in_graph(runtime.onnx_model, output_names)
        mode = self.options.debug.check_against_torch
        verify.check(ort, run_torch, runtime.weights, self._checked_dtype(), where, mode, subject=verify.FIRST_EVAL)

    def _as_the_graphs_compute(self, run_torch):
        """``run_torch`` (torch's side of a check) in the precision the graphs compute in: under torch.autocast for
        bfloat16 mixed precision, whose policy the graphs were traced with."""
        return amp.under_torch_autocast(self.options.mixed_precision, self._device, run_torch)

    def _checked_dtype(self):
        """The dtype ONNX Runtime computed in, which sets the checks' tolerance (verify.Comparison)."""
        return amp.compute_dtype(self.options.mixed_precision)

    # ------------------------------------------------------------- state dict
    def state_dict(self, pytorch_format=False):
        """The trainer's state in the legacy layout (numpy arrays), or with ``pytorch_format``
        the flat {name: tensor} that the torch module's ``load_state_dict`` accepts. Before the first
        step: the state a load is waiting to apply (of a checkpoint, its tensors are
        ``checkpoint.StoredTensor``, which ``np.asarray`` reads), else {}."""
        if self._runtime is None:
            warnings.warn(
                "ONNX Runtime training session is not initialized yet. Please run train_step or eval_step "
                "at least once before calling ORTTrainer.state_dict()."
            )
            return self._load_state_dict.args[0] if self._load_state_dict is not None else {}
        return self._state.pytorch() if pytorch_format else self._state.capture()

    def sync_to_module(self):
        """Nothing to do: the trainer trains the module's own tensors in place, so after every step the module holds
        the trained weights and buffers. Kept for code written when the trainer trained a copy."""

    @property
    def _state(self):
        return TrainerState(self._runtime, self._gradients, self._optimizer, self.options, self.optim_config.name,
                            self._data_parallel, self._world, self._train_step_info, self._seed)  # fmt: skip

    def load_state_dict(self, state_dict, strict=True):
        """Restore weights, optimizer state and step counters from a ``state_dict()``.

        Before the first step the dict is kept and applied when the sessions are built.
        Everything is checked first (keys when ``strict``, shapes, dtypes, optimizer name), so a
        bad dict leaves the trainer unchanged; then each value is copied into the trainer's own
        tensor (no second copy of the state).
        """
        if self._runtime is None:
            if self._torch_model is not None:
                check_against_module(state_dict, self._torch_model, strict)
            self._load_state_dict = functools.partial(self._apply_state_dict, state_dict, strict)
            return
        self._apply_state_dict(state_dict, strict)

    def _apply_state_dict(self, state_dict, strict):
        self._seed = self._state.restore(state_dict, strict)
        self._load_state_dict = None

    def save_checkpoint(self, path, user_dict=None, include_optimizer_states=True, overwrite=False, consolidate=False):
        """Write ``state_dict()`` (+ ``user_dict``, stored natively, never pickled) to an HDF5 file atomically.

        On several ranks the weights are the same everywhere, so rank 0 writes; under ZeRO each
        rank holds part of the optimizer state: every rank writes its own file (put ``{rank}`` in
        ``path``), or with ``consolidate=True`` the parts are merged into one single-process
        checkpoint. All ranks must call this at the same step, one that completes a gradient-
        accumulation window; if any rank's write fails, every rank raises ``RankWriteError``.
        """
        # written at once: views of the trainer's tensors, not a second copy of the model's state
        state = self._state.capture(copies=False) if self._runtime is not None else dict(self.state_dict())
        if not include_optimizer_states:
            state.pop("optimizer", None)
        if user_dict:
            state["user_dict"] = user_dict
        write_checkpoint(state, path, self._world, self._data_parallel, self._train_step_info.step, overwrite, consolidate)

    def load_checkpoint(self, *paths, strict=True, allow_pickle=False):
        """Load a checkpoint written by ``save_checkpoint`` (or by the legacy ORTTrainer); return its user_dict.

        One file is checked whole first (every tensor read once against the checksum saved with it; a corrupt
        or truncated file raises ``CheckpointError`` naming the file and the tensor), then its names, shapes and
        dtypes against the trainer's; only then is each tensor read from the file into the trainer's own, one at a
        time, so a resume needs no memory beyond training's. Before the first step the file stays open until the
        build applies it. Per-rank ZeRO checkpoints (several paths) are read whole and aggregated first. A legacy
        pickled user_dict is only unpickled with ``allow_pickle=True``. All ranks must call this together and
        read the same values; if a rank cannot, every rank raises ``CheckpointError`` and none loads.
        """
        state, user_dict = read_checkpoint(paths, self._world, allow_pickle)
        try:
            self.load_state_dict(state, strict=strict)
        except RuntimeError as error:
            raise RuntimeError(f"checkpoint {', '.join(map(str, paths))} does not fit this trainer: {error}") from error
        return user_dict

    # ----------------------------------------------------------------- export
    def save_as_onnx(self, path, with_loss=True, external_data=None):
        """Write the model with the current weights as an inference graph (dropout off, BatchNorm on
        running statistics) that runs in a plain ``onnxruntime.InferenceSession``.

        ``with_loss=True`` (the legacy form) keeps the label input and returns the loss first;
        ``with_loss=False`` keeps only the model's own inputs and outputs. ``external_data``: the weights
        in a file beside ``path`` ('<path>.data', ONNX's external data), which a model past 2 GiB needs and
        gets by default (None); True or False choose.
        """
        if self._runtime is None:
            raise RuntimeError(
                "save_as_onnx needs the graph that the first train_step or eval_step builds from a batch; run one "
                "(e.g. trainer.eval_step(*batch) right after load_checkpoint) before saving"
            )
        onnx_file.save(self._runtime.inference_model(with_loss), self._runtime.weights, path, external_data)


class GradientSource:
    """An ORTTrainer's forward and backward without its update, for a loop whose own optimizer updates
    (``orttrainer.hf.Trainer``): each run's outputs and the gradients of the trained weights, the mean over the
    ranks as DistributedDataParallel's, in buffers the next run overwrites."""

    def __init__(self, model, device_id: str, runs_before: int = 0, bfloat16: bool = False):
        """``runs_before``: the runs an uninterrupted job would have taken before this one's first (a resumed
        job's), which seed dropout as they would have. ``bfloat16``: computing as under torch.autocast with bfloat16
        (options mixed_precision.dtype torch.bfloat16)."""
        options = {"device": {"id": device_id}}
        if bfloat16:
            options["mixed_precision"] = {"enabled": True, "dtype": torch.bfloat16}
        self._trainer = ORTTrainer(model, None, SGDConfig(lr=0.0), options=ORTTrainerOptions(options))
        self._trainer._train_step_info.step = runs_before

    @property
    def runs(self) -> int:
        """The runs taken so far, ``runs_before`` included."""
        return self._trainer._train_step_info.step

    def forward_backward(self, inputs: dict):
        """(The outputs for keyword ``inputs``, as ``train_step`` returns them; {trained weight name: gradient})."""
        trainer = self._trainer
        outputs, _, _ = trainer._forward_backward((), inputs)
        gradients = trainer._gradients
        if trainer._data_parallel is not None:
            gradients.reduce_over_ranks(trainer._data_parallel)
            torch._foreach_div_(gradients.all, float(trainer._world.size))
        return outputs, gradients.sums
