"""Context parallelism (KCP) for GDN under jax.shard_map: layouts, plan, exchanges, gdn_kcp."""

from .gdn_kcp import gdn_kcp
from .layout import LAYOUTS, from_layout, to_layout
from .plan import KcpPlan, plan_kcp

__all__ = ["gdn_kcp", "to_layout", "from_layout", "plan_kcp", "KcpPlan", "LAYOUTS"]
