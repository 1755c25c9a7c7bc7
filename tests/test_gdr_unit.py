"""GPU kernels vs the fp32 PyTorch reference (skips without CUDA).

Every case draws fresh inputs, poisons every kernel output with NaN before the run (so an
element the kernels never write fails the check), runs the public API on the GPU and
compares with the chunked reference computed in fp32 from the same rounded inputs.
"""

import zlib

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla.reference.chunked import chunk_gated_delta_rule_fwd_ref
from flash_qla.reference.inputs import make_inputs
from gpu_cases import CASES, Case, case_inputs, patch_planner, record_calls, rel_l2

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16/fp16 operands of every tensor-core product (A, S, v_new, P rounded once per chunk)
# land between 1e-3 and 3e-3 relative L2; the bar is 5e-3.
FWD_TOL = 5e-3
# g_cum is an fp32 cumsum of at most 64 terms in both implementations.
GCUM_TOL = 1e-5
# A is stored in the input dtype (one rounding of values of order 1; fp16 rounds finer).
A_TOL = 1e-2
# kkt_solve's gate exponentials: the kernel's fp32 exp2(γ log2 e) vs torch.exp in fp32, a few
# ulp apart (the product with log2 e rounds once, the hardware exp2 is within 2 ulp).
GATES_TOL = 1e-5


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forward_matches_reference(case, poisoned):
    forward_matches_reference(case)


def forward_matches_reference(case):
    """The public forward of case's inputs against the fp32 chunked reference (o, final state)."""
    x, cu, h0 = case_inputs(case, seed=zlib.crc32(case.id.encode()))
    scale = case.extra.get("scale")
    state_v_first = case.extra.get("state_v_first", False)
    l2 = case.extra.get("use_qk_l2norm_in_kernel", False)

    o, ht = flash_qla.chunk_gated_delta_rule(
        **x, scale=scale, initial_state=None if h0 is None else (h0.transpose(-1, -2) if state_v_first else h0),
        output_final_state=True, cu_seqlens=cu, state_v_first=state_v_first, use_qk_l2norm_in_kernel=l2,
    )
    if state_v_first:
        ht = ht.transpose(-1, -2)

    q, k = x["q"], x["k"]
    if l2:
        q, k = (F.normalize(t.float(), dim=-1, eps=1e-6).to(t.dtype) for t in (q, k))
    ref = chunk_gated_delta_rule_fwd_ref(
        q.float(), k.float(), x["v"].float(), x["g"].float(), x["beta"].float(), scale, h0, cu, True, False
    )
    errors = {"o": rel_l2(o, ref[2]), "final_state": rel_l2(ht, ref[4])}
    print(case.id, {name: f"{err:.2e}" for name, err in errors.items()})
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert errors["o"] <= FWD_TOL and errors["final_state"] <= FWD_TOL, errors


# inference forwards whose walk runs at 64 columns: fused_fwd_opath, P formed in the walk (CASES has more:
# GVA 2, 3, 4 and 8, fp16, h0, zero-length and partial chunks)
OPATH_CASES = [
    Case("opath_gva1_h0", (700, 0, 1, 2000), heads=(16, 16), h0=True),
    Case("opath_strong_gate_edges", (0, 1, 63, 64, 65, 0, 130, 3000), heads=(2, 8), gate="strong"),
    Case("opath_fp16_4096x8", (4096,) * 8, heads=(2, 8), dtype=torch.float16, h0=True),
]


@pytest.mark.parametrize("case", OPATH_CASES, ids=[c.id for c in OPATH_CASES])
def test_opath_forward_matches_reference(case, poisoned, monkeypatch):
    from flash_qla.ops import forward as forward_module

    walks = record_calls(monkeypatch, forward_module, "fused_fwd_opath_kernel")
    forward_matches_reference(case)
    assert walks, "the forward did not take fused_fwd_opath"


LOW_LEVEL = [
    c for c in CASES if c.id in ("dense_B2_T300_h0", "varlen_edges_h0", "fp16_varlen_edges", "gva3_Hv48", "fp16_varlen_wide_h0")
]


@pytest.mark.parametrize("case", LOW_LEVEL, ids=[c.id for c in LOW_LEVEL])
def test_low_level_forward_intermediates(case, poisoned):
    """g_cum, A and the per-chunk states h of the low-level forward, each vs the reference."""
    x, cu, h0 = case_inputs(case, seed=7)
    g_cum, A, o, h, ht = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu, output_h=True)
    ref = chunk_gated_delta_rule_fwd_ref(
        *(x[n].float() for n in ("q", "k", "v", "g", "beta")), None, h0, cu, True, True
    )
    assert A.dtype == x["q"].dtype and g_cum.dtype == torch.float32
    for name, got, want, tol in [
        ("g_cum", g_cum, ref[0], GCUM_TOL), ("A", A, ref[1], A_TOL), ("o", o, ref[2], FWD_TOL),
        ("h", h, ref[3], FWD_TOL), ("final_state", ht, ref[4], FWD_TOL),
    ]:
        assert got.shape == want.shape, name
        assert torch.isfinite(got).all(), f"{name} has unwritten (NaN) elements"
        assert rel_l2(got, want) <= tol, (name, rel_l2(got, want))


# The composition of the maps: three bf16 products keep ~16 bits of each operand (1.5e-5), summed
# over 128 terms a product and a few pieces.
COMPOSE_TOL = 1e-4
SPLIT_CASES = [  # sequences the planner would leave whole: the split is forced
    Case("split_one_long_h0", (9000,), heads=(2, 8), gate="weak", h0=True),  # 5 pieces, the last partial
    Case("split_one_piece_and_a_bit", (2049,), heads=(4, 16)),  # 33 chunks: a piece of one chunk
    Case("split_fp16_strong_gate", (5000,), heads=(2, 8), dtype=torch.float16, gate="strong"),
    # several sequences: an empty one, one inside a piece, pieces not aligned to a sequence start
    Case("split_varlen_h0", (5000, 0, 70, 9000), heads=(2, 8), h0=True),
]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.id for c in SPLIT_CASES])
def test_split_forward_matches_whole_walk(case, poisoned, monkeypatch):
    """The forward walked in pieces from their composed start states (flash_qla.ops.context_parallel)
    gives o, h and the final state of the walk over the whole sequence, up to rounding."""
    from flash_qla.ops import forward as forward_module

    x, cu, h0 = case_inputs(case, seed=zlib.crc32(case.id.encode()))
    splits = record_calls(monkeypatch, forward_module, "split_walk")
    out = {}
    for split in (True, False):
        patch_planner(monkeypatch, "splits_forward", lambda *args, split=split: split)
        out[split] = flash_qla.chunk_gated_delta_rule_fwd(**x, initial_state=h0, cu_seqlens=cu, output_h=True)[2:]
    assert len(splits) == 1, "the forward split exactly when the planner said so"
    ref = chunk_gated_delta_rule_fwd_ref(
        *(x[n].float() for n in ("q", "k", "v", "g", "beta")), None, h0, cu, True, True
    )
    for name, got, whole, want in zip(("o", "h", "final_state"), out[True], out[False], ref[2:]):
        # both round S to the input dtype every chunk, at different points: each within FWD_TOL
        # of the reference, so within twice that of each other (2.2e-4 measured at 2/8 1x32768)
        assert torch.isfinite(got).all(), f"{name} has unwritten (NaN) elements"
        assert rel_l2(got, want) <= FWD_TOL, (name, rel_l2(got, want))
        assert rel_l2(got, whole) <= 2 * FWD_TOL, (name, rel_l2(got, whole))


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("has_s0", [False, True])
@pytest.mark.parametrize("decay", [0.9, 1e-3], ids=["keeps", "forgets"])
def test_compose_maps_gives_every_start_state(has_s0, decay, reverse):
    """S_0 = s0, S_{j+1} = M_j S_j + b_j over each sequence's pieces, against a float64 loop; maps
    that forget the state (M ≈ 0) included, where one bf16 product would leave the rounding of S
    behind. Reverse (the backward's): the pieces last to first, each map transposed."""
    from flash_qla.arch import get_profile
    from flash_qla.ops.buffers import placeholder
    from flash_qla.ops.compose_maps import compose_maps_kernel

    counts, Hv, K = (5, 0, 12), 8, 128  # pieces of each sequence: 17 in all, the second has none
    n, N = sum(counts), len(counts)
    first_pieces = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(3)
    M = (decay * torch.eye(K) + torch.randn(n, Hv, K, K, generator=gen) * (0.1 * decay / K**0.5)).cuda()
    b = torch.randn(n, Hv, K, K, generator=gen).cuda()
    s0 = torch.randn(N, Hv, K, K, generator=gen).cuda() if has_s0 else None
    starts = torch.full((n, Hv, K, K), float("nan"), device="cuda")
    # D = M − I as the maps' walk writes it: rounded to bf16 (hi), beside the rest (lo)
    d = M - torch.eye(K, device="cuda")
    hi = d.bfloat16()
    D = torch.cat([hi, (d - hi.float()).bfloat16()], dim=-1)
    kernel = compose_maps_kernel(Hv, K, K, get_profile(M.device), has_s0, reverse)
    kernel(D, b, first_pieces, s0 if has_s0 else placeholder(M.device, Hv, K, K), starts)
    for seq in range(N):
        S = s0[seq].double() if has_s0 else torch.zeros(Hv, K, K, dtype=torch.float64, device="cuda")
        pieces = range(first_pieces[seq].item(), first_pieces[seq + 1].item())
        for j in reversed(pieces) if reverse else pieces:
            assert rel_l2(starts[j], S.float()) <= COMPOSE_TOL, (seq, j, rel_l2(starts[j], S.float()))
            S = (M[j].mT if reverse else M[j]).double() @ S + b[j].double()


def test_kkt_gates_are_the_gate_exponentials():
    """kkt_solve's `gates` (fused_fwd_wide's gate input): e^γ and e^{γ_L − γ} of each chunk's tokens, 0 past its end."""
    from flash_qla.arch import get_profile
    from flash_qla.ops.chunks import chunk_offsets_of, chunk_table
    from flash_qla.ops.kkt_solve import kkt_solve_kernel

    seqlens, (Hqk, Hv), C = (0, 1, 63, 64, 65, 130), (4, 8), 64
    T, slots = sum(seqlens), sum(seqlens) // C + len(seqlens)
    x = make_inputs(1, T, Hqk, Hv, 128, 128, device="cuda", seed=11)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    offsets = chunk_offsets_of(cu, C)

    def poisoned_buffer(*shape, dtype=torch.float32):
        return torch.full(shape, float("nan"), dtype=dtype, device="cuda")

    g_cum, gamma, gates = poisoned_buffer(T, Hv), poisoned_buffer(Hv, slots, C), poisoned_buffer(Hv, slots, 2, C)
    A, P = (poisoned_buffer(T, Hv, C, dtype=x["q"].dtype) for _ in range(2))
    kkt = kkt_solve_kernel(Hqk, Hv, 128, "bfloat16", get_profile(x["q"].device), "float32")
    q, k = x["q"][0].contiguous(), x["k"][0].contiguous()
    g, beta = x["g"][0].float().contiguous(), x["beta"][0].float().contiguous()
    kkt(q, k, g, beta, chunk_table(cu, C, slots), g_cum, gamma, gates, A, P, slots)

    valid = torch.cat([(n - torch.arange(0, n, C)).clamp(max=C) for n in seqlens if n > 0]).cuda()  # tokens per chunk
    chunks = valid.numel()
    assert chunks == int(offsets[-1])
    inside = torch.arange(C, device="cuda")[None, :] < valid[:, None]  # [chunks, C]
    gam = gamma[:, :chunks]  # [Hv, chunks, C]
    gam_last = gam.gather(2, (valid - 1).view(1, -1, 1).expand(Hv, -1, 1))
    zero = torch.zeros((), device="cuda")
    torch.testing.assert_close(gates[:, :chunks, 0], torch.where(inside, gam.exp(), zero), rtol=GATES_TOL, atol=0)
    torch.testing.assert_close(gates[:, :chunks, 1], torch.where(inside, (gam_last - gam).exp(), zero), rtol=GATES_TOL, atol=0)


def test_inference_calls_share_scratch_by_stream(monkeypatch):
    """An inference call (no gradient) keeps kkt_solve's outputs in scratch buffers that the next call
    of the same shapes on the same stream and thread reuses (flash_qla.ops.buffers.scratch); another
    stream or thread gets its own; flash_qla.release_scratch() frees them all. Each call is right though
    the buffers hold the previous call's values, poisoned here."""
    import threading

    from flash_qla.ops import buffers

    seqlens, (Hqk, Hv) = (300, 700), (4, 8)
    cu = torch.tensor([0, 300, 1000], dtype=torch.int32, device="cuda")

    def run(seed):
        x = make_inputs(1, sum(seqlens), Hqk, Hv, 128, 128, device="cuda", seed=seed)
        o, ht = flash_qla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu)
        inputs = (x[name].float() for name in ("q", "k", "v", "g", "beta"))
        ref = chunk_gated_delta_rule_fwd_ref(*inputs, None, None, cu, True, False)
        return o, (rel_l2(o, ref[2]), rel_l2(ht, ref[4]))

    def kept():
        return {key: [t.data_ptr() for t in tensors] for key, (_, tensors) in buffers._scratch.items()}

    monkeypatch.setattr(buffers, "_scratch", {})  # none kept by earlier tests
    o1, errors1 = run(seed=1)
    first = kept()
    assert len(first) == 1
    for _, tensors in buffers._scratch.values():
        for t in tensors:
            t.fill_(float("nan"))
    o1_before = o1.clone()
    _, errors2 = run(seed=2)
    assert kept() == first
    assert torch.equal(o1, o1_before)  # the returned o is not scratch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _, errors3 = run(seed=3)
    torch.cuda.current_stream().wait_stream(side)
    assert len(kept()) == 2
    results = []
    thread = threading.Thread(target=lambda: results.append(run(seed=4)[1]))
    thread.start()
    thread.join()
    assert len(kept()) == 3
    flash_qla.release_scratch()
    assert kept() == {}
    _, errors5 = run(seed=5)
    assert len(kept()) == 1  # kept again by the next call
    for errors in (errors1, errors2, errors3, *results, errors5):
        assert max(errors) <= FWD_TOL, errors
    assert len(results) == 1


def test_no_recompile_across_batch_shapes():
    """Seqlen patterns of one head layout and V-tile width hit the same compiled kernels.

    The V-tile width follows sequences x heads (choose_block_v); each width is its own
    kernel, built once (precompile builds them all). Every pattern here has 9 or 10
    sequences, so all take the same width.
    """
    from flash_qla.arch import SM90
    from flash_qla.ops import fused_fwd, kkt_solve
    from flash_qla.ops.forward import choose_block_v

    def run(seqlens):
        x = make_inputs(1, sum(seqlens), 4, 8, 128, 128, device="cuda")
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        flash_qla.chunk_gated_delta_rule(**x, cu_seqlens=cu)

    patterns = ((64, 64, 1) * 3, (5000,) + (1,) * 8, (1, 2, 3, 4, 300) * 2)
    assert len({choose_block_v(len(p), 8, 128, SM90) for p in patterns + ((100,) * 9,)}) == 1
    run((100,) * 9)
    before = (fused_fwd.fused_fwd_kernel.cache_info().misses, kkt_solve.kkt_solve_kernel.cache_info().misses)
    for seqlens in patterns:
        run(seqlens)
    after = (fused_fwd.fused_fwd_kernel.cache_info().misses, kkt_solve.kkt_solve_kernel.cache_info().misses)
    assert after == before


def test_unsupported_head_dim_raises():
    x = make_inputs(1, 64, 2, 2, 64, 64, device="cuda")
    with pytest.raises(ValueError, match="head dims"):
        flash_qla.chunk_gated_delta_rule(**x)
