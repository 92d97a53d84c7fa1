"""Run a grid of train.py runs on one machine, resumably.

    uv run sweep.py --reward happy_binary --grid seed=1,2 beta=0.01,0.02 --fixed max_steps=200 --dry_run

Details: trl_ext/sweep.py. A configuration error exits with code 2 before any run is launched.
"""

import sys

from trl_ext.sweep import main

if __name__ == "__main__":
    sys.exit(main())
