"""transformers' sparse mixtures of experts (Mixtral, Qwen2-MoE) trained in the experts implementation the user has.

transformers' default, "grouped_mm", and its "eager" loop route each batch's tokens in Python; the trainer traces
"batched_mm" in their place (export/experts.py), which computes the same experts for every routing. Batches that
reach other experts than the one the graph was traced from must train as torch does: losses (the router's
load-balancing loss included), outputs, and every state_dict key, the routers' weights among them, as close to a
float64 torch loop as float32 torch is; then eval_step. The user's model keeps its implementation and config.
"""

import copy

import pytest
import torch
import zoo
from parity import (assert_outputs_within_float32_error, cpu_options, float64_batch, float64_copy,
                    train_keywords_like_torch)

from orttrainer import ExportError, ORTTrainer, optim

LR = 0.1
# 8 experts, 2 per token, batches of 2 x 3 tokens: each batch hits only some experts of a layer
_EXPERTS, _BATCH, _LENGTH, _STEPS = 8, 2, 3, 4


def _transformers():
    return pytest.importorskip("transformers", reason="Hugging Face models need transformers (the test extra)")


def _mixtral():
    """The zoo's Mixtral with 8 experts and the router's load-balancing loss (a tenth of it) in the loss."""
    _transformers()
    return zoo.mixtral_lm(num_local_experts=_EXPERTS, output_router_logits=True, router_aux_loss_coef=0.1)


def _qwen2_moe():
    """Qwen2-MoE: 8 routed experts beside a shared expert behind a sigmoid gate, the top-2 weights not renormalized,
    and the router's load-balancing loss (a tenth of it) in the loss."""
    transformers = _transformers()
    config = transformers.Qwen2MoeConfig(vocab_size=zoo.VOCAB, hidden_size=32, intermediate_size=37,
                                         moe_intermediate_size=20, shared_expert_intermediate_size=24,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, num_experts=_EXPERTS, num_experts_per_tok=2,
                                         output_router_logits=True, router_aux_loss_coef=0.1, use_cache=False,
                                         pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return transformers.Qwen2MoeForCausalLM(config)


def _batches(masked: bool):
    """Batches of one shape (one graph serves them all), with or without an attention mask: without one the
    load-balancing loss counts each expert's tokens with torch.histc, with one with scatter_add_."""
    generator = torch.Generator().manual_seed(7)
    batches = [zoo.causal_lm_batch(_BATCH, _LENGTH, generator=generator) for _ in range(_STEPS + 1)]
    if not masked:
        batches = [{key: value for key, value in batch.items() if key != "attention_mask"} for batch in batches]
    return batches[:-1], batches[-1]


def _experts_hit(model, batches) -> list:
    """[{(layer, expert) the router of ``model`` sends a token of the batch to}] per batch, by a run of ``model``."""
    hit, layers = set(), [layer for layer in model.modules() if type(layer).__name__.endswith("Experts")]
    hooks = [layer.register_forward_hook(lambda module, args, output, index=index: hit.update(
        (index, expert) for expert in args[1].flatten().tolist())) for index, layer in enumerate(layers)]  # fmt: skip
    found = []
    with torch.no_grad():
        for batch in batches:
            hit.clear()
            model(**batch)
            found.append(set(hit))
    for hook in hooks:
        hook.remove()
    assert len(layers) == 2, f"{len(layers)} experts layers"
    return found


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"], ids=["default-grouped-mm", "eager"])
@pytest.mark.parametrize("make, masked", [(_mixtral, False), (_qwen2_moe, True)], ids=["mixtral", "qwen2-moe"])
def test_trains_like_torch_on_batches_routed_to_other_experts(make, masked, implementation):
    torch.manual_seed(0)
    model = make()
    if implementation != "grouped_mm":
        model.set_experts_implementation(implementation)
    assert model.get_experts_implementation() == {"": implementation}
    config = model.config.to_dict()
    batches, eval_batch = _batches(masked)
    hit = _experts_hit(model, [*batches, eval_batch])
    assert all(hit[index] - hit[0] for index in range(1, len(hit))), f"a batch hits no expert the first does not: {hit}"

    reference, reference64 = copy.deepcopy(model), float64_copy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    train_keywords_like_torch(trainer, reference, reference64, batches, LR, assert_outputs_within_float32_error)
    reference.eval()
    reference64.eval()
    with torch.no_grad():
        expected, expected64 = reference(**eval_batch), reference64(**float64_batch(eval_batch))
    outputs = trainer.eval_step(**eval_batch)
    assert outputs.aux_loss > 0 and len(outputs.router_logits) == 2
    assert_outputs_within_float32_error(outputs, expected, expected64, "eval_step")

    assert model.get_experts_implementation() == {"": implementation}
    assert model.config.to_dict() == config


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "batched_mm"])
def test_the_trace_runs_batched_mm_and_gives_the_users_implementation_back_after_a_failure(implementation):
    """Inside the trace's block the experts run "batched_mm"; on the way out, of a failed export too, the model has
    the implementation it had."""
    from orttrainer.export.experts import traced_for_every_routing

    model = _mixtral()
    model.set_experts_implementation(implementation)
    with pytest.raises(ExportError, match="failed inside"):
        with traced_for_every_routing(model):
            assert model.get_experts_implementation() == {"": "batched_mm"}
            assert model.model.get_experts_implementation() == {"": "batched_mm"}
            raise ExportError("failed inside")
    assert model.get_experts_implementation() == model.model.get_experts_implementation() == {"": implementation}


def test_an_experts_implementation_the_trainer_does_not_replace_is_refused_with_the_fix():
    """An implementation registered under a name of its own is traced as it is: this one, transformers' grouped_mm
    under another name, fails at torch's grouped matmul, and the error names the implementation and the call that
    makes the model train."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward

    ALL_EXPERTS_FUNCTIONS["sorted_by_expert"] = grouped_mm_experts_forward
    try:
        model = _mixtral()
        model.set_experts_implementation("sorted_by_expert")
        trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
        with pytest.raises(ExportError, match=r"aten::_grouped_mm.*MixtralForCausalLM computes its experts in "
                                              r"transformers' 'sorted_by_expert' experts implementation.*call "
                                              r"model.set_experts_implementation\('batched_mm'\)"):  # fmt: skip
            trainer.train_step(**zoo.causal_lm_batch(_BATCH, _LENGTH, generator=torch.Generator().manual_seed(0)))
        assert model.get_experts_implementation() == {"": "sorted_by_expert"}
    finally:
        del ALL_EXPERTS_FUNCTIONS["sorted_by_expert"]
