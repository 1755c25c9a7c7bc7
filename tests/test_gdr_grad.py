"""Gradients of the GPU path vs the fp32 PyTorch reference (skips without CUDA).

What is checked, every kernel output poisoned with NaN first (an element the kernels never
write fails the check):

- test_gradients_match_reference: dq, dk, dv, dg, dbeta and dh0 of flash_qla.chunk_gated_delta_rule
  (autograd, random upstream gradients of both o and final_state), and the training forward's o and
  final_state (its walks keep states or checkpoints, which inference's do not), against autograd through the
  chunked reference in fp32 on the same rounded inputs, over the forward's case table plus a varlen
  case whose sequences' first tokens have dg = 0. With use_qk_l2norm_in_kernel the gradients are
  those of the raw, un-normalised q and k; with state_v_first those of the [N, Hv, V, K] states.
- test_low_level_backward_matches_reference: flash_qla.chunk_gated_delta_rule_bwd, fed the kernel
  forward's g_cum and A, against chunk_gated_delta_rule_bwd_ref.
- test_backward_is_deterministic: two runs of one backward give bitwise-identical gradients.
- test_chunk_grads_independent_of_block_count: chunk_grads' persistent blocks (one per SM) give
  bitwise the gradients of one block and of three walking every chunk, empty slots included, with
  whole items and with each item's v-heads in two parts.
- test_chunk_grads_in_parts_match_whole_items: an item's v-heads in two parts (the first part to
  count itself publishes its fp32 dq and dk sums, the second adds them) against whole items, twice,
  over two inputs (the counts left zero).
- test_training_backward_takes_the_forward_kkt_outputs: the training backward reuses the forward's
  P, γ and gates (no kkt_solve) and matches the low-level backward bitwise.
- test_checkpointed_recompute_is_exact, test_split_backward_matches_whole_walk: the backward's
  state recompute from the forward's checkpoints, and its walk split into pieces of a sequence.
- test_kept_states_give_the_recomputed_gradients, test_kept_states_are_saved_only_when_asked:
  keep_states (the forward keeps every state, the backward recomputes none) gives bitwise the
  gradients of the recompute, and saves the states only when asked, or by default where they are
  small (so the table above runs its short cases with kept states, the long ones recomputed; the
  recompute of short ones is checked bitwise against the kept states here, and against the
  reference through the low-level backward, which always recomputes).
- test_gradients_of_one_output: a loss of o alone (the backward gets dht None, not a filled zero
  tensor) or of final_state alone, against the reference.
- test_cuda_graph_replays_the_eager_results: a training step (whole, and with the split forced),
  and the low-level forward and backward, captured in a CUDA graph (the backward's second stream,
  and the split forward's, join the capture) and replayed on new inputs give the eager results bitwise.
- test_compiled_training_is_the_eager_step: under torch.compile (fullgraph, capture_dynamic_output_shape_ops), the
  training operator pair gives bitwise the eager step's outputs and gradients.
- test_training_matches_reference: a tiny GatedDeltaNet layer trained with the kernels and with the
  reference on the GPU reaches the same loss, and the loss goes down.
"""

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import flash_qla
import flash_qla.autograd as autograd_module
import flash_qla.ops.backward as backward_module
import flash_qla.ops.forward as forward_module
from flash_qla.reference.chunked import _forward_from_gcum, chunk_gated_delta_rule_bwd_ref, chunk_local_cumsum
from gpu_cases import CASES, FWD_TOL, Case, case_inputs, drop_plans, patch_planner, record_calls, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# The backward runs about twice the rounded tensor-core products of the forward (states recomputed,
# dv_new, dU, dP, dN, each from bf16 operands), and dg is a reverse cumsum of differences of such
# terms. The bar for bf16 gradients is 1e-2 relative L2; fp16 rounds finer and takes it too.
GRAD_TOL = 1e-2
# Without an initial state a sequence's first token has dg = 0 exactly (its gate decays a zero
# state; every other term cancels in the chunk's sum), so whatever the kernels return there is error:
# RMS over those tokens, relative to the RMS of the reference dg over all tokens. The kernels sum the
# cancelling terms in fp32: measured at most 3.1e-7 over the table (benchmark/NOTES.md v41-v63); a term
# that went through bf16 would leave ~2^-8 of itself, ~1e-3.
FIRST_TOKEN_DG_TOL = 1e-5
# The split backward walk against the whole one: the pieces start from end gradients composed in fp32 and
# walk their chunks from other starts, so the two round apart; measured at most 3.6e-3 (split_bwd_one_long_h0's
# dk, weak gates; benchmark/NOTES.md v41). A wrong start gradient of a piece is off by order 1.
SPLIT_APART_TOL = 1e-2

GRAD_CASES = CASES + [
    # 1-token sequences, chunk edges, no initial state: dg = 0 at every sequence's first token.
    Case("varlen_first_token_dg", (1, 1, 200, 1, 64, 65, 1, 3, 1, 130), heads=(4, 8)),
    # fp16, one sequence over 32 heads, the states kept: the backward walk alone at V-tiles of 32 (fused_bwd)
    Case("fp16_one_seq_bwd32", (2048,), dtype=torch.float16),
]


def reference_gdr(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                  use_qk_l2norm_in_kernel=False, state_v_first=False):  # fmt: skip
    """chunk_gated_delta_rule as differentiable fp32 PyTorch (the chunked reference), on any device.

    Returns o and final_state in float32, final_state in the user's layout.
    """
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    if initial_state is not None:
        initial_state = (initial_state.transpose(-1, -2) if state_v_first else initial_state).float()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g_cum = chunk_local_cumsum(g, cu_seqlens)
    _, o, _, final_state = _forward_from_gcum(q, k, v, g_cum, beta, scale, initial_state, cu_seqlens)
    return o, (final_state.transpose(-1, -2) if state_v_first else final_state)


def flash_qla_gdr(**kwargs):
    return flash_qla.chunk_gated_delta_rule(**kwargs, output_final_state=True)


def _randn(shape, dtype, seed):
    """Seeded standard normal noise on the GPU (upstream gradients)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=gen, device="cuda").to(dtype)


def _num_seqs(case):
    return case.dense[0] if case.dense else len(case.seqlens)


def _first_tokens(case):
    """Flat token index of every non-empty sequence's first token."""
    if case.dense:
        B, T = case.dense
        return torch.arange(B) * T
    starts = itertools.accumulate(case.seqlens, initial=0)
    return torch.tensor([start for start, n in zip(starts, case.seqlens) if n > 0])


def _grads(gdr, inputs, do, dht, with_outputs=False, **options):
    """{"dq", "dk", ...}: autograd of gdr's (o, final_state) w.r.t. every tensor in inputs; with_outputs:
    "o" and "final_state" besides (the training forward's, which no gradient depends on)."""
    leaves = {name: x.detach().clone().requires_grad_() for name, x in inputs.items()}
    o, final_state = gdr(**leaves, **options)
    grads = torch.autograd.grad([o, final_state], list(leaves.values()), [do.to(o.dtype), dht])
    got = {"dh0" if name == "initial_state" else "d" + name: grad for name, grad in zip(leaves, grads)}
    if with_outputs:
        got.update(o=o.detach(), final_state=final_state.detach())
    return got


def _tolerance(name):
    """The bar of one output or gradient against the reference."""
    return FWD_TOL if name in ("o", "final_state") else GRAD_TOL


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c.id for c in GRAD_CASES])
def test_gradients_match_reference(case, poisoned):
    seed = zlib.crc32(case.id.encode())
    x, cu, h0 = case_inputs(case, seed)
    options = {
        "scale": case.extra.get("scale"),
        "cu_seqlens": cu,
        "state_v_first": case.extra.get("state_v_first", False),
        "use_qk_l2norm_in_kernel": case.extra.get("use_qk_l2norm_in_kernel", False),
    }
    inputs = dict(x)
    if h0 is not None:  # in the user's layout, so dh0 is too
        inputs["initial_state"] = h0.transpose(-1, -2).contiguous() if options["state_v_first"] else h0
    Hv = case.heads[1]
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    dht = _randn((_num_seqs(case), Hv, 128, 128), torch.float32, seed + 2)

    got = _grads(flash_qla_gdr, inputs, do, dht, with_outputs=True, **options)
    want = _grads(reference_gdr, {name: t.float() for name, t in inputs.items()}, do, dht, with_outputs=True, **options)

    errors = {name: rel_l2(got[name], want[name]) for name in want}
    if h0 is None:  # the first tokens' dg is exactly 0
        first = _first_tokens(case).to(x["g"].device)
        dg, dg_ref = got["dg"].flatten(0, 1), want["dg"].flatten(0, 1)
        rms = (dg_ref.double().norm() / math.sqrt(dg_ref.shape[0])).item()
        errors["dg_first_token"] = (dg[first] - dg_ref[first]).double().norm().item() / math.sqrt(len(first)) / rms
    print(case.id, {name: f"{err:.2e}" for name, err in errors.items()})
    for name in want:
        assert got[name].shape == want[name].shape, name
        assert torch.isfinite(got[name]).all(), f"{name} has unwritten (NaN) or non-finite elements"
    assert all(err <= _tolerance(name) for name, err in errors.items() if name != "dg_first_token"), errors
    assert errors.get("dg_first_token", 0) <= FIRST_TOKEN_DG_TOL, errors


LOW_LEVEL = [  # (case, pass dht): varlen edges with h0, GVA 4, fp16 dense with h0, fp16 varlen without dht, GVA 3
    (next(c for c in CASES if c.id == case_id), with_dht)
    for case_id, with_dht in [
        ("varlen_edges_h0", True), ("gva4_Hv64", True), ("fp16_dense_B2", True), ("fp16_varlen_edges", False),
        ("gva3_Hv24", True),
    ]
]


@pytest.mark.parametrize("case,with_dht", LOW_LEVEL, ids=[f"{c.id}-{'dht' if d else 'no_dht'}" for c, d in LOW_LEVEL])
def test_low_level_backward_matches_reference(case, with_dht, poisoned):
    """dq, dk, dv, dbeta, dg, dh0 of chunk_gated_delta_rule_bwd (g_cum, A from the kernel forward) vs the reference."""
    seed = zlib.crc32(case.id.encode()) + 1
    x, cu, h0 = case_inputs(case, seed)
    Hv = case.heads[1]
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    dht = _randn((_num_seqs(case), Hv, 128, 128), torch.float32, seed + 2) if with_dht else None

    g_cum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu)
    got = flash_qla.chunk_gated_delta_rule_bwd(
        x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht, initial_state=h0, cu_seqlens=cu
    )
    q, k, v, beta = (x[name].float() for name in ("q", "k", "v", "beta"))
    want = chunk_gated_delta_rule_bwd_ref(
        q, k, v, chunk_local_cumsum(x["g"], cu), beta, do.float(), dht, initial_state=h0, cu_seqlens=cu
    )

    names = ("dq", "dk", "dv", "dbeta", "dg", "dh0")
    dtypes = (x["q"].dtype, x["k"].dtype, x["v"].dtype, x["beta"].dtype, torch.float32, torch.float32)
    errors = {name: rel_l2(g, w) for name, g, w in zip(names, got, want) if w is not None}
    print(case.id, {name: f"{err:.2e}" for name, err in errors.items()})
    assert (got[5] is None) == (h0 is None)
    for name, g, w, dtype in zip(names, got, want, dtypes):
        if w is None:
            continue
        assert g.shape == w.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        assert torch.isfinite(g).all(), f"{name} has unwritten (NaN) or non-finite elements"
    assert all(err <= GRAD_TOL for err in errors.values()), errors


def test_backward_is_deterministic(poisoned):
    """GVA (4 v-heads per qk-head, dq and dk summed over them), varlen, h0 and dht: bitwise repeatable."""
    case = next(c for c in CASES if c.id == "gva4_Hv64")
    x, cu, h0 = case_inputs(case, seed=3)
    do = _randn(x["v"].shape, x["v"].dtype, 4)
    dht = _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, 5)
    g_cum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu)

    def backward():
        return flash_qla.chunk_gated_delta_rule_bwd(
            x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht, initial_state=h0, cu_seqlens=cu
        )

    first, second = backward(), backward()
    for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), first, second):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("case_id", ["varlen_edges_h0", "gva4_Hv64"])
def test_chunk_grads_independent_of_block_count(case_id, parts, monkeypatch, poisoned):
    """Each (chunk, qk-head) item's arithmetic is the same whichever persistent block computes it and
    whatever that block copied ahead, and with its v-heads in two parts whichever part counts first (one
    block walks both of an item's parts): one block, three, and one per SM agree bitwise."""
    patch_planner(monkeypatch, "grads_parts", lambda *args: parts, backward_module)
    case = next(c for c in CASES if c.id == case_id)
    x, cu, h0 = case_inputs(case, seed=6)
    do = _randn(x["v"].shape, x["v"].dtype, 7)
    dht = _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, 8)
    g_cum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu)

    def backward(blocks):
        if blocks is not None:
            patch_planner(monkeypatch, "multiprocessors", lambda device: blocks, backward_module)
        return flash_qla.chunk_gated_delta_rule_bwd(
            x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht, initial_state=h0, cu_seqlens=cu
        )

    every_sm = backward(None)
    for blocks in (1, 3):
        for name, a, b in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), backward(blocks), every_sm):
            assert torch.equal(a, b), (blocks, name)


# dq and dk of an item in parts are the same fp32 terms summed in another order (a part's v-heads, then the parts),
# rounded once to bf16: an element moves by at most a bf16 ulp or two (2^-8 relative) where the terms cancel;
# measured 0.7-4.4e-5 in L2 on the H200 (benchmark/NOTES.md v59 step 2), the bound 20x that.
PARTS_TOL = 1e-3


@pytest.mark.parametrize("case_id", ["varlen_edges_h0", "gva8_Hv16", "gva4_Hv64"])
def test_chunk_grads_in_parts_match_whole_items(case_id, monkeypatch, poisoned):
    """An item's v-heads in two parts (chunk_grads' dq and dk: the first part to count itself publishes its fp32
    sums, the second adds them) against whole items: dv, dβ, dg and dh0 bitwise (per v-head, untouched), dq and
    dk within PARTS_TOL, a second run in parts bitwise the first. Over two inputs one after the other: the counts
    must be back at zero after each launch (a part that found its count non-zero would add another launch's
    sums, the same ones again on the same input)."""
    case = next(c for c in CASES if c.id == case_id)
    for seed in (12, 15):
        x, cu, h0 = case_inputs(case, seed=seed)
        do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
        dht = _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, seed + 2)
        g_cum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu)
        grads = {}
        for parts in (1, 2, 2):
            patch_planner(monkeypatch, "grads_parts", lambda *args: parts, backward_module)
            grads.setdefault(parts, []).append(flash_qla.chunk_gated_delta_rule_bwd(
                x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht, initial_state=h0, cu_seqlens=cu
            ))  # fmt: skip
        (whole,), (split, again) = grads[1], grads[2]
        for name, a, b, c in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), whole, split, again):
            if a is None:  # no h0, no dh0
                assert b is None and c is None, name
                continue
            assert torch.equal(b, c), (seed, name)
            if name in ("dq", "dk"):
                assert rel_l2(b, a) <= PARTS_TOL, (seed, name, rel_l2(b, a))
            else:
                assert torch.equal(a, b), (seed, name)


def test_training_backward_takes_the_forward_kkt_outputs(monkeypatch, poisoned):
    """A training forward keeps kkt_solve's P, γ and gates: its backward launches no kkt_solve, and its
    gradients are bitwise those of the low-level backward, which computes the three again (varlen
    edges, GVA 2, h0 and dht; short sequences: neither backward splits or restarts from checkpoints)."""
    case = next(c for c in CASES if c.id == "varlen_edges_h0")
    x, cu, h0 = case_inputs(case, seed=9)
    do = _randn(x["v"].shape, x["v"].dtype, 10)
    dht = _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, 11)
    g_cum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu)
    low_level = flash_qla.chunk_gated_delta_rule_bwd(
        x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht, initial_state=h0, cu_seqlens=cu
    )
    # the factory is called when a backward is planned: plan the training backward afresh (the low-level one's plan,
    # which holds kkt_solve, has the key a training backward handed nothing would have)
    drop_plans()
    kkt_builds = record_calls(monkeypatch, backward_module, "kkt_solve_kernel")
    got = _grads(flash_qla_gdr, {**x, "initial_state": h0}, do, dht, cu_seqlens=cu)
    assert not kkt_builds, "the training backward ran kkt_solve again"
    for name, want in zip(("dq", "dk", "dv", "dbeta", "dg", "dh0"), low_level):
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


CHECKPOINT_CASES = [  # forward walks at V-tiles of 32 and 16, the recompute's pieces at 64
    Case("checkpoints_varlen_h0", (5000, 70, 0, 3000), heads=(4, 16), h0=True),
    Case("checkpoints_one_long", (9000,), heads=(2, 8)),
]


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=[c.id for c in CHECKPOINT_CASES])
def test_checkpointed_recompute_is_exact(case, poisoned, monkeypatch):
    """Training with the state recompute restarted from the forward's checkpoints gives bitwise the
    gradients of the recompute over whole sequences: each piece starts from the fp32 state the
    forward walk had there and runs the same arithmetic."""
    seed = zlib.crc32(case.id.encode())
    x, cu, h0 = case_inputs(case, seed)
    inputs = dict(x) if h0 is None else {**x, "initial_state": h0}
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    dht = _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, seed + 2)
    walked_pieces = record_calls(monkeypatch, backward_module, "checkpoint_pieces")
    # the walks whole (a split forward keeps its checkpoints always; the planner splits 9000 tokens over
    # 8 heads, and so would the backward of a whole forward)
    patch_planner(monkeypatch, "splits_forward", lambda *args: False)
    patch_planner(monkeypatch, "splits_backward", lambda *args: False, backward_module)
    grads = {}
    for keep in (True, False):
        walked_pieces.clear()
        patch_planner(monkeypatch, "keeps_checkpoints", lambda *args, keep=keep: keep)
        # keep_states=False: kept by default at this size (keeps_states), every state leaves no checkpoints to keep
        grads[keep] = _grads(flash_qla_gdr, inputs, do, dht, cu_seqlens=cu, keep_states=False)
        assert len(walked_pieces) == int(keep), "the backward walks pieces exactly when the forward kept checkpoints"
    for name, got in grads[True].items():
        assert torch.isfinite(got).all(), f"{name} has unwritten (NaN) or non-finite elements"
        assert torch.equal(got, grads[False][name]), name


KEEP_STATES_CASES = [  # (case, auto_cp): the forward walks that keep every state, at each width and route
    (next(c for c in CASES if c.id == "varlen_4096x8"), True),  # V-tiles of 128 (fused_fwd_wide)
    (next(c for c in CASES if c.id == "strong_gate"), True),  # V-tiles of 64, h0, strong decay
    (Case("keep_varlen_edges_h0", (0, 1, 63, 64, 65, 0, 130, 1), heads=(4, 16), h0=True), True),
    # one long sequence over few heads: the training forward splits it (pieces at V-tiles of 64) ...
    (Case("keep_one_long_h0", (9000,), heads=(2, 8), gate="weak", h0=True), True),
    # ... or, without auto_cp, walks it whole at V-tiles of 16 (fused_fwd)
    (Case("keep_one_long_h0", (9000,), heads=(2, 8), gate="weak", h0=True), False),
    # four pieces over 4 heads: kept, the pieces' walk at 16; recomputed, from the pieces' starts at 16
    (Case("keep_narrow_gva1_h0", (8192,), heads=(4, 4), h0=True), True),
    # fp16: kept, the backward walk at 128; recomputed, the recompute and the walk at 128 (beside_widths)
    (Case("keep_fp16_varlen_edges_h0", (0, 1, 63, 64, 65, 0, 130, 1), dtype=torch.float16, h0=True), True),
]


@pytest.mark.parametrize(
    "case,auto_cp", KEEP_STATES_CASES, ids=[f"{c.id}-{'cp' if cp else 'no_cp'}" for c, cp in KEEP_STATES_CASES]
)
def test_kept_states_give_the_recomputed_gradients(case, auto_cp, poisoned, monkeypatch):
    """keep_states: the training forward stores the state at every chunk start (every slot the
    backward reads written: outputs start as NaN) and the backward runs no state walk; the gradients
    are bitwise those of the backward that recomputes the states (the same walk arithmetic, in the
    forward instead of the backward)."""
    seed = zlib.crc32(case.id.encode())
    x, cu, h0 = case_inputs(case, seed)
    inputs = dict(x) if h0 is None else {**x, "initial_state": h0}
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    dht = _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, seed + 2)
    state_walks = record_calls(monkeypatch, backward_module, "walk_kernel")
    grads = {}
    for keep in (False, True):
        drop_plans()  # each arm plans afresh: a backward that ignored the kept states would reuse keep=False's plan
        state_walks.clear()
        grads[keep] = _grads(flash_qla_gdr, inputs, do, dht, cu_seqlens=cu, auto_cp=auto_cp, keep_states=keep)
        assert len(state_walks) == int(not keep), "the backward recomputes the states exactly when none were kept"
    for name, got in grads[True].items():
        assert torch.isfinite(got).all(), f"{name} has unwritten (NaN) or non-finite elements"
        assert torch.equal(got, grads[False][name]), (name, rel_l2(got, grads[False][name]))


@pytest.mark.parametrize(
    "keep,max_bytes,kept",
    [(False, None, False), (True, None, True), (None, None, True), (None, 2**20, False)],
    ids=["off", "on", "default_small", "default_above_the_cap"],
)
def test_kept_states_are_saved_only_when_asked(keep, max_bytes, kept, monkeypatch):
    """The states ([chunk slots, Hv, K, V] in q's dtype) are among the autograd node's saved tensors
    exactly with keep_states, or by default (None) where they take at most KEEP_STATES_MAX_BYTES (32 MiB
    here: kept; with the cap at 1 MiB, not); checkpoints are not kept beside them."""
    if max_bytes is not None:
        monkeypatch.setattr(forward_module, "KEEP_STATES_MAX_BYTES", max_bytes)
    case = Case("keep_saved", (5000, 3000), heads=(2, 8))
    x, cu, _ = case_inputs(case, seed=12)
    slots = sum(case.seqlens) // 64 + len(case.seqlens)
    leaves = {name: t.detach().clone().requires_grad_() for name, t in x.items()}
    o, _ = flash_qla_gdr(**leaves, cu_seqlens=cu, keep_states=keep)
    saved = [t for t in o.grad_fn.saved_tensors if t is not None]
    states = [t for t in saved if t.shape == (slots, 8, 128, 128)]
    assert len(states) == int(kept) and all(t.dtype == x["q"].dtype for t in states)
    if kept:
        assert not any(t.dtype == torch.float32 and t.shape[1:] == (8, 128, 128) for t in saved), "checkpoints"


SPLIT_BACKWARD_CASES = [  # (case, pass dht, the split forced: else the planner's own)
    (Case("split_bwd_one_long_h0", (9000,), heads=(2, 8), gate="weak", h0=True), True, True),  # V-tiles of 64
    (Case("split_bwd_piece_and_a_bit", (2049,), heads=(4, 16)), False, True),  # 33 chunks: a piece of one chunk
    (Case("split_bwd_fp16_strong_gate", (5000,), heads=(2, 8), dtype=torch.float16, gate="strong"), True, True),
    (Case("split_bwd_wide_h0", (20000,), heads=(2, 8), h0=True), True, True),  # V-tiles of 128
    # several sequences: an empty one (dh0 = dht there), one inside a piece, unaligned pieces
    (Case("split_bwd_varlen_h0", (5000, 0, 70, 9000), heads=(2, 8), h0=True), True, True),
    # the planner splits two sequences from the lengths validation read, as the forward would
    (Case("split_bwd_planned_2x16384", (16384, 16384), heads=(2, 8)), True, False),
    # ... and one over 4 heads in 4 pieces: the maps, the recompute and the walk at V-tiles of 16
    (Case("split_bwd_planned_narrow_gva1", (8192,), heads=(4, 4), h0=True), True, False),
]


@pytest.mark.parametrize(
    "case,with_dht,forced",
    SPLIT_BACKWARD_CASES,
    ids=[f"{c.id}-{'dht' if d else 'no_dht'}" for c, d, _ in SPLIT_BACKWARD_CASES],
)
def test_split_backward_matches_whole_walk(case, with_dht, forced, poisoned, monkeypatch):
    """The backward walked in pieces from their composed end gradients
    (flash_qla.ops.context_parallel.split_backward_walk) gives the gradients of the walk over the
    whole sequence, up to rounding: each within GRAD_TOL of the reference. auto_cp on splits (the
    planner forced to, or by its own decision), off walks whole. The split's map and end walks leave
    out what kkt_solve's bounds show negligible (strong gates: most of it)."""
    seed = zlib.crc32(case.id.encode())
    x, cu, h0 = case_inputs(case, seed)
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    dht = _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, seed + 2) if with_dht else None
    g_cum, A, _, _, _ = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu)
    if forced:
        patch_planner(monkeypatch, "splits_backward", lambda *args: True, backward_module)
    splits = record_calls(monkeypatch, backward_module, "split_backward_walk")
    got = {}
    for split in (True, False):
        got[split] = flash_qla.chunk_gated_delta_rule_bwd(
            x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht, initial_state=h0, cu_seqlens=cu, auto_cp=split
        )
    assert len(splits) == 1, "the backward walk split exactly when the planner said so"
    assert (splits[0][-2] < 0).any(), "with the bounds (log_norms) of kkt_solve's backward mode, not zeros"
    q, k, v, beta = (x[name].float() for name in ("q", "k", "v", "beta"))
    want = chunk_gated_delta_rule_bwd_ref(
        q, k, v, chunk_local_cumsum(x["g"], cu), beta, do.float(), dht, initial_state=h0, cu_seqlens=cu
    )
    names = ("dq", "dk", "dv", "dbeta", "dg", "dh0")
    errors = {name: rel_l2(g, w) for name, g, w in zip(names, got[True], want) if w is not None}
    apart = {name: rel_l2(g, w) for name, g, w in zip(names, got[True], got[False]) if w is not None}
    print(case.id, {name: f"{err:.2e}" for name, err in errors.items()}, "split vs whole", {
        name: f"{err:.2e}" for name, err in apart.items()
    })
    assert (got[True][5] is None) == (h0 is None) and (got[False][5] is None) == (h0 is None)
    for split in (True, False):
        for name, g in zip(names, got[split]):
            assert g is None or torch.isfinite(g).all(), f"{name} has unwritten (NaN) or non-finite elements"
    whole = {name: rel_l2(g, w) for name, g, w in zip(names, got[False], want) if w is not None}
    assert all(err <= GRAD_TOL for err in errors.values()), errors
    assert all(err <= GRAD_TOL for err in whole.values()), whole
    # each within GRAD_TOL of the reference, the two within rounding of each other
    assert all(err <= SPLIT_APART_TOL for err in apart.values()), apart


@pytest.mark.parametrize("gate", ["model", "strong"])
def test_split_training_matches_reference(gate, poisoned, monkeypatch):
    """Training with the forward split forced over several sequences: the forward hands its maps
    and kkt_solve's bounds to the backward, whose walk splits the same pieces; every gradient vs the
    reference. Strong gates leave most of the map, offset and end walks out
    (flash_qla.ops.context_parallel), model gates some."""
    case = Case(f"split_train_varlen_h0_{gate}_gate", (5000, 0, 70, 9000), heads=(2, 8), h0=True, gate=gate)
    seed = zlib.crc32(case.id.encode())
    x, cu, h0 = case_inputs(case, seed)
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    dht = _randn((_num_seqs(case), 8, 128, 128), torch.float32, seed + 2)
    patch_planner(monkeypatch, "splits_forward", lambda *args: True)
    split_walks = record_calls(monkeypatch, backward_module, "split_backward_walk")
    backward_maps = record_calls(monkeypatch, backward_module, "maps_of_pieces")
    inputs = {**x, "initial_state": h0}
    got = _grads(flash_qla_gdr, inputs, do, dht, with_outputs=True, cu_seqlens=cu)
    want = _grads(reference_gdr, {name: t.float() for name, t in inputs.items()}, do, dht, with_outputs=True, cu_seqlens=cu)
    assert len(split_walks) == 1 and not backward_maps, "the forward's maps were handed over (the backward formed none)"
    assert (split_walks[0][-2] < 0).any(), "and kkt_solve's bounds (log_norms)"
    errors = {name: rel_l2(got[name], want[name]) for name in want}
    print(case.id, {name: f"{err:.2e}" for name, err in errors.items()})
    for name in want:
        assert torch.isfinite(got[name]).all(), f"{name} has unwritten (NaN) or non-finite elements"
    assert all(err <= _tolerance(name) for name, err in errors.items()), errors


def test_training_split_hands_its_maps_to_the_backward(monkeypatch, poisoned):
    """Where a training forward splits (16/32 at one sequence of 32768 tokens), the planner's split
    reaches the backward: its walk splits the same pieces with the forward's maps (benchmark/NOTES.md
    v17: on the H200 the split's gradients were 2-3e-3 apart from the whole walk's, dv included)."""
    case = Case("train_split_16_32", (32768,), heads=(16, 32))
    profile = forward_module.get_profile(torch.device("cuda"))
    assert forward_module.splits_forward([32768], 32, 128, profile, True)
    seed = zlib.crc32(case.id.encode())
    x, cu, _ = case_inputs(case, seed)
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    split_walks = record_calls(monkeypatch, backward_module, "split_backward_walk")
    backward_maps = record_calls(monkeypatch, backward_module, "maps_of_pieces")
    leaves = {name: t.detach().requires_grad_() for name, t in x.items()}
    grads = {}
    for split in (True, False):
        if not split:
            patch_planner(monkeypatch, "splits_forward", lambda *args: False)
        o, _ = flash_qla_gdr(**leaves, cu_seqlens=cu)
        grads[split] = torch.autograd.grad(o, list(leaves.values()), do)
        assert all(torch.isfinite(g).all() for g in grads[split])
    assert len(split_walks) == 1 and not backward_maps, "the forward's maps were handed over (the backward formed none)"
    # each walk is within GRAD_TOL of the reference elsewhere; apart by a rounding of the composed maps
    # (2-3e-3 measured), not by a wrong start gradient of a piece (order 1)
    apart = {"d" + name: rel_l2(a, b) for name, a, b in zip(leaves, grads[True], grads[False])}
    print(case.id, "split vs whole", {name: f"{err:.2e}" for name, err in apart.items()})
    assert all(err <= SPLIT_APART_TOL for err in apart.values()), apart


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
def test_no_host_sync_once_cu_seqlens_is_validated(split, monkeypatch):
    """Validation reads a cu_seqlens tensor to the host once; after that every entry point runs
    without a host synchronisation (torch's sync debug mode raises on one): the low-level forward
    with h and the final state, the low-level backward, and a training step through autograd, over
    several sequences (an empty one included), the walks whole or split (forced)."""
    case = Case("no_sync_varlen_h0", (5000, 0, 70, 9000), heads=(2, 8), h0=True)
    seed = zlib.crc32(case.id.encode())
    x, cu, h0 = case_inputs(case, seed)
    do = _randn(x["v"].shape, x["v"].dtype, seed + 1)
    dht = _randn((_num_seqs(case), 8, 128, 128), torch.float32, seed + 2)
    monkeypatch.setattr(forward_module, "splits_forward", lambda *args: split)
    monkeypatch.setattr(backward_module, "splits_backward", lambda *args: split)
    leaves = {name: t.detach().requires_grad_() for name, t in {**x, "initial_state": h0}.items()}

    def calls():
        g_cum, A, *_ = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu, output_h=True)
        flash_qla.chunk_gated_delta_rule_bwd(
            x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht, initial_state=h0, cu_seqlens=cu
        )
        o, ht = flash_qla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True)
        torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])

    calls()  # validation reads cu_seqlens; the kernels compile and load
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("used", ["o", "final_state"])
def test_gradients_of_one_output(used, poisoned, monkeypatch):
    """A loss of o alone (final_state returned but unused, as in most training) or of final_state
    alone: the unused output's gradient reaches the backward as None, not as a filled zero tensor
    (without dht the backward walk runs its no-dht form); the gradients match the reference
    (varlen edges, GVA 2, h0)."""
    case = next(c for c in CASES if c.id == "varlen_edges_h0")
    seed = zlib.crc32(f"one_output_{used}".encode())
    x, cu, h0 = case_inputs(case, seed)
    inputs = {**x, "initial_state": h0}
    upstream = {
        "o": _randn(x["v"].shape, x["v"].dtype, seed + 1),
        "final_state": _randn((_num_seqs(case), case.heads[1], 128, 128), torch.float32, seed + 2),
    }[used]
    backward_calls = record_calls(monkeypatch, autograd_module, "_backward")
    grads = {}
    for name, gdr, dtype in (("got", flash_qla_gdr, None), ("want", reference_gdr, torch.float32)):
        leaves = {n: t.detach().to(dtype or t.dtype).requires_grad_() for n, t in inputs.items()}
        outputs = dict(zip(("o", "final_state"), gdr(**leaves, cu_seqlens=cu)))
        grads[name] = torch.autograd.grad(
            outputs[used], list(leaves.values()), upstream.to(outputs[used].dtype), allow_unused=True
        )
    (args,) = backward_calls
    do, dht = args[6], args[7]
    assert (dht is None) if used == "o" else (not do.any() and dht is not None)
    for n, got, want in zip(inputs, grads["got"], grads["want"]):
        assert torch.isfinite(got).all(), n
        if want is None:  # q does not reach final_state
            assert not got.any(), n
        else:
            assert rel_l2(got, want) <= GRAD_TOL, (n, rel_l2(got, want))


@pytest.mark.parametrize("entry", ["training_step", "low_level", "training_step_split"])
def test_cuda_graph_replays_the_eager_results(entry, monkeypatch):
    """A training step through autograd, or the low-level forward and backward, captured in a CUDA
    graph and replayed on new inputs (copied into the captured ones) gives the eager results bitwise:
    the backward's second stream (and a split forward's, its map walk: training_step_split, the split
    forced) forks from the capturing stream and joins it again (varlen edges, GVA 2, h0 and dht;
    kernels and the cu_seqlens tables warmed up by an eager call first). Between the capture and the
    replay an eager call with another cu_seqlens replaces the tables cached for the first, and the
    memory freed is written over: the graph reads tables of its own (flash_qla.tensor_cache)."""
    if entry == "training_step_split":
        patch_planner(monkeypatch, "splits_forward", lambda *args: True)
    case = next(c for c in CASES if c.id == "varlen_edges_h0")
    static, cu, h0 = case_inputs(case, seed=31)
    static["initial_state"] = h0
    shape = (_num_seqs(case), case.heads[1], 128, 128)
    static["do"], static["dht"] = _randn(static["v"].shape, static["v"].dtype, 32), _randn(shape, torch.float32, 33)

    def step(t, cu=cu):
        inputs = {n: t[n] for n in ("q", "k", "v", "g", "beta", "initial_state")}
        if entry != "low_level":
            leaves = {n: x.detach().requires_grad_() for n, x in inputs.items()}
            o, ht = flash_qla.chunk_gated_delta_rule(**leaves, cu_seqlens=cu, output_final_state=True)
            return (o, ht, *torch.autograd.grad([o, ht], list(leaves.values()), [t["do"], t["dht"]]))
        g_cum, A, o, _, ht = flash_qla.chunk_gated_delta_rule_fwd(**inputs, cu_seqlens=cu)
        grads = flash_qla.chunk_gated_delta_rule_bwd(
            t["q"], t["k"], t["v"], g_cum, t["beta"], A, t["do"], t["dht"], initial_state=t["initial_state"],
            cu_seqlens=cu,
        )
        return (o, ht, *grads)

    step(static)  # compiles, validates cu_seqlens, builds its tables
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static)
    fresh, _, fresh_h0 = case_inputs(case, seed=34)
    fresh["initial_state"] = fresh_h0
    fresh["do"], fresh["dht"] = _randn(static["v"].shape, static["v"].dtype, 35), _randn(shape, torch.float32, 36)
    for name in fresh:
        static[name].copy_(fresh[name])
    other = torch.tensor([0, *itertools.accumulate(reversed(case.seqlens))], dtype=torch.int32, device="cuda")
    step({n: t.clone() for n, t in static.items()}, other)
    torch.cuda.synchronize()
    junk = [torch.full((n,), 2**30, dtype=torch.int32, device="cuda") for n in range(1, 4096, 7) for _ in range(4)]
    graph.replay()
    eager = step({n: t.clone() for n, t in static.items()})
    torch.cuda.synchronize()
    assert len(captured) == len(eager) and junk
    for i, (got, want) in enumerate(zip(captured, eager)):
        assert torch.equal(got, want), f"output {i}"


def test_a_non_finite_sequence_leaves_the_one_before_alone(poisoned):
    """An Inf in the first token of the second of two packed sequences (one request of a serving batch gone bad):
    the first sequence's o, final state and gradients are still its own, as the reference over it alone has them."""
    case = Case("non_finite_neighbour", (100, 100), heads=(4, 8))
    x, cu, _ = case_inputs(case, seed=41)
    x["v"][0, 100, 0, 0] = float("inf")  # the second sequence's first token, v-head 0
    do = _randn(x["v"].shape, x["v"].dtype, 42)
    dht = _randn((2, 8, 128, 128), torch.float32, 43)
    got = _grads(flash_qla_gdr, x, do, dht, with_outputs=True, cu_seqlens=cu)
    first = {name: t[:, :100] for name, t in x.items()}
    want = _grads(reference_gdr, {n: t.float() for n, t in first.items()}, do[:, :100], dht[:1], with_outputs=True)
    got = {name: t[:1] if name == "final_state" else t[:, :100] for name, t in got.items()}
    errors = {name: rel_l2(got[name], want[name]) for name in want}
    print(case.id, {name: f"{err:.2e}" for name, err in errors.items()})
    for name in want:
        assert torch.isfinite(got[name]).all(), f"{name} of the first sequence is not finite"
    assert all(err <= _tolerance(name) for name, err in errors.items()), errors


# ---- training smoke test ------------------------------------------------------------------------

# A smoke test: it catches what breaks training (non-finite values, gross errors in o or in the
# gradients of the projections), not small errors, which the tests above pin per gradient. Measured
# with the reference alone (CPU, fp32): 300 Adam steps take the loss from 2.07 to 0.061; 1 % relative
# noise on o and on every input gradient (a few times the forward kernels' measured rounding) moves
# the final loss by 0.4 %; even zeroing dg or dbeta moves it by only 3 % and 5 %. Bar: the issue's
# suggested 5 %.
TRAIN_LOSS_RTOL = 0.05
TRAIN_MIN_DECREASE = 10  # initial / final loss; measured 34
TRAIN_STEPS = 300
TRAIN_SEQLENS = (700, 1, 300, 1047)  # packed, T = 2048


class TinyGatedDeltaNet(torch.nn.Module):
    """A GatedDeltaNet token mixer: q/k/v/a/b projections -> Gated Delta Rule -> output projection.

    q and k are L2-normalised by the rule (use_qk_l2norm_in_kernel), g = -exp(A_log) * softplus(a +
    dt_bias), beta = sigmoid(b); q, k, v and beta enter the rule in bf16, g in fp32.
    """

    def __init__(self, hidden=256, heads=(2, 4), head_dim=128):
        super().__init__()
        Hqk, Hv = heads
        self.heads, self.head_dim = heads, head_dim
        self.q_proj = torch.nn.Linear(hidden, Hqk * head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden, Hqk * head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden, Hv * head_dim, bias=False)
        self.a_proj = torch.nn.Linear(hidden, Hv, bias=False)
        self.b_proj = torch.nn.Linear(hidden, Hv, bias=False)
        self.A_log = torch.nn.Parameter(torch.empty(Hv).uniform_(0, math.log(16)))
        dt = torch.empty(Hv).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias = torch.nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.o_proj = torch.nn.Linear(Hv * head_dim, hidden, bias=False)

    def forward(self, x, cu_seqlens, gdr):
        """x [1, T, hidden] float32 -> [1, T, hidden]; gdr is flash_qla.chunk_gated_delta_rule or reference_gdr."""
        T = x.shape[1]
        (Hqk, Hv), D = self.heads, self.head_dim
        q = self.q_proj(x).view(1, T, Hqk, D).bfloat16()
        k = self.k_proj(x).view(1, T, Hqk, D).bfloat16()
        v = self.v_proj(x).view(1, T, Hv, D).bfloat16()
        g = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)  # [1, T, Hv] float32
        beta = self.b_proj(x).sigmoid().bfloat16()
        o, _ = gdr(q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
        return self.o_proj(o.float().reshape(1, T, Hv * D))


def train(gdr, x, cu_seqlens, target, steps=TRAIN_STEPS, lr=1e-3, seed=0):
    """Losses (normalised MSE to target) of a TinyGatedDeltaNet trained with Adam from a fixed init."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyGatedDeltaNet().to(x.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = (model(x, cu_seqlens, gdr) - target).pow(2).mean() / target.pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def teacher_data(seqlens=TRAIN_SEQLENS, hidden=256, device="cuda"):
    """Fixed inputs x [1, T, hidden], cu_seqlens and the targets of a fixed random teacher layer."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        teacher = TinyGatedDeltaNet(hidden).to(device)
        x = torch.randn(1, sum(seqlens), hidden).to(device)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(seqlens)], dtype=torch.int32, device=device)
    with torch.no_grad():
        target = teacher(x, cu_seqlens, reference_gdr)
    return x, cu_seqlens, target


@pytest.mark.parametrize("case_id", ["varlen_edges_h0", "long_T32768_weak_gate"])
def test_compiled_training_is_the_eager_step(case_id, poisoned):
    """Under torch.compile (fullgraph=True) with capture_dynamic_output_shape_ops on, a training call is the operator
    pair flash_qla::chunk_gated_delta_rule_training(_backward), which run the eager step's forward and backward: o,
    final_state and every gradient bitwise the eager step's (4/8 varlen edges with kept states; 2/8 one sequence of
    32768, walked in pieces whose maps and start states the backward operator takes)."""
    case = next(c for c in CASES if c.id == case_id)
    seed = zlib.crc32(f"compiled_{case_id}".encode())
    x, cu, h0 = case_inputs(case, seed)

    def step(q, k, v, g, beta, initial_state):
        o, final_state = flash_qla.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu, output_final_state=True
        )  # fmt: skip
        return o * 2, final_state

    torch._dynamo.reset()
    results = []
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        for fn in (compiled, step):
            leaves = {name: t.detach().clone().requires_grad_() for name, t in {**x, "initial_state": h0}.items()}
            outputs = fn(**leaves)
            upstream = [_randn(t.shape, t.dtype, seed + i) for i, t in enumerate(outputs)]
            results.append((*outputs, *torch.autograd.grad(outputs, list(leaves.values()), upstream)))
    assert all(torch.equal(got, want) for got, want in zip(*results))


def test_training_matches_reference(poisoned):
    x, cu_seqlens, target = teacher_data()
    kernel_losses = train(flash_qla.chunk_gated_delta_rule, x, cu_seqlens, target)
    reference_losses = train(reference_gdr, x, cu_seqlens, target)
    final = {"kernels": kernel_losses[-1], "reference": reference_losses[-1]}
    print("training", {"initial": f"{reference_losses[0]:.3f}", **{name: f"{v:.4f}" for name, v in final.items()}})
    assert math.isfinite(final["kernels"])
    assert abs(final["kernels"] - final["reference"]) <= TRAIN_LOSS_RTOL * final["reference"], final
    assert reference_losses[0] >= TRAIN_MIN_DECREASE * final["reference"], (reference_losses[0], final)
    assert kernel_losses[0] >= TRAIN_MIN_DECREASE * final["kernels"], (kernel_losses[0], final)
