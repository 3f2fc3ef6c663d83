"""transformers' mixture-of-experts layers traced in a form that computes every routing as torch does.

transformers computes the experts of its mixture-of-experts models (the layers it builds with
``use_experts_implementation``: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and more) in the implementation
the model's config names. Its default, "grouped_mm", sorts each expert's tokens together and counts them with
torch.histc into the offsets of a grouped matmul, which the exporter cannot write; "eager" loops in Python over the
experts the batch hits, which a trace would unroll for the routing of its batch alone.

So the trace runs ``every_expert_forward``, registered in transformers' experts interface under the name
"orttrainer_every_expert" for the trace only, where the model runs "eager" or "grouped_mm": every expert computes
every token (one batched matmul over the stacked experts per projection) and each token sums the outputs of the
experts its router chose, weighted as the others weight them. That is the same experts, weights and sum for every
routing, in ops a trace records as they are, and no per-token copy of any weight (transformers' "batched_mm",
which gathers the chosen experts' weights for every token, is traced as it is where the user chose it). The model
gets its own implementation back right after: torch, and the first step's check against it (verify.py), run what
the user chose. An implementation of another name (a kernel, the user's own) is traced as it is.
"""

import contextlib

import torch

from .refusals import ExportError

_ROUTING_DEPENDENT = ("eager", "grouped_mm")
_EVERY_EXPERT = "orttrainer_every_expert"


def every_expert_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """transformers' experts forward (``self`` an experts layer, ``hidden_states`` [tokens, hidden], the experts
    each token's router chose and their weights [tokens, k]) computed by every expert for every token: the sum over
    the chosen experts of weight x down(gate(up(x))), bias terms, gating and post-expert norm as the layer has them.

    What an expert computes for a token that did not choose it is selected away (Where) after the up projection
    and again after the down one, before it can reach the result or a gradient: an overflow there, inf or NaN,
    trains as torch, which never computes it. The up projection of an expert no token chose is zeroed too: its
    weights, whatever their values, then take no part in the tokens' gradients (0 x inf would be NaN)."""
    if self._is_expert_parallel:
        raise ExportError(f"{type(self).__name__} is sharded over devices (transformers' expert parallelism), "
                          "which orttrainer does not train: train the model on one device")  # fmt: skip
    experts = torch.arange(self.num_experts, device=top_k_index.device)
    chosen = top_k_index.unsqueeze(-1) == experts  # [tokens, k, experts]
    routed = chosen.any(dim=1).T.unsqueeze(-1)  # [experts, tokens, 1]: the token chose the expert
    routing_weights = torch.where(chosen, top_k_weights.unsqueeze(-1), 0).sum(dim=1).T.unsqueeze(-1)
    up, up_bias = ("gate_up_proj", "gate_up_proj_bias") if self.has_gate else ("up_proj", "up_proj_bias")
    reached = routed.any(dim=1, keepdim=True)  # [experts, 1, 1]: some token chose the expert
    projected = _every_expert_linear(self, hidden_states, torch.where(reached, getattr(self, up), 0), up_bias)
    projected = torch.where(routed, projected, 0)
    activated = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    outputs = torch.where(routed, _every_expert_linear(self, activated, self.down_proj, "down_proj_bias"), 0)
    if self.has_post_expert_norm:
        outputs = self.post_expert_norm(outputs)
    return (outputs * routing_weights).sum(dim=0).to(hidden_states.dtype)


def _every_expert_linear(layer, inputs: torch.Tensor, weight: torch.Tensor, bias_name: str) -> torch.Tensor:
    """``inputs`` ([tokens, in], or [experts, tokens, in]) through each expert's projection ``weight`` ([experts,
    out, in], or [experts, in, out] in a layer of transposed weights) plus the bias ``bias_name`` if the layer has
    them: [experts, tokens, out]."""
    projected = torch.matmul(inputs, weight if layer.is_transposed else weight.transpose(-2, -1))
    return projected + getattr(layer, bias_name).unsqueeze(-2) if layer.has_bias else projected


@contextlib.contextmanager
def traced_for_every_routing(model: torch.nn.Module):
    """During the block, every transformers model in ``model`` computes the experts it computes in "eager" or
    "grouped_mm" in ``every_expert_forward``; afterwards each has the implementations it had (its config and
    sub-configs') and transformers' experts interface no longer holds the name."""
    chosen = [(layer, layer.get_experts_implementation()) for layer in _experts_choosers(model)]
    switched = [(layer, implementations) for layer, implementations in chosen
                if any(value in _ROUTING_DEPENDENT for value in implementations.values())]  # fmt: skip
    if not switched:
        yield
        return
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS[_EVERY_EXPERT] = every_expert_forward
    try:
        for layer, implementations in switched:  # outer models first: they set their inner ones too
            layer.set_experts_implementation({key: _EVERY_EXPERT if value in _ROUTING_DEPENDENT else value
                                              for key, value in implementations.items()})  # fmt: skip
        yield
    finally:
        for layer, implementations in switched:
            layer.set_experts_implementation(implementations)
        del ALL_EXPERTS_FUNCTIONS[_EVERY_EXPERT]


def other_implementations(model: torch.nn.Module) -> list:
    """The experts implementations in ``model`` that the trace runs as they are and that may hold what the exporter
    cannot write (neither "eager" nor "grouped_mm", which it replaces, nor "batched_mm"), each once, or []."""
    names = [value for layer in _experts_choosers(model) for value in layer.get_experts_implementation().values()]
    return sorted({name for name in names if name not in (*_ROUTING_DEPENDENT, "batched_mm", None)})


def _experts_choosers(model: torch.nn.Module) -> list:
    """The modules of ``model`` that choose an experts implementation (transformers' PreTrainedModel), outer first."""
    return [layer for layer in model.modules()
            if callable(getattr(layer, "get_experts_implementation", None))
            and callable(getattr(layer, "set_experts_implementation", None))]  # fmt: skip
