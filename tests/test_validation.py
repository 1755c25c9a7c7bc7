"""Every input check: bad input raises ValueError/TypeError naming the argument, what was expected and what came."""

import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from flash_qla import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flash_qla.reference import CHUNK_SIZE
from flash_qla.reference.inputs import make_inputs
from flash_qla.validation import seqlens_of

B, T, HQK, HV, K, V = 2, 10, 2, 4, 8, 4  # K != V, so a swapped state layout is caught


def valid_inputs(varlen):
    """Valid arguments for all three entry points; varlen packs 2 sequences (3 + 7 tokens) in B = 1."""
    b, n = (1, 2) if varlen else (B, B)
    return {
        "q": torch.randn(b, T, HQK, K),
        "k": torch.randn(b, T, HQK, K),
        "v": torch.randn(b, T, HV, V),
        "g": -torch.rand(b, T, HV),
        "beta": torch.rand(b, T, HV),
        "A": torch.zeros(b, T, HV, CHUNK_SIZE),
        "do": torch.zeros(b, T, HV, V),
        "dht": torch.zeros(n, HV, K, V),
        "scale": None,
        "initial_state": torch.zeros(n, HV, K, V),
        "cu_seqlens": torch.tensor([0, 3, T]) if varlen else None,
        "state_v_first": False,
    }


def call_api(x):
    return chunk_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"], state_v_first=x["state_v_first"],
    )  # fmt: skip


def call_fwd(x):
    return chunk_gated_delta_rule_fwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"], state_v_first=x["state_v_first"],
    )  # fmt: skip


def call_bwd(x):
    return chunk_gated_delta_rule_bwd(
        x["q"], x["k"], x["v"], x["g"], x["beta"], x["A"], x["do"], x["dht"], scale=x["scale"],
        initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"], state_v_first=x["state_v_first"],
    )  # fmt: skip


ENTRY_POINTS = {"api": call_api, "fwd": call_fwd, "bwd": call_bwd}


@dataclass(frozen=True)
class Bad:
    id: str
    change: Callable  # dict of valid inputs -> dict of replacements
    error: type
    message: str  # a literal part of the message
    varlen: bool = False


COMMON = [
    # types and ranks
    Bad("q-not-a-tensor", lambda x: {"q": x["q"].tolist()}, TypeError, "q: expected a torch.Tensor, got list"),
    Bad("q-3-dims", lambda x: {"q": x["q"][0]}, ValueError, "q: expected 4 dims [B, T, Hqk, K], got shape (10, 2, 8)"),
    Bad("k-5-dims", lambda x: {"k": x["k"][None]}, ValueError, "k: expected 4 dims [B, T, Hqk, K]"),
    Bad("v-3-dims", lambda x: {"v": x["v"][..., 0]}, ValueError, "v: expected 4 dims [B, T, Hv, V]"),
    Bad("g-4-dims", lambda x: {"g": x["g"][..., None]}, ValueError, "g: expected 3 dims [B, T, Hv]"),
    Bad("beta-2-dims", lambda x: {"beta": x["beta"][..., 0]}, ValueError, "beta: expected 3 dims [B, T, Hv]"),
    # dtypes
    Bad("q-int32", lambda x: {k: x[k].int() for k in "qkv"}, TypeError, "q: expected one of torch.bfloat16"),
    Bad("k-float16-q-float32", lambda x: {"k": x["k"].half()}, TypeError,
        "k: expected the dtype of q, torch.float32, got torch.float16"),
    Bad("v-bfloat16-q-float32", lambda x: {"v": x["v"].bfloat16()}, TypeError, "v: expected the dtype of q"),
    Bad("g-int64", lambda x: {"g": x["g"].long()}, TypeError, "g: expected a floating-point dtype, got torch.int64"),
    Bad("beta-bool", lambda x: {"beta": x["beta"] > 0.5}, TypeError, "beta: expected a floating-point dtype"),
    # shapes
    Bad("T-0", lambda x: {k: x[k][:, :0] for k in ("q", "k", "v", "g", "beta")}, ValueError,
        "q: expected no empty dimension, got shape (2, 0, 2, 8)"),
    Bad("V-0", lambda x: {"v": x["v"][..., :0]}, ValueError, "v: expected no empty dimension"),
    Bad("k-T-differs", lambda x: {"k": x["k"][:, :-1]}, ValueError,
        "k: expected shape [B, T, Hqk, K] = (2, 10, 2, 8), got (2, 9, 2, 8)"),
    Bad("k-K-differs", lambda x: {"k": x["k"][..., :-1]}, ValueError, "k: expected shape [B, T, Hqk, K]"),
    Bad("k-heads-differ", lambda x: {"k": x["k"][:, :, :1]}, ValueError, "k: expected shape [B, T, Hqk, K]"),
    Bad("v-B-differs", lambda x: {"v": x["v"][:1]}, ValueError, "v: expected [B, T] = (2, 10) as in q, got shape"),
    Bad("v-T-differs", lambda x: {"v": x["v"][:, 1:]}, ValueError, "v: expected [B, T] = (2, 10)"),
    Bad("Hv-3-Hqk-2", lambda x: {"v": x["v"][:, :, :3]}, ValueError,
        "v: expected a head count Hv divisible by Hqk = 2 (q's heads), got Hv = 3"),
    Bad("g-heads-differ", lambda x: {"g": x["g"][..., :-1]}, ValueError,
        "g: expected shape [B, T, Hv] = (2, 10, 4), got (2, 10, 3)"),
    Bad("g-T-differs", lambda x: {"g": x["g"][:, :-1]}, ValueError, "g: expected shape [B, T, Hv]"),
    Bad("beta-B-differs", lambda x: {"beta": x["beta"][:1]}, ValueError, "beta: expected shape [B, T, Hv]"),
    # devices
    Bad("k-on-meta", lambda x: {"k": x["k"].to("meta")}, ValueError,
        "k: expected a tensor on cpu (the device of q), got meta"),
    Bad("v-on-meta", lambda x: {"v": x["v"].to("meta")}, ValueError, "v: expected a tensor on cpu"),
    Bad("g-on-meta", lambda x: {"g": x["g"].to("meta")}, ValueError, "g: expected a tensor on cpu"),
    Bad("beta-on-meta", lambda x: {"beta": x["beta"].to("meta")}, ValueError, "beta: expected a tensor on cpu"),
    # scale
    Bad("scale-str", lambda x: {"scale": "0.1"}, TypeError, "scale: expected None or a float, got str"),
    Bad("scale-tensor", lambda x: {"scale": torch.tensor(0.1)}, TypeError, "scale: expected None or a float"),
    Bad("scale-nan", lambda x: {"scale": float("nan")}, ValueError, "scale: expected a finite value, got nan"),
    # initial_state
    Bad("initial_state-list", lambda x: {"initial_state": x["initial_state"].tolist()}, TypeError,
        "initial_state: expected a torch.Tensor, got list"),
    Bad("initial_state-3-dims", lambda x: {"initial_state": x["initial_state"][0]}, ValueError,
        "initial_state: expected 4 dims [N, Hv, K, V]"),
    Bad("initial_state-int", lambda x: {"initial_state": x["initial_state"].int()}, TypeError,
        "initial_state: expected a floating-point dtype"),
    Bad("initial_state-N-1", lambda x: {"initial_state": x["initial_state"][:1]}, ValueError,
        "initial_state: expected shape [N, Hv, K, V] = (2, 4, 8, 4), got (1, 4, 8, 4)"),
    Bad("initial_state-V-first", lambda x: {"initial_state": x["initial_state"].transpose(-1, -2)}, ValueError,
        "initial_state: expected shape [N, Hv, K, V] = (2, 4, 8, 4), got (2, 4, 4, 8)"),
    Bad("initial_state-K-first-with-state_v_first", lambda x: {"state_v_first": True}, ValueError,
        "initial_state: expected shape [N, Hv, V, K] = (2, 4, 4, 8), got (2, 4, 8, 4)"),
    Bad("initial_state-on-meta", lambda x: {"initial_state": x["initial_state"].to("meta")}, ValueError,
        "initial_state: expected a tensor on cpu"),
    Bad("initial_state-N-3-varlen", lambda x: {"initial_state": torch.zeros(3, HV, K, V)}, ValueError,
        "initial_state: expected shape [N, Hv, K, V] = (2, 4, 8, 4), got (3, 4, 8, 4)", varlen=True),
    # cu_seqlens
    Bad("cu_seqlens-with-B-2", lambda x: {"cu_seqlens": torch.tensor([0, 3, T])}, ValueError,
        "cu_seqlens: expected batch size B == 1 with packed sequences, got B = 2"),
    Bad("cu_seqlens-list", lambda x: {"cu_seqlens": [0, 3, T]}, TypeError,
        "cu_seqlens: expected a torch.Tensor, got list", varlen=True),
    Bad("cu_seqlens-float", lambda x: {"cu_seqlens": x["cu_seqlens"].float()}, TypeError,
        "cu_seqlens: expected int32 or int64, got torch.float32", varlen=True),
    Bad("cu_seqlens-2-dims", lambda x: {"cu_seqlens": x["cu_seqlens"][None]}, ValueError,
        "cu_seqlens: expected 1 dims [N + 1], got shape (1, 3)", varlen=True),
    Bad("cu_seqlens-1-entry", lambda x: {"cu_seqlens": torch.tensor([0])}, ValueError,
        "cu_seqlens: expected at least 2 entries [0, ..., T], got 1", varlen=True),
    Bad("cu_seqlens-not-from-0", lambda x: {"cu_seqlens": torch.tensor([1, 3, T])}, ValueError,
        "cu_seqlens: expected non-decreasing values from 0 to T = 10, got [1, 3, 10]", varlen=True),
    Bad("cu_seqlens-decreasing", lambda x: {"cu_seqlens": torch.tensor([0, 6, 3, T])}, ValueError,
        "cu_seqlens: expected non-decreasing values from 0 to T = 10, got [0, 6, 3, 10]", varlen=True),
    Bad("cu_seqlens-not-to-T", lambda x: {"cu_seqlens": torch.tensor([0, 3, T - 1])}, ValueError,
        "cu_seqlens: expected non-decreasing values from 0 to T = 10, got [0, 3, 9]", varlen=True),
    Bad("cu_seqlens-on-meta", lambda x: {"cu_seqlens": x["cu_seqlens"].to("meta")}, ValueError,
        "cu_seqlens: expected a tensor on cpu (the device of q), got meta", varlen=True),
]  # fmt: skip

BACKWARD_ONLY = [
    Bad("A-32-columns", lambda x: {"A": x["A"][..., :32]}, ValueError,
        "A: expected shape [B, T, Hv, 64] = (2, 10, 4, 64), got (2, 10, 4, 32)"),
    Bad("A-int", lambda x: {"A": x["A"].int()}, TypeError, "A: expected a floating-point dtype"),
    Bad("A-on-meta", lambda x: {"A": x["A"].to("meta")}, ValueError, "A: expected a tensor on cpu"),
    Bad("do-missing-V", lambda x: {"do": x["do"][..., 0]}, ValueError, "do: expected 4 dims [B, T, Hv, V]"),
    Bad("do-V-differs", lambda x: {"do": x["do"][..., :1]}, ValueError, "do: expected shape [B, T, Hv, V]"),
    Bad("do-int", lambda x: {"do": x["do"].int()}, TypeError, "do: expected a floating-point dtype"),
    Bad("do-on-meta", lambda x: {"do": x["do"].to("meta")}, ValueError, "do: expected a tensor on cpu"),
    Bad("dht-int", lambda x: {"dht": x["dht"].int()}, TypeError, "dht: expected a floating-point dtype"),
    Bad("dht-3-dims", lambda x: {"dht": x["dht"][0]}, ValueError, "dht: expected 4 dims [N, Hv, K, V]"),
    # a V-first initial_state passes, so the check that fails is dht's
    Bad("dht-K-first-with-state_v_first",
        lambda x: {"state_v_first": True, "initial_state": x["initial_state"].transpose(-1, -2)}, ValueError,
        "dht: expected shape [N, Hv, V, K] = (2, 4, 4, 8), got (2, 4, 8, 4)"),
    Bad("dht-N-1", lambda x: {"dht": x["dht"][:1]}, ValueError,
        "dht: expected shape [N, Hv, K, V] = (2, 4, 8, 4), got (1, 4, 8, 4)"),
    Bad("dht-on-meta", lambda x: {"dht": x["dht"].to("meta")}, ValueError, "dht: expected a tensor on cpu"),
]  # fmt: skip


def expect(bad, call):
    x = valid_inputs(bad.varlen)
    x.update(bad.change(x))
    with pytest.raises(bad.error, match=re.escape(bad.message)):
        call(x)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_valid_inputs_pass(entry, varlen):
    ENTRY_POINTS[entry](valid_inputs(varlen))


@pytest.mark.parametrize("bad", COMMON, ids=lambda b: b.id)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_bad_input_is_rejected(entry, bad):
    expect(bad, ENTRY_POINTS[entry])


@pytest.mark.parametrize("bad", BACKWARD_ONLY, ids=lambda b: b.id)
def test_bad_backward_input_is_rejected(bad):
    expect(bad, call_bwd)


def test_head_first_is_rejected():
    x = valid_inputs(varlen=False)
    with pytest.raises(ValueError, match=re.escape("head_first: expected False")):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], head_first=True)


def test_unknown_keyword_is_rejected():
    x = valid_inputs(varlen=False)
    with pytest.raises(TypeError, match="unexpected keyword argument 'chunk_size'"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=64)


def test_cu_seqlens_recheck_after_in_place_change():
    """The last valid cu_seqlens is remembered; an in-place edit is seen and checked again."""
    x = make_inputs(1, 10, 1, 1, 4, 4, dtype=torch.float32)
    cu = torch.tensor([0, 4, 10])
    chunk_gated_delta_rule(**x, cu_seqlens=cu)
    chunk_gated_delta_rule(**x, cu_seqlens=cu)  # cached: same tensor, same version
    cu[1] = 11
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(**x, cu_seqlens=cu)


def test_seqlens_read_once_per_tensor(monkeypatch):
    """The lengths the planner weighs come from validation's one read of cu_seqlens."""
    cu = torch.tensor([0, 4, 4, 10])
    assert seqlens_of(cu, 10) == (4, 0, 6)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("cu_seqlens read again"))
    assert seqlens_of(cu, 10) == (4, 0, 6)


@pytest.mark.parametrize("varlen", [False, True])
def test_check_inputs_returns_the_lengths(monkeypatch, varlen):
    """What the planner and the sizes of outputs take: cu_seqlens' lengths, or B of T."""
    from flash_qla import validation

    monkeypatch.setitem(validation._passed, "signature", None)
    x = valid_inputs(varlen)
    args = [x[name] for name in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens", "state_v_first")]
    assert validation.check_inputs(*args) == ((3, 7) if varlen else (T,) * B)  # the full checks' path
    assert validation.check_inputs(*args) == ((3, 7) if varlen else (T,) * B)  # the signature's path


def test_checks_run_once_per_signature(monkeypatch):
    """check_inputs remembers the last arguments it passed by their shapes, dtypes and devices (the
    layers of a step repeat them) and checks again whatever differs, a new cu_seqlens' values too."""
    from flash_qla import validation

    full_checks = []
    check_shapes = validation.check_shapes
    monkeypatch.setattr(validation, "check_shapes", lambda *args: (full_checks.append(args), check_shapes(*args)))
    monkeypatch.setitem(validation._passed, "signature", None)
    call_api(valid_inputs(varlen=True))
    call_api(valid_inputs(varlen=True))  # new tensors, the same signature
    assert len(full_checks) == 1
    x = valid_inputs(varlen=True)
    x["k"] = x["k"][..., :-1]
    with pytest.raises(ValueError, match=re.escape("k: expected shape")):
        call_api(x)
    call_api(valid_inputs(varlen=True))  # a failed check left the remembered signature as it was
    assert len(full_checks) == 2
    x = valid_inputs(varlen=True)
    x["cu_seqlens"] = torch.tensor([0, T + 1, T])  # the signature that passed, values that do not
    with pytest.raises(ValueError, match=re.escape("cu_seqlens: expected non-decreasing values")):
        validation.check_inputs(*(x[name] for name in ("q", "k", "v", "g", "beta", "scale", "initial_state")),
                                x["cu_seqlens"], x["state_v_first"])  # fmt: skip
    x = valid_inputs(varlen=True)
    x["scale"] = 1
    call_api(x)
    x["scale"] = True  # equal to the 1 that passed, but not a number here
    with pytest.raises(TypeError, match=re.escape("scale: expected None or a float")):
        call_api(x)
