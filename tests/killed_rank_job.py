"""samples/torchrun_ddp.py with rank 1 killed (SIGKILL, no cleanup) right after its training step KILL_AFTER,
once per job: a crash for torchrun --max-restarts to recover from.

    torchrun ... killed_rank_job.py KILL_AFTER KILLED_MARKER <the sample's arguments>

Rank 1 creates the file KILLED_MARKER just before it dies, and no rank dies once it exists: TORCHELASTIC_RESTART_COUNT
cannot tell the first attempt, as each agent counts its own restarts (with several nodes, the agent of a node whose
workers did not fail restarts them without counting).
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from orttrainer import ORTTrainer

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "torchrun_ddp.py"


def main():
    kill_after, marker, sys.argv = int(sys.argv[1]), Path(sys.argv[2]), [str(SAMPLE), *sys.argv[3:]]
    if os.environ["RANK"] == "1" and not marker.exists():
        train_step, steps = ORTTrainer.train_step, []

        def train_step_then_die(self, *args, **kwargs):
            outputs = train_step(self, *args, **kwargs)
            steps.append(None)
            if len(steps) == kill_after:
                marker.touch(exist_ok=False)
                os.kill(os.getpid(), signal.SIGKILL)
            return outputs

        ORTTrainer.train_step = train_step_then_die
    sys.path.insert(0, str(SAMPLE.parent))  # the sample imports digits_classifier beside it
    runpy.run_path(str(SAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
