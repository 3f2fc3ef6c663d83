"""transformers' sparse mixtures of experts (Mixtral, Qwen2-MoE) trained in the experts implementation the user has.

transformers' default, "grouped_mm", and its "eager" loop route each batch's tokens in Python; the trainer traces
every expert computing every token in their place (export/experts.py), each token summing the outputs of the
experts it chose. Batches that reach other experts than the one the graph was traced from must train as torch
does: losses (the router's load-balancing loss included), outputs, and every state_dict key, the routers' weights
among them, as close to a float64 torch loop as float32 torch is; then eval_step. So must every variant of
transformers' experts layers (bias terms, transposed weights, no gate, custom gates, a post-expert norm), and an
expert whose output overflows for the tokens that did not choose it. The user's model keeps its implementation and
config.
"""

import pytest
import torch
import zoo
import torch.nn.functional as F
from parity import (assert_within_float32_error, cpu_options, keywords_trained_and_evaluated_like_torch,
                    run_parity)

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


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager", "batched_mm"],
                         ids=["default-grouped-mm", "eager", "batched-mm-kept"])
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

    _, outputs, _, _, _, _ = keywords_trained_and_evaluated_like_torch(model, batches, eval_batch, LR)
    assert outputs.aux_loss > 0 and len(outputs.router_logits) == 2

    assert model.get_experts_implementation() == {"": implementation}
    assert model.config.to_dict() == config


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
def test_the_trace_computes_every_expert_and_gives_the_users_implementation_back_after_a_failure(implementation):
    """Inside the trace's block the experts run orttrainer's implementation, registered in transformers' experts
    interface; on the way out, of a failed export too, the model has the implementation it had and the interface no
    longer holds orttrainer's."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from orttrainer.export.experts import every_expert_forward, traced_for_every_routing

    model = _mixtral()
    model.set_experts_implementation(implementation)
    with pytest.raises(ExportError, match="failed inside"):
        with traced_for_every_routing(model):
            assert model.get_experts_implementation() == {"": "orttrainer_every_expert"}
            assert model.model.get_experts_implementation() == {"": "orttrainer_every_expert"}
            assert ALL_EXPERTS_FUNCTIONS["orttrainer_every_expert"] is every_expert_forward
            raise ExportError("failed inside")
    assert model.get_experts_implementation() == model.model.get_experts_implementation() == {"": implementation}
    assert "orttrainer_every_expert" not in ALL_EXPERTS_FUNCTIONS


def test_batched_mm_chosen_by_the_user_is_traced_as_it_is():
    from orttrainer.export.experts import traced_for_every_routing

    model = _mixtral()
    model.set_experts_implementation("batched_mm")
    with traced_for_every_routing(model):
        assert model.get_experts_implementation() == {"": "batched_mm"}


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
                                              r"model.set_experts_implementation\('grouped_mm'\)"):  # fmt: skip
            trainer.train_step(**zoo.causal_lm_batch(_BATCH, _LENGTH, generator=torch.Generator().manual_seed(0)))
        assert model.get_experts_implementation() == {"": "sorted_by_expert"}
    finally:
        del ALL_EXPERTS_FUNCTIONS["sorted_by_expert"]


class _RoutedExperts(torch.nn.Module):
    """A transformers experts layer behind a softmax top-k router (a linear map, trained; the top k renormalized, as
    Mixtral's), choosing its experts implementation through get/set_experts_implementation as transformers' models
    do, so that the trainer traces it as it traces theirs: forward(hidden_states [tokens, hidden]) -> [tokens, hidden].
    The hidden states are scaled first by a trained vector (ones at first), which their gradient reaches, as in a
    model the layers before the experts."""

    def __init__(self, experts: torch.nn.Module, hidden: int, top_k: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(hidden))
        self.router = torch.nn.Linear(hidden, experts.num_experts, bias=False)
        self.experts, self.top_k = experts, top_k

    def get_experts_implementation(self) -> dict:
        return {"": self.experts.config._experts_implementation}

    def set_experts_implementation(self, implementation):
        self.experts.config._experts_implementation = implementation

    def forward(self, hidden_states):
        hidden_states = hidden_states * self.scale
        weights, index = self.router(hidden_states).softmax(dim=-1).topk(self.top_k)
        return self.experts(hidden_states, index, weights / weights.sum(dim=-1, keepdim=True))


_HIDDEN, _INTERMEDIATE = 8, 12  # rows of whole 16 bytes: torch's grouped matmul takes no others
# each variant of transformers' experts layers: (its model, config and experts layer, the config's keywords)
_VARIANTS = {
    "default-gate": ("mixtral", "MixtralConfig", "MixtralExperts",
                     dict(hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE, num_local_experts=_EXPERTS)),
    "transposed-bias-interleaved-clamped-gate": ("gpt_oss", "GptOssConfig", "GptOssExperts",
                                                 dict(hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE,
                                                      num_local_experts=_EXPERTS, swiglu_limit=0.5)),
    "transposed": ("aria", "AriaTextConfig", "AriaExperts",
                   dict(hidden_size=_HIDDEN, intermediate_size=_INTERMEDIATE, moe_num_experts=_EXPERTS,
                        num_attention_heads=2)),
    "no-gate-relu2": ("nemotron_h", "NemotronHConfig", "NemotronHExperts",
                      dict(hidden_size=_HIDDEN, moe_intermediate_size=_INTERMEDIATE, n_routed_experts=_EXPERTS)),
    "post-expert-norm": ("muse_spark", "MuseSparkTextConfig", "MuseSparkExperts",
                         dict(moe_hidden_size=_HIDDEN, moe_intermediate_size=_INTERMEDIATE,
                              num_local_experts=_EXPERTS)),
}  # fmt: skip


def _variant(name: str, implementation: str) -> _RoutedExperts:
    """The experts layer of ``name`` (_VARIANTS) in ``implementation`` behind a router, every weight and bias drawn
    from N(0, 0.5) (the layers leave them uninitialized), a post-expert norm's scale too."""
    import importlib

    transformers = _transformers()
    model, config_class, layer, sizes = _VARIANTS[name]
    config = getattr(transformers, config_class)(**sizes)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    experts = getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), layer)(config)
    routed = _RoutedExperts(experts, _HIDDEN, top_k=2)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.normal_(0, 0.5)
    return routed


def _mse_sgd_parity(model, batches, lr):
    """run_parity of ``model`` on ``batches`` ((hidden, target) pairs): MSE loss, SGD at ``lr``, against float64."""
    return run_parity(model, batches, optim.SGDConfig(lr=lr), lambda parameters: torch.optim.SGD(parameters, lr=lr),
                      loss_fn=F.mse_loss, float64=True)  # fmt: skip


def _hit_per_batch(model: _RoutedExperts, batches) -> list:
    """{expert the router sends a token of the batch to} per batch."""
    with torch.no_grad():
        return [set(model.router(hidden).topk(model.top_k).indices.flatten().tolist()) for hidden, _ in batches]


@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_every_variant_of_transformers_experts_trains_like_torch(variant, implementation):
    """Bias terms, weights stored transposed, gate and up interleaved, a clamped gate, no gate (relu2), a norm after
    each expert: four SGD steps on batches of 4 tokens (each reaching experts the first does not), every state_dict
    key within float32 torch's distance from float64, then eval_step."""
    model = _variant(variant, implementation)
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, _HIDDEN, generator=generator), torch.randn(4, _HIDDEN, generator=generator))
               for _ in range(_STEPS)]  # fmt: skip
    hit = _hit_per_batch(model, batches)
    assert all(hit[index] - hit[0] for index in range(1, len(hit))), f"a batch hits no expert the first does not: {hit}"

    trainer, reference, reference64 = _mse_sgd_parity(model, batches, LR)
    hidden, target = batches[0]
    with torch.no_grad():
        expected, expected64 = reference(hidden), reference64(hidden.double())
    assert_within_float32_error(trainer.eval_step(hidden, target)[1], expected, expected64, "eval_step")
    assert model.get_experts_implementation() == {"": implementation}


# Experts of the boundary model: 2 reached by no token and holding inf and NaN; 3 chosen by the tokens whose first
# feature is 0, its up projection 1e38 x that feature (inf for the others, whose first feature is 5)
_UNREACHED, _OVERFLOWING = 2, 3
_BOUNDARY_LR = 0.01  # small enough that the steps keep the router's choices as set


def _overflowing_experts() -> _RoutedExperts:
    """Mixtral's experts in "eager" behind a router whose choice of expert 3 hangs on the first feature (0: chosen
    first; 5: never) and that never chooses expert 2 (the second feature is always 1)."""
    model = _variant("default-gate", "eager")
    with torch.no_grad():
        model.router.weight[_OVERFLOWING, :2] = torch.tensor([-10.0, 5.0])
        model.router.weight[_UNREACHED, :2] = torch.tensor([0.0, -20.0])
        model.experts.gate_up_proj[_OVERFLOWING, :, 0] = 1e38
        model.experts.gate_up_proj[_UNREACHED, 0, :2] = torch.tensor([float("inf"), float("nan")])
        model.experts.down_proj[_UNREACHED, 0, 0] = float("-inf")
    return model


def _boundary_batches(first_features: list) -> list:
    """Batches of 4 tokens, the first feature of each batch's tokens as ``first_features`` gives, the second 1."""
    generator = torch.Generator().manual_seed(2)
    batches = []
    for features in first_features:
        hidden = torch.randn(4, _HIDDEN, generator=generator)
        hidden[:, 0], hidden[:, 1] = torch.tensor(features), 1.0
        batches.append((hidden, torch.randn(4, _HIDDEN, generator=generator)))
    return batches


def test_an_expert_overflowing_for_the_tokens_that_did_not_choose_it_trains_like_torch():
    """Expert 3 computes inf for the tokens that did not choose it, expert 2 (chosen by none) holds inf and NaN: torch
    never computes either, and neither may reach the loss, the outputs or any gradient of the trainer: the same
    finite losses and state_dict (the non-finite weights staying as they are) over three steps."""
    model = _overflowing_experts()
    batches = _boundary_batches([[0.0, 5.0, 5.0, 0.0], [5.0, 5.0, 0.0, 5.0], [0.0, 0.0, 5.0, 5.0]])
    hit = _hit_per_batch(model, batches)
    assert all(_OVERFLOWING in experts and _UNREACHED not in experts for experts in hit), hit
    with torch.no_grad():
        assert (model.experts.gate_up_proj[_OVERFLOWING] @ batches[0][0][1]).isinf().all()  # token 1 did not choose it

    trainer, reference, _ = _mse_sgd_parity(model, batches, _BOUNDARY_LR)
    state = trainer.state_dict(pytorch_format=True)
    trained = [state["scale"], state["router.weight"], *(state[f"experts.{name}"][[0, 1, *range(3, _EXPERTS)]]
                                                        for name in ("gate_up_proj", "down_proj"))]  # fmt: skip
    assert all(weights.isfinite().all() for weights in trained), trained
    unreached = state["experts.gate_up_proj"][_UNREACHED, 0, :2]
    assert unreached[0].isinf() and unreached[1].isnan() and state["experts.down_proj"][_UNREACHED, 0, 0].isinf()
    hidden, target = batches[0]
    with torch.no_grad():
        expected = reference(hidden)
    assert torch.isfinite(expected).all()
    torch.testing.assert_close(trainer.eval_step(hidden, target)[1], expected)


def test_an_expert_overflowing_for_a_token_that_chose_it_gives_nan_where_torch_does():
    """A token that chose expert 3 with a first feature of 0.1: its up projection (1e37) squares to inf in the gate,
    the down projection sums infinities of both signs to NaN, torch's loss is NaN and so are the gradients of the
    router and of the experts that token chose; the trainer's NaN in the same places, the rest finite as torch's.
    One step: the next one's router would rank NaN logits, which torch's topk and ONNX's TopK order differently."""
    model = _overflowing_experts()
    batches = _boundary_batches([[0.1, 5.0, 0.0, 5.0]])
    trainer, reference, _ = _mse_sgd_parity(model, batches, _BOUNDARY_LR)
    state = reference.state_dict()
    assert state["router.weight"].isnan().all() and state["experts.gate_up_proj"][_OVERFLOWING].isnan().all()


def test_expert_parallel_layers_are_refused_by_name():
    model = _mixtral()
    model.model.layers[0].mlp.experts._is_expert_parallel = True
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    with pytest.raises(ExportError, match="MixtralExperts is sharded over devices .transformers' expert parallelism"):
        trainer.train_step(**zoo.causal_lm_batch(_BATCH, _LENGTH, generator=torch.Generator().manual_seed(0)))
