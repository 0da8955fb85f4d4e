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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """How ``./dev test`` shares the suite between its pytest-xdist workers: a module
    stays on one worker (its module-scoped fixtures are made once), and the end-to-end
    tests are one unit, run one after another on one worker: each starts a fleet of
    processes that wants the machine's cores, and two at once would only slow each
    other. The other workers run everything else beside them (``--no-loadscope-reorder``
    keeps the collection order, so that the end-to-end unit, the longest, starts first)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndEndToEnd(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "tests/e2e" if module.startswith("tests/e2e/") else module

    return ModulesAndEndToEnd(config, log)
