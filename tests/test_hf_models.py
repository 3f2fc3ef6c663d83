"""Models as Hugging Face users have them: forward by keyword, labels in the batch, the loss computed
by the model, a ModelOutput (or dict) returned; no loss_fn, no model_desc; flags such as
output_hidden_states=True passed to the step as Python values (constants of the graph).

The Hugging Face models are tiny random-init configs (hidden 32, 2 layers, 2 heads, vocab 100,
every dropout 0), trained at one batch shape. Models written here return dicts, to test the output
rules (model_outputs.py) without transformers.
"""

import copy

import onnxruntime
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import assert_close_state, cpu_options

from orttrainer import ExportError, ORTTrainer, optim

LR = 0.1
VOCAB = 100
BATCH, LENGTH = 3, 8


def _transformers():
    return pytest.importorskip("transformers", reason="Hugging Face models need transformers (the test extra)")


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected.detach(), atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


# ------------------------------------------------------------------ Hugging Face models
def _bert_config(**extra):
    settings = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                "intermediate_size": 37, "max_position_embeddings": 64, "hidden_dropout_prob": 0.0,
                "attention_probs_dropout_prob": 0.0, "pad_token_id": 0}  # fmt: skip
    return _transformers().BertConfig(**{**settings, **extra})


def bert_classifier():  # hidden_states on: a tuple field, one graph output per tensor
    return _transformers().BertForSequenceClassification(_bert_config(num_labels=3, output_hidden_states=True))


def bert_masked_lm():  # the output embedding tied to the input embedding
    return _transformers().BertForMaskedLM(_bert_config())


def gpt2_lm():  # use_cache left on: past_key_values is left out of the graph
    config = _transformers().GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return _transformers().GPT2LMHeadModel(config)


def checkpointed_gpt2_lm():  # transformers' activation checkpointing (non-reentrant): the same gradients
    model = gpt2_lm()
    model.activation_checkpointing_enable()
    return model


def _text(generator):
    """Token ids and an attention mask with the last two positions of the first row padded."""
    input_ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    attention_mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    attention_mask[0, -2:] = 0
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask}


def classification_batch(generator):
    return {**_text(generator), "labels": torch.randint(0, 3, (BATCH,), generator=generator)}


def masked_lm_batch(generator):
    """token_type_ids given too; labels -100 except at about a third of the positions."""
    batch = _text(generator)
    masked = torch.rand(BATCH, LENGTH, generator=generator) < 0.35
    masked[1, 0] = True
    return {**batch, "token_type_ids": torch.zeros(BATCH, LENGTH, dtype=torch.long),
            "labels": batch["input_ids"].masked_fill(~masked, -100)}  # fmt: skip


def causal_lm_batch(generator):
    batch = _text(generator)
    return {**batch, "labels": batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)}


def _as_step_argument(batch, step):
    """The batch as train_step gets it at ``step``: keywords, one dict, a tokenizer's BatchEncoding."""
    if step == 1:
        return (), batch
    return ((dict(batch) if step == 2 else _transformers().BatchEncoding(batch)),), {}


def _compare_outputs(outputs, expected, what):
    """``outputs`` is a ModelOutput of ``expected``'s class with its tensors (past_key_values aside)."""
    assert type(outputs) is type(expected), f"{what} returned {type(outputs).__name__}, the model {type(expected).__name__}"
    kept = [key for key in expected.keys() if key != "past_key_values"]
    assert list(outputs.keys()) == kept
    for key in kept:
        as_tuples = [value if isinstance(value, tuple) else (value,) for value in (outputs[key], expected[key])]
        for index, (mine, torch_value) in enumerate(zip(*as_tuples)):
            _close(mine, torch_value, f"{what} {key}[{index}]")


@pytest.mark.parametrize(
    "make, make_batch",
    [(bert_classifier, classification_batch), pytest.param(bert_masked_lm, masked_lm_batch, marks=pytest.mark.slow),
     (gpt2_lm, causal_lm_batch), (checkpointed_gpt2_lm, causal_lm_batch)],
    ids=["bert-classifier", "bert-masked-lm-tied", "gpt2-lm-tied-use-cache", "gpt2-lm-gradient-checkpointing"],
)
def test_trains_like_torch_and_gives_back_the_model(tmp_path, make, make_batch):
    """3 SGD steps equal a torch loop (loss, outputs, every state_dict key), the batch given as keywords,
    a dict and a BatchEncoding; eval_step gives the ModelOutput with the loss; the state loads strictly; the user's
    module is trained in place (it equals the trainer's state after every step), so save_pretrained needs no sync."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = make()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in (1, 2, 3):
        batch = make_batch(generator)
        args, kwargs = _as_step_argument(batch, step)
        outputs = trainer.train_step(*args, **kwargs)
        expected = reference(**batch)
        expected.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _compare_outputs(outputs, expected, f"train_step {step}")
        assert_close_state(trainer, reference, step=step)
        trained = trainer.state_dict(pytorch_format=True)
        assert all(torch.equal(tensor, trained[name]) for name, tensor in model.state_dict().items()), f"step {step}"

    reference.eval()
    with torch.no_grad():
        expected = reference(**batch)
    _compare_outputs(trainer.eval_step(batch), expected, "eval_step")

    fresh = make()
    fresh.load_state_dict(trainer.state_dict(pytorch_format=True), strict=True)
    trainer.sync_to_module()  # kept for code that calls it: nothing to do
    model.save_pretrained(tmp_path)
    saved = type(model).from_pretrained(tmp_path)
    for name, tensor in reference.state_dict().items():
        _close(model.state_dict()[name], tensor, f"synced '{name}'")
        _close(saved.state_dict()[name], tensor, f"saved '{name}'")


def test_errors_name_the_key_and_the_fix():
    torch.manual_seed(0)
    model = gpt2_lm()
    batch = causal_lm_batch(torch.Generator().manual_seed(1))
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    with pytest.raises(ValueError, match=r"batch keys \['lables'\] are not parameters of GPT2LMHeadModel.forward, which "
                                         r"takes \['input_ids', 'past_key_values', .*'labels'.*\*\*kwargs would take"):
        trainer.train_step(input_ids=batch["input_ids"], lables=batch["labels"])
    with pytest.raises(ValueError, match=r"as one dict or as keyword arguments, not both"):
        trainer.train_step(batch, labels=batch["labels"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel returned CausalLMOutputWithCrossAttentions without a 'loss' "
                                         r"\(its outputs: \['logits'\]\).*put the labels in the batch"):
        trainer.train_step(input_ids=batch["input_ids"])
    with_loss_fn = ORTTrainer(model, None, optim.SGDConfig(lr=LR), loss_fn=lambda output, label: output.logits.mean(),
                              options=cpu_options())  # fmt: skip
    with pytest.raises(ValueError, match=r"computed its own 'loss' and a loss_fn is given too"):
        with_loss_fn.train_step(input_ids=batch["input_ids"], labels=batch["labels"], label=batch["labels"])
    assert trainer._runtime is None


# ------------------------------------------------------------------ models returning dicts
class Tagger(nn.Module):
    """A token classifier returning a dict like a Hugging Face model: the loss when given labels,
    the logits, a tuple of hidden states, and a None."""

    def __init__(self, extra=None):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 16)
        self.layer = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.extra = extra

    def forward(self, input_ids, attention_mask=None, labels=None, scale=2.0):
        first = self.embedding(input_ids)
        second = torch.tanh(self.layer(first)) * scale
        if attention_mask is not None:
            second = second * attention_mask.unsqueeze(-1)
        logits = self.head(second)
        loss = None if labels is None else F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits, "hidden_states": (first, second), "attentions": None, **(self.extra or {})}


def _tagger_batch(generator):
    return {"input_ids": torch.randint(0, VOCAB, (4, 5), generator=generator),
            "attention_mask": torch.ones(4, 5), "labels": torch.randint(0, 3, (4, 5), generator=generator)}  # fmt: skip


def _side_by_side(model):
    """An ORTTrainer of ``model``, a deep copy of it and torch SGD on the copy, both at LR."""
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    return trainer, reference, torch.optim.SGD(reference.parameters(), lr=LR)


def test_dict_comes_back_as_a_dict_with_tuples_and_forward_defaults_kept():
    """Fields in the model's order, None left out, a tuple of tensors a tuple again; a key the batch
    leaves out keeps forward's default (scale=2); the key order does not matter (one graph)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    trainer, reference, optimizer = _side_by_side(Tagger())
    for step in (1, 2):
        batch = _tagger_batch(generator)
        outputs = trainer.train_step(**dict(reversed(batch.items())) if step == 2 else batch)
        expected = reference(**batch)
        expected["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        assert type(outputs) is dict and list(outputs) == ["loss", "logits", "hidden_states"]
        assert isinstance(outputs["hidden_states"], tuple) and len(outputs["hidden_states"]) == 2
        for name in ("loss", "logits"):
            _close(outputs[name], expected[name], f"step {step} {name}")
        for index in (0, 1):
            _close(outputs["hidden_states"][index], expected["hidden_states"][index], f"step {step} hidden_states[{index}]")
        assert_close_state(trainer, reference, step=step)
    assert trainer._graphs.built == 1
    assert [entry.name for entry in trainer.model_desc.outputs] == ["loss", "logits", "hidden_states.0", "hidden_states.1"]

    trainer._train_step_info.fetches = ["logits", "loss"]  # the legacy fetches: a list in their order
    logits, loss = trainer.eval_step(batch)
    reference.eval()
    _close(loss, reference(**batch)["loss"], "fetched loss")
    trainer._train_step_info.fetches = []

    with pytest.raises(ValueError, match=r"this batch has inputs \['input_ids', 'attention_mask'\], the first batch had "
                                         r"\['input_ids', 'attention_mask', 'labels'\] \(missing: \['labels'\]\)"):
        trainer.eval_step(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_a_legacy_model_desc_gets_the_legacy_list():
    """Constants are the keywords the model_desc does not list; those it lists are tensors."""
    torch.manual_seed(0)
    desc = {"inputs": [("input_ids", ["batch", 5]), ("attention_mask", ["batch", 5]), ("labels", ["batch", 5])],
            "outputs": [("loss", [], True), ("logits", ["batch", 5, 3]), ("first", ["batch", 5, 16]),
                        ("second", ["batch", 5, 16])]}  # fmt: skip
    model = Tagger()
    reference = copy.deepcopy(model).eval()
    trainer = ORTTrainer(model, desc, optim.SGDConfig(lr=LR), options=cpu_options())
    batch = _tagger_batch(torch.Generator().manual_seed(1))
    _close(trainer.eval_step(*batch.values(), scale=3.0)[0], reference(**batch, scale=3.0)["loss"], "scale=3.0")
    outputs = trainer.train_step(batch)
    assert isinstance(outputs, list) and [tuple(output.shape) for output in outputs] == [(), (4, 5, 3), (4, 5, 16), (4, 5, 16)]
    with pytest.raises(TypeError, match=r"input 'labels' must be a torch.Tensor, got NoneType: .*not a model_desc input"):
        trainer.eval_step(batch["input_ids"], batch["attention_mask"], labels=None)
    with pytest.raises(ValueError, match=r"batch keys \['scael'\] are not parameters of Tagger.forward"):
        trainer.eval_step(*batch.values(), scael=3.0)


class TupleTagger(Tagger):
    """Returns a tuple, the loss first, with a cache object in it."""

    def forward(self, input_ids, attention_mask=None, labels=None, scale=2.0):
        outputs = super().forward(input_ids, attention_mask, labels, scale)
        return outputs["loss"], outputs["logits"], object()


@pytest.mark.parametrize(
    "model, message",
    [(Tagger(extra={"count": 3}), r"Tagger.forward returned 'count' as a int; the graph can only return tensors"),
     (Tagger(extra={"hidden_states": (torch.ones(1), None)}), r"Tagger.forward returned 'hidden_states' as a tuple"),
     (TupleTagger(), r"TupleTagger.forward returned a object as output \[2\].*config.use_cache=False"),
     (Tagger(extra={"text_output": {"count": 3}}), r"Tagger.forward returned 'text_output.count' as a int; the graph can "
                                                   r"only return tensors, tuples of tensors and ModelOutputs or dicts")],
    ids=["int-field", "tuple-with-none", "object-in-tuple", "int-in-nested-output"],
)  # fmt: skip
def test_an_output_that_is_not_a_tensor_is_refused_by_name(model, message):
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    with pytest.raises(TypeError, match=message):
        trainer.train_step(_tagger_batch(torch.Generator().manual_seed(1)))


class NestedTagger(Tagger):
    """Returns a dict inside its dict, as CLIP returns each tower's ModelOutput inside its CLIPOutput."""

    def forward(self, input_ids, attention_mask=None, labels=None, scale=2.0):
        outputs = super().forward(input_ids, attention_mask, labels, scale)
        encoder = {"hidden_states": outputs["hidden_states"], "attentions": None, "last_hidden_state": outputs["hidden_states"][1]}
        return {"loss": outputs["loss"], "encoder": encoder, "logits": outputs["logits"]}


def test_a_dict_inside_the_dict_comes_back_nested():
    """Its tensors are graph outputs '<field>.<subfield>' (a tuple in it '<field>.<subfield>.<index>'), None left out."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    model = NestedTagger()
    reference = copy.deepcopy(model)
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    batch = _tagger_batch(generator)
    outputs = trainer.train_step(batch)
    expected = reference(**batch)
    assert [entry.name for entry in trainer.model_desc.outputs] == [
        "loss", "encoder.hidden_states.0", "encoder.hidden_states.1", "encoder.last_hidden_state", "logits"]  # fmt: skip
    assert list(outputs) == ["loss", "encoder", "logits"] and list(outputs["encoder"]) == ["hidden_states", "last_hidden_state"]
    for index in (0, 1):
        _close(outputs["encoder"]["hidden_states"][index], expected["encoder"]["hidden_states"][index], f"hidden_states[{index}]")
    _close(outputs["encoder"]["last_hidden_state"], expected["encoder"]["last_hidden_state"], "last_hidden_state")
    _close(outputs["loss"], expected["loss"], "loss")


# ------------------------------------------------------------------ constants: Python values passed to a step
class TensorScaleTagger(Tagger):
    """Makes a tensor of its ``scale`` in forward: the trace freezes it (torch.tensor results are constants), so the
    first batch of other values of each signature is exported once more (graph_cache._ValuesCheck)."""

    def forward(self, input_ids, attention_mask=None, labels=None, scale=2.0):
        return super().forward(input_ids, attention_mask, labels, torch.tensor(scale))


def test_a_constant_passed_to_a_step_goes_to_forward_and_chooses_the_graph(tmp_path):
    """scale=3.0 then 2.0, 3 (an int) and 3.0 again: each step, eval_step and save_as_onnx equal torch with that
    value (the first-step check and the values check run with it too); a value seen before reuses its graph; the
    batch the user passed is not changed."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    trainer, reference, optimizer = _side_by_side(TensorScaleTagger())
    for step, scale in enumerate((3.0, 3.0, 2.0, 3, 3.0), 1):
        batch = {**_tagger_batch(generator), "scale": scale}
        given = dict(batch)
        outputs = trainer.train_step(batch)
        assert batch.keys() == given.keys() and all(batch[key] is given[key] for key in given)
        expected = reference(**batch)
        expected["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        for name in ("loss", "logits"):
            _close(outputs[name], expected[name], f"step {step} (scale={scale!r}) {name}")
        assert_close_state(trainer, reference, step=step)
    assert len(trainer._graphs._signatures) == 3 and trainer._graphs.built == 2  # 3 apart from 3.0: the same graph

    reference.eval()
    with torch.no_grad():
        _close(trainer.eval_step(**batch)["logits"], reference(**batch)["logits"], "eval_step at scale 3.0")
        _close(trainer.eval_step(batch)["loss"], reference(**batch)["loss"], "eval_step loss")
        trainer.eval_step({**batch, "scale": 2.0})  # the graph of 2.0: save_as_onnx writes the last batch's
        trainer.save_as_onnx(str(tmp_path / "tagger.onnx"), with_loss=False)
        session = onnxruntime.InferenceSession(str(tmp_path / "tagger.onnx"), providers=["CPUExecutionProvider"])
        feeds = {entry.name: batch[entry.name].numpy() for entry in session.get_inputs()}
        _close(torch.from_numpy(session.run(["logits"], feeds)[0]), reference(**{**batch, "scale": 2.0})["logits"], "ONNX")


def test_output_hidden_states_changed_between_steps_gives_what_torch_gives():
    """A transformers flag (forward's **kwargs: Unpack[TransformersKwargs]) that changes the outputs: False, True, False."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    trainer, reference, optimizer = _side_by_side(_transformers().BertForSequenceClassification(_bert_config(num_labels=3)))
    for step, hidden in enumerate((False, True, False), 1):
        batch = classification_batch(generator)
        outputs = trainer.train_step(**batch, output_hidden_states=hidden)
        expected = reference(**batch, output_hidden_states=hidden)
        expected.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        _compare_outputs(outputs, expected, f"train_step {step} (output_hidden_states={hidden})")
        assert ("hidden_states.0" in [entry.name for entry in trainer.model_desc.outputs]) is hidden
        assert_close_state(trainer, reference, step=step)
    assert trainer._graphs.built == 2
    reference.eval()
    with torch.no_grad():
        _compare_outputs(trainer.eval_step(**batch, output_hidden_states=True), reference(**batch, output_hidden_states=True),
                         "eval_step")  # fmt: skip


def test_return_dict_false_gives_the_tuple_torch_gives():
    """transformers 5 takes return_dict in a decorator (can_return_tuple) around forward, whose own signature has no
    such parameter: the key was refused as unknown."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    trainer, reference, optimizer = _side_by_side(_transformers().BertForSequenceClassification(_bert_config(num_labels=3)))
    for step in range(1, 3):
        batch = classification_batch(generator)
        loss, logits = trainer.train_step(**batch, return_dict=False)
        expected = reference(**batch, return_dict=False)
        assert isinstance(expected, tuple)
        expected[0].backward()
        optimizer.step()
        optimizer.zero_grad()
        _close(loss, expected[0], f"step {step} loss")
        _close(logits, expected[1], f"step {step} logits")
        assert_close_state(trainer, reference, step=step)


class TwoHeadTagger(Tagger):
    """Its ``head`` keyword picks the head: another value trains other weights."""

    def __init__(self):
        super().__init__()
        self.other_head = nn.Linear(16, 3)

    def forward(self, input_ids, labels=None, head="head"):
        logits = getattr(self, head)(torch.tanh(self.layer(self.embedding(input_ids))))
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def test_a_constant_that_switches_weights_is_refused():
    """The trainer trains one set of weights for every graph (graph_cache.py)."""
    trainer = ORTTrainer(TwoHeadTagger(), None, optim.SGDConfig(lr=LR), options=cpu_options())
    batch = _tagger_batch(torch.Generator().manual_seed(1))
    del batch["attention_mask"]
    trainer.train_step(**batch, head="head")
    with pytest.raises(NotImplementedError, match=r"uses other weights than the graph of earlier batches \(only here: "
                                                  r"\['other_head.weight', 'other_head.bias'\]\).*on a value passed to "
                                                  r"the step switches parameters"):
        trainer.train_step(**batch, head="other_head")


@pytest.mark.parametrize("value", [[3.0], (3.0,), {"value": 3.0}, torch.float16], ids=["list", "tuple", "dict", "dtype"])
def test_a_keyword_that_is_neither_a_tensor_nor_a_constant_is_refused_by_name(value):
    trainer = ORTTrainer(Tagger(), None, optim.SGDConfig(lr=LR), options=cpu_options())
    with pytest.raises(TypeError, match=rf"input 'scale' must be a torch.Tensor, got {type(value).__name__}: .*a keyword "
                                        r"argument that is a bool, int, float, str or None .*goes to forward as a constant"):
        trainer.train_step(**_tagger_batch(torch.Generator().manual_seed(1)), scale=value)
    with pytest.raises(ValueError, match=r"batch keys \['scael'\] are not parameters of Tagger.forward"):
        trainer.train_step(**_tagger_batch(torch.Generator().manual_seed(1)), scael=3.0)


class TrainingOnlyOutput(Tagger):
    """Returns one more output in training mode than in eval mode."""

    def forward(self, input_ids, attention_mask=None, labels=None, scale=2.0):
        outputs = super().forward(input_ids, attention_mask, labels, scale)
        return {**outputs, "auxiliary": outputs["logits"] * 2} if self.training else outputs


class EvalOnlyOutput(Tagger):
    """Returns one more output in eval mode than in training mode (XLNet's memories with use_mems_eval)."""

    def forward(self, input_ids, attention_mask=None, labels=None, scale=2.0):
        outputs = super().forward(input_ids, attention_mask, labels, scale)
        return outputs if self.training else {**outputs, "memory": outputs["logits"] * 2}


@pytest.mark.parametrize("model, extra", [(TrainingOnlyOutput, r"\[.*'auxiliary'\] in training mode but \[.*\]"),
                                          (EvalOnlyOutput, r"\[.*\] in training mode but \[.*'memory'\]")])  # fmt: skip
def test_outputs_that_change_with_the_mode_are_refused(model, extra):
    """The graph's output names come from an eval-mode run and are given to the training-mode export by position;
    more names than outputs failed inside torch's exporter, with its own message, before."""
    trainer = ORTTrainer(model(), None, optim.SGDConfig(lr=LR), options=cpu_options())
    with pytest.raises(ExportError, match=rf"{model.__name__} returns {extra} in eval mode or model_desc: return the same "
                                          r"outputs in both modes"):  # fmt: skip
        trainer.train_step(_tagger_batch(torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("by_keyword", [False, True])
def test_first_step_check_turns_off_the_dropout_of_scaled_dot_product_attention(by_keyword):
    """Hugging Face attention (sdpa, the default) calls F.scaled_dot_product_attention, a builtin without
    a signature to bind; the check against torch runs it with dropout_p 0, given by position or keyword."""
    from orttrainer.export.verify import _NoDropout

    query, key, value = torch.randn(3, 2, 2, 5, 4).unbind(0)
    expected = F.scaled_dot_product_attention(query, key, value, None, 0.0)
    with _NoDropout():
        if by_keyword:
            output = F.scaled_dot_product_attention(query, key, value, dropout_p=0.9)
        else:
            output = F.scaled_dot_product_attention(query, key, value, None, 0.9)
    torch.testing.assert_close(output, expected)


def test_first_step_check_runs_activation_checkpointed_models_with_dropout():
    """Checkpointing runs forward again inside backward, where the check's dropout-off mode is not active:
    transformers' models are checked without it, other torch.utils.checkpoint users get a clear error."""
    torch.manual_seed(0)
    config = _bert_config(num_labels=3, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = _transformers().BertForSequenceClassification(config)
    model.activation_checkpointing_enable()
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=LR), options=cpu_options())
    trainer.train_step(classification_batch(torch.Generator().manual_seed(0)))  # the check ran and passed
    assert model.is_activation_checkpointing

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4))

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    trainer = ORTTrainer(Checkpointed(), None, optim.SGDConfig(lr=LR), loss_fn=F.mse_loss, options=cpu_options())
    with pytest.raises(RuntimeError, match=r"torch\.utils\.checkpoint runs forward again inside it.*check_against_torch"):
        trainer.train_step(torch.randn(3, 4), torch.randn(3, 4))


@pytest.mark.parametrize("changes, message", [
    ({"layerdrop": 0.1}, r"modeling_wav2vec2.py:\d+: if not skip_the_layer.*computed from a random draw .*config.layerdrop"),
    ({"apply_spec_augment": True, "mask_time_prob": 0.05},
     r"(?s)draws from numpy's global generator \(np.random\) at:\n- \S*modeling_wav2vec2.py:\d+.*mask_time_prob"),
], ids=["layerdrop", "spec-augment"])  # fmt: skip
def test_random_layer_skips_and_masks_drawn_in_python_are_refused(changes, message):
    """Wav2Vec2 with transformers' defaults for LayerDrop (0.1) and SpecAugment (0.05): a trace keeps one draw of each
    for every step. LayerDrop's, ``torch.rand([]) < p`` in a Python ``if``, passed as a value of shapes alone: the layers
    were never skipped, or always. SpecAugment's masks, drawn with numpy, are refused at the first export, naming the
    line that draws."""
    import zoo

    torch.manual_seed(0)
    trainer = ORTTrainer(zoo.wav2vec2_audio_classifier(**changes), None, optim.SGDConfig(lr=LR), options=cpu_options())
    generator = torch.Generator().manual_seed(0)
    with pytest.raises(ExportError, match=message):
        for _ in range(2):
            trainer.train_step(**zoo.audio_batch(4, generator=generator))


class _CausalLMWithItsConfig(nn.Module):
    """A user's wrapper that keeps the Hugging Face model's config beside it and names ``dtype`` in its forward."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone, self.config = backbone, backbone.config

    def forward(self, input_ids, attention_mask, labels):
        output = self.backbone(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return output.loss.to(output.logits.dtype)


def test_save_pretrained_between_steps_is_no_edit_of_a_wrapper_that_holds_the_config(tmp_path):
    """save_pretrained sets the config's ``dtype`` (None -> 'float32') and ``architectures``: a config is a package's
    dataclass, whose fields the between-steps check does not compare (forward_effects._namespace_entries), or the
    commonest Hugging Face loop (sync, save a checkpoint, train on) would be refused."""
    _transformers()
    import zoo

    torch.manual_seed(0)
    model = _CausalLMWithItsConfig(zoo.gpt2_lm())
    trainer = ORTTrainer(model, None, optim.SGDConfig(lr=0.1), options=cpu_options())
    generator = torch.Generator().manual_seed(0)
    trainer.train_step(**zoo.causal_lm_batch(4, 12, generator=generator))
    trainer.sync_to_module()
    model.backbone.save_pretrained(tmp_path)
    assert model.config.dtype is not None, "save_pretrained no longer sets the config's dtype: the test shows nothing"
    trainer.train_step(**zoo.causal_lm_batch(4, 12, generator=generator))
