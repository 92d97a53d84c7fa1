"""Registration of off-policy training (`trl_ext.parts.FEATURES` "offpolicy"; its generator is
`trl_ext.offpolicy.source`)."""

from __future__ import annotations

from trl_ext.offpolicy.args import OffPolicyArgs
from trl_ext.parts import FEATURES, Feature


class OffPolicy(Feature):
    """The off-policy loss and the asynchronous generator (``--max_async_level``; the trainer reads its flags). Under
    FSDP2 the generator's plain copy is loaded with whole tensors gathered from the shards at its start and at each
    publish (`trl_ext.offpolicy.sharded`); not under DeepSpeed (not run there)."""

    what = "off-policy training"
    flags = OffPolicyArgs

    def supports(self, launch) -> str | None:
        return None if launch.sharding == "FSDP" else launch.unsharded(self.what)


FEATURES.add("offpolicy", OffPolicy())
