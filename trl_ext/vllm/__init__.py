"""vLLM generation (``--use_vllm``): TRL's colocate engine with a weight sync that works on CPU and GPU and merges
every adapter (``trainer``, ``weights``), and an engine for the off-policy generator (``engine``); flags and
refusals in ``args``, registration in ``register``. Guide: docs/vllm.md."""
