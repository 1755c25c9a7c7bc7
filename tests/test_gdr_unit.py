"""GPU kernels vs the fp32 PyTorch reference (skips without CUDA).

Every case draws fresh inputs, poisons every kernel output with NaN before the run (so an
element the kernels never write fails the check), runs the public API on the GPU and
compares with the chunked reference computed in fp32 from the same rounded inputs.
"""

import math
import zlib
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import flash_qla
from flash_qla.reference.chunked import chunk_gated_delta_rule_fwd_ref
from flash_qla.reference.inputs import make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16/fp16 operands of every tensor-core product (A, S, v_new, P rounded once per chunk)
# land between 1e-3 and 3e-3 relative L2; the bar is 5e-3.
FWD_TOL = 5e-3
# g_cum is an fp32 cumsum of at most 64 terms in both implementations.
GCUM_TOL = 1e-5
# A is stored in the input dtype (one rounding of values of order 1; fp16 rounds finer).
A_TOL = 1e-2


@dataclass(frozen=True)
class Case:
    id: str
    seqlens: tuple  # lengths of the packed sequences (B = 1) ...
    dense: tuple = ()  # ... or (B, T) of a dense batch
    heads: tuple = (16, 32)  # Hqk, Hv
    dtype: torch.dtype = torch.bfloat16
    h0: bool = False
    gate: str = "model"  # model | weak | strong
    extra: dict = field(default_factory=dict)


def _short_seqlens(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(1, 90, (n,), generator=gen).tolist())


CASES = [
    Case("dense_B1_T256", (), dense=(1, 256)),
    Case("dense_B2_T300_h0", (), dense=(2, 300), h0=True),
    Case("varlen_edges_h0", (0, 1, 63, 64, 65, 0, 130, 1), heads=(4, 8), h0=True),
    Case("varlen_many_short", _short_seqlens(150, 1), heads=(8, 32), h0=True),
    Case("varlen_4096x8", (4096,) * 8, heads=(16, 32)),
    Case("long_T32768", (32768,), heads=(16, 32)),
    Case("long_T32768_weak_gate", (32768,), heads=(2, 8), gate="weak", h0=True),
    Case("strong_gate", (1000, 3000), heads=(16, 32), gate="strong", h0=True),
    Case("gva1_Hv4", (500, 700), heads=(4, 4), h0=True),
    Case("gva8_Hv16", (777,), heads=(2, 16)),
    Case("gva4_Hv32", (1024, 1), heads=(8, 32), h0=True),
    Case("gva3_Hv48", (2048,), heads=(16, 48)),
    Case("gva4_Hv64", (333, 2048), heads=(16, 64), h0=True),
    Case("gva8_Hv64", (2000,), heads=(8, 64)),
    Case("fp16_dense_B2", (), dense=(2, 1000), dtype=torch.float16, h0=True),
    Case("fp16_varlen_edges", (0, 1, 63, 64, 65, 129), heads=(4, 8), dtype=torch.float16),
    Case("scale_0.3", (300,), heads=(4, 8), extra={"scale": 0.3}),
    Case("state_v_first", (200, 100), heads=(4, 8), h0=True, extra={"state_v_first": True}),
    Case("qk_l2norm", (260,), heads=(4, 8), extra={"use_qk_l2norm_in_kernel": True}),
]


def _inputs(case, seed):
    B, T = case.dense if case.dense else (1, sum(case.seqlens))
    Hqk, Hv = case.heads
    x = make_inputs(B, T, Hqk, Hv, 128, 128, dtype=case.dtype, device="cuda", seed=seed)
    if case.gate == "weak":
        x["g"] = -0.001 * (1 + 0.1 * torch.rand_like(x["g"]))
    elif case.gate == "strong":  # A_log = log 16, dt = 0.1
        x["g"] = -16 * F.softplus(torch.randn_like(x["g"]) + math.log(math.expm1(0.1)))
    if case.extra.get("use_qk_l2norm_in_kernel"):
        x["q"], x["k"] = x["q"] * 3, x["k"] * 0.5  # not unit norm: the kernel path must normalise
    N = B if case.dense else len(case.seqlens)
    cu = None
    if not case.dense:
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    h0 = torch.randn(N, Hv, 128, 128, device="cuda") if case.h0 else None
    return x, cu, h0


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.fixture
def poisoned(monkeypatch):
    """Every output the forward allocates starts as NaN."""
    from flash_qla.ops import forward

    def new(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(forward, "_new", new)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_forward_matches_reference(case, poisoned):
    x, cu, h0 = _inputs(case, seed=zlib.crc32(case.id.encode()))
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
    errors = {"o": _rel(o, ref[2]), "final_state": _rel(ht, ref[4])}
    print(case.id, {name: f"{err:.2e}" for name, err in errors.items()})
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    assert errors["o"] <= FWD_TOL and errors["final_state"] <= FWD_TOL, errors


LOW_LEVEL = [c for c in CASES if c.id in ("dense_B2_T300_h0", "varlen_edges_h0", "fp16_varlen_edges", "gva3_Hv48")]


@pytest.mark.parametrize("case", LOW_LEVEL, ids=[c.id for c in LOW_LEVEL])
def test_low_level_forward_intermediates(case, poisoned):
    """g_cum, A and the per-chunk states h of the low-level forward, each vs the reference."""
    x, cu, h0 = _inputs(case, seed=7)
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
        assert _rel(got, want) <= tol, (name, _rel(got, want))


def test_no_recompile_across_batch_shapes():
    """Three seqlen patterns of one head layout hit the same compiled kernels."""
    from flash_qla.ops import fused_fwd, kkt_solve

    def run(seqlens):
        x = make_inputs(1, sum(seqlens), 4, 8, 128, 128, device="cuda")
        cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        flash_qla.chunk_gated_delta_rule(**x, cu_seqlens=cu)

    run((100,))
    before = (fused_fwd.fused_fwd_kernel.cache_info().misses, kkt_solve.kkt_solve_kernel.cache_info().misses)
    for seqlens in ((64, 64, 1), (5000,), (1, 2, 3, 4, 300)):
        run(seqlens)
    after = (fused_fwd.fused_fwd_kernel.cache_info().misses, kkt_solve.kkt_solve_kernel.cache_info().misses)
    assert after == before


def test_unsupported_head_dim_raises():
    x = make_inputs(1, 64, 2, 2, 64, 64, device="cuda")
    with pytest.raises(ValueError, match="head dims"):
        flash_qla.chunk_gated_delta_rule(**x)
