"""Audit ONNX Runtime's kernels on the zoo's training graphs for reads of memory they never wrote.

    .venv/bin/python docs/kernel_audit.py [zoo model name ...]

For each model of tests/zoo.py (Hugging Face and torch ones; all by default) the trainer builds its
training graph at the zoo's second batch shape; that graph, every intermediate made an output, then
runs in two fresh processes with ONNX Runtime's arena off, so each tensor is its own malloc, and
glibc filling new memory with a different byte in each (MALLOC_PERTURB_). A node whose output
differs between the two read memory it never wrote; MALLOC_CHECK_=3 makes a write past the end of
a buffer abort the process. Both found bugs of onnxruntime-training 1.19.2 that trained models other
than torch without a word (docs/stack_facts.md: ConvGrad's grouped 1-d/3-d overflow and its ignored
auto_pad). Run it after upgrading onnxruntime or adding to the zoo; nothing here is a test (it takes
minutes and depends on glibc).
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parent.parent
FILL_BYTES = (165, 51)


def save_training_graph(name: str, folder: str) -> None:
    """The zoo model's training graph at its second batch shape, its inputs' values beside it."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import test_zoo
    import zoo
    from parity import cpu_options

    from orttrainer import ORTTrainer, optim

    hugging_face = name in zoo.HUGGING_FACE_MODELS
    make, make_batch, kind = (zoo.HUGGING_FACE_MODELS if hugging_face else zoo.TORCH_MODELS)[name]
    torch.manual_seed(0)
    batches, _ = test_zoo._batches(make_batch, (test_zoo.HUGGING_FACE_SHAPES if hugging_face else test_zoo.SHAPES)[kind])
    path = os.path.join(folder, "train.onnx")
    options = cpu_options({"debug": {"graph_save_paths": {"model_with_training_graph_path": path},
                                     "check_against_torch": "off"}})  # audited even where the check would refuse it
    loss_fn = None if hugging_face else torch.nn.functional.cross_entropy  # test_zoo's
    trainer = ORTTrainer(make().train(), None, optim.SGDConfig(lr=0.1), loss_fn=loss_fn, options=options)
    for batch in batches[:2]:
        trainer.train_step(**batch) if hugging_face else trainer.train_step(*batch)
    batch = batches[1] if hugging_face else dict(zip([entry.name for entry in trainer.model_desc.inputs], batches[1]))
    weights = trainer.state_dict(pytorch_format=True)
    tensors = {key: value.numpy() for key, value in {**weights, **batch}.items() if isinstance(value, torch.Tensor)}
    np.savez(os.path.join(folder, "inputs.npz"), **tensors)  # a batch's bools (return_loss) are constants of the graph


def run_every_intermediate(folder: str, out: str) -> None:
    """Run the saved graph with every node output as a graph output, the CPU arena off; save all outputs."""
    import onnxruntime

    model = onnx.load(os.path.join(folder, "train.onnx"))
    named = {output.name for output in model.graph.output} | {graph_input.name for graph_input in model.graph.input}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in named:
                model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
                named.add(name)
    options = onnxruntime.SessionOptions()
    options.enable_cpu_mem_arena, options.enable_mem_pattern = False, False
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = np.load(os.path.join(folder, "inputs.npz"))
    feeds = {}
    for graph_input in session.get_inputs():
        name = graph_input.name
        key = name[: -len(".lookup")] if name.endswith(".lookup") else name
        if key in values:
            feeds[name] = values[key]
        elif "scale" in name:  # the dropout scale (0: off, as the first-step check runs) and a loss scale
            feeds[name] = np.array(0.0 if "dropout" in name else 1.0, np.float32)
    names = [output.name for output in session.get_outputs()]
    np.savez(out, names=np.array(names), **{f"v{index}": value for index, value in enumerate(session.run(None, feeds))})


def differing_nodes(folder: str, first: str, second: str) -> list:
    """(node name, op type, output) of each output that differs between the two runs, in graph order."""
    model = onnx.load(os.path.join(folder, "train.onnx"))
    producers = {output: node for node in model.graph.node for output in node.output}
    order = {node.name: index for index, node in enumerate(model.graph.node)}
    a, b = np.load(first), np.load(second)
    found = []
    for index, name in enumerate(a["names"]):
        x, y = a[f"v{index}"], b[f"v{index}"]
        if x.shape != y.shape or not np.array_equal(x, y, equal_nan=True):
            node = producers.get(str(name))
            found.append((order.get(node.name, -1) if node else -1, node.name if node else "", node.op_type if node else "", str(name)))
    return [row[1:] for row in sorted(found)]


def audit(name: str) -> str:
    with tempfile.TemporaryDirectory(prefix="kernel_audit_") as folder:
        step = [sys.executable, __file__, "--step"]
        saved = subprocess.run(step + ["save", name, folder], capture_output=True, text=True)
        if saved.returncode:
            return f"{name}: could not build ({saved.stderr.strip().splitlines()[-1] if saved.stderr.strip() else saved.returncode})"
        outputs = []
        for fill in FILL_BYTES:
            out = os.path.join(folder, f"run{fill}.npz")
            env = {**os.environ, "MALLOC_PERTURB_": str(fill), "MALLOC_CHECK_": "3"}
            run = subprocess.run(step + ["run", name, folder, out], capture_output=True, text=True, env=env)
            if run.returncode:
                return f"{name}: the run aborted (exit {run.returncode}): a write outside a buffer? {run.stderr.strip()[-200:]}"
            outputs.append(out)
        differing = differing_nodes(folder, *outputs)
        if not differing:
            return f"{name}: every output the same"
        listed = "; ".join(f"{op_type} '{node}' -> {output}" for node, op_type, output in differing[:5])
        return f"{name}: {len(differing)} outputs read memory never written, first: {listed}"


def main():
    if sys.argv[1:2] == ["--step"]:
        action, name, folder, *rest = sys.argv[2:]
        if action == "save":
            save_training_graph(name, folder)
        else:
            run_every_intermediate(folder, rest[0])
        return
    sys.path.insert(0, str(ROOT / "tests"))
    import zoo

    for name in sys.argv[1:] or [*zoo.TORCH_MODELS, *zoo.HUGGING_FACE_MODELS]:
        print(audit(name), flush=True)


if __name__ == "__main__":
    main()
