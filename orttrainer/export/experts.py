"""transformers' mixture-of-experts layers traced in a form that computes every routing as torch does.

transformers computes the experts of its mixture-of-experts models (the layers it builds with
``use_experts_implementation``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and more) in the implementation
the model's config names. Its default, "grouped_mm", sorts each expert's tokens together and counts them with
torch.histc into the offsets of a grouped matmul, which the exporter cannot write; "eager" loops in Python over the
experts the batch hits, which a trace would unroll for the routing of its batch alone. transformers' "batched_mm"
gathers, for each token, the weights of the experts its router chose and multiplies them batched: the same experts,
routing weights and sum as the other two for every routing, in ops a trace records as they are.

So the trace runs "batched_mm" where the model runs "eager" or "grouped_mm", and the model gets its own
implementation back right after: torch, and the first step's check against it (verify.py), run what the user chose.
An implementation of another name (a kernel, the user's own) is traced as it is.
"""

import contextlib

import torch

_ROUTING_DEPENDENT = ("eager", "grouped_mm")
_FOR_EVERY_ROUTING = "batched_mm"


@contextlib.contextmanager
def traced_for_every_routing(model: torch.nn.Module):
    """During the block, every transformers model in ``model`` computes the experts it computes in "eager" or
    "grouped_mm" in "batched_mm"; afterwards each has the implementations it had (its config and sub-configs')."""
    chosen = [(layer, layer.get_experts_implementation()) for layer in _experts_choosers(model)]
    switched = [(layer, implementations) for layer, implementations in chosen
                if any(value in _ROUTING_DEPENDENT for value in implementations.values())]  # fmt: skip
    try:
        for layer, implementations in switched:  # outer models first: they set their inner ones too
            layer.set_experts_implementation({key: _FOR_EVERY_ROUTING if value in _ROUTING_DEPENDENT else value
                                              for key, value in implementations.items()})  # fmt: skip
        yield
    finally:
        for layer, implementations in switched:
            layer.set_experts_implementation(implementations)


def other_implementations(model: torch.nn.Module) -> list:
    """The experts implementations in ``model`` that the trace runs as they are (neither the ones it replaces nor
    "batched_mm"), each once, or []."""
    names = [value for layer in _experts_choosers(model) for value in layer.get_experts_implementation().values()]
    return sorted({name for name in names if name not in (*_ROUTING_DEPENDENT, _FOR_EVERY_ROUTING, None)})


def _experts_choosers(model: torch.nn.Module) -> list:
    """The modules of ``model`` that choose an experts implementation (transformers' PreTrainedModel), outer first."""
    return [layer for layer in model.modules()
            if callable(getattr(layer, "get_experts_implementation", None))
            and callable(getattr(layer, "set_experts_implementation", None))]  # fmt: skip
