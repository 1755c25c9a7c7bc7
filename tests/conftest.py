"""Test-session settings."""

import torch

# The CPU tests use tiny tensors: intra-op threads only add overhead, and on a busy machine
# their spin-waiting made the suite 20x slower.
torch.set_num_threads(1)
