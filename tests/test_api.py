"""The public API against the float64 token-by-token oracle, and the low-level tuples' definitions."""

import dataclasses
import math
import re
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from flash_qla import chunk_gated_delta_rule, chunk_gated_delta_rule_bwd, chunk_gated_delta_rule_fwd
from flash_qla.api import _dense_cu_seqlens, _packed_cu_seqlens
from flash_qla.reference import CHUNK_SIZE, naive_recurrent_gated_delta_rule
from helpers import CASES, FP64_REL, Case, chunk_bounds, randn_like, rel_err

# Inputs in a low precision vs the float64 oracle on the same (rounded) inputs. The PyTorch path
# computes in float32, so the error is the rounding of o and of each gradient to the input dtype
# (2^-9 per element for bf16, 2^-11 for fp16): measured <= 2.7e-3 and 3.7e-4. In float32 the worst
# measured is dg under strong decay, 3e-5 (γ cumulated to about -1000 in float32).
LOW_PRECISION_REL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}

GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")

# Packed sequences of lengths 0, 1, 65 and 130 (6 chunks), GVA 2, K != V.
VARLEN = Case("varlen-0-1-65-130-gva2", lengths=(0, 1, 65, 130), Hqk=1, Hv=2, K=16, V=32, initial_state=True)
LAYOUTS = [Case("dense-B2-T150", B=2, T=150, Hqk=1, Hv=2, K=16, V=32, initial_state=True), VARLEN]


def naive_like_api(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                   use_qk_l2norm_in_kernel=False, state_v_first=False):  # fmt: skip
    """The oracle with the public API's options applied around it."""
    scale = None if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    if state_v_first and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    o, final_state = naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    return o, (final_state.transpose(-1, -2) if state_v_first else final_state)


def outputs_and_grads(fn, x, **options):
    """o, final_state and the gradients of every tensor input for seeded upstream gradients."""
    leaves = {name: x[name].clone().requires_grad_() for name in GRAD_INPUTS if x[name] is not None}
    o, final_state = fn(**{**x, **leaves}, **options)
    do, dht = randn_like(o, seed=1), randn_like(final_state, seed=2)
    grads = torch.autograd.grad([o, final_state], list(leaves.values()), [do, dht])
    return {"o": o, "final_state": final_state, **{"d" + name: grad for name, grad in zip(leaves, grads)}}


def api_with_final_state(**kwargs):
    return chunk_gated_delta_rule(**kwargs, output_final_state=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_outputs_and_gradients_match_naive(case):
    x = case.inputs()
    got = outputs_and_grads(api_with_final_state, x)
    expected = outputs_and_grads(naive_recurrent_gated_delta_rule, x)
    assert got.keys() == expected.keys()
    for name in expected:
        assert rel_err(got[name], expected[name]) <= FP64_REL, name


@pytest.mark.parametrize("used", ["o", "final_state"])
def test_gradients_of_one_output(used, monkeypatch):
    """A loss of o alone (or final_state alone): the other output's gradient never arrives, and none
    is made up for it (a loss of o alone: the backward takes dht = None); the gradients are the oracle's."""
    import flash_qla.autograd as autograd_module

    backward, dhts = autograd_module._backward, []

    def recorded(*args):
        dhts.append(args[7])
        return backward(*args)

    monkeypatch.setattr(autograd_module, "_backward", recorded)
    x = VARLEN.inputs()
    grads = {}
    for name, fn in (("got", api_with_final_state), ("want", naive_recurrent_gated_delta_rule)):
        leaves = {n: x[n].clone().requires_grad_() for n in GRAD_INPUTS}
        outputs = dict(zip(("o", "final_state"), fn(**{**x, **leaves})))
        loss = (outputs[used] * randn_like(outputs[used], seed=3)).sum()
        grads[name] = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    assert len(dhts) == 1 and (dhts[0] is None) == (used == "o"), "dht as the loss gave it, no zeros made up"
    for n, got, want in zip(GRAD_INPUTS, grads["got"], grads["want"]):
        if want is None:  # q does not reach final_state
            assert not got.any(), n
        else:
            assert rel_err(got, want) <= FP64_REL, n


OPTIONS = [
    ("state-v-first", dict(state_v_first=True)),
    ("qk-l2norm", dict(use_qk_l2norm_in_kernel=True)),
    ("scale-0.3", dict(scale=0.3)),
    ("scale-int", dict(scale=2)),
    ("scale-fraction", dict(scale=Fraction(3, 10))),  # any numbers.Real (a NumPy float too)
    ("all", dict(state_v_first=True, use_qk_l2norm_in_kernel=True, scale=0.3)),
]


@pytest.mark.parametrize("options", [o for _, o in OPTIONS], ids=[i for i, _ in OPTIONS])
def test_options_match_naive(options):
    x = VARLEN.inputs()
    x["k"] = x["k"] * torch.linspace(0.5, 3, x["k"].shape[1], dtype=x["k"].dtype)[:, None, None]  # not unit norm
    if options.get("state_v_first"):
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    got = outputs_and_grads(api_with_final_state, x, **options)
    expected = outputs_and_grads(naive_like_api, x, **options)
    for name in expected:
        assert rel_err(got[name], expected[name]) <= FP64_REL, name
    if options.get("state_v_first"):
        assert got["final_state"].shape == (VARLEN.N, VARLEN.Hv, VARLEN.V, VARLEN.K)


@pytest.mark.parametrize("dtype", list(LOW_PRECISION_REL), ids=str)
def test_low_precision_inputs_match_naive(dtype):
    x = VARLEN.inputs(dtype)
    x["initial_state"] = x["initial_state"].to(dtype)  # any float dtype, used in float32
    got = outputs_and_grads(api_with_final_state, x)
    x64 = {name: t.double() if t is not None and t.is_floating_point() else t for name, t in x.items()}
    expected = outputs_and_grads(naive_recurrent_gated_delta_rule, x64)
    for name in expected:
        assert rel_err(got[name], expected[name]) <= LOW_PRECISION_REL[dtype], name
    assert got["o"].dtype == dtype and got["final_state"].dtype == torch.float32
    for name in GRAD_INPUTS:
        assert got["d" + name].dtype == x[name].dtype, name


def test_varlen_equals_a_loop_over_sequences():
    lengths = (0, 1, 65, 130, 0, 7)
    x = Case("varlen", lengths=lengths, Hqk=1, Hv=2, initial_state=True).inputs()
    o, final_state = chunk_gated_delta_rule(**x, output_final_state=True)
    bounds = x.pop("cu_seqlens").tolist()
    h0 = x.pop("initial_state")
    for n, (bos, eos) in enumerate(zip(bounds[:-1], bounds[1:])):
        if bos == eos:  # an empty sequence passes its state through
            assert torch.equal(final_state[n], h0[n])
            continue
        seq = {name: t[:, bos:eos] for name, t in x.items()}
        o_n, final_n = chunk_gated_delta_rule(**seq, initial_state=h0[n : n + 1], output_final_state=True)
        assert rel_err(o[:, bos:eos], o_n) <= FP64_REL
        assert rel_err(final_state[n : n + 1], final_n) <= FP64_REL


def test_fla_keyword_call():
    """fla-core 0.6.0 calls the backend with exactly these keywords."""
    x = VARLEN.inputs()
    o, final_state = chunk_gated_delta_rule(
        q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=None,
        initial_state=x["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=False,
        state_v_first=False, cu_seqlens=x["cu_seqlens"], auto_cp=True,
    )  # fmt: skip
    o_ref, final_ref = naive_recurrent_gated_delta_rule(**x)
    assert rel_err(o, o_ref) <= FP64_REL and rel_err(final_state, final_ref) <= FP64_REL


def test_no_final_state_unless_asked_and_auto_cp_is_accepted_on_the_pytorch_path():
    """auto_cp is a GPU planner option: the PyTorch path takes it and computes the same (on the GPU the split walks
    agree within rounding: tests/test_gdr_unit.py, test_gdr_grad.py)."""
    x = VARLEN.inputs()
    o, final_state = chunk_gated_delta_rule(**x)
    assert final_state is None
    o_no_cp, _ = chunk_gated_delta_rule(**x, auto_cp=False)
    assert torch.equal(o, o_no_cp)


def test_keep_states_changes_nothing_on_the_pytorch_path():
    """keep_states is a GPU memory-for-time option: on the PyTorch path the outputs and gradients are
    bitwise those without it, and those of its default (None: the library's choice)."""
    x = VARLEN.inputs()
    results = {}
    for keep in (False, True, None):
        leaves = {n: x[n].clone().requires_grad_() for n in GRAD_INPUTS}
        o, final_state = api_with_final_state(**{**x, **leaves}, keep_states=keep)
        loss = (o * randn_like(o, seed=4)).sum() + (final_state * randn_like(final_state, seed=5)).sum()
        results[keep] = (o, final_state, *torch.autograd.grad(loss, list(leaves.values())))
    for keep in (True, None):
        for got, want in zip(results[keep], results[False]):
            assert torch.equal(got, want)


def test_dense_batch_boundaries_are_built_once_and_match_explicit_ones():
    """A dense batch runs as B packed sequences; the boundary tensor is shared between calls."""
    x = Case("dense", B=3, T=70, Hqk=1, Hv=2).inputs()
    del x["cu_seqlens"], x["initial_state"]
    first, again = _packed_cu_seqlens(None, x["q"]), _packed_cu_seqlens(None, x["q"])
    assert first is again and first.dtype == torch.int32 and first.tolist() == [0, 70, 140, 210]
    o, final_state = chunk_gated_delta_rule(**x, output_final_state=True)
    packed = {name: t.flatten(0, 1)[None] for name, t in x.items()}
    o_packed, final_packed = chunk_gated_delta_rule(**packed, cu_seqlens=first, output_final_state=True)
    assert torch.equal(o, o_packed.view_as(o)) and torch.equal(final_state, final_packed)


def test_dense_batch_boundaries_are_kept_per_stream(monkeypatch):
    """The boundary tensor is made on the stream that reads it (streams and CUDA graph capture simulated: no GPU
    here): each stream gets its own, the same one on every call there; a call under capture gets a new one, not
    kept (the graph's replays read it from the graph's memory)."""
    from flash_qla import tensor_cache

    stream = {"key": 1}
    monkeypatch.setattr(tensor_cache, "stream_key", lambda tensor: stream["key"])
    _dense_cu_seqlens.cache_clear()
    q = Case("dense", B=3, T=70, Hqk=1, Hv=2).inputs()["q"]
    first = _packed_cu_seqlens(None, q)
    assert _packed_cu_seqlens(None, q) is first
    stream["key"] = 2
    second = _packed_cu_seqlens(None, q)
    assert second is not first and torch.equal(second, first) and _packed_cu_seqlens(None, q) is second
    stream["key"] = None
    captured = _packed_cu_seqlens(None, q)
    assert captured is not first and captured is not second and torch.equal(captured, first)
    assert _packed_cu_seqlens(None, q) is not captured
    stream["key"] = 1
    assert _packed_cu_seqlens(None, q) is first


def test_int64_boundaries_are_converted_once_per_tensor():
    """FLA passes int64 cu_seqlens: the layers of a step sharing one get the same int32 tensor (and so the
    chunk tables built from it once); an in-place edit is converted again."""
    x = VARLEN.inputs()
    cu = x["cu_seqlens"].long()
    first = _packed_cu_seqlens(cu, x["q"])
    assert _packed_cu_seqlens(cu, x["q"]) is first and first.dtype == torch.int32
    assert first.tolist() == cu.tolist()
    cu[1] += 1
    assert _packed_cu_seqlens(cu, x["q"]).tolist() == cu.tolist()


@pytest.mark.parametrize("mode", ["no_grad", "grad_disabled"])
def test_inference_calls_skip_autograd_and_match(mode):
    """Without a tensor to differentiate the call builds no autograd node; its outputs are the same."""
    x = VARLEN.inputs()
    leaves = {name: x[name].clone().requires_grad_() for name in GRAD_INPUTS}
    o_grad, final_grad = chunk_gated_delta_rule(**{**x, **leaves}, output_final_state=True)
    assert o_grad.grad_fn is not None
    if mode == "no_grad":  # plain tensors
        o, final_state = chunk_gated_delta_rule(**x, output_final_state=True)
    else:  # leaves under torch.no_grad()
        with torch.no_grad():
            o, final_state = chunk_gated_delta_rule(**{**x, **leaves}, output_final_state=True)
    assert o.grad_fn is None and final_state.grad_fn is None
    assert torch.equal(o, o_grad.detach()) and torch.equal(final_state, final_grad.detach())


@pytest.mark.parametrize("layout", ["varlen_int32", "varlen_int64", "varlen_int64_made_outside", "dense"])
def test_inference_mode_calls_match_and_leave_training_working(layout):
    """Under torch.inference_mode (serving) a call gives the no_grad call's outputs, whether cu_seqlens is
    made there (no version counter to cache its checks and tables on), made outside (int64: its int32 copy,
    made under inference_mode, is kept), or absent (a dense batch, whose boundaries are built once); a later
    call with a gradient to compute, the same shapes and boundaries, still runs its backward (nothing made
    under inference_mode is saved for it)."""
    x = VARLEN.inputs() if layout != "dense" else Case("dense", B=2, T=70, Hqk=1, Hv=2).inputs()
    cu = x.pop("cu_seqlens")
    _dense_cu_seqlens.cache_clear()  # the dense boundaries first built under inference_mode
    if layout == "varlen_int64_made_outside":
        cu = cu.long()
    with torch.inference_mode():
        cu_inference = cu
        if layout in ("varlen_int32", "varlen_int64"):
            cu_inference = torch.tensor(cu.tolist(), dtype=torch.int64 if layout == "varlen_int64" else torch.int32)
        got = chunk_gated_delta_rule(**x, cu_seqlens=cu_inference, output_final_state=True)
    with torch.no_grad():
        want = chunk_gated_delta_rule(**x, cu_seqlens=cu, output_final_state=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q = x["q"].clone().requires_grad_()
    o, _ = chunk_gated_delta_rule(**{**x, "q": q}, cu_seqlens=cu)
    o.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_scratch_of_ended_threads_is_dropped(monkeypatch):
    """Scratch is kept per device, stream and thread; a thread's goes once the thread has ended, when the
    next buffers are kept (a server's thread per request keeps nothing after its request). Streams
    simulated on CPU tensors."""
    import threading

    from flash_qla.ops import buffers

    monkeypatch.setattr(buffers, "_scratch", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    like = torch.empty(1)
    thread = threading.Thread(target=lambda: buffers.scratch(((((4,), torch.float32)),), like))
    thread.start()
    thread.join()
    assert [key[2] for key in buffers._scratch] == [thread.ident]
    kept = buffers.scratch(((((8,), torch.float32)),), like)
    assert [key[2] for key in buffers._scratch] == [threading.get_ident()]
    assert buffers.scratch(((((8,), torch.float32)),), like) is kept


def test_release_scratch_empties_the_kept_buffers(monkeypatch):
    """flash_qla.release_scratch() drops every kept scratch buffer (their use: tests/test_gdr_unit.py)."""
    import flash_qla
    from flash_qla.ops import buffers

    monkeypatch.setattr(buffers, "_scratch", {(0, 0, 0): ((((4,), torch.float32),), [torch.empty(4)])})
    flash_qla.release_scratch()
    assert buffers._scratch == {}


def test_compiled_callers_run_the_call_eagerly_without_recompiles():
    """Under torch.compile, with a gradient to compute (and torch._dynamo.config.capture_dynamic_output_shape_ops at
    its default, off), each entry point is one graph break (the low-level ones by api.eager_only): outputs and
    gradients are the eager call's, bitwise, and new cu_seqlens values (same count of sequences) reuse the caller's
    compiled graphs. Traced, the host code took 28 compiled frames at the first pattern
    and 47 after the fourth."""
    from torch._dynamo.testing import CompileCounter

    def step(q, k, v, g, beta, cu_seqlens):
        o, final_state = chunk_gated_delta_rule(q * 2, k, v, g, beta, cu_seqlens=cu_seqlens, output_final_state=True)
        g_cum, A, o_low, _, _ = chunk_gated_delta_rule_fwd(q, k, v, g, beta, cu_seqlens=cu_seqlens)
        dq = chunk_gated_delta_rule_bwd(q, k, v, g_cum, beta, A, torch.ones_like(o_low), cu_seqlens=cu_seqlens)[0]
        return (o * randn_like(o, seed=3)).sum() + final_state.sum() + (o_low * dq[..., :1]).sum()

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
    frames = []
    for lengths in ((37, 63), (50, 50), (1, 99), (64, 36)):
        x = Case("varlen", lengths=lengths, Hqk=1, Hv=2).inputs()
        del x["initial_state"]
        results = []
        for fn in (compiled, step):
            leaves = {name: x[name].clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
            loss = fn(**{**x, **leaves})
            results.append((loss, *torch.autograd.grad(loss, list(leaves.values()))))
        assert all(torch.equal(got, want) for got, want in zip(*results)), lengths
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames[1:] == frames[:1] * 3, frames


# Under torch.compile, a call without a gradient is one operator of the caller's graph: (case, options).
TRACED = [
    (VARLEN, {"state_v_first": True}),
    (LAYOUTS[0], {"use_qk_l2norm_in_kernel": True, "scale": 0.5}),
    (Case("varlen-1-63-64", lengths=(1, 63, 64), Hqk=2, Hv=2), {"auto_cp": False}),
]


def traced_graphs(graphs):
    """A torch.compile backend that keeps each graph it gets and runs it as traced."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


@pytest.mark.parametrize("case, options", TRACED, ids=[case.id for case, _ in TRACED])
def test_compiled_inference_is_one_operator_of_the_callers_graph(case, options):
    """fullgraph=True holds (no graph break), the graph holds the operator once, the outputs are the eager call's
    bitwise, and new cu_seqlens values (the same count) or a new h0 reuse the graph: no recompile."""

    def step(q, k, v, g, beta, initial_state, cu_seqlens):
        o, final_state = chunk_gated_delta_rule(
            q * 2, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=True,
            **options,
        )  # fmt: skip
        return o.sin(), final_state * 3

    torch._dynamo.reset()
    graphs = []
    compiled = torch.compile(step, fullgraph=True, backend=traced_graphs(graphs))
    for seed, lengths in enumerate((case.lengths, case.lengths and case.lengths[::-1])):
        x = dataclasses.replace(case, lengths=lengths).inputs(torch.float32, seed=seed)
        if options.get("state_v_first") and x["initial_state"] is not None:
            x["initial_state"] = x["initial_state"].transpose(-1, -2)
        with torch.no_grad():
            got, want = compiled(**x), step(**x)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), seed
        assert got[1].stride() == want[1].stride()
    assert len(graphs) == 1
    targets = [node.target for node in graphs[0].graph.nodes]
    assert targets.count(torch.ops.flash_qla.chunk_gated_delta_rule.default) == 1


@pytest.mark.parametrize("case, options", TRACED, ids=[case.id for case, _ in TRACED])
def test_operator_passes_opcheck(case, options):
    """The operator's schema, fake outputs (shapes, dtypes, strides) and dispatch agree with its eager run. The
    initial state is V-first in memory with state_v_first: the PyTorch path's final state would follow its strides,
    where the fake's and the kernels' are K-first."""
    x = case.inputs(torch.float32)
    if options.get("state_v_first") and x["initial_state"] is not None:
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    args = (
        *(x[name] for name in ("q", "k", "v", "g", "beta")), options.get("scale"), x["initial_state"],
        x["cu_seqlens"], options.get("use_qk_l2norm_in_kernel", False), options.get("state_v_first", False),
        options.get("auto_cp", True),
    )  # fmt: skip
    results = torch.library.opcheck(torch.ops.flash_qla.chunk_gated_delta_rule.default, args)
    assert set(results.values()) == {"SUCCESS"}, results


# With a gradient to compute and capture_dynamic_output_shape_ops on, the call is one operator pair: (case, options).
TRAINED = [
    (VARLEN, {"state_v_first": True}),
    (LAYOUTS[0], {"use_qk_l2norm_in_kernel": True, "scale": 0.5, "output_final_state": False}),
    (Case("varlen-1-63-64", lengths=(1, 63, 64), Hqk=2, Hv=2), {"auto_cp": False, "keep_states": True}),
]


def trained_inputs(case, options, seed):
    """case's float32 inputs, each a leaf requiring a gradient; the initial state in K-first memory (a transposed
    view with state_v_first), as the kernels write states: the PyTorch path's state gradients follow its strides."""
    x = case.inputs(torch.float32, seed=seed)
    if options.get("state_v_first") and x["initial_state"] is not None:
        x["initial_state"] = x["initial_state"].transpose(-1, -2)
    for name in GRAD_INPUTS:
        if x[name] is not None:
            x[name].requires_grad_()
    return x


@pytest.mark.parametrize("backend", ["graph", "aot_eager"])
@pytest.mark.parametrize("case, options", TRAINED, ids=[case.id for case, _ in TRAINED])
def test_compiled_training_is_one_operator_pair_of_the_callers_graph(case, options, backend):
    """With torch._dynamo.config.capture_dynamic_output_shape_ops on, fullgraph=True holds with a gradient to compute:
    the graph holds the training operator once, outputs and every gradient are the eager call's, bitwise (the
    operator's backward run by autograd, or by AOTAutograd's backward graph), and new cu_seqlens values (the same
    count) reuse the graph. A loss without final_state gives the backward none (output_final_state=False)."""
    call_options = {"output_final_state": True, **options}

    def step(q, k, v, g, beta, initial_state, cu_seqlens):
        o, final_state = chunk_gated_delta_rule(
            q * 2, k, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, **call_options
        )  # fmt: skip
        return (o.sin(),) if final_state is None else (o.sin(), final_state * 3)

    torch._dynamo.reset()
    graphs = []
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(
            step, fullgraph=True, backend=traced_graphs(graphs) if backend == "graph" else backend
        )  # fmt: skip
        for seed, lengths in enumerate((case.lengths, case.lengths and case.lengths[::-1])):
            case_now = dataclasses.replace(case, lengths=lengths)
            results = []
            for fn in (compiled, step):
                x = trained_inputs(case_now, options, seed)
                outputs = fn(**x)
                leaves = [x[name] for name in GRAD_INPUTS if x[name] is not None]
                cotangents = [randn_like(t, seed=i) for i, t in enumerate(outputs)]
                results.append((*outputs, *torch.autograd.grad(outputs, leaves, cotangents)))
            assert all(torch.equal(got, want) for got, want in zip(*results)), seed
    if backend == "graph":
        assert len(graphs) == 1
        targets = [node.target for node in graphs[0].graph.nodes]
        assert targets.count(torch.ops.flash_qla.chunk_gated_delta_rule_training.default) == 1


@pytest.mark.parametrize("case, options", TRAINED, ids=[case.id for case, _ in TRAINED])
def test_training_operator_passes_opcheck(case, options):
    """The training operator's schema, fake outputs, autograd registration and AOT dispatch (its backward operator
    included) agree with its eager run; the initial state V-first in memory with state_v_first, as above."""
    x = trained_inputs(case, options, seed=0)
    if options.get("state_v_first") and x["initial_state"] is not None:
        x["initial_state"] = x["initial_state"].detach().contiguous().requires_grad_()
    args = (
        *(x[name] for name in ("q", "k", "v", "g", "beta")), options.get("scale"), x["initial_state"],
        x["cu_seqlens"], options.get("state_v_first", False), options.get("auto_cp", True), options.get("keep_states"),
    )  # fmt: skip
    results = torch.library.opcheck(torch.ops.flash_qla.chunk_gated_delta_rule_training.default, args)
    assert set(results.values()) == {"SUCCESS"}, results


def test_traced_operator_checks_shapes():
    """Traced (fake tensors, no values), the operator raises validation's error naming the argument."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = VARLEN.inputs(torch.float32)
    x["g"] = x["g"][..., :1]
    with FakeTensorMode() as mode:
        fake = {name: None if t is None else mode.from_tensor(t) for name, t in x.items()}
        with pytest.raises(ValueError, match=re.escape("g: expected shape [B, T, Hv]")):
            torch.ops.flash_qla.chunk_gated_delta_rule(
                fake["q"], fake["k"], fake["v"], fake["g"], fake["beta"], None, fake["initial_state"],
                fake["cu_seqlens"], False, False, True,
            )  # fmt: skip


# Low-level forward: shapes and dtypes, and h, A, g_cum checked against their definitions.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c.id)
def test_fwd_shapes_and_dtypes(case, dtype):
    x = case.inputs(dtype)
    for name in GRAD_INPUTS:
        x[name].requires_grad_()  # the low-level forward still returns plain tensors
    B, T = x["q"].shape[:2]
    NT = sum(math.ceil(n / CHUNK_SIZE) for n in case.sequence_lengths)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    expected = {
        "g_cum": ((B, T, case.Hv), state_dtype),
        "A": ((B, T, case.Hv, CHUNK_SIZE), dtype),
        "o": ((B, T, case.Hv, case.V), dtype),
        "h": ((NT, case.Hv, case.K, case.V), state_dtype),
        "final_state": ((case.N, case.Hv, case.K, case.V), state_dtype),
    }
    outputs = dict(zip(expected, chunk_gated_delta_rule_fwd(**x, output_h=True)))
    for name, (shape, out_dtype) in expected.items():
        assert (outputs[name].shape, outputs[name].dtype) == (shape, out_dtype), name
        assert not outputs[name].requires_grad, name

    _, _, _, h, final_state = chunk_gated_delta_rule_fwd(**x, output_final_state=False)
    assert h is None and final_state is None


@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c.id)
def test_fwd_g_cum_A_and_h_follow_their_definitions(case):
    x = case.inputs()
    g_cum, A, o, h, final_state = chunk_gated_delta_rule_fwd(**x, output_h=True)
    flat = {name: t.flatten(0, 1) for name, t in x.items() if name not in ("cu_seqlens", "initial_state")}
    group = case.Hv // case.Hqk
    starts = {}  # sequence -> its first token
    for chunk, (n, start, end) in enumerate(chunk_bounds(case.sequence_lengths, CHUNK_SIZE)):
        starts.setdefault(n, start)
        L = end - start
        gamma = flat["g"][start:end].cumsum(0)  # [L, Hv]
        torch.testing.assert_close(g_cum.flatten(0, 1)[start:end], gamma)

        # A = (I + StrictLower(diag(beta) K K^T ⊙ Γ))^-1 diag(beta), per head, zero past L.
        for head in range(case.Hv):
            k = flat["k"][start:end, head // group]  # [L, K]
            beta, gam = flat["beta"][start:end, head], gamma[:, head]
            Gamma = (gam[:, None] - gam[None, :]).exp()
            M = torch.eye(L, dtype=k.dtype) + torch.tril(beta[:, None] * (k @ k.T) * Gamma, -1)
            expected = torch.zeros(L, CHUNK_SIZE, dtype=k.dtype)
            expected[:, :L] = torch.linalg.inv(M) @ torch.diag(beta)
            assert rel_err(A.flatten(0, 1)[start:end, head], expected) <= FP64_REL

        # h: the state after the sequence's tokens before this chunk.
        before = slice(starts[n], start)
        h0 = x["initial_state"][n : n + 1]
        if before.start == before.stop:
            expected_h = h0
        else:
            prefix = {name: t[None, before] for name, t in flat.items()}
            _, expected_h = naive_recurrent_gated_delta_rule(**prefix, initial_state=h0)
        assert rel_err(h[chunk], expected_h[0]) <= FP64_REL
    assert chunk + 1 == h.shape[0]


# Low-level backward.


@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c.id)
def test_bwd_matches_autograd_through_naive_wrt_raw_g(case):
    x = case.inputs()
    g_cum, A, o, _, final_state = chunk_gated_delta_rule_fwd(**x)
    do, dht = randn_like(o, seed=1), randn_like(final_state, seed=2)
    grads = chunk_gated_delta_rule_bwd(
        x["q"], x["k"], x["v"], g_cum, x["beta"], A, do, dht,
        initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"],
    )  # fmt: skip
    names = ("q", "k", "v", "beta", "g", "initial_state")
    leaves = {name: x[name].clone().requires_grad_() for name in names}
    o_ref, final_ref = naive_recurrent_gated_delta_rule(**{**x, **leaves})
    expected = torch.autograd.grad([o_ref, final_ref], list(leaves.values()), [do, dht])
    for name, got, want in zip(names, grads, expected):
        assert got.shape == want.shape, name
        assert rel_err(got, want) <= FP64_REL, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_bwd_dtypes_and_optional_states(dtype):
    x = VARLEN.inputs(dtype)
    g_cum, A, o, _, final_state = chunk_gated_delta_rule_fwd(**x)
    args = (x["q"], x["k"], x["v"], g_cum, x["beta"], A, randn_like(o))
    dq, dk, dv, dbeta, dg, dh0 = chunk_gated_delta_rule_bwd(
        *args, initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"]
    )
    assert (dq.dtype, dk.dtype, dv.dtype, dbeta.dtype) == (dtype,) * 4
    assert dg.dtype == dh0.dtype == torch.float32

    # dht=None counts as zero (bitwise); without initial_state there is no dh0.
    with_zero_dht = chunk_gated_delta_rule_bwd(
        *args, torch.zeros_like(final_state), initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"]
    )
    for got, want in zip((dq, dk, dv, dbeta, dg, dh0), with_zero_dht):
        assert torch.equal(got, want)
    assert chunk_gated_delta_rule_bwd(*args, cu_seqlens=x["cu_seqlens"])[-1] is None


def test_bwd_state_v_first_and_empty_sequences():
    x = VARLEN.inputs()
    g_cum, A, o, _, final_state = chunk_gated_delta_rule_fwd(**x)
    args = (x["q"], x["k"], x["v"], g_cum, x["beta"], A, randn_like(o, seed=1))
    dht = randn_like(final_state, seed=2)
    k_first = chunk_gated_delta_rule_bwd(*args, dht, initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"])
    v_first = chunk_gated_delta_rule_bwd(
        *args, dht.transpose(-1, -2), initial_state=x["initial_state"].transpose(-1, -2),
        cu_seqlens=x["cu_seqlens"], state_v_first=True,
    )  # fmt: skip
    for got, want in zip(v_first[:-1], k_first[:-1]):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(v_first[-1], k_first[-1].transpose(-1, -2))
    assert torch.equal(k_first[-1][0], dht[0])  # sequence 0 is empty: its state passes through
