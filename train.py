"""Train a policy with GRPO and the project's extensions.

    uv run train.py --reward happy_binary --model builtin --lr 3e-4 --max_steps 120

Every GRPOConfig / TrainingArguments field is a flag too (`uv run train.py --help`).
A configuration error exits with code 2 before any model is loaded.
"""

import os
import sys

# Before torch is imported: with OpenMP's default spin-waiting, 2-thread torch runs several times
# slower whenever another process shares the cores (a parallel sweep, the test suite).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from trl_ext.cli_train import main  # noqa: E402
from trl_ext.launch.processes import end_processes  # noqa: E402

if __name__ == "__main__":
    code = main()
    end_processes()  # every rank, after its last collective (a refusal included)
    sys.exit(code)
