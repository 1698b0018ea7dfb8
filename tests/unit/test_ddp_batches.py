"""`recovery.ddp.Batches`, the data position of a DDP job: restored into a fresh iterator it yields
the batches the uninterrupted loop yields, across epochs, whatever the loader draws from torch's
RNG, and leaves the training RNG as it found it; and the `training` report's api is checked."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from wire import messages
from recovery.ddp import Batches

DATA = TensorDataset(torch.arange(40.0).reshape(20, 2))


def _loaders() -> list[DataLoader]:
    # A DistributedSampler shuffles by (seed, epoch); a RandomSampler draws its seed from torch's
    # RNG when the epoch's iterator starts, as a DataLoader draws its base seed.
    return [DataLoader(DATA, batch_size=3, sampler=DistributedSampler(DATA, num_replicas=2, rank=1, seed=5)),
            DataLoader(DATA, batch_size=3, sampler=RandomSampler(DATA))]


def _take(batches: Batches, n: int) -> list[list[float]]:
    out = []
    for _ in range(n):
        out.append(next(batches)[0].tolist())
        torch.rand(3)  # the training step draws from the same RNG (dropout, say)
    return out


@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("cut", [1, 4, 5, 7])  # mid-epoch, the epoch's end, the next epoch's start
def test_a_restored_position_yields_the_same_batches(which: int, cut: int) -> None:
    torch.manual_seed(0)
    whole = Batches(_loaders()[which])
    expected = _take(whole, 12)
    rng_expected = torch.get_rng_state()

    torch.manual_seed(0)
    first = Batches(_loaders()[which])
    _take(first, cut)
    saved, rng = first.state_dict(), torch.get_rng_state()

    torch.manual_seed(123)  # a replacement process: another RNG state until the restore
    fresh = Batches(_loaders()[which])
    fresh.load_state_dict(saved)
    torch.set_rng_state(rng)  # the job restores the RNG with the rest of the state
    assert _take(fresh, 12 - cut) == expected[cut:]
    # Replaying the epoch's draws to seek left the training RNG where the uninterrupted loop has it.
    assert torch.equal(torch.get_rng_state(), rng_expected)


def test_an_empty_loader_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="no batch in epoch 1"):
        next(Batches(DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=2)))


def test_the_training_report_names_its_api() -> None:
    msg = messages.decode({"type": "training", "rank": 0, "node": 0, "gen": 0, "api": "ddp"})
    assert isinstance(msg, messages.Training) and msg.api == "ddp"
    with pytest.raises(messages.DecodeError, match="api"):
        messages.decode({"type": "training", "rank": 0, "node": 0, "gen": 0, "api": "horovod"})
