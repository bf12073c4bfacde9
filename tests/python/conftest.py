"""pytest fixtures shared by the Python tests; the helpers they use live in support.py."""

import pytest
import torch

from support import TinyModel


@pytest.fixture
def tiny_model():
    return TinyModel(seed=0)


@pytest.fixture
def batches():
    """Seeded (input, target) pairs for TinyModel."""
    gen = torch.Generator().manual_seed(99)
    return [(torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen))
            for _ in range(20)]
