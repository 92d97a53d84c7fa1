"""trl-ext: research extensions of TRL's GRPOTrainer (gradient routing, off-policy rollouts, context distillation,
environments). The Python API::

    from trl_ext import ExtGRPOConfig, ExtGRPOTrainer

Both names are imported on first use, so that ``import trl_ext.<module>`` stays light.
"""

__all__ = ["ExtGRPOConfig", "ExtGRPOTrainer"]


def __getattr__(name: str):
    if name == "ExtGRPOConfig":
        from trl_ext.config import ExtGRPOConfig

        return ExtGRPOConfig
    if name == "ExtGRPOTrainer":
        from trl_ext.trainer import ExtGRPOTrainer

        return ExtGRPOTrainer
    raise AttributeError(f"module 'trl_ext' has no attribute {name!r}")
