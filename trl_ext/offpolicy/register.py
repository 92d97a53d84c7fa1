"""Registration of off-policy training (`trl_ext.parts.FEATURES` "offpolicy"; its generator is
`trl_ext.offpolicy.source`)."""

from __future__ import annotations

from trl_ext.offpolicy.args import OffPolicyArgs
from trl_ext.parts import FEATURES, Feature


class OffPolicy(Feature):
    """The off-policy loss and the asynchronous generator (``--max_async_level``; the trainer reads its flags). Not
    under FSDP / DeepSpeed: the generator deep-copies the model and publishes its trainable parameters."""

    what = "off-policy training"
    flags = OffPolicyArgs

    def supports(self, launch) -> str | None:
        return launch.unsharded(self.what)


FEATURES.add("offpolicy", OffPolicy())
