"""jax-cake-gdn: Gated DeltaNet training kernels for JAX (pure-JAX and CUDA backends)."""

from .conv import short_conv
from .gdn import gdn, saved_bytes, saved_layout
from .kcp import from_layout, gdn_kcp, plan_kcp, to_layout
from .recurrent import gdn_step

__all__ = ["gdn", "gdn_kcp", "short_conv", "saved_layout", "saved_bytes", "to_layout",
           "from_layout", "plan_kcp", "GatedDeltaNet", "gdn_step"]
__version__ = "0.1.0"


def __getattr__(name):
    # The Flax layer imports flax, which the ops themselves do not need: load it on first use.
    if name == "GatedDeltaNet":
        from .layers import GatedDeltaNet

        return GatedDeltaNet
    raise AttributeError(f"module 'jax_cake_gdn' has no attribute {name!r}")
