"""Guards shared by every test."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

# The storage fixtures (a moto S3 server on loopback), for every suite that asks.
pytest_plugins = ["tests.support.storage"]


@pytest.fixture(autouse=True)
def _grad_mode_is_left_enabled() -> Iterator[None]:
    """torch's grad mode is thread-local state: code that holds ``no_grad`` across an
    await or a yield leaks it into everything else on the event loop's thread. Fail the
    test that leaked it, not whichever later test trips over it."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None:
        assert torch.is_grad_enabled(), "this test left torch's grad mode disabled"
