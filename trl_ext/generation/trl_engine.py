"""Registration of TRL's own generation (`trl_ext.parts.GENERATION_SOURCES` "trl", and its engines "vllm" and
"continuous_batching", selected by TRL's flag ``--use_transformers_continuous_batching``; vLLM's is
``trl_ext.vllm.register``)."""

from __future__ import annotations

from trl_ext.parts import GENERATION_SOURCES, GenerationSource


class TrlGenerate(GenerationSource):
    """TRL's synchronous generation (``--generation_backend trl``, ``--max_async_level 0``): supported everywhere."""

    def selected(self, run, cfg) -> bool:
        return cfg.generation_backend == "trl" and cfg.max_async_level == 0


class TrlEngine(GenerationSource):
    """One of TRL's generation engines, selected by its flag: not yet run on several processes nor sharded."""

    def __init__(self, flag: str, what: str):
        self.flags, self.what = (flag,), what

    def supports(self, launch) -> str | None:
        return launch.one_process(self.what) or launch.unsharded(self.what)


GENERATION_SOURCES.add("trl", TrlGenerate())
GENERATION_SOURCES.add("continuous_batching", TrlEngine("use_transformers_continuous_batching",
                                                        "continuous-batching generation"))
