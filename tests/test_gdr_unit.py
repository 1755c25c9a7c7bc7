"""GPU kernels vs the fp32 PyTorch reference (skips without CUDA).

Every case draws fresh inputs, poisons every kernel output with NaN before the run (so an
element the kernels never write fails the check), runs the public API on the GPU and
compares with the chunked reference computed in fp32 from the same rounded inputs.
"""

import contextlib
import zlib

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla.reference.chunked import chunk_gated_delta_rule_fwd_ref
from flash_qla.reference.inputs import make_inputs
from gpu_cases import (
    CASES, FWD_TOL, OUTPUT_H_CASES, SPLIT_CASES, Case, case_inputs, patch_planner, planned_walk, record_calls, rel_l2,
    short_seqlens, strided,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

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


# A batch with one request gone bad: every input of its first token NaN (or Inf), sequence 1 of each batch (and, in
# training, its rows of dO). Each walk's tiles hold up to 63 tokens past a sequence's end (TMA boxes, chunk_grads'
# copies), which the kernels zero or select away: multiplied by zero, an Inf or NaN would not cancel. The table
# reaches every forward walk (id: the walk flash_qla.ops.forward.walk_plan takes, checked), inference and training
# (whose forward walks keep the states or checkpoints, and whose backward walks at the same widths and the split's
# run too); each sequence before the bad one ends mid-chunk. The training cases run again with finite inputs and
# only sequence 1's dO rows and dht non-finite: the backward kernels' zeroing on its own.
ISOLATION_CASES = [  # (walk, heads, sequence lengths, training)
    ("narrow16", (4, 4), (100, 100, 100), False),
    ("narrow16", (4, 4), (100, 100, 100), True),
    ("narrow32", (2, 4), (1000,) * 8, True),
    ("wide64", (4, 8), (1000,) * 8, True),
    ("wide128", (4, 16), (1000,) * 8, True),
    ("opath", (2, 4), (1000,) * 8, False),
    ("wide128", (2, 8), (40,) * 400, False),  # 400 one-chunk sequences: 12 a block of the walk (PACKED)
    ("split", (2, 4), (30000, 100), False),
    ("split", (2, 4), (30000, 100), True),
]


def isolation_inputs(walk, heads, seqlens, training):
    """The case's clean inputs, cu_seqlens, dO and dht (training), after checking that the planner takes walk."""
    split, BV, opath = planned_walk(seqlens, heads[1], training)
    assert walk == ("split" if split else "opath" if opath else ("narrow" if BV < 64 else "wide") + str(BV))
    x, cu, _ = case_inputs(Case("isolation", seqlens, heads=heads), seed=zlib.crc32(walk.encode()))
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(x["v"].shape, generator=gen).to(x["v"])
    dht = torch.randn(len(seqlens), heads[1], 128, 128, generator=gen).cuda()
    return x, cu, do, dht


def isolation_results(inputs, cu, do, dht, training):
    """o and final_state of a call and, training, the gradients of every input (named d + input)."""
    leaves = {name: t.clone().requires_grad_(training) for name, t in inputs.items()}
    with contextlib.nullcontext() if training else torch.no_grad():
        o, ht = flash_qla.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=cu)
    out = {"o": o.detach(), "final_state": ht.detach()}
    if training:
        grads = torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
        out.update({"d" + name: grad for name, grad in zip(leaves, grads)})
    return out


def assert_others_unchanged(clean, dirty, bounds, bad_sequence):
    """Every sequence but bad_sequence has bitwise the same rows (states) in dirty as in clean."""
    for n in range(len(bounds) - 1):
        if n != bad_sequence:
            for name in clean:
                if name == "final_state":
                    assert torch.equal(dirty[name][n], clean[name][n]), f"{name} of sequence {n}"
                else:
                    rows = slice(bounds[n], bounds[n + 1])
                    assert torch.equal(dirty[name][:, rows], clean[name][:, rows]), f"{name} of sequence {n}"


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("walk,heads,seqlens,training", ISOLATION_CASES,
                         ids=[f"{c[0]}_{'training' if c[3] else 'inference'}" for c in ISOLATION_CASES])  # fmt: skip
def test_a_non_finite_sequence_leaves_the_others_alone(walk, heads, seqlens, training, bad, poisoned):
    """The other sequences' o, final states and (training) gradients are bitwise those of the same batch with the
    bad request's token finite (the products see zeros past a sequence's end either way)."""
    x, cu, do, dht = isolation_inputs(walk, heads, seqlens, training)
    bounds = cu.tolist()
    broken = {name: t.clone() for name, t in x.items()}
    for t in broken.values():
        t[0, bounds[1]] = float(bad)  # sequence 1's first token
    do_broken = do.clone()
    do_broken[:, bounds[1]:bounds[2]] = float(bad)

    clean, dirty = isolation_results(x, cu, do, dht, training), isolation_results(broken, cu, do_broken, dht, training)
    assert all(torch.isfinite(t).all() for t in clean.values())
    assert not torch.isfinite(dirty["o"][:, bounds[1]:bounds[2]]).all(), "the bad token reached its own sequence"
    assert_others_unchanged(clean, dirty, bounds, bad_sequence=1)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("walk,heads,seqlens", [c[:3] for c in ISOLATION_CASES if c[3]],
                         ids=[c[0] for c in ISOLATION_CASES if c[3]])  # fmt: skip
def test_a_non_finite_gradient_leaves_the_others_alone(walk, heads, seqlens, bad, poisoned):
    """The backward's isolation alone: finite inputs (the forward is the clean batch's), sequence 1's rows of dO
    and its dht non-finite; the other sequences' gradients are bitwise the clean batch's. (The test above breaks
    the forward too, whose outputs then fail first.)"""
    x, cu, do, dht = isolation_inputs(walk, heads, seqlens, training=True)
    bounds = cu.tolist()
    do_broken, dht_broken = do.clone(), dht.clone()
    do_broken[:, bounds[1]:bounds[2]] = float(bad)
    dht_broken[1] = float(bad)

    clean, dirty = isolation_results(x, cu, do, dht, True), isolation_results(x, cu, do_broken, dht_broken, True)
    assert all(torch.isfinite(t).all() for t in clean.values())
    assert not torch.isfinite(dirty["dv"][:, bounds[1]:bounds[2]]).all(), "the bad gradient reached its own sequence"
    assert_others_unchanged(clean, dirty, bounds, bad_sequence=1)


# inference forwards that take fused_fwd_opath, P formed in the walk (most of CASES do too, at GVA 2, 3, 4 and 8,
# fp16, h0, zero-length and partial chunks: flash_qla.ops.forward.o_path_pays)
OPATH_CASES = [
    Case("opath_gva1_h0", (700, 0, 1, 2000), heads=(16, 16), h0=True),
    Case("opath_strong_gate_edges", (0, 1, 63, 64, 65, 0, 130, 1000, 1000, 1000, 1000), heads=(2, 8), gate="strong"),
    Case("opath_fp16_4096x8", (4096,) * 8, heads=(2, 8), dtype=torch.float16, h0=True),
    # a few sequences of at most two chunks: the walk would run at 32 columns, the O path at 64 leads there
    Case("opath_few_short_edges_h0", (1, 64, 65, 128, 0, 77), heads=(4, 16), h0=True),
]


@pytest.mark.parametrize("case", OPATH_CASES, ids=[c.id for c in OPATH_CASES])
def test_opath_forward_matches_reference(case, poisoned, monkeypatch):
    from flash_qla.ops import forward as forward_module

    walks = record_calls(monkeypatch, forward_module, "fused_fwd_opath_kernel")
    forward_matches_reference(case)
    assert walks, "the forward did not take fused_fwd_opath"


# inference forwards whose walk stays at 128 columns (96 sequence-heads of equal chunk counts:
# flash_qla.ops.forward.o_path_pays keeps fused_fwd_wide; CASES' 128-column layouts take the O path now, and unequal
# chunk counts walk at 64 columns: whole_walk_time)
WIDE_WALK_CASES = [
    Case("wide128_h0", (2000, 2048), heads=(16, 48), h0=True),
    Case("wide128_fp16_edges_h0", (65, 100, 127), dtype=torch.float16, h0=True),
    # every sequence one chunk, over many waves of blocks: no O path (o_path_pays, SHORT_CHUNKS)
    Case("wide128_one_chunk_each_h0", short_seqlens(300, 2, longest=64), heads=(2, 8), h0=True),
    # three and four chunks a sequence: no O path at 128 columns, one sequence a block (sequences_per_block)
    Case("wide128_three_four_chunks_h0", tuple(n + 128 for n in short_seqlens(170, 5, 128)), heads=(2, 8), h0=True),
]


@pytest.mark.parametrize("case", WIDE_WALK_CASES, ids=[c.id for c in WIDE_WALK_CASES])
def test_wide_walk_forward_matches_reference(case, poisoned, monkeypatch):
    from flash_qla.ops import forward as forward_module

    walks = record_calls(monkeypatch, forward_module, "fused_fwd_wide_kernel")
    forward_matches_reference(case)
    assert [args[4] for args in walks] == [128], "the forward did not walk at 128 columns"


# many short sequences (at most two chunks each): the walk takes several a block (fused_fwd_wide's PACKED), its blocks'
# first and last sequences ending mid-chunk, empty ones among them
PACKED_CASES = [
    Case("packed_edges_h0", (1, 64, 65, 128, 0, 63) * 60, heads=(2, 8), h0=True),
    Case("packed_empty", (0, 8, 0, 64, 1, 0, 128) * 60, heads=(4, 8)),  # empty ones' final states zero
    Case("packed_short", short_seqlens(700, 3, longest=128), heads=(4, 16)),
    Case("packed_fp16_h0", short_seqlens(400, 4, longest=100), heads=(2, 8), dtype=torch.float16, h0=True),
]


@pytest.mark.parametrize("case", PACKED_CASES, ids=[c.id for c in PACKED_CASES])
def test_packed_forward_matches_reference(case, poisoned, monkeypatch):
    """The inference forward over many short sequences, several a block of the walk (sequences_per_block), against
    the reference: each sequence's state starts at its own initial state, and its o and final state are its own."""
    from flash_qla.ops import forward as forward_module

    walks = record_calls(monkeypatch, forward_module, "fused_fwd_wide_kernel")
    per_block, planned = [], forward_module.sequences_per_block
    monkeypatch.setattr(forward_module, "sequences_per_block", lambda *args: per_block.append(planned(*args)) or per_block[-1])
    forward_module.forward_plan.cache_clear()
    forward_matches_reference(case)
    assert [args[4] for args in walks] == [128] and per_block[0] > 1, ("not packed at 128 columns", per_block)


@pytest.mark.parametrize("case", OUTPUT_H_CASES, ids=[c.id for c in OUTPUT_H_CASES])
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


# o of the O-path walk over the pieces against the pieces walked at the planner's width: P formed in fp32 there and
# rounded to the input dtype as the A operand of P v_new, where kkt_solve rounded it for its store (2e-5 measured)
OPATH_PIECES_TOL = 1e-4


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.id for c in SPLIT_CASES])
def test_split_opath_forward_matches_pieces_walk(case, poisoned, monkeypatch):
    """An inference forward that splits walks its pieces with fused_fwd_opath where o_path_pays says so over
    them (flash_qla.ops.forward.walk_plan; kkt_solve forms no P, only the bounds its map and offsets walks skip
    by): o and the final state against the fp32 reference, and against the pieces walked at the planner's width
    after a kkt_solve with P, the final states bitwise (the same chain) and o within OPATH_PIECES_TOL. The split
    and the O path forced, so that every case's pieces take it."""
    from flash_qla.ops import forward as forward_module

    opath_walks = record_calls(monkeypatch, forward_module, "fused_fwd_opath_kernel")
    splits = record_calls(monkeypatch, forward_module, "split_walk")
    patch_planner(monkeypatch, "splits_forward", lambda *args: True)
    x, cu, h0 = case_inputs(case, seed=zlib.crc32(case.id.encode()))
    out = {}
    for opath in (True, False):
        patch_planner(monkeypatch, "o_path_pays", lambda *args, opath=opath: opath)
        if opath:
            forward_matches_reference(case)
        out[opath] = flash_qla.chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        assert len(opath_walks) == 1, "fused_fwd_opath walked the pieces, and only where forced"
    assert len(splits) == 3, "every forward split"
    assert torch.equal(out[True][1], out[False][1]), "final states"
    assert rel_l2(out[True][0], out[False][0]) <= OPATH_PIECES_TOL, rel_l2(out[True][0], out[False][0])


@pytest.mark.parametrize("case", SPLIT_CASES, ids=[c.id for c in SPLIT_CASES])
def test_split_forward_longer_pieces(case, poisoned, monkeypatch):
    """An inference split on the O path walks pieces of 64 chunks where flash_qla.ops.forward.split_piece_chunks
    says so (forced here to 64 and to 32): the map and offsets walks skip
    by the longer pieces' bounds and compose_maps composes them; o and the final state within FWD_TOL of the fp32
    reference, o within 2 FWD_TOL of the pieces of 32 (each rounds S to the input dtype at other chunks), and
    split_walk handed the length forced."""
    import inspect

    from flash_qla.ops import context_parallel
    from flash_qla.ops import forward as forward_module

    x, cu, h0 = case_inputs(case, seed=zlib.crc32(case.id.encode()))
    patch_planner(monkeypatch, "splits_forward", lambda *args: True)
    patch_planner(monkeypatch, "o_path_pays", lambda *args: True)
    splits = record_calls(monkeypatch, forward_module, "split_walk")
    ref = chunk_gated_delta_rule_fwd_ref(
        *(x[n].float() for n in ("q", "k", "v", "g", "beta")), None, h0, cu, True, False
    )
    out = {}
    for every in (64, 32):
        patch_planner(monkeypatch, "split_piece_chunks", lambda *args, every=every: every)
        o, ht = flash_qla.chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        for name, got, want in (("o", o, ref[2]), ("final_state", ht, ref[4])):
            assert torch.isfinite(got).all(), (every, name, "unwritten (NaN) elements")
            assert rel_l2(got, want) <= FWD_TOL, (every, name, rel_l2(got, want))
        out[every] = o
    signature = inspect.signature(context_parallel.split_walk)
    assert [signature.bind(*args).arguments["tables"].every for args in splits] == [64, 32]
    assert rel_l2(out[64], out[32]) <= 2 * FWD_TOL, rel_l2(out[64], out[32])


@contextlib.contextmanager
def late_map_walk():
    """Within: a split walk's map walk starts ~10 ms (on the H200) after its fork, held back on its stream by a
    device sleep (flash_qla.ops.context_parallel.fork swapped)."""
    from flash_qla.ops import context_parallel

    fork = context_parallel.fork

    @contextlib.contextmanager
    def late_fork(beside, main):
        with fork(beside, main):
            torch.cuda._sleep(20_000_000)
            yield

    context_parallel.fork = late_fork
    try:
        yield
    finally:
        context_parallel.fork = fork


def test_split_forward_waits_for_its_map_walk(poisoned, monkeypatch):
    """A split forward walks the pieces' maps on a second stream, beside their offsets
    (flash_qla.ops.context_parallel.fork), and compose_maps waits for it: held back there by a
    device sleep, the map walk ends long after the offsets walk, and o and the final state are
    bitwise those of a call without the sleep (D is NaN until the map walk writes it)."""
    case = Case("split_join", (9000,), heads=(2, 8), gate="weak")  # no map negligible: every D read
    x, cu, _ = case_inputs(case, seed=zlib.crc32(case.id.encode()))
    patch_planner(monkeypatch, "splits_forward", lambda *args: True)
    want = flash_qla.chunk_gated_delta_rule_fwd(**x, cu_seqlens=cu, output_final_state=True)
    with late_map_walk():
        got = flash_qla.chunk_gated_delta_rule_fwd(**x, cu_seqlens=cu, output_final_state=True)
    for name, a, b in zip(("o", "final_state"), (got[2], got[4]), (want[2], want[4])):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())


def test_split_inference_keeps_its_pieces_in_scratch(monkeypatch):
    """A split inference call keeps the pieces' buffers (D, b, start and end states) in scratch with kkt_solve's
    outputs (flash_qla.ops.buffers.scratch), the same ones for the next call, poisoned here. The first call's
    map walk is held back on its stream by a device sleep, so that the second call's kkt_solve, queued right after,
    would overwrite A and the bounds under it but for the join: both calls give the low-level forward's o and final
    state (the same route, its buffers its own) bitwise."""
    from flash_qla.ops import buffers

    case = Case("split_scratch", (9000,), heads=(2, 8), gate="weak")  # no map negligible: every D read
    seed = zlib.crc32(case.id.encode())
    inputs = [case_inputs(case, seed + i)[0] for i in range(2)]
    cu = torch.tensor([0, 9000], dtype=torch.int32, device="cuda")
    patch_planner(monkeypatch, "splits_forward", lambda *args: True)
    want = [flash_qla.chunk_gated_delta_rule_fwd(**x, cu_seqlens=cu) for x in inputs]
    monkeypatch.setattr(buffers, "_scratch", {})  # none kept by earlier tests

    def kept():
        return [t.data_ptr() for _, tensors in buffers._scratch.values() for t in tensors]

    first = flash_qla.chunk_gated_delta_rule(**inputs[0], cu_seqlens=cu, output_final_state=True)
    pointers = kept()
    # the pieces walked by the O path (flash_qla.ops.forward.walk_plan): kkt_solve forms no P
    assert len(pointers) == 5 + 4, "kkt_solve's outputs with the bounds, then D, b, starts and ends"
    first = [t.clone() for t in first]
    for _, tensors in buffers._scratch.values():
        for t in tensors:
            t.fill_(float("nan"))
    with late_map_walk():
        late = flash_qla.chunk_gated_delta_rule(**inputs[0], cu_seqlens=cu, output_final_state=True)
    second = flash_qla.chunk_gated_delta_rule(**inputs[1], cu_seqlens=cu, output_final_state=True)
    assert kept() == pointers
    for got, (_, _, o, _, final_state) in zip((first, late, second), (want[0], want[0], want[1])):
        assert torch.equal(got[0], o) and torch.equal(got[1], final_state)


@pytest.mark.parametrize("BV", [32, 64], ids=["narrow", "wide"])  # fused_fwd / fused_bwd and their _wide twins
def test_split_walks_leave_out_the_chunks_log_norms_show_negligible(BV):
    """The prologues of the split's map, offset and end walks (flash_qla.ops.negligible), run with
    made-up log_norms: in each piece, the even v-heads have one chunk j whose bound is −100 (far
    below ln 2^-24), the odd ones none (all 0: nothing negligible). Then, bit for bit:
    - MAPS: the even heads' M is negligible, D left as it was (NaN); the odd heads' D as with no bound at all;
    - offsets: the even heads walk chunks j.. from 0: b as the walk of the piece that starts at j;
    - ends: the even heads walk back over chunks j..0: b' as the walk of the piece cut after j.
    Two sequences, pieces of 32 chunks and shorter ones, j at different places per piece."""
    from flash_qla.arch import get_profile
    from flash_qla.ops.backward import backward_walk_kernel
    from flash_qla.ops.buffers import placeholder
    from flash_qla.ops.chunks import checkpoint_pieces, chunk_table
    from flash_qla.ops.forward import walk_gate, walk_kernel
    from flash_qla.ops.kkt_solve import kkt_solve_kernel

    case = Case("split_walk_skips", (4796, 3000), heads=(2, 8))
    (Hqk, Hv), C, K = case.heads, 64, 128
    x, cu, _ = case_inputs(case, seed=17)
    profile = get_profile(cu.device)
    E, T, scale = profile.checkpoint_chunks, sum(case.seqlens), K**-0.5
    slots = T // C + len(case.seqlens)
    q, k, v = (x[n].contiguous() for n in ("q", "k", "v"))  # packed: [1, T, ...], as the kernels take them
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(18)).to(v)
    g_cum, gamma, gates = torch.empty(1, T, Hv, device="cuda"), torch.empty(Hv, slots, C, device="cuda"), torch.empty(Hv, slots, 2, C, device="cuda")
    A, P = torch.empty(1, T, Hv, C, dtype=q.dtype, device="cuda"), torch.empty(1, T, Hv, C, dtype=q.dtype, device="cuda")
    kkt = kkt_solve_kernel(Hqk, Hv, K, "bfloat16", profile, "float32")
    g, beta = x["g"].float().contiguous(), x["beta"].float().contiguous()
    kkt(q, k, g, beta, chunk_table(cu, C, slots), g_cum, gamma, gates, A, P, torch.empty(Hv, slots, device="cuda"), slots)
    gate = walk_gate(BV, gamma, gates)
    none = placeholder(q.device, Hv, K, K)
    maps = walk_kernel(BV)(Hqk, Hv, K, K, BV, "bfloat16", profile, False, False, True, False, True)
    offsets = walk_kernel(BV)(Hqk, Hv, K, K, BV, "bfloat16", profile, False, False, True)
    ends = backward_walk_kernel(BV)(Hqk, Hv, K, K, BV, "bfloat16", profile, False, True, True)
    dh, dv = torch.empty(slots, Hv, K, K, dtype=q.dtype, device="cuda"), torch.empty_like(v)  # not written (ENDS_ONLY)

    def walk(kind, log_norms, bounds, firsts):
        out = torch.full((bounds.numel() - 1, Hv, K, 2 * K if kind == "maps" else K), float("nan"), device="cuda")
        if kind == "maps":
            out = out.bfloat16()
            maps(q, k, v, gate, A, P, bounds, firsts, log_norms, none, v, out, none, scale)
        elif kind == "offsets":
            offsets(q, k, v, gate, A, P, bounds, firsts, log_norms, none, v, out, none, scale)
        else:
            ends(q, k, do, gate, A, P, bounds, firsts, log_norms, none, dh, dv, out, scale)
        return out

    bounds, firsts, _ = checkpoint_pieces(cu, C, slots, E)
    sizes = (bounds[1:] - bounds[:-1]).tolist()
    pieces = [p for p, size in enumerate(sizes) if size > 0]
    count = {p: -(-sizes[p] // C) for p in pieces}
    assert [count[p] for p in pieces] == [32, 32, 11, 21, 26], "full pieces, a sequence's last, one starting mid-way"
    # the negligible chunk of each piece: inside, a partial piece's last (a partial chunk), first, last
    j = dict(zip(pieces, (3, 10, 10, 0, 25)))
    exact, made_up = torch.zeros(Hv, slots, device="cuda"), torch.zeros(Hv, slots, device="cuda")
    for p in pieces:
        made_up[0::2, firsts[p] + j[p]] = -100.0
    even, odd = slice(0, Hv, 2), slice(1, Hv, 2)

    for kind in ("maps", "offsets", "ends"):
        whole, skipped = walk(kind, exact, bounds, firsts), walk(kind, made_up, bounds, firsts)
        for p in pieces:
            b0, b1, f = bounds[p].item(), bounds[p + 1].item(), firsts[p].item()
            assert torch.equal(skipped[p, odd], whole[p, odd]), (kind, p, "a head with nothing negligible")
            if kind == "maps":  # compose_maps reads no D there
                assert torch.isfinite(whole[p, even].float()).all(), (kind, p)
                assert torch.isnan(skipped[p, even].float()).all(), (kind, p, "D written where M is negligible")
                continue
            if kind == "offsets":  # the piece from chunk j
                piece = torch.tensor([b0 + j[p] * C, b1], dtype=torch.int32, device="cuda")
                want = walk(kind, exact, piece, torch.tensor([f + j[p], 0], dtype=torch.int32, device="cuda"))[0, even]
            else:  # the piece up to chunk j
                piece = torch.tensor([b0, min(b1, b0 + (j[p] + 1) * C)], dtype=torch.int32, device="cuda")
                want = walk(kind, exact, piece, torch.tensor([f, 0], dtype=torch.int32, device="cuda"))[0, even]
            assert torch.isfinite(skipped[p].float()).all(), (kind, p, "unwritten (NaN) elements")
            assert torch.equal(skipped[p, even], want), (kind, p, j[p], (skipped[p, even].float() - want.float()).abs().max())
            if (kind == "offsets" and j[p] > 0) or (kind == "ends" and j[p] < count[p] - 1):  # not nothing left out
                assert not torch.equal(whole[p, even], want), (kind, p)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("has_s0", [False, True])
@pytest.mark.parametrize("decay", [0.9, 1e-3, "bounded"], ids=["keeps", "forgets", "bounded"])
def test_compose_maps_gives_every_start_state(has_s0, decay, reverse):
    """S_0 = s0, S_{j+1} = M_j S_j + b_j over each sequence's pieces, against a float64 loop; maps
    that forget the state (M ≈ 0) included, where one bf16 product would leave the rounding of S
    behind. Reverse (the backward's): the pieces last to first, each map transposed. Bounded: the
    pieces' chunk bounds (made-up log_norms, −100 on one chunk of every third piece of the even heads)
    say M_j is negligible there: S_{j+1} = b_j, although the M_j drawn is not (D's NaN rows there left out)."""
    from flash_qla.arch import get_profile
    from flash_qla.ops.buffers import placeholder
    from flash_qla.ops.compose_maps import compose_maps_kernel

    counts, Hv, K, C = (5, 0, 12), 8, 128, 64  # pieces of each sequence: 17 in all, the second has none
    n, N = sum(counts), len(counts)
    first_pieces = torch.tensor([0, 5, 5, 17], dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(3)
    scale = 0.9 if decay == "bounded" else decay
    M = (scale * torch.eye(K) + torch.randn(n, Hv, K, K, generator=gen) * (0.1 * scale / K**0.5)).cuda()
    b = torch.randn(n, Hv, K, K, generator=gen).cuda()
    s0 = torch.randn(N, Hv, K, K, generator=gen).cuda() if has_s0 else None
    starts = torch.full((n, Hv, K, K), float("nan"), device="cuda")
    # pieces of 1 to 32 chunks, one after another
    chunks = torch.randint(1, 33, (n,), generator=gen)
    first_chunks = torch.cat([torch.zeros(1, dtype=torch.int64), chunks.cumsum(0)]).to(torch.int32)
    bounds = first_chunks * C - torch.cat([torch.zeros(n, dtype=torch.int32), torch.tensor([10], dtype=torch.int32)])
    log_norms = torch.zeros(Hv, int(first_chunks[-1]))
    negligible = torch.zeros(n, Hv, dtype=torch.bool)
    if decay == "bounded":
        for j in range(0, n, 3):
            log_norms[0::2, first_chunks[j] + (j % int(chunks[j]))] = -100.0
            negligible[j, 0::2] = True
    # D = M − I as the maps' walk writes it: rounded to bf16 (hi), beside the rest (lo)
    d = M - torch.eye(K, device="cuda")
    hi = d.bfloat16()
    D = torch.cat([hi, (d - hi.float()).bfloat16()], dim=-1)
    D[negligible.cuda()] = float("nan")  # never loaded nor multiplied
    kernel = compose_maps_kernel(Hv, K, K, get_profile(M.device), has_s0, reverse)
    kernel(
        D, b, first_pieces, bounds.cuda(), first_chunks.cuda(), log_norms.cuda(),
        s0 if has_s0 else placeholder(M.device, Hv, K, K), starts,
    )  # fmt: skip
    for seq in range(N):
        S = s0[seq].double() if has_s0 else torch.zeros(Hv, K, K, dtype=torch.float64, device="cuda")
        pieces = range(first_pieces[seq].item(), first_pieces[seq + 1].item())
        for j in reversed(pieces) if reverse else pieces:
            assert rel_l2(starts[j], S.float()) <= COMPOSE_TOL, (seq, j, rel_l2(starts[j], S.float()))
            S = (M[j].mT if reverse else M[j]).double() @ S + b[j].double()
            S[negligible[j]] = b[j, negligible[j]].double()


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

    # packed: [1, T, ...], as the kernels take them
    g_cum, gamma, gates = poisoned_buffer(1, T, Hv), poisoned_buffer(Hv, slots, C), poisoned_buffer(Hv, slots, 2, C)
    A, P = (poisoned_buffer(1, T, Hv, C, dtype=x["q"].dtype) for _ in range(2))
    kkt = kkt_solve_kernel(Hqk, Hv, 128, "bfloat16", get_profile(x["q"].device), "float32")
    q, k = x["q"].contiguous(), x["k"].contiguous()
    g, beta = x["g"].float().contiguous(), x["beta"].float().contiguous()
    log_norms = poisoned_buffer(Hv, slots)
    kkt(q, k, g, beta, chunk_table(cu, C, slots), g_cum, gamma, gates, A, P, log_norms, slots)

    valid = torch.cat([(n - torch.arange(0, n, C)).clamp(max=C) for n in seqlens if n > 0]).cuda()  # tokens per chunk
    chunks = valid.numel()
    assert chunks == int(offsets[-1])
    inside = torch.arange(C, device="cuda")[None, :] < valid[:, None]  # [chunks, C]
    gam = gamma[:, :chunks]  # [Hv, chunks, C]
    gam_last = gam.gather(2, (valid - 1).view(1, -1, 1).expand(Hv, -1, 1))
    zero = torch.zeros((), device="cuda")
    torch.testing.assert_close(gates[:, :chunks, 0], torch.where(inside, gam.exp(), zero), rtol=GATES_TOL, atol=0)
    torch.testing.assert_close(gates[:, :chunks, 1], torch.where(inside, (gam_last - gam).exp(), zero), rtol=GATES_TOL, atol=0)


# kkt_solve's log_norms against the same sums in float64: its fp32 cumsum of γ over 64 gates
# (|γ_L| up to ~100 under strong gates: ulps of 1e-5 relative) and fp32 β ‖k‖²
LOG_NORMS_RTOL, LOG_NORMS_ATOL = 1e-5, 1e-4
# the bound against the exact transitions' norms (float64 SVD of float64 products): both float64
BOUND_TOL = 1e-6


def test_kkt_log_norms_bound_each_chunk_transition():
    """kkt_solve's log_norms L_c = γ_L + Σ_t ln max(1, |1 − β_t ‖k_t‖²|) (flash_qla.ops.context_parallel)
    under strong gates, with tokens that grow the state (v-heads 2-7: β up to 2.5, ‖k_t‖ up to 1.5)
    and heads whose tokens do not (0-1: β ≤ 2, ‖k_t‖ < 1): equal to that sum in float64, which is at
    least the log of the norm of each chunk's exact transition T_c = Π_t e^{g_t} (I − β_t k_t k_tᵀ)
    and equal to it where no token grows the state (64 tokens leave directions of the 128 that no
    k_t touches: ‖Π_t (I − β_t k_t k_tᵀ)‖ = 1)."""
    from flash_qla.arch import get_profile
    from flash_qla.ops.chunks import chunk_table
    from flash_qla.ops.kkt_solve import kkt_solve_kernel

    seqlens, (Hqk, Hv), C = (1, 63, 64, 65, 130, 700), (2, 8), 64
    T, slots = sum(seqlens), sum(seqlens) // C + len(seqlens)
    x, cu, _ = case_inputs(Case("log_norms", seqlens, heads=(Hqk, Hv), gate="strong"), seed=13)
    gen = torch.Generator().manual_seed(14)
    k_scale = 0.5 + torch.rand(T, Hqk, 1, generator=gen) * torch.tensor([0.49, 1.0]).view(1, Hqk, 1)
    beta_max = torch.tensor([2.0] * 2 + [2.5] * (Hv - 2))
    k = (x["k"][0].float() * k_scale.cuda()).bfloat16().contiguous()
    beta = (beta_max * torch.rand(T, Hv, generator=gen)).cuda()
    q, g = x["q"][0].contiguous(), x["g"][0].float().contiguous()

    def poisoned_buffer(*shape, dtype=torch.float32):
        return torch.full(shape, float("nan"), dtype=dtype, device="cuda")

    g_cum, gamma, gates = poisoned_buffer(1, T, Hv), poisoned_buffer(Hv, slots, C), poisoned_buffer(Hv, slots, 2, C)
    A, P = (poisoned_buffer(1, T, Hv, C, dtype=q.dtype) for _ in range(2))
    log_norms = poisoned_buffer(Hv, slots)
    kkt = kkt_solve_kernel(Hqk, Hv, 128, "bfloat16", get_profile(q.device), "float32")
    # the kernel takes the packed [1, T, ...] views
    kkt(q[None], k[None], g[None], beta[None], chunk_table(cu, C, slots), g_cum, gamma, gates, A, P, log_norms, slots)

    chunks = [(s, min(C, b + n - s)) for b, n in zip(cu[:-1].tolist(), seqlens) for s in range(b, b + n, C)]
    kh = k.double().repeat_interleave(Hv // Hqk, dim=1)  # [T, Hv, K]
    want, exact = (torch.empty(Hv, len(chunks), dtype=torch.float64, device="cuda") for _ in range(2))
    grows = torch.empty(Hv, len(chunks), dtype=torch.bool, device="cuda")
    for c, (t0, valid) in enumerate(chunks):
        kc, bc, gc = kh[t0 : t0 + valid], beta[t0 : t0 + valid].double(), g[t0 : t0 + valid].double()
        growth = (1 - bc * (kc * kc).sum(-1)).abs().log().clamp_min(0)  # [valid, Hv]
        want[:, c] = gc.sum(0) + growth.sum(0)
        grows[:, c] = (growth > 0).any(0)
        prod = torch.eye(128, dtype=torch.float64, device="cuda").repeat(Hv, 1, 1)
        for t in range(valid):  # the chunk's first token acts first
            kt = kc[t].unsqueeze(-1)  # [Hv, K, 1]
            prod = prod - bc[t].view(Hv, 1, 1) * kt @ (kt.mT @ prod)
        exact[:, c] = torch.linalg.matrix_norm(prod, ord=2).log() + gc.sum(0)
    assert not grows[:2].any() and grows[2:].any(), "both kinds of head drawn"
    torch.testing.assert_close(log_norms[:, : len(chunks)].double(), want, rtol=LOG_NORMS_RTOL, atol=LOG_NORMS_ATOL)
    assert (exact <= want + BOUND_TOL).all(), (exact - want).max()
    tight = (exact - want).abs()[~grows]
    assert (tight <= BOUND_TOL).all(), tight.max()
    # without P (the O-path walk over a split's pieces): the same bounds, γ, gates and A, bit for bit
    nop = [poisoned_buffer(*t.shape, dtype=t.dtype) for t in (g_cum, gamma, gates, A, log_norms)]
    kkt_nop = kkt_solve_kernel(Hqk, Hv, 128, "bfloat16", get_profile(q.device), "float32", FORM_P=False, BOUNDS=True)
    kkt_nop(k[None], g[None], beta[None], chunk_table(cu, C, slots), *nop, slots)
    names = ("g_cum", "gamma", "gates", "A", "log_norms")
    for name, with_p, without in zip(names, (g_cum, gamma, gates, A, log_norms), nop):
        assert torch.equal(with_p.isnan(), without.isnan()), name
        assert torch.equal(with_p.nan_to_num(7.0), without.nan_to_num(7.0)), name


@pytest.mark.parametrize("beta_dtype", ["float32", "bfloat16"])
def test_kkt_backward_mode_gives_the_forward_modes_terms(beta_dtype):
    """kkt_solve's backward mode (the low-level backward's, from the forward's g_cum) writes bitwise
    the forward mode's γ, gates, P and log_norms (the bounds its split walks skip by), and neither A
    nor g_cum: varlen with a chunk of one token, strong gates, heads whose tokens grow the state.
    γ past a chunk's last token is nothing either reads (the gates are 0 there): the forward mode's
    cumsum carries γ_L on there, the backward mode leaves 0."""
    from flash_qla.arch import get_profile
    from flash_qla.ops.chunks import chunk_table
    from flash_qla.ops.kkt_solve import kkt_solve_kernel

    seqlens, (Hqk, Hv), C = (1, 63, 65, 130, 700), (2, 8), 64
    T, slots = sum(seqlens), sum(seqlens) // C + len(seqlens)
    x, cu, _ = case_inputs(Case("kkt_modes", seqlens, heads=(Hqk, Hv), gate="strong"), seed=15)
    q, k, g = x["q"].contiguous(), x["k"].contiguous(), x["g"].float().contiguous()  # packed: [1, T, ...]
    beta = (2.5 * torch.rand(1, T, Hv, generator=torch.Generator().manual_seed(16))).to("cuda", getattr(torch, beta_dtype))
    table, profile = chunk_table(cu, C, slots), get_profile(q.device)

    def outputs():
        nan = float("nan")
        return {
            "g_cum": torch.full((1, T, Hv), nan, device="cuda"),
            "gamma": torch.full((Hv, slots, C), nan, device="cuda"),
            "gates": torch.full((Hv, slots, 2, C), nan, device="cuda"),
            "A": torch.full((1, T, Hv, C), nan, dtype=q.dtype, device="cuda"),
            "P": torch.full((1, T, Hv, C), nan, dtype=q.dtype, device="cuda"),
            "log_norms": torch.full((Hv, slots), nan, device="cuda"),
        }

    fwd, bwd = outputs(), outputs()
    kkt_solve_kernel(Hqk, Hv, 128, "bfloat16", profile, beta_dtype)(q, k, g, beta, table, *fwd.values(), slots)
    g_cum = fwd["g_cum"].clone()
    backward_mode = kkt_solve_kernel(Hqk, Hv, 128, "bfloat16", profile, beta_dtype, True)
    backward_mode(q, k, g_cum, beta, table, *bwd.values(), slots)
    inside = torch.arange(C, device="cuda") < table[:, 1:]  # [slots, C]
    fwd["gamma"], bwd["gamma"] = fwd["gamma"][:, inside], bwd["gamma"][:, inside]
    for name in ("gamma", "gates", "P", "log_norms"):  # the slots past the last chunk: NaN in both
        torch.testing.assert_close(bwd[name], fwd[name], rtol=0, atol=0, equal_nan=True, msg=name)
    chunks = sum(-(-n // C) for n in seqlens)
    assert torch.isfinite(bwd["P"]).all() and bwd["log_norms"][:, :chunks].isfinite().all()
    assert bwd["A"].isnan().all() and bwd["g_cum"].isnan().all(), "the backward mode wrote A or g_cum"


# kkt_solve's A = (I + M)⁻¹ diag(β) of each chunk against float64's inverse of the same M (from the same rounded k,
# β and the kernel's γ): the solve in fp32 (3xTF32 merges) keeps ~2⁻²¹ of its terms, so A's one rounding to the input
# dtype is what remains: ~1.7e-3 relative L2 over the off-diagonal entries in bf16 (benchmark/NOTES.md v35), 2.7e-4
# over whole chunks (v84), finer in fp16
INVERSE_TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3}
INVERSE_CASES = [  # (Hqk, Hv), seqlens, dtype, gate, FORM_P
    ((2, 8), (1, 63, 64, 65, 130, 700, 0), torch.bfloat16, "model", True),
    ((2, 8), (1, 63, 64, 65, 130, 700, 0), torch.float16, "strong", False),
    ((16, 32), (3000,), torch.bfloat16, "weak", True),
    ((16, 32), (129, 2000), torch.float16, "model", True),
]


@pytest.mark.parametrize(
    "heads,seqlens,dtype,gate,form_p", INVERSE_CASES,
    ids=[f"{h}_{len(s)}seqs_{str(d)[6:]}_{g}_{'P' if p else 'noP'}" for (_, h), s, d, g, p in INVERSE_CASES],
)
def test_kkt_solve_inverts_each_chunk(heads, seqlens, dtype, gate, form_p):
    """A from kkt_solve (forward mode, with and without P) against float64's (I + M)⁻¹ diag(β) chunk by chunk, with
    M = StrictLower(diag(β) K Kᵀ ⊙ Γ); columns past each row (and the chunk's end) exactly 0; three more launches
    bitwise the same (the solve's barriers are placed by hand, SOLVE in flash_qla.ops.kkt_solve: a missing one would
    show as a difference between launches or against float64)."""
    from flash_qla.arch import get_profile
    from flash_qla.ops.chunks import chunk_table
    from flash_qla.ops.kkt_solve import kkt_solve_kernel

    (Hqk, Hv), C = heads, 64
    T, slots = sum(seqlens), sum(seqlens) // C + len(seqlens)
    x, cu, _ = case_inputs(Case("kkt_inverse", seqlens, heads=heads, dtype=dtype, gate=gate), seed=17)
    q, k, g, beta = x["q"].contiguous(), x["k"].contiguous(), x["g"].float().contiguous(), x["beta"].contiguous()
    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    kkt = kkt_solve_kernel(Hqk, Hv, 128, name, get_profile(q.device), name, FORM_P=form_p, BOUNDS=form_p)
    nan = float("nan")
    g_cum, gamma, gates = (torch.full(s, nan, device="cuda") for s in ((1, T, Hv), (Hv, slots, C), (Hv, slots, 2, C)))
    As = [torch.full((1, T, Hv, C), nan, dtype=dtype, device="cuda") for _ in range(2)]
    table = chunk_table(cu, C, slots)
    for A in (As[0], As[1], As[1], As[1]):
        if form_p:
            P, log_norms = torch.full_like(A, nan), torch.full((Hv, slots), nan, device="cuda")
            kkt(q, k, g, beta, table, g_cum, gamma, gates, A, P, log_norms, slots)
        else:
            kkt(k, g, beta, table, g_cum, gamma, gates, A, slots)
    assert torch.equal(As[0], As[1]), "kkt_solve's A differs between launches"

    A, kh = As[0][0].double(), k[0].double().repeat_interleave(Hv // Hqk, dim=1)  # [T, Hv, C], [T, Hv, K]
    gc, bt = g_cum[0].double(), beta[0].double()
    chunks = [(s, min(C, b + n - s)) for b, n in zip(cu[:-1].tolist(), seqlens) for s in range(b, b + n, C)]
    for t0, n in chunks:
        kc, gam, bc = kh[t0 : t0 + n].transpose(0, 1), gc[t0 : t0 + n].T, bt[t0 : t0 + n].T  # [Hv, n, K], [Hv, n]
        M = (bc[:, :, None] * (kc @ kc.mT) * (gam[:, :, None] - gam[:, None, :]).exp()).tril(-1)
        want = torch.linalg.inv(torch.eye(n, dtype=torch.float64, device="cuda") + M) * bc[:, None, :]
        got = A[t0 : t0 + n].transpose(0, 1)  # [Hv, n, C]
        assert (got.triu(1) == 0).all(), (t0, "A above its diagonal")
        assert rel_l2(got[..., :n], want) <= INVERSE_TOL[dtype], (t0, n, rel_l2(got[..., :n], want))


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


def test_no_recompile_across_batch_shapes(monkeypatch):
    """Sequence lengths, batch and cu_seqlens are run-time values: calls that the planner routes alike
    compile nothing after the first, whatever their lengths, batch or number of sequences.

    The route (split or not, the walk's V-tile width, the O path, several sequences a block or one) follows
    the lengths (walk_plan, sequences_per_block), and each route's kernels are their own builds (precompile builds
    them all). Here three routes, an inference forward at 128 columns (equal lengths, packed and dense), on the O
    path (unequal lengths, empty and 1-token sequences, chunk edges) and over many short sequences several a block
    (a different number a block in each pattern: a run-time value), each called first once; then every other
    pattern of each route compiles nothing (any TileLang compile, a load from its disk cache included, is counted).
    """
    import tilelang

    from flash_qla.arch import SM90
    from flash_qla.ops.forward import sequences_per_block

    def route(seqlens):
        split, BV, opath = planned_walk(seqlens, 8)
        packed = sequences_per_block([-(-n // SM90.chunk) for n in seqlens], 8, 128, BV, SM90) > 1
        return split, BV, opath, packed

    def run(seqlens, dense):
        if dense:  # B rows of one length, no cu_seqlens
            x = make_inputs(len(seqlens), seqlens[0], 4, 8, 128, 128, device="cuda")
            return flash_qla.chunk_gated_delta_rule(**x)
        x = make_inputs(1, sum(seqlens), 4, 8, 128, 128, device="cuda")
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        return flash_qla.chunk_gated_delta_rule(**x, cu_seqlens=cu)

    routes = {  # route -> (seqlens, dense) patterns, the first called before counting
        (False, 128, False, False): [((100,) * 9, False), ((64, 64, 1) * 3, False), ((50,) * 12, False),
                                     ((700,) * 9, True), ((2048,) * 9, True)],
        (False, 64, True, False): [((200, 0, 1, 63, 65) * 2, False), ((300, 0, 1, 63, 65, 500, 64, 128, 200), False),
                                   ((1, 2, 3, 4, 300) * 2, False), ((300,) * 5, True)],
        (False, 128, False, True): [((40,) * 400, False), ((1, 64, 128, 0, 5) * 60, False), ((8,) * 1024, False),
                                    ((100,) * 300, True)],
    }  # fmt: skip
    for key, patterns in routes.items():
        assert {route(seqlens) for seqlens, _ in patterns} == {key}
        run(*patterns[0])
    compiles = []
    compile_ = tilelang.compile

    def counted(func, *args, **kwargs):
        compiles.append(func)
        return compile_(func, *args, **kwargs)

    monkeypatch.setattr(tilelang, "compile", counted)
    for patterns in routes.values():
        for seqlens, dense in patterns[1:]:
            run(seqlens, dense)
    torch.cuda.synchronize()
    assert compiles == []


@pytest.mark.parametrize("seqlens", [(200, 0, 1, 63, 65) * 2, (9000,)], ids=["opath", "split"])
def test_compiled_inference_is_the_eager_call(seqlens):
    """Under torch.compile (fullgraph) an inference call is the operator flash_qla::chunk_gated_delta_rule, which
    runs the eager call: o and final_state bitwise the eager call's (2/8: on the O path, and walked in pieces)."""
    x = make_inputs(1, sum(seqlens), 2, 8, 128, 128, device="cuda")
    x["cu_seqlens"] = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def call(q, k, v, g, beta, cu_seqlens):
        o, final_state = flash_qla.chunk_gated_delta_rule(
            q, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=True
        )  # fmt: skip
        return o * 2, final_state

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        got, want = compiled(**x), call(**x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_unsupported_head_dim_raises():
    x = make_inputs(1, 64, 2, 2, 64, 64, device="cuda")
    with pytest.raises(ValueError, match="head dims"):
        flash_qla.chunk_gated_delta_rule(**x)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize(
    "layout,case",
    [
        ("fused", Case("fused_dense_B2", (), dense=(2, 300), heads=(2, 8), h0=True)),
        ("fused", Case("fused_varlen", (0, 1, 63, 65, 700), heads=(4, 8))),
        ("batch_stride", Case("batch_stride_varlen", (100, 2000), heads=(16, 32), h0=True)),
        ("offset", Case("offset_varlen", (300, 77), heads=(4, 8), h0=True)),
    ],
    ids=["fused_dense_B2", "fused_varlen", "batch_stride_varlen", "offset_varlen"],
)
def test_strided_inputs_give_the_contiguous_results(layout, case, training, poisoned):
    """Inputs that are views of other memory give bitwise the results of the same values contiguous: o, the final
    state and, training, every gradient. The host makes the views contiguous and 16-byte aligned where the kernels
    need it (the batch_stride layout passes as it comes: torch counts it contiguous, its size-1 dim's stride
    unread; the offset layout is contiguous but 8 bytes off, which a kernel's copies would fault on)."""
    x, cu, h0 = case_inputs(case, seed=zlib.crc32(case.id.encode()))
    do = torch.randn_like(x["v"])

    def run(inputs):
        if training:  # leaves in the inputs' own layout (detach keeps the strides)
            inputs = {name: t.detach().requires_grad_() for name, t in inputs.items()}
        o, ht = flash_qla.chunk_gated_delta_rule(**inputs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        if not training:
            return o, ht
        return (o, ht, *torch.autograd.grad((o.float() * do.float()).sum() + ht.sum(), list(inputs.values())))

    contiguous = run(x)
    views = {name: strided(t, layout) for name, t in x.items()}
    assert all(v.is_contiguous() == (layout != "fused") for v in views.values())
    got = run(views)
    assert len(got) == (7 if training else 2)
    for name, want, value in zip(("o", "final_state", *(f"d{name}" for name in x)), contiguous, got):
        assert torch.equal(value, want), name


def test_split_forward_in_a_cuda_graph(monkeypatch):
    """A split inference forward (its map walk forks onto launch.side_stream and joins the capturing stream again),
    captured in a CUDA graph and replayed on new inputs copied into the captured ones: o and the final state of the
    eager call on those inputs, bitwise."""
    case = next(c for c in SPLIT_CASES if c.id == "split_one_long_h0")
    patch_planner(monkeypatch, "splits_forward", lambda *args: True)
    static, cu, h0 = case_inputs(case, seed=41)
    static["initial_state"] = h0

    def step(t):
        return flash_qla.chunk_gated_delta_rule_fwd(**t, cu_seqlens=cu, output_final_state=True)[2::2]

    step(static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(static)
    fresh, _, fresh_h0 = case_inputs(case, seed=42)
    fresh["initial_state"] = fresh_h0
    for name in fresh:
        static[name].copy_(fresh[name])
    graph.replay()
    eager = step({n: t.clone() for n, t in static.items()})
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
