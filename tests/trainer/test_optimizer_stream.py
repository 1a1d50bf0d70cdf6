"""trainer.optimizer_state=disk: Adam's state lives in a file, read and written bucket by bucket
during each update only; training is bit-identical to memory, checkpoints are the same, a damaged
file stops the update."""

from __future__ import annotations

import pytest
import torch

from miles_engine.errors import ConfigError
from miles_engine.trainer import TorchTrainer, build_trainer
from miles_engine.trainer.config import TrainerConfig
from miles_engine.trainer.optimizer_stream import OptimizerStateError

from .helpers import TIMING, TINY, params, random_groups

pytestmark = pytest.mark.timeout(300)
CFG = {"optimizer": {"lr": 1e-3, "weight_decay": 0.01}, "max_tokens_per_micro_batch": 64, "value": {},
       "sft": {"optimizer": {"lr": 5e-3}}}
SMALL_BUCKETS = 0.05  # MiB: TINY's ~0.1M parameters' state spread over many buckets


def _same(a: dict, b: dict) -> None:
    def keep(m: dict) -> dict:
        return {k: v for k, v in m.items() if k not in TIMING and not k.startswith(("optimizer_stream", "offload"))}

    assert keep(a) == keep(b)


def _streamed(tmp_path, **extra) -> dict:
    return {**CFG, "optimizer_state": "disk", "optimizer_state_dir": str(tmp_path),
            "optimizer_bucket_mb": SMALL_BUCKETS, **extra}


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _state_equal(a[k], b[k]) if isinstance(a[k], dict) else
        (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]) for k in a)


def test_disk_state_trains_bit_identically_with_one_bucket_in_memory(tmp_path) -> None:
    groups = random_groups(2, 4, seed=3)
    rows = [(t.token_ids, t.loss_mask) for g in groups for t in g.trajectories][:4]
    memory, disk = TorchTrainer(TINY, CFG), TorchTrainer(TINY, _streamed(tmp_path))
    stream = disk.streams[id(disk.optimizer)]
    assert len(stream.buckets()) == 0  # no gradients yet
    for step in range(4):
        a = memory.sft_step(rows) if step == 1 else memory.train_step(groups)
        b = disk.sft_step(rows) if step == 1 else disk.train_step(groups)
        _same(a, b)
        assert not disk.optimizer.state, "between updates the state is on disk only"
        if step != 1:  # two moments per weight written (and read back, once there are any)
            moved = (2 if step == 0 else 4) * sum(p.nbytes for p in disk.trainable())
            assert moved <= b["optimizer_stream_bytes"] <= moved + 1024
    assert len(list(tmp_path.glob("*.optstate"))) == 2  # the RL and the SFT optimizer's
    largest = max(2 * p.nbytes + 4 for p in disk.trainable())
    whole = sum(2 * p.nbytes + 4 for p in disk.trainable())
    assert 0 < stream.peak_resident_bytes <= max(SMALL_BUCKETS * 2**20, largest) < whole / 3
    got, want = params(disk), params(memory)
    assert all(torch.equal(got[k], want[k]) for k in want)
    state_a, state_b = memory.state_dict(), disk.state_dict()  # the checkpoint sees the whole state
    assert _state_equal(state_a["optimizer"], state_b["optimizer"])
    assert _state_equal(state_a["sft_optimizer"], state_b["sft_optimizer"])
    assert not disk.optimizer.state  # back on disk after the checkpoint read it
    disk.close()
    assert not list(tmp_path.glob("*.optstate")), "close removes the state files"


def test_more_than_one_bucket_and_a_checkpoint_crosses_between_settings(tmp_path) -> None:
    groups = random_groups(2, 4, seed=4)
    memory = TorchTrainer(TINY, CFG)
    memory.train_step(groups)
    disk = TorchTrainer(TINY, _streamed(tmp_path))
    assert len(disk.streams[id(disk.optimizer)].buckets()) == 0
    disk.load_state_dict(memory.state_dict())  # a memory run's checkpoint resumes with disk state
    assert not disk.optimizer.state
    for _ in range(2):
        _same(memory.train_step(groups), disk.train_step(groups))
    assert len(disk.streams[id(disk.optimizer)].buckets()) == 0  # gradients are gone after the step
    back = TorchTrainer(TINY, CFG)
    back.load_state_dict(disk.state_dict())  # and the other way
    _same(memory.train_step(groups), back.train_step(groups))
    assert all(torch.equal(a, b) for a, b in zip(params(memory).values(), params(back).values()))


def test_buckets_follow_optimizer_bucket_mb(tmp_path) -> None:
    trainer = TorchTrainer(TINY, _streamed(tmp_path))
    groups = random_groups(1, 4)
    trainer.train_step(groups)
    loss = trainer.policy(input_ids=torch.tensor([groups[0].trajectories[0].token_ids])).logits.sum()
    loss.backward()  # gradients, as during an update
    stream = trainer.streams[id(trainer.optimizer)]
    buckets = stream.buckets()
    sizes = [sum(2 * p.nbytes + 8 for p in b) for b in buckets]
    assert len(buckets) > 3 and all(s <= SMALL_BUCKETS * 2**20 for s, b in zip(sizes, buckets) if len(b) > 1)
    assert sum(len(b) for b in buckets) == len([p for p in trainer.trainable() if p.grad is not None])
    trainer.optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_state_file_stops_the_update(tmp_path, damage: str) -> None:
    trainer = TorchTrainer(TINY, _streamed(tmp_path))
    groups = random_groups(1, 4)
    trainer.train_step(groups)
    [path] = tmp_path.glob("*.optstate")
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":  # inside the largest moment's slot
        slot = max(trainer.streams[id(trainer.optimizer)]._slots.values(), key=lambda s: s.nbytes)
        data[slot.offset + slot.nbytes // 2] ^= 1
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[:50]))
    with pytest.raises(OptimizerStateError, match=r"came back (changed|short)") as err:
        trainer.train_step(groups)
    assert str(path) in str(err.value)
    trainer.close()


def test_optimizer_state_refusals() -> None:
    with pytest.raises(ConfigError, match="optimizer_state"):
        TrainerConfig.load({"optimizer_state": "ssd"})
    with pytest.raises(ConfigError, match="optimizer_bucket_mb"):
        TrainerConfig.load({"optimizer_bucket_mb": 0})


def test_two_fsdp_ranks_stream_their_shards_and_train_as_memory(tmp_path) -> None:
    groups = random_groups(3, 4, seed=2)
    cfg = {**CFG, "parallel": {"world_size": 2}}
    with build_trainer(TINY, cfg) as memory, build_trainer(TINY, {**_streamed(tmp_path), **cfg}) as disk:
        for _ in range(3):
            _same(memory.train_step(groups), disk.train_step(groups))
            assert len(list(tmp_path.glob("*.optstate"))) == 2  # one per rank
        got, want = params(disk), params(memory)
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert _state_equal(memory.state_dict()["optimizer"], disk.state_dict()["optimizer"])
        state = disk.state_dict()
    # resumed at another layout (one process): as a memory trainer resumed from the same checkpoint
    one, one_memory = TorchTrainer(TINY, _streamed(tmp_path / "one")), TorchTrainer(TINY, CFG)
    one.load_state_dict(state)
    one_memory.load_state_dict(state)
    _same(one_memory.train_step(groups), one.train_step(groups))


def test_with_offload_the_state_already_on_disk_does_not_move_again(tmp_path) -> None:
    groups = random_groups(2, 4, seed=6)
    memory = TorchTrainer(TINY, CFG)
    both = TorchTrainer(TINY, _streamed(tmp_path / "state", offload="disk", offload_dir=str(tmp_path / "offload")))
    for _ in range(3):
        _same(memory.train_step(groups), both.train_step(groups))
        figures = both.offload()
        assert figures["offload_bytes_optimizer"] == 0 and figures["offload_bytes_weights"] > 0
    got, want = params(both), params(memory)
    assert all(torch.equal(got[k], want[k]) for k in want)
    both.close()


def test_megatron_tensor_parallel_ranks_stream_their_shards_and_train_as_memory(tmp_path) -> None:
    pytest.importorskip("megatron.core")
    from miles_engine.trainer.factory import create_trainer

    groups = random_groups(3, 3, seed=1)
    cfg = {**CFG, "backend": "megatron", "megatron": {"tensor_parallel": 2}}
    with create_trainer(TINY, cfg, world_size=2) as memory, \
            create_trainer(TINY, {**_streamed(tmp_path), **cfg}, world_size=2) as disk:
        for _ in range(3):
            _same(memory.train_step(groups), disk.train_step(groups))
            assert len(list(tmp_path.glob("*.optstate"))) == 2  # one per tensor-parallel rank
        got, want = dict(disk.named_tensors()), dict(memory.named_tensors())
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert _state_equal(memory.state_dict()["optimizer"], disk.state_dict()["optimizer"])
