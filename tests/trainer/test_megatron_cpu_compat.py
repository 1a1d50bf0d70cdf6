"""The CPU RNG tracker that stands in for megatron-core's CUDA one (no megatron import needed)."""

from __future__ import annotations

import pytest
import torch

from miles_engine.trainer.megatron.cpu_compat import CPURNGStatesTracker


def test_fork_draws_from_its_own_stream_and_leaves_the_default_one_alone() -> None:
    tracker = CPURNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    expected_default = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_default)  # the default stream did not move
    with tracker.fork():
        second = torch.rand(3)  # the tracked stream continues where it stopped
    torch.manual_seed(1234)
    assert torch.equal(torch.cat([first, second]), torch.rand(6))
    states = tracker.get_states()
    again = CPURNGStatesTracker()
    again.set_states(states)
    with tracker.fork(), torch.random.fork_rng(devices=[]):
        a = torch.rand(2)
    with again.fork():
        b = torch.rand(2)
    assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="already exists"):
        tracker.add("other", 1234)
    with pytest.raises(RuntimeError, match="is not added"):
        with tracker.fork("missing"):
            pass
