"""The log lines of slow build phases (progress.py): what a large model's first step spends its minutes on."""

import logging

import torch.nn.functional as F
from models import MLP, mlp_batch
from parity import cpu_options

from orttrainer import ORTTrainer, optim, progress


def test_each_slow_phase_of_the_first_step_logs_one_line_with_its_time_and_the_models_size(monkeypatch, caplog):
    """Every phase counts as slow here (SLOW_PHASE_SECONDS 0): export, training graph, sessions and the first-step
    check each log one line, the model's size in it; a second step logs nothing; the logger's level silences them.
    Until the program configures the logger, it prints them to stderr as 'orttrainer: ...'."""
    record = logging.makeLogRecord({"msg": "x"})
    assert not progress.logger.propagate and any(  # pytest's logging plugin adds its own handlers beside it
        isinstance(handler, logging.StreamHandler) and handler.format(record) == "orttrainer: x"
        for handler in progress.logger.handlers)  # fmt: skip
    monkeypatch.setattr(progress, "SLOW_PHASE_SECONDS", 0.0)
    monkeypatch.setattr(progress.logger, "handlers", [caplog.handler])
    trainer = ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options())
    trainer.train_step(*mlp_batch())
    assert [record.getMessage().split(" in ")[0] for record in caplog.records] == [
        "exported MLP (0.0M parameters, 0.00 GiB) at [[8, 32], [8]]",
        "built the training graph (0.0M parameters, 0.00 GiB to train)",
        "opened the ONNX Runtime sessions on cpu",
        "checked the first step against torch (debug.check_against_torch)",
    ]
    assert all(record.getMessage().endswith(" s") and record.levelno == logging.INFO for record in caplog.records)
    caplog.clear()
    trainer.train_step(*mlp_batch())
    assert not caplog.records
    progress.logger.setLevel(logging.WARNING)  # what a user does to silence them
    try:
        ORTTrainer(MLP(), None, optim.SGDConfig(lr=0.1), loss_fn=F.cross_entropy, options=cpu_options()).train_step(*mlp_batch())
    finally:
        progress.logger.setLevel(logging.INFO)
    assert not caplog.records


def test_size_of_counts_elements_and_bytes():
    import torch

    assert progress.size_of([torch.zeros(1000, 1000), torch.zeros(250_000, dtype=torch.float64)]) == \
        "1.2M parameters, 0.01 GiB"  # fmt: skip
