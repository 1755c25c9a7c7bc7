"""Shared pieces of the GPU tests: the case table, its inputs on the GPU, and the error measure.

Importing this module needs no GPU; only case_inputs does.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flash_qla.reference.backward_stages import BETA_MIN
from flash_qla.reference.inputs import make_inputs

# o and final_state against the fp32 reference, relative L2: bf16/fp16 operands of every tensor-core
# product (A, S, v_new, P rounded once per chunk) land between 1e-3 and 3e-3; the bar is 5e-3.
FWD_TOL = 5e-3


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


def planned_walk(seqlens, Hv, training=False, output_h=False, auto_cp=True, dtype=torch.bfloat16):
    """flash_qla.ops.forward.walk_plan on SM90 at K = V = 128, asked as forward_plan asks it by default: a training
    forward keeps its states where keeps_states says so (keep_states=None)."""
    from flash_qla.arch import SM90
    from flash_qla.ops.forward import keeps_states, walk_plan

    keep = keeps_states(None, training, output_h, sum(seqlens), Hv, 128, 128, dtype, SM90)
    return walk_plan(seqlens, Hv, 128, SM90, auto_cp, training, output_h, keep)


def record_calls(monkeypatch, module, name):
    """Wrap module.name (for the test's duration) so that each call's arguments are appended to the
    returned list: which route a planner took, seen from outside."""
    calls, original = [], getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


def drop_plans():
    """Forget the plans flash_qla.ops.forward.forward_plan and flash_qla.ops.backward.backward_plan remember
    per shapes and options: the next forward and backward plan afresh (after a planner function was swapped)."""
    from flash_qla.ops import backward, forward

    forward.forward_plan.cache_clear()
    backward.backward_plan.cache_clear()


def patch_planner(monkeypatch, name, fn, module=None):
    """Swap the planner function `name` of module (flash_qla.ops.forward unless given) for fn for the test's
    duration, and drop the plans made so far, so that the next forward and backward plan with fn."""
    if module is None:
        from flash_qla.ops import forward as module

    monkeypatch.setattr(module, name, fn)
    drop_plans()


def short_seqlens(n, seed, longest=89):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(1, longest + 1, (n,), generator=gen).tolist())


CASES = [
    Case("dense_B1_T256", (), dense=(1, 256)),
    Case("dense_B2_T300_h0", (), dense=(2, 300), h0=True),
    Case("varlen_edges_h0", (0, 1, 63, 64, 65, 0, 130, 1), heads=(4, 8), h0=True),
    Case("varlen_many_short", short_seqlens(150, 1), heads=(8, 32), h0=True),
    Case("varlen_4096x8", (4096,) * 8, heads=(16, 32)),
    Case("long_T32768", (32768,), heads=(16, 32)),
    Case("long_T32768_weak_gate", (32768,), heads=(2, 8), gate="weak", h0=True),
    Case("strong_gate", (1000, 3000), heads=(16, 32), gate="strong", h0=True),
    Case("gva1_Hv4", (500, 700), heads=(4, 4), h0=True),
    Case("gva8_Hv16", (777,), heads=(2, 16)),
    Case("gva4_Hv32", (1024, 1), heads=(8, 32), h0=True),
    Case("gva3_Hv48", (2048,), heads=(16, 48)),
    # 24 (sequence, head) pairs: the low-level backward's walk at 64 columns beside the recompute at 64 (beside_widths'
    # grid load; test_gdr_grad.py's LOW_LEVEL); training keeps the states, its backward walk alone at 32
    Case("gva3_Hv24", (2048,), heads=(8, 24)),
    Case("gva4_Hv64", (333, 2048), heads=(16, 64), h0=True),
    Case("gva8_Hv64", (2000,), heads=(8, 64)),
    Case("fp16_dense_B2", (), dense=(2, 1000), dtype=torch.float16, h0=True),
    Case("fp16_varlen_edges", (0, 1, 63, 64, 65, 129), heads=(4, 8), dtype=torch.float16),
    # 11 sequences x 32 heads: V-tiles of 128 (fused_fwd_wide) where h is kept or asked for; o alone takes the O path
    Case("fp16_varlen_wide_h0", (0, 1, 63, 64, 65) + (1000,) * 6, dtype=torch.float16, h0=True),
    # one sequence over 8 heads: V-tiles of 16 (fused_fwd, fused_bwd) in every mode
    Case("fp16_narrow_h0", (2048,), heads=(2, 8), dtype=torch.float16, h0=True),
    Case("scale_0.3", (300,), heads=(4, 8), extra={"scale": 0.3}),
    Case("state_v_first", (200, 100), heads=(4, 8), h0=True, extra={"state_v_first": True}),
    Case("qk_l2norm", (260,), heads=(4, 8), extra={"use_qk_l2norm_in_kernel": True}),
    Case("beta_fp32", (300, 700), heads=(4, 8), extra={"beta_fp32": True}),  # β not in q's dtype
    # β = 0 and β below BETA_MIN in some chunks: chunk_grads' dβ by the products there, the quotient elsewhere
    Case("small_beta", (300, 700), h0=True, extra={"small_beta": True}),
    Case("fp16_small_beta", (0, 1, 63, 64, 65, 700), dtype=torch.float16, extra={"small_beta": True}),
]

# the low-level forward's cases with output_h (its per-chunk states h in fp32, test_gdr_unit.py): the whole walk
# storing h at V-tiles of 64, 32, 64, 128 (bf16) and 32, 128, 64 (fp16)
OUTPUT_H_CASES = [
    next(c for c in CASES if c.id == case_id)
    for case_id in (
        "dense_B2_T300_h0", "varlen_edges_h0", "gva3_Hv48", "varlen_many_short",
        "fp16_varlen_edges", "fp16_varlen_wide_h0", "fp16_dense_B2",
    )
]

# the forward split forced on and off, whatever the planner would do, with output_h (test_gdr_unit.py); off, the
# whole walks store h at V-tiles of 16
SPLIT_CASES = [
    Case("split_one_long_h0", (9000,), heads=(2, 8), gate="weak", h0=True),  # 5 pieces, the last partial
    Case("split_one_piece_and_a_bit", (2049,), heads=(4, 16)),  # 33 chunks: a piece of one chunk
    Case("split_fp16_strong_gate", (5000,), heads=(2, 8), dtype=torch.float16, gate="strong"),
    # several sequences: an empty one, one inside a piece, pieces not aligned to a sequence start
    Case("split_varlen_h0", (5000, 0, 70, 9000), heads=(2, 8), h0=True),
    Case("split_narrow_gva1_h0", (8192,), heads=(4, 4), h0=True),  # 4 pieces x 4 heads: walks at V-tiles of 16
]


def case_inputs(case, seed):
    """q, k, v, g, beta (dict, on the GPU), cu_seqlens (int32 or None) and a K-first h0 [N, Hv, K, V] or None."""
    B, T = case.dense if case.dense else (1, sum(case.seqlens))
    Hqk, Hv = case.heads
    x = make_inputs(B, T, Hqk, Hv, 128, 128, dtype=case.dtype, device="cuda", seed=seed)
    # the case's own draws come from seed too (on the CPU, as make_inputs'): a failure reproduces
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(sample, like, dtype=None):
        return sample(like.shape, generator=gen, dtype=dtype or like.dtype).to(like.device)

    if case.gate == "weak":
        x["g"] = -0.001 * (1 + 0.1 * draw(torch.rand, x["g"]))
    elif case.gate == "strong":  # A_log = log 16, dt = 0.1
        x["g"] = -16 * F.softplus(draw(torch.randn, x["g"]) + math.log(math.expm1(0.1)))
    if case.extra.get("beta_fp32"):
        x["beta"] = torch.sigmoid(draw(torch.randn, x["beta"], torch.float32))
    if case.extra.get("small_beta"):
        x["beta"][:, ::197, 0] = 0
        x["beta"][:, 90::311, -1] = BETA_MIN / 8
    if case.extra.get("use_qk_l2norm_in_kernel"):
        x["q"], x["k"] = x["q"] * 3, x["k"] * 0.5  # not unit norm: the kernel path must normalise
    N = B if case.dense else len(case.seqlens)
    cu = None
    if not case.dense:
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    h0 = torch.randn(N, Hv, 128, 128, generator=gen).cuda() if case.h0 else None
    return x, cu, h0


def strided(x, layout):
    """x's values in another memory layout, as callers hand tensors over. "fused": a slice along the last dim of a
    wider tensor (q, k, v, g and β cut from one projection's output: the heads' rows not adjacent). "batch_stride":
    a batch of one whose batch dim has a stride no contiguous tensor has ([T, 1, ...] transposed), which the
    kernels, taking [1, T, ...] as it comes, never read. "offset": contiguous, 8 bytes into a longer buffer, so not
    at the 16-byte aligned address the kernels' copies need (flash_qla.ops.forward.ALIGNMENT)."""
    if layout == "fused":  # the rest of the row NaN: read by mistake, it shows
        wide = torch.full((*x.shape[:-1], x.shape[-1] + 8), float("nan"), dtype=x.dtype, device=x.device)
        wide[..., 3 : 3 + x.shape[-1]] = x
        return wide[..., 3 : 3 + x.shape[-1]]
    if layout == "offset":
        skip = 8 // x.element_size()
        flat = torch.full((skip + x.numel(),), float("nan"), dtype=x.dtype, device=x.device)
        return flat[skip:].view(x.shape).copy_(x)
    assert x.shape[0] == 1
    return x[0].unsqueeze(1).contiguous().transpose(0, 1)


def rel_l2(x, ref):
    """‖x − ref‖ / ‖ref‖ in float64."""
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
