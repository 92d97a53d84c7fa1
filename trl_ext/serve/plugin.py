"""The project's vLLM general plugin (``pyproject.toml``: entry point group ``vllm.general_plugins``, which vLLM loads
in every one of its processes): registers the ``gloo`` weight-transfer backend (``trl_ext.serve.gloo_transfer``) in
vLLM's worker and trainer factories by module path, so nothing is imported until a server or trainer uses them."""

from __future__ import annotations


def register() -> None:
    """Register ``gloo`` in both of vLLM's weight-transfer factories (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, name in ((WeightTransferEngineFactory, "GlooWeightTransferEngine"),
                          (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine")):  # fmt: skip
        try:
            factory.register_engine("gloo", "trl_ext.serve.gloo_transfer", name)
        except ValueError:  # registered already in this process
            pass
