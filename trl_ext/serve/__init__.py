"""vLLM servers beside the trainer: the policy's inference servers and the teacher's (docs/layout.md)."""
