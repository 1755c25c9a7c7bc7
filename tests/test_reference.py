"""The references checked against each other in float64: chunked WY form vs token-by-token recurrence,
and the stage-by-stage backward (the kernels' spec) vs autograd through the chunked form."""

import pytest
import torch

from flash_qla.reference import (
    CHUNK_SIZE,
    chunk_gated_delta_rule_bwd_ref,
    chunk_gated_delta_rule_fwd_ref,
    chunk_local_cumsum,
    make_inputs,
    naive_recurrent_gated_delta_rule,
)
from flash_qla.reference.backward_stages import BETA_MIN, chunk_gated_delta_rule_bwd_stages, dbeta_by_quotient
from flash_qla.reference.inputs import parse_seqs
from helpers import CASES, Case, FP64_REL, chunk_bounds, cu_seqlens_of, randn_like, rel_err

# make_inputs' k: unit rows in float32 rounded to bf16 (2^-9 relative an element): the norm moves by a few 1e-3
BF16_UNIT_NORM_TOL = 1e-2


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunked_forward_matches_naive(case):
    x = case.inputs()
    _, _, o, _, final_state = chunk_gated_delta_rule_fwd_ref(**x)
    o_ref, final_ref = naive_recurrent_gated_delta_rule(**x)
    assert rel_err(o, o_ref) <= FP64_REL
    assert rel_err(final_state, final_ref) <= FP64_REL


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunked_backward_matches_autograd_through_naive(case):
    x = case.inputs()
    g_cum, _, o, _, final_state = chunk_gated_delta_rule_fwd_ref(**x)
    do, dht = randn_like(o, seed=1), randn_like(final_state, seed=2)
    grads = chunk_gated_delta_rule_bwd_ref(
        x["q"], x["k"], x["v"], g_cum, x["beta"], do, dht,
        initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
    )  # fmt: skip

    names = ["q", "k", "v", "beta", "g"] + (["initial_state"] if case.initial_state else [])
    leaves = {name: x[name].clone().requires_grad_() for name in names}
    o_ref, final_ref = naive_recurrent_gated_delta_rule(**{**x, **leaves})
    expected = torch.autograd.grad([o_ref, final_ref], list(leaves.values()), [do, dht])
    for name, got, want in zip(names, grads, expected):
        assert rel_err(got, want) <= FP64_REL, name


def stages_and_chunked_backward(x):
    """The gradients of the stage formulas (fed the forward's A) and of the chunked backward, for inputs x."""
    g_cum, A, o, _, final_state = chunk_gated_delta_rule_fwd_ref(**x)
    do, dht = randn_like(o, seed=1), randn_like(final_state, seed=2)
    args = (x["q"], x["k"], x["v"], g_cum, x["beta"])
    options = dict(initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    got = chunk_gated_delta_rule_bwd_stages(*args, A, do, dht, **options)
    return got, chunk_gated_delta_rule_bwd_ref(*args, do, dht, **options)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backward_stages_match_chunked_backward(case):
    """The stage formulas, fed the forward's A, give the gradients autograd finds through the chunked form."""
    got, expected = stages_and_chunked_backward(case.inputs())
    for name, g, e in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), got, expected):
        if name == "dh0" and not case.initial_state:
            assert g is None and e is None
            continue
        assert g.shape == e.shape and g.dtype == e.dtype == torch.float64, name
        assert rel_err(g, e) <= FP64_REL, name


def test_backward_stages_take_the_products_where_beta_is_small():
    """dβ is the quotient rowsum(dU ⊙ v_new) / β² only in chunks whose valid β are all ≥ BETA_MIN (every other case
    here takes it everywhere); chunks with β = 0 or below BETA_MIN take the products, and still give autograd's
    gradients. The chunk of tokens 64-127 of the first sequence keeps β as drawn: both forms in one call."""
    case = Case("varlen-small-beta", lengths=(200, 65), Hqk=1, Hv=2, initial_state=True)
    x = case.inputs()
    for t, h, value in ((5, 0, 0.0), (140, 1, BETA_MIN / 4), (210, 0, 0.0), (264, 1, 1e-30)):
        x["beta"][0, t, h] = value
    got, expected = stages_and_chunked_backward(x)
    for name, g, e in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), got, expected):
        assert torch.isfinite(g).all() and rel_err(g, e) <= FP64_REL, name


def test_dbeta_takes_the_quotient_only_where_every_valid_beta_is_at_least_beta_min():
    """The rule itself (in float64 both forms agree with autograd except at β = 0, so the test above cannot tell
    them apart elsewhere): one chunk a row, 64 tokens, the last 20 of the fourth past its end."""
    beta = torch.full((4, 64), 0.5, dtype=torch.float64)
    valid = torch.ones(4, 64, dtype=torch.bool)
    beta[1, 7] = BETA_MIN * (1 - 2**-20)  # just below
    beta[2, 7] = -BETA_MIN  # at it, in magnitude
    beta[3, 50], valid[3, 44:] = 0.0, False  # zero past the end
    assert dbeta_by_quotient(beta, valid).flatten().tolist() == [True, False, True, True]


@pytest.mark.parametrize("lengths", [(200,), (0, 1, 65, 130), (64, 64, 0)], ids=lambda x: "-".join(map(str, x)))
def test_chunk_local_cumsum_restarts_at_every_chunk_and_sequence(lengths):
    g = torch.randn(1, sum(lengths), 3, dtype=torch.float64)
    forward, backward = torch.empty_like(g), torch.empty_like(g)
    for _, start, end in chunk_bounds(lengths, CHUNK_SIZE):
        forward[:, start:end] = g[:, start:end].cumsum(1)
        backward[:, start:end] = g[:, start:end].flip(1).cumsum(1).flip(1)
    cu_seqlens = cu_seqlens_of(lengths)
    torch.testing.assert_close(chunk_local_cumsum(g, cu_seqlens), forward)
    torch.testing.assert_close(chunk_local_cumsum(g, cu_seqlens, reverse=True), backward)


def test_chunk_local_cumsum_dense_rows_are_sequences():
    g = torch.randn(2, 150, 3, dtype=torch.float64)
    packed = chunk_local_cumsum(g.view(1, 300, 3), cu_seqlens_of([150, 150]))
    torch.testing.assert_close(chunk_local_cumsum(g), packed.view(2, 150, 3))


def test_naive_value_head_reads_qk_head_h_div_group():
    Hqk, Hv = 2, 6
    x = make_inputs(1, 40, Hqk, Hv, 8, 8, torch.float64)
    o, final_state = naive_recurrent_gated_delta_rule(**x)
    for h in range(Hv):
        qk_head = [h // (Hv // Hqk)]
        o_h, final_h = naive_recurrent_gated_delta_rule(
            x["q"][:, :, qk_head], x["k"][:, :, qk_head],
            x["v"][:, :, [h]], x["g"][:, :, [h]], x["beta"][:, :, [h]],
        )  # fmt: skip
        torch.testing.assert_close(o[:, :, [h]], o_h)
        torch.testing.assert_close(final_state[:, [h]], final_h)


@pytest.mark.parametrize("strong_decay", [False, True], ids=["model-decay", "strong-decay"])
def test_make_inputs_look_like_a_model(strong_decay):
    x = make_inputs(2, 50, 2, 4, 16, 32, torch.bfloat16, strong_decay=strong_decay)
    assert x["q"].dtype == x["k"].dtype == x["v"].dtype == x["beta"].dtype == torch.bfloat16
    assert x["g"].dtype == torch.float32
    torch.testing.assert_close(x["k"].float().norm(dim=-1), torch.ones(2, 50, 2), atol=BF16_UNIT_NORM_TOL, rtol=0)
    assert ((x["beta"] > 0) & (x["beta"] < 1)).all()
    assert (x["g"] < 0).all()
    assert (x["g"].median() < -1) == strong_decay


@pytest.mark.parametrize(
    "label, seqlens",
    [("1x2048", [2048]), ("4096x8", [4096] * 8), ("8192x4", [8192] * 4), ("28672+4096", [28672, 4096]), ("77", [77])],
)
def test_sequence_labels_read_as_design_md_writes_them(label, seqlens):
    """DESIGN.md §4's labels (the benchmark's and the profiles' --seqs): length x count, one sequence for 1xT."""
    assert parse_seqs(label) == seqlens
