"""trainer.offload: the trainer's state leaves memory between steps and comes back bit-identical."""

from __future__ import annotations

import pytest
import torch

from miles_engine.errors import ConfigError
from miles_engine.trainer import TorchTrainer, build_trainer
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.offload import OffloadError

from .helpers import TIMING, TINY, params, random_groups

pytestmark = pytest.mark.timeout(300)

# big enough that what leaves memory is visible in the process's RSS (~2.4M parameters)
WIDE = dict(TINY, vocab_size=4096, hidden_size=256, intermediate_size=512, head_dim=64)
CFG = {"optimizer": {"lr": 1e-3}, "kl": {"reference": True, "coef": 0.05}, "max_tokens_per_micro_batch": 64}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _no_timing(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k not in TIMING and not k.startswith("offload")}


def _optimizer_bytes(trainer: TorchTrainer) -> int:
    return sum(v.nbytes for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def test_disk_offload_frees_the_state_and_trains_bit_identically(tmp_path) -> None:
    groups = random_groups(2, 4, seed=3)
    rows = [(t.token_ids, t.loss_mask) for g in groups for t in g.trajectories][:4]
    plain = TorchTrainer(WIDE, CFG)
    off = TorchTrainer(WIDE, {**CFG, "offload": "disk", "offload_dir": str(tmp_path)})
    drops, figures = [], []
    for step in range(3):
        a = plain.sft_step(rows) if step == 1 else plain.train_step(groups)
        b = off.sft_step(rows) if step == 1 else off.train_step(groups)
        assert _no_timing(a) == _no_timing(b), step
        before = _rss()
        figures.append(off.offload())
        drops.append(before - _rss())
        assert list(tmp_path.iterdir()), "the offloaded state is on disk"
        assert off.offload() == figures[-1]  # offloading twice moves nothing more
    f = figures[-1]
    weights = sum(p.nbytes for p in off.root.parameters())  # tied embedding counted once
    assert f["offload_bytes_weights"] == weights
    assert f["offload_bytes_optimizer"] == _optimizer_bytes(plain)
    assert f["offload_bytes_grads"] == 0  # set to None after each optimizer step
    # what left memory: the weights (policy and reference) and both Adam moments
    assert min(drops) >= 0.9 * (f["offload_bytes_weights"] + f["offload_bytes_optimizer"]), (drops, f)
    got = params(off)  # named_tensors brings the state back
    assert not list(tmp_path.iterdir()), "the offload file is removed once read back"
    want = params(plain)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    ref_a, ref_b = plain.state_dict(), off.state_dict()
    assert all(torch.equal(ref_a["model"][k], ref_b["model"][k]) for k in ref_a["model"])
    assert _no_timing(plain.train_step(groups)) == _no_timing(off.train_step(groups))
    off.close()


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "deleted"])
def test_a_damaged_offload_file_stops_the_next_step(tmp_path, damage: str) -> None:
    trainer = TorchTrainer(TINY, {"offload": "disk", "offload_dir": str(tmp_path)})
    groups = random_groups(1, 4)
    trainer.train_step(groups)
    trainer.offload()
    [path] = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path.write_bytes(bytes(data[: len(data) - 10]))
    else:
        path.unlink()
    match = "is gone" if damage == "deleted" else r"came back (changed|short).*resume from the last checkpoint"
    for _ in range(2):  # refused every time: the state stays lost
        with pytest.raises(OffloadError, match=match) as err:
            trainer.train_step(groups)
        assert str(path) in str(err.value)
    trainer.close()


def test_offload_refusals() -> None:
    with pytest.raises(ConfigError, match="offload='host'.*already runs in host memory.*'disk'"):
        TorchTrainer(TINY, {"offload": "host"})
    with pytest.raises(ConfigError, match="offload='disk' needs backend='torch'"):
        TrainerConfig.load({"backend": "megatron", "offload": "disk"})
    assert TorchTrainer(TINY).offload() == {}  # offload none: nothing moves


def test_two_fsdp_ranks_offload_and_train_as_without(tmp_path) -> None:
    groups = random_groups(3, 4, seed=2)
    cfg = {**CFG, "parallel": {"world_size": 2}}
    with build_trainer(TINY, cfg) as plain, \
            build_trainer(TINY, {**cfg, "offload": "disk", "offload_dir": str(tmp_path)}) as off:
        for _ in range(2):
            assert _no_timing(plain.train_step(groups)) == _no_timing(off.train_step(groups))
            figures = off.offload()
            assert figures["offload_bytes_weights"] > 0 and figures["offload_bytes_optimizer"] > 0
            assert len(list(tmp_path.iterdir())) == 2  # one file per rank
        got, want = params(off), params(plain)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_state_loaded_from_a_checkpoint_file_offloads(tmp_path) -> None:
    """torch.load gives storages that cannot be resized; the optimizer keeps them as its state."""
    groups = random_groups(2, 4, seed=5)
    plain = TorchTrainer(TINY, CFG)
    plain.train_step(groups)
    torch.save(plain.state_dict(), tmp_path / "trainer.pt")
    off = TorchTrainer(TINY, {**CFG, "offload": "disk", "offload_dir": str(tmp_path / "off")})
    off.load_state_dict(torch.load(tmp_path / "trainer.pt", map_location="cpu", weights_only=False))
    for _ in range(2):
        assert off.offload()["offload_bytes_optimizer"] > 0
        assert _no_timing(plain.train_step(groups)) == _no_timing(off.train_step(groups))
    got, want = params(off), params(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)
