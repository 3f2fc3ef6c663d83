"""``orttrainer.hf.Trainer``: ``transformers.Trainer`` with its forward and backward run by orttrainer.

A ``Trainer`` script changes one import. The subclass replaces only what computes the training loss's
gradients: ``compute_loss`` calls the model through an ORTTrainer built on the same module (trained in
place, so the module *is* the trained model) and returns a loss whose ``backward()`` hands the graph's
gradients to autograd, which sums them into each parameter's ``.grad`` as torch's backward would. The rest
is ``Trainer``'s own: the optimizer (any ``optim``), ``max_grad_norm`` clipping, the scheduler, gradient
accumulation (the loss divided as ``Trainer`` divides it), logging, callbacks, checkpoints and resume, and
evaluation and prediction, which run the module in torch. What would train something other than
``transformers.Trainer`` does is refused by argument name when the trainer is created (``_refusals``).

Needs ``pip install 'orttrainer[hf]'`` (transformers and accelerate); the core package does not import it.
"""

import torch
import transformers

from .trainer import GradientSource


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` (same constructor and ``TrainingArguments``) training through orttrainer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        refused = _refusals(self)
        if refused:
            raise ValueError(f"orttrainer.hf.Trainer cannot honour {'; '.join(refused)}")
        self._graph_runner = None  # a GradientSource, made at the first training step (the model is on its device then)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``Trainer.compute_loss`` with the model's forward and backward in ONNX Runtime when training (grad mode
        on, model in train mode); evaluation and prediction run the module itself."""
        if not (torch.is_grad_enabled() and model.training):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return super().compute_loss(self._forward_through_graph, inputs, return_outputs, num_items_in_batch)

    def _forward_through_graph(self, **inputs):
        """The model's outputs for ``inputs`` from orttrainer's training graph, with a ``loss`` whose backward
        passes the graph's gradients of it to the parameters."""
        runner = self._runner()
        outputs, gradients = runner.forward_backward(inputs)
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        trained = [parameters[name] for name in gradients]
        loss_at = "loss" if isinstance(outputs, dict) else 0  # a ModelOutput, or a tuple (return_dict=False): loss first
        loss = _GraphLoss.apply(outputs[loss_at], (runner, runner.runs, list(gradients.values())), *trained)
        if isinstance(outputs, dict):
            outputs["loss"] = loss
            return outputs
        return (loss, *outputs[1:])

    def _runner(self) -> GradientSource:
        """orttrainer's forward and backward over ``self.model``: no update of its own (``Trainer``'s optimizer makes
        it), one graph run per micro-batch (``Trainer`` accumulates in ``.grad``), dropout seeded by the micro-batch's
        count as an uninterrupted run would have it, so that a resumed run draws the same masks."""
        if self._graph_runner is None:
            runs_before = self.state.global_step * self.args.gradient_accumulation_steps
            self._graph_runner = GradientSource(self.model, str(self.args.device), runs_before, bfloat16=self.args.bf16)
        return self._graph_runner


class _GraphLoss(torch.autograd.Function):
    """The graph's loss as an autograd node over the trained parameters: backward returns the gradients the graph
    computed, times the gradient arriving at the loss (``Trainer``'s division for accumulation, a loss scale)."""

    @staticmethod
    def forward(ctx, loss, run, *parameters):
        ctx.run = run
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        runner, run, gradients = ctx.run
        if runner.runs != run:
            raise RuntimeError(
                "backward() of an orttrainer.hf.Trainer loss after a later training forward: its gradients were in "
                "buffers that forward overwrote. Call backward on each loss before computing the next one"
            )
        return (None, None, *(grad * grad_loss.to(grad.dtype) for grad in gradients))


_REFUSED_OPTIMIZERS = {"lomo", "adalomo"}  # they update inside backward, on gradients orttrainer hands over at once


def _refusals(trainer: transformers.Trainer) -> list:
    """What of ``trainer``'s arguments orttrainer cannot honour, each naming the argument and why."""
    args, refused = trainer.args, []
    if args.deepspeed or getattr(trainer, "is_deepspeed_enabled", False):
        refused.append(f"TrainingArguments.deepspeed={args.deepspeed!r}: DeepSpeed runs its own engine around the "
                       "module's forward and backward; use torchrun data parallelism (the default when launched)")
    if args.fsdp or getattr(trainer, "is_fsdp_enabled", False):
        refused.append(f"TrainingArguments.fsdp={args.fsdp!r}: FSDP shards the weights the graph reads whole")
    if args.fp16:
        refused.append("TrainingArguments.fp16=True: transformers.Trainer computes under torch.autocast with float16 "
                       "(without a loss scale on the CPU), orttrainer's float16 converts the whole graph and scales the "
                       "loss: another computation; use bf16=True (torch.autocast with bfloat16, which orttrainer follows)")
    if args.torch_compile:
        refused.append("TrainingArguments.torch_compile=True: the forward runs in ONNX Runtime, not torch.compile")
    if str(args.optim).lower().split(".")[-1] in _REFUSED_OPTIMIZERS:
        refused.append(f"TrainingArguments.optim={args.optim!r}: it updates inside backward; choose another optim "
                       "(e.g. 'adamw_torch')")
    if args.label_smoothing_factor:
        refused.append(f"TrainingArguments.label_smoothing_factor={args.label_smoothing_factor}: the smoothed loss is "
                       "computed outside the model from its logits, which the graph returns without a gradient")
    if trainer.compute_loss_func is not None:
        refused.append("compute_loss_func: a loss computed outside the model from its outputs, which the graph "
                       "returns without a gradient; compute the loss in the model's forward (labels=)")
    if args.n_gpu > 1:
        refused.append(f"{args.n_gpu} GPUs in one process (torch.nn.DataParallel): launch one process per GPU with "
                       "torchrun instead")
    return refused
