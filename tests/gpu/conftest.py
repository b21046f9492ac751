"""Tests that need a CUDA device (marker ``gpu``): collected by ``make test`` everywhere, skipped
where ``torch.cuda.is_available()`` is false, run by ``benchmarks/gpu/check.sh`` on a GPU machine
(PyTorch + Triton, no vLLM, no LMCache: nothing here imports either)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def compute():
    """vLLM's compute stream stands in as a non-default stream: code that works only on the legacy
    default stream (implicit ordering) fails here."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield stream
    torch.cuda.synchronize()


@pytest.fixture
def spin():
    """``spin(ms)`` keeps the current stream busy for about ``ms`` (work queued after it waits)."""
    return lambda ms=200.0: torch.cuda._sleep(int(ms * 2e6))  # cycles: ~2 GHz (H100 / H200 boost clocks)
