"""Sample from a checkpoint, check diversity and rewards, show the reward history and the routing ablations.

    uv run eval_run.py --model_path output/<run>/checkpoint-2000 --n_samples 20 --eval_rewards a,b
    uv run eval_run.py --model_path output/<run>/checkpoint-2000 --dataset data/test.jsonl   # a prompt dataset

Details: trl_ext/evaluate.py. A wrong --model_path exits with code 2 before anything is loaded.
"""

import sys

from trl_ext.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
