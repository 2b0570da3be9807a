"""jax-cake-gdn: Gated DeltaNet training kernels for JAX (pure-JAX and CUDA backends)."""

from importlib import metadata as _metadata

from .conv import short_conv
from .gdn import gdn, saved_bytes, saved_layout
from .kcp import from_layout, gdn_kcp, plan_kcp, to_layout
from .recurrent import gdn_step

__all__ = ["gdn", "gdn_kcp", "short_conv", "saved_layout", "saved_bytes", "to_layout",
           "from_layout", "plan_kcp", "GatedDeltaNet", "gdn_step"]
try:  # the version is written once, in pyproject.toml
    __version__ = _metadata.version("jax-cake-gdn")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name):
    # The Flax layer imports flax, which the ops themselves do not need: load it on first use.
    if name == "GatedDeltaNet":
        from .layers import GatedDeltaNet

        return GatedDeltaNet
    raise AttributeError(f"module 'jax_cake_gdn' has no attribute {name!r}")
