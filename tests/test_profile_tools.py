"""The host-time tool runs: profile/host_glue.py's stand-ins still carry the library's host code to its launches.

The tool replaces the GPU-only calls of flash_qla.ops.forward and backward with stand-ins (as test_launches does)
and times the Python around them; a library change that adds a GPU-only call to the route, or renames one the tool
replaces, would break the tool without breaking the library. Each case runs it briefly in a process of its own (its
stand-ins are process-wide) and checks that every timed call reached the kernels' launches, and that a compiled
training step launches what the eager one does.
"""

import pathlib
import re
import subprocess
import sys

import pytest

HOST_GLUE = pathlib.Path(__file__).parents[1] / "profile" / "host_glue.py"
BRIEF = ("--calls", "5", "--rounds", "1")


def run_host_glue(*args):
    done = subprocess.run(
        [sys.executable, str(HOST_GLUE), *args, *BRIEF], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize(
    "seqs, launches",
    [
        ("1x2048", 2),  # kkt_solve, the walk
        ("16384+16384", 5),  # split: kkt_solve, the map and offsets walks, compose_maps, the walk over the pieces
    ],
)
def test_inference_call_reaches_its_launches(seqs, launches):
    out = run_host_glue("--heads", "2/8", "--seqs", seqs)
    found = re.search(r"to the return [\d.]+ \((\d+) launches\)", out)
    assert found and int(found.group(1)) == launches, out


@pytest.mark.parametrize(
    "heads, seqs, compiled",
    [
        ("16/32", "1x2048", True),  # the states kept: no recompute
        ("2/8", "16384+16384", False),  # split forward and backward
    ],
)
def test_training_step_reaches_its_launches(heads, seqs, compiled):
    out = run_host_glue("--mode", "train", "--heads", heads, "--seqs", seqs, *(("--compile",) if compiled else ()))
    launches = {name: int(n) for name, n in re.findall(r"(eager|operator pair|graph break) [\d.]+ \((\d+)\)", out)}
    assert set(launches) == ({"eager", "operator pair", "graph break"} if compiled else {"eager"}), out
    assert launches["eager"] >= 4, out  # kkt_solve and the walk, the backward walk and chunk_grads at least
    assert len(set(launches.values())) == 1, out
