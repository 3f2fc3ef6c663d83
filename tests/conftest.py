"""Shared test helpers: the environment of the subprocesses tests start."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Set by torchrun for its workers. A child that inherits them (pytest itself run under
# torchrun, or a CI job that exports them) would think it is one rank of a larger job.
TORCHRUN_VARIABLES = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
)  # fmt: skip


def subprocess_env(*extra_paths, **variables) -> dict:
    """``os.environ`` for a child process that imports orttrainer from this checkout.

    The repository root, then ``extra_paths``, come first on PYTHONPATH (so a child finds
    this checkout even where orttrainer is not installed); torchrun's variables are
    removed; ``variables`` are set last (a value of None removes the variable).
    """
    env = {name: value for name, value in os.environ.items()
           if name not in TORCHRUN_VARIABLES and not name.startswith("TORCHELASTIC_")}  # fmt: skip
    paths = [str(ROOT), *map(str, extra_paths), os.environ.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(filter(None, paths)))
    for name, value in variables.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = str(value)
    return env


@pytest.fixture
def child_env() -> dict:
    """The environment for a subprocess started by a test (see ``subprocess_env``)."""
    return subprocess_env()
