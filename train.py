"""Train a policy with GRPO and the project's extensions.

    uv run train.py --reward happy_binary --model builtin --lr 3e-4 --max_steps 120

Every GRPOConfig / TrainingArguments field is a flag too (`uv run train.py --help`).
A configuration error exits with code 2 before any model is loaded.
"""

import sys

from trl_ext.cli_train import main

if __name__ == "__main__":
    sys.exit(main())
