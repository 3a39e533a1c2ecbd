"""cs336_basics.data.get_batch."""

import numpy as np
import pytest
import torch

from cs336_basics.data import get_batch


def test_get_batch_windows_are_shifted_slices():
    data = np.arange(1000, dtype=np.uint16)
    torch.manual_seed(0)
    x, y = get_batch(data, batch_size=32, context_length=16, device="cpu")
    assert x.shape == y.shape == (32, 16) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(y, x + 1)
    assert (x[:, 1:] == x[:, :-1] + 1).all()
    assert x.min() >= 0 and y.max() <= 999
    assert len(set(x[:, 0].tolist())) > 10  # random starts, not one window repeated


def test_get_batch_reaches_the_last_window_and_works_on_memmap(tmp_path):
    data = np.arange(20, dtype=np.int32)
    path = tmp_path / "tokens.bin"
    data.tofile(path)
    mm = np.memmap(path, dtype=np.int32, mode="r")
    torch.manual_seed(0)
    seen = set()
    for _ in range(200):
        x, y = get_batch(mm, 4, 5, "cpu")
        seen.update(x[:, 0].tolist())
        assert int(y.max()) <= 19
    assert seen == set(range(15))


def test_get_batch_bad_input():
    with pytest.raises(ValueError, match="context_length"):
        get_batch(np.arange(10), 2, 10, "cpu")
    with pytest.raises(TypeError, match="integer"):
        get_batch(np.linspace(0, 1, 100), 2, 4, "cpu")
    with pytest.raises(ValueError, match="1-D"):
        get_batch(np.zeros((10, 10), dtype=np.int64), 2, 4, "cpu")
