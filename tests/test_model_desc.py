"""model_desc: legacy schema validation and inference from the first batch."""

import pytest
import torch
import torch.nn.functional as F
from models import MLP, TwoHeads, mlp_batch, two_head_batch, two_head_loss
from parity import cpu_options, run_parity
from zoo import BagOfWordsClassifier, bert_classifier, classification_batch

from orttrainer import ORTTrainer, optim
from orttrainer.api.model_desc import _ORTTrainerModelDesc, match_inputs


def test_legacy_form_is_normalised():
    desc = _ORTTrainerModelDesc({"inputs": [("x", ["batch", 4])], "outputs": [("loss", [], True), ("y", ["batch"])]})
    assert desc.inputs[0] == ("x", ["batch", 4])
    assert desc.outputs[1].is_loss is False
    assert desc.loss_output.name == "loss"
    desc.add_type_to_input_description(0, torch.float32)
    assert isinstance(desc.inputs[0], desc._InputDescriptionTyped) and desc.inputs[0][2] == torch.float32
    desc.add_type_to_output_description(1, torch.float32, torch.float16)
    assert desc.outputs[1].dtype_amp == torch.float16
    assert "inputs:" in repr(desc)


@pytest.mark.parametrize(
    "desc, message",
    [
        ({"inputs": [("x", [1])]}, "outputs: required field"),
        ({"inputz": [], "inputs": [("x", [1])], "outputs": [("y", [1])]}, "inputz: unknown field"),
        ({"inputs": [("x", [1], True)], "outputs": [("y", [1])]}, r"inputs\[0\]: must be a tuple with size 2"),
        ({"inputs": [(1, [1])], "outputs": [("y", [1])]}, r"inputs\[0\]: the first element of the tuple \(aka name\) must be a string"),
        ({"inputs": [("x", (1,))], "outputs": [("y", [1])]}, r"inputs\[0\]: the second element of the tuple \(aka shape\) must be a list"),
        ({"inputs": [("x", [True])], "outputs": [("y", [1])]}, r"inputs\[0\]: each shape must be either a string or integer"),
        ({"inputs": [("x", [1])], "outputs": [("y", [1], "yes")]}, r"outputs\[0\]: the third element of the tuple \(aka is_loss\) must be a boolean"),
        ({"inputs": [("x", [1])], "outputs": [("a", [], True), ("b", [], True)]}, r"outputs\[1\]: only one is_loss can be set to True"),
        ({"inputs": [], "outputs": [("y", [1])]}, "inputs: must be a non-empty list"),
    ],
)
def test_invalid_model_desc_names_the_entry(desc, message):
    with pytest.raises(ValueError, match="Invalid model_desc: .*" + message):
        _ORTTrainerModelDesc(desc)


@pytest.mark.parametrize(
    "add, error, message",
    [
        (lambda desc: desc.add_type_to_input_description(-1, torch.float32), ValueError,
         r"input index must be a non-negative int, got int -1\. Pass the position of the entry in model_desc.inputs \(0..0\)"),
        (lambda desc: desc.add_type_to_input_description(1, torch.float32), ValueError,
         r"input index must be a non-negative int, got int 1\. .*\(0..0\)"),
        (lambda desc: desc.add_type_to_input_description("x", torch.float32), TypeError,
         r"input index must be a non-negative int, got str 'x'"),
        (lambda desc: desc.add_type_to_input_description(0, "float32"), TypeError,
         r"input dtype must be a torch.dtype, got str 'float32'\. Pass a torch dtype such as torch.float32"),
        (lambda desc: desc.add_type_to_output_description(2, torch.float32), ValueError,
         r"output index must be a non-negative int, got int 2\. Pass the position of the entry in model_desc.outputs \(0..1\)"),
        (lambda desc: desc.add_type_to_output_description(0, None), TypeError, r"output dtype must be a torch.dtype, got None\."),
    ],
)
def test_add_type_checks_index_and_dtype(add, error, message):
    desc = _ORTTrainerModelDesc({"inputs": [("x", [1])], "outputs": [("loss", [], True), ("y", [1])]})
    with pytest.raises(error, match=message):
        add(desc)


def test_no_loss_output_is_an_error():
    desc = _ORTTrainerModelDesc({"inputs": [("x", [1])], "outputs": [("y", [1])]})
    with pytest.raises(ValueError, match=r"exactly one output with is_loss=True \(0 were specified\)"):
        desc.loss_output


def test_inferred_from_first_batch_and_forward_signature():
    torch.manual_seed(0)
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    desc = trainer.model_desc  # every size free: the module decides which shapes it accepts (graph_cache.py)
    assert [(entry.name, entry.shape, entry.dtype) for entry in desc.inputs] == [
        ("x", ["batch", "x_dim1"], torch.float32),
        ("label", ["batch"], torch.int64),
    ]
    assert [(entry.name, entry.shape, entry.is_loss) for entry in desc.outputs] == [
        ("loss", [], True),
        ("output", ["batch", "output_dim1"], False),
    ]


def test_sizes_equal_in_the_first_batch_are_not_tied_in_the_next():
    """A bag of words' first batch happens to have one token per text, so its token count equals its
    text count ('batch'); the next batch has more tokens than texts, and still trains as in torch."""
    torch.manual_seed(0)
    first = (torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]))
    second = (torch.tensor([5, 6, 7, 8, 9, 10, 11]), torch.tensor([0, 3, 5]), torch.tensor([2, 1, 0]))
    trainer, _ = run_parity(BagOfWordsClassifier(), [first, second, first], optim.SGDConfig(lr=0.5),
                            lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=F.cross_entropy)  # fmt: skip
    assert [entry.shape for entry in trainer.model_desc.inputs] == [["batch"], ["batch"], ["batch"]]


def test_inferred_with_keyword_inputs_and_tuple_outputs():
    torch.manual_seed(0)
    trainer = ORTTrainer(TwoHeads(), None, optim.SGDConfig(), loss_fn=two_head_loss, options=cpu_options())
    x, target = two_head_batch()
    loss, value, logits = trainer.train_step(x=x, label=target)
    assert [entry.name for entry in trainer.model_desc.inputs] == ["x", "label"]
    assert value.shape == (8,) and logits.shape == (8, 4)


def test_an_onnx_model_takes_no_constants():
    """A Python value passed to a step goes to a torch module's forward; an ONNX model (no module) has none."""
    desc = _ORTTrainerModelDesc({"inputs": [("x", ["batch", 32]), ("label", ["batch"])], "outputs": [("loss", [], True)]})
    with pytest.raises(ValueError, match=r"keyword inputs \['scale'\] are Python values, .*an ONNX model takes only its "
                                         r"model_desc inputs \['x', 'label'\], as tensors"):
        match_inputs(mlp_batch(), {"scale": 2.0}, desc)
    with pytest.raises(TypeError, match=r"input 'label' must be a torch.Tensor, got int"):
        match_inputs((mlp_batch()[0],), {"label": 3}, desc)


def test_a_keyword_both_typed_and_known_to_the_loss_is_one_input():
    """transformers' TypedDict of forward's **kwargs lists num_items_in_batch, which transformers.Trainer passes and
    orttrainer also knows as the loss function's keyword: one graph input, not two of one name."""
    pytest.importorskip("transformers", reason="the Hugging Face zoo needs transformers (the test extra)")
    model = bert_classifier()
    batch = classification_batch(2, 8, generator=torch.Generator().manual_seed(0))
    names, _, _ = match_inputs((), {**batch, "num_items_in_batch": torch.tensor(2)}, None, model)
    assert names == ["input_ids", "attention_mask", "labels", "num_items_in_batch"]
