"""jax-cake-gdn: Gated DeltaNet training kernels for JAX (pure-JAX and CUDA backends)."""

from .conv import short_conv
from .gdn import gdn, saved_bytes, saved_layout

__all__ = ["gdn", "short_conv", "saved_layout", "saved_bytes"]
__version__ = "0.1.0"
