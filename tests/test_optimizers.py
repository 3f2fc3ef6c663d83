"""Adam, Lamb and SGD against float64 references of the legacy formulas, on real models."""

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import MLP, Encoder, lm_loss, mlp_batch, token_batch
from parity import assert_close_state, cpu_options, run_parity, step_both
from reference_optim import ReferenceOptimizer, legacy_hyper_parameters

from orttrainer import ORTTrainer, optim

STEPS = 10
DecayMode = optim.AdamConfig.DecayMode
# The encoder's key bias has an exactly-zero gradient, so both sides only see float32
# rounding noise there, which Adam/Lamb would normalise into lr-sized steps for
# epsilon << noise. With epsilon = 1e-4 (far above the noise, far below the RMS of the
# real gradients) the comparison checks the formulas, not the noise.
EPSILON = 1e-4

MODELS = {
    "mlp": (MLP, F.cross_entropy, mlp_batch),
    "transformer": (lambda: Encoder(dropout=0.0), lm_loss, token_batch),
}


def train_against_reference(model_name, config, kind, clip, options_extra=None, accumulation=1):
    """Train with orttrainer and with torch gradients + the float64 reference; compare every step."""
    make, loss_fn, make_batch = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    reference_model = copy.deepcopy(model)
    extra = {"utils": {"grad_norm_clip": clip}, "batch": {"gradient_accumulation_steps": accumulation}}
    extra.update(options_extra or {})
    trainer = ORTTrainer(model, None, config, loss_fn=loss_fn, options=cpu_options(extra))
    trainable = dict(reference_model.named_parameters())
    reference = ReferenceOptimizer(kind, trainable, legacy_hyper_parameters(config), clip)
    generator = torch.Generator().manual_seed(42)
    for step in range(1, STEPS + 1):
        batch = make_batch(generator=generator)
        ort_loss = trainer.train_step(*batch)[0]
        reference_model.zero_grad()
        loss = loss_fn(reference_model(*batch[:-1]), batch[-1])
        loss.backward()
        torch.testing.assert_close(ort_loss, loss.detach(), rtol=1e-5, atol=1e-5)
        reference.step({name: p.grad for name, p in trainable.items()}, config.lr)
        with torch.no_grad():
            for name, parameter in trainable.items():
                parameter.copy_(reference.weights[name])
        state = trainer.state_dict()
        for name, expected in reference.weights.items():
            np.testing.assert_allclose(state["model"]["full_precision"][name], expected.numpy(), rtol=1e-5, atol=2e-6,
                                       err_msg=f"weight {name} at step {step}")
            if kind != "sgd":
                moments = state["optimizer"][name]
                np.testing.assert_allclose(moments["Moment_1"], reference.m[name].numpy(), rtol=1e-5, atol=1e-7,
                                           err_msg=f"Moment_1 of {name} at step {step}")
                np.testing.assert_allclose(moments["Moment_2"], reference.v[name].numpy(), rtol=1e-5, atol=1e-9,
                                           err_msg=f"Moment_2 of {name} at step {step}")
    return trainer, reference


# the fast tier: the MLP with clipping and bias correction, both decay modes; the other combinations marked slow
@pytest.mark.parametrize("model_name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", [DecayMode.BEFORE_WEIGHT_UPDATE, DecayMode.AFTER_WEIGHT_UPDATE])
@pytest.mark.parametrize("bias_correction", [True, pytest.param(False, marks=pytest.mark.slow)])
@pytest.mark.parametrize("clip", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_adam_matches_legacy_formula(model_name, mode, bias_correction, clip):
    config = optim.AdamConfig(lr=3e-3, alpha=0.85, beta=0.99, lambda_coef=0.05, epsilon=EPSILON, max_norm_clip=0.5,
                              do_bias_correction=bias_correction, weight_decay_mode=mode)
    trainer, reference = train_against_reference(model_name, config, "adam", clip)
    if clip:
        assert reference.clipped_steps > 0, "clipping never triggered; the test would not see it"
    counts = {entry["Update_Count"][0] for name, entry in trainer.state_dict()["optimizer"].items()}
    assert counts == {STEPS + 1}


@pytest.mark.parametrize("model_name", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("clip", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_lamb_matches_legacy_formula(model_name, bias_correction, clip):
    config = optim.LambConfig(lr=1e-2, alpha=0.9, beta=0.99, lambda_coef=0.01, ratio_min=0.05, ratio_max=5.0,
                              epsilon=EPSILON, max_norm_clip=0.5, do_bias_correction=bias_correction)
    trainer, reference = train_against_reference(model_name, config, "lamb", clip)
    assert trainer.state_dict()["optimizer"]["shared_optimizer_state"]["Step"][0] == STEPS + 1
    if clip:
        assert reference.clipped_steps > 0


def test_sgd_matches_legacy_formula_without_clipping():
    train_against_reference("mlp", optim.SGDConfig(lr=0.1), "sgd", clip=True)


def test_adam_mode_0_matches_torch_adamw():
    from parity import run_parity

    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(7)
    batches = [token_batch(generator=generator) for _ in range(STEPS)]
    config = optim.AdamConfig(lr=1e-3, alpha=0.9, beta=0.98, lambda_coef=0.01, epsilon=EPSILON)
    run_parity(Encoder(dropout=0.0), batches, config,
               lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.98), eps=EPSILON, weight_decay=0.01),
               loss_fn=lm_loss, options=cpu_options({"utils": {"grad_norm_clip": False}}), atol=1e-5)


def test_param_groups_take_effect():
    params = [{"params": ["fc1.weight", "fc1.bias"], "alpha": 0.5, "lambda_coef": 0.2},
              {"params": ["head.weight"], "beta": 0.9, "epsilon": 1e-3}]
    given = copy.deepcopy(params)
    config = optim.AdamConfig(params=params, lr=1e-2, lambda_coef=0.0, epsilon=EPSILON)
    assert config.params[0]["lambda"] == 0.2 and "lambda_coef" not in config.params[0], "groups are completed"
    assert config.params[1]["alpha"] == 0.9 and config.params[1]["lr"] == 1e-2
    assert params == given, "the user's groups are never changed (the legacy code completed them in place)"
    # the reference applies alpha 0.5 / lambda 0.2 to fc1 and beta 0.9 / epsilon 1e-3 to head:
    # a trainer that ignored the groups would drift from it within a few steps
    train_against_reference("mlp", config, "adam", clip=False)


class TiedLM(nn.Module):
    """A language model whose head is its embedding (head.weight is emb.weight), as GPT-2's."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(12, 6), nn.Linear(6, 6), nn.Linear(6, 12, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def _tied_lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, 12), labels.reshape(-1))


def _tied_lm_batches(count=3):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 12, (3, 5), generator=generator), torch.randint(0, 12, (3, 5), generator=generator))
            for _ in range(count)]  # fmt: skip


@pytest.mark.parametrize("name", ["emb.weight", "head.weight"])
def test_a_tied_weight_is_frozen_and_grouped_by_either_of_its_names(name):
    """The trainer keeps a tied weight under its first name (emb.weight); named by the other, it was trained although
    frozen, and a group naming it did not apply, without a word."""
    torch.manual_seed(0)
    run_parity(TiedLM(), _tied_lm_batches(), optim.SGDConfig(lr=0.1), lambda params: torch.optim.SGD(list(params)[1:], lr=0.1),
               loss_fn=_tied_lm_loss, options=cpu_options({"utils": {"frozen_weights": [name]}}))  # fmt: skip
    torch.manual_seed(0)
    config = optim.AdamConfig(params=[{"params": [name], "lambda_coef": 0.5}], lr=1e-2, epsilon=EPSILON)

    def adamw(params):
        tied, *others = params
        return torch.optim.AdamW([{"params": [tied], "weight_decay": 0.5}, {"params": others, "weight_decay": 0.0}],
                                 lr=1e-2, eps=EPSILON)  # fmt: skip

    run_parity(TiedLM(), _tied_lm_batches(), config, adamw, loss_fn=_tied_lm_loss,
               options=cpu_options({"utils": {"grad_norm_clip": False}}))


@pytest.mark.slow
def test_lamb_param_groups_take_effect():
    params = [{"params": ["fc2.weight"], "alpha": 0.6, "lambda_coef": 0.3, "ratio_max": 2.0}]
    config = optim.LambConfig(params=params, lr=1e-2, ratio_min=0.05, ratio_max=5.0, epsilon=EPSILON)
    train_against_reference("mlp", config, "lamb", clip=True)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (lambda: optim.SGDConfig(params=[{"params": ["w"], "lr": 0.1}]), ValueError,
         r"'params' must be an empty list for SGD optimizer, got list \[\{'params': \['w'\], 'lr': 0.1\}\]\. .*pass params=\[\]"),
        (lambda: optim.AdamConfig(params=[{"params": ["w"], "lr": 0.1}]), ValueError,
         r"'lr' is not supported inside params \(params\[0\] has lr=0.1\).* Remove 'lr' from params\[0\]"),
        (lambda: optim.AdamConfig(params=[{"params": ["w"], "gamma": 0.1}]), ValueError,
         r"params\[0\] has 'gamma', which is not a hyper-parameter of AdamOptimizer; a group may set alpha, beta, "
         r"lambda_coef, .* Remove 'gamma'"),
        (lambda: optim.AdamConfig(params=[{"params": ["w"]}]), ValueError,
         r"params\[0\] must be a dict with 'params' and at least one hyper-parameter, got dict \{'params': \['w'\]\}"),
        (lambda: optim.AdamConfig(params=["w"]), TypeError, r"params\[0\] must be a dict .*, got str 'w'\. Write each group like"),
        (lambda: optim.LambConfig(params={"params": ["w"]}), TypeError, r"'params' must be a list of dicts, got dict"),
        (lambda: optim.AdamConfig(alpha=-0.1), ValueError,
         r"'alpha' must be a non-negative number, got float -0.1\. Pass alpha >= 0 to AdamConfig"),
        (lambda: optim.LambConfig(beta="0.9"), TypeError,
         r"'beta' must be a non-negative number, got str '0.9'\. Pass beta >= 0 to LambConfig"),
        (lambda: optim.AdamConfig(max_norm_clip=0), ValueError,
         r"'max_norm_clip' must be a non-zero number, got int 0\. .*grad_norm_clip=False"),
        (lambda: optim.AdamConfig(do_bias_correction=1), TypeError, r"'do_bias_correction' must be a bool, got int 1"),
        (lambda: optim.AdamConfig(weight_decay_mode=0), TypeError,
         r"'weight_decay_mode' must be an AdamConfig.DecayMode, got int 0\. Pass AdamConfig.DecayMode.BEFORE_WEIGHT_UPDATE"),
        (lambda: optim.LambConfig(ratio_min=0), TypeError, r"'ratio_min' must be a float, got int 0\. Pass ratio_min as a float"),
        (lambda: optim.SGDConfig(lr=-1), ValueError, r"'lr' must be a non-negative number, got int -1\. Pass a learning rate >= 0"),
        (lambda: optim.SGDConfig(lr=True), TypeError, r"'lr' must be a non-negative number, got bool True"),
        (lambda: optim.config._OptimizerConfig("Adagrad", [], {"lr": 0.1}), ValueError,
         r"'name' must be one of AdamOptimizer, LambOptimizer, SGDOptimizer, got str 'Adagrad'"),
        (lambda: optim.config._OptimizerConfig("SGDOptimizer", [], {"alpha": 0.1}), ValueError,
         r"'defaults' must be a dict with an 'lr' entry, got dict \{'alpha': 0.1\}\. .*defaults=\{'lr': 0.001\}"),
    ],
)
def test_config_checks(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_config_defaults_are_legacy():
    adam, lamb = optim.AdamConfig(), optim.LambConfig()
    assert (adam.lr, adam.alpha, adam.beta, adam.lambda_coef, adam.epsilon, adam.max_norm_clip, adam.do_bias_correction) == (
        0.001, 0.9, 0.999, 0.0, 1e-8, 1.0, True)
    assert adam.weight_decay_mode == DecayMode.BEFORE_WEIGHT_UPDATE
    assert (lamb.epsilon, lamb.do_bias_correction, lamb.ratio_min, lamb.ratio_max) == (1e-6, False, float("-inf"), float("inf"))
    assert optim.SGDConfig().name == "SGDOptimizer" and adam.name == "AdamOptimizer" and lamb.name == "LambOptimizer"


def _with_decay_on_weights_only(model, **settings):
    weights = [parameter for name, parameter in model.named_parameters() if name.endswith("weight")]
    biases = [parameter for name, parameter in model.named_parameters() if name.endswith("bias")]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], **settings)


@pytest.mark.parametrize("make", [
    lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.8, 0.99), eps=EPSILON, weight_decay=0.05),
    pytest.param(lambda model: _with_decay_on_weights_only(model, lr=3e-3, eps=EPSILON, weight_decay=0.1),
                 marks=pytest.mark.slow),
    pytest.param(lambda model: torch.optim.Adam(model.parameters(), lr=1e-3, eps=EPSILON), marks=pytest.mark.slow),
    pytest.param(lambda model: torch.optim.AdamW(model.fc1.parameters(), lr=1e-3, eps=EPSILON), marks=pytest.mark.slow),
    lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
], ids=["adamw", "adamw-no-decay-on-biases", "adam", "adamw-over-one-layer", "sgd"])  # fmt: skip
def test_the_config_a_torch_optimizer_is_refused_with_trains_as_that_optimizer(make):
    """A torch loop's optimizer passed as optim_config is refused with the equivalent config and options
    (optim/_from_torch.py): that config trains as the torch optimizer does, every step, groups and frozen weights too."""
    from orttrainer.optim._from_torch import equivalent_config

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    torch_optimizer = make(reference)
    with pytest.raises(TypeError, match=r"'optim_config' must be an orttrainer.optim config, not a torch optimizer.*"
                                        r"The same update is optim\.(Adam|SGD)Config\("):  # fmt: skip
        ORTTrainer(model, None, make(model), loss_fn=F.cross_entropy)
    config, options, _ = equivalent_config(make(model), model)
    trainer = ORTTrainer(model, None, config, loss_fn=F.cross_entropy, options=cpu_options(options))
    generator = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        step_both(trainer, reference, torch_optimizer, mlp_batch(generator=generator), step, F.cross_entropy)


@pytest.mark.parametrize("make, reason", [
    (lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "its momentum is not 0"),
    (lambda model: torch.optim.Adam(model.parameters(), weight_decay=1e-4), "torch's Adam adds its weight decay to the "
                                                                             "gradient"),
    (lambda model: torch.optim.AdamW(model.parameters(), amsgrad=True), "amsgrad is on"),
    (lambda model: torch.optim.RMSprop(model.parameters()), "no legacy config is RMSprop"),
], ids=["sgd-momentum", "adam-l2", "amsgrad", "rmsprop"])  # fmt: skip
def test_a_torch_optimizer_without_an_equivalent_is_refused_saying_why(make, reason):
    model = MLP()
    with pytest.raises(TypeError, match=rf"No orttrainer config updates as this torch.optim.\w+ does: {reason}"):
        ORTTrainer(model, None, make(model), loss_fn=F.cross_entropy)


def test_the_legacy_clipping_is_torchs_clip_grad_norm():
    """What the refusal above advises for a loop that calls clip_grad_norm_(parameters, c): keep utils.grad_norm_clip
    and pass max_norm_clip=c (torch divides by the norm + 1e-6: a difference of rounding)."""
    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=EPSILON, weight_decay=0.0)
    trainer = ORTTrainer(model, None, optim.AdamConfig(lr=1e-2, epsilon=EPSILON, max_norm_clip=0.05),
                         loss_fn=F.cross_entropy, options=cpu_options())  # fmt: skip
    generator = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        x, label = mlp_batch(generator=generator)
        trainer.train_step(x, label)
        torch_optimizer.zero_grad()
        F.cross_entropy(reference(x), label).backward()
        assert torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05) > 0.05, "the norm is clipped at every step"
        torch_optimizer.step()
        assert_close_state(trainer, reference, step=step)
