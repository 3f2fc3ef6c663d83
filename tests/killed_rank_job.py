"""samples/torchrun_ddp.py with rank 1 killed (SIGKILL, no cleanup) right after its training step KILL_AFTER,
on torchrun's first attempt only: a crash for torchrun --max-restarts to recover from.

    torchrun ... killed_rank_job.py KILL_AFTER <the sample's arguments>
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from orttrainer import ORTTrainer

SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "torchrun_ddp.py"


def main():
    kill_after, sys.argv = int(sys.argv[1]), [str(SAMPLE), *sys.argv[2:]]
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        train_step, steps = ORTTrainer.train_step, []

        def train_step_then_die(self, *args, **kwargs):
            outputs = train_step(self, *args, **kwargs)
            steps.append(None)
            if len(steps) == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return outputs

        ORTTrainer.train_step = train_step_then_die
    sys.path.insert(0, str(SAMPLE.parent))  # the sample imports digits_classifier beside it
    runpy.run_path(str(SAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
