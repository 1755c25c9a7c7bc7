"""flash_qla: fused chunked Gated Delta Rule (GDN) prefill, forward and backward."""

from flash_qla.api import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flash_qla.ops.buffers import release_scratch

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_fwd",
    "chunk_gated_delta_rule_bwd",
    "release_scratch",
    "__version__",
]
