"""A rank whose first-step check against torch fails ends every rank promptly (torchrun, gloo, 2 processes on the CPU)."""

import time

import pytest
from test_distributed import HERE, launch

from orttrainer.export.verify import FIRST_STEP

# Rank 1's module doubles its output outside the export (so its graphs are rank 0's, but torch's step differs): with
# "first", on every batch; with "later", on sequences of 9 only, which rank 1 alone meets from step 2 on: a
# sequence-first encoder needs a graph per length, so rank 1 builds and checks one there by itself, while rank 0
# trains on its first graph.
JOB = f"""
import os, sys, torch
sys.path.insert(0, {str(HERE)!r})
from models import VOCAB, SeqFirstEncoder, lm_loss
from orttrainer import ORTTrainer, ORTTrainerOptions, optim

case, rank = sys.argv[1], int(os.environ["RANK"])

class OtherOnRank1(SeqFirstEncoder):
    def forward(self, tokens):
        out = super().forward(tokens)
        differs = case == "first" or tokens.shape[0] == 9
        return out * 2 if differs and rank == 1 and not torch.onnx.is_in_onnx_export() else out

trainer = ORTTrainer(OtherOnRank1(), None, optim.SGDConfig(), loss_fn=lm_loss,
                     options=ORTTrainerOptions({{"device": {{"id": "cpu"}}, "batch": {{"gradient_accumulation_steps": 2}}}}))
for step in range(6):
    length = 9 if case == "later" and rank == 1 and step >= 2 else 12
    generator = torch.Generator().manual_seed(step)
    trainer.train_step(*(torch.randint(0, VOCAB, (length, 5), generator=generator) for _ in range(2)))
    print(f"rank {{rank}} step {{step}} done", flush=True)
"""


@pytest.mark.parametrize("case, failing_step", [("first", 0), ("later", 2)])
def test_a_rank_whose_first_step_check_fails_ends_every_rank_promptly_naming_it(tmp_path, case, failing_step):
    """Rank 1's check fails at ``failing_step``; it trains on to the window's end (the step after), where every rank
    raises TorchMismatchError naming rank 1 and its cause, instead of rank 0 waiting at the gradient all-reduce."""
    script = tmp_path / "check_fails_on_rank_1.py"
    script.write_text(JOB)
    start = time.monotonic()
    result = launch([script, case], 2, timeout=240)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    error = ("orttrainer.export.verify.TorchMismatchError: the first step's check against torch (debug.check_against_torch) "
             f"failed on rank 1: TorchMismatchError: {FIRST_STEP}:")  # fmt: skip
    for rank in (0, 1):
        assert f"[rank{rank}]: {error}" in result.stderr, result.stderr[-4000:]  # torch prefixes each rank's traceback
        assert f"rank {rank} step {failing_step} done" in result.stdout  # rank 1 trained on to the window's end
        assert f"rank {rank} step {failing_step + 1} done" not in result.stdout  # where no rank updated
    assert "rank 0: TorchMismatchError" not in result.stderr
    assert elapsed < 60
