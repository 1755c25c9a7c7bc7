"""PyTorch references: the token-by-token oracle and the chunked WY form of DESIGN.md §1."""

from flash_qla.reference.chunked import (
    CHUNK_SIZE,
    chunk_gated_delta_rule_bwd_ref,
    chunk_gated_delta_rule_fwd_ref,
    chunk_local_cumsum,
)
from flash_qla.reference.inputs import make_inputs
from flash_qla.reference.naive import naive_recurrent_gated_delta_rule

__all__ = [
    "CHUNK_SIZE",
    "chunk_gated_delta_rule_bwd_ref",
    "chunk_gated_delta_rule_fwd_ref",
    "chunk_local_cumsum",
    "make_inputs",
    "naive_recurrent_gated_delta_rule",
]
