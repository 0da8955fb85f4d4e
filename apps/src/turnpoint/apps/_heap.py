"""What a long-lived process of ours does with the heap it built at start-up.

CPython's cyclic collector runs a full (generation 2) collection whenever the objects
that survived into the oldest generation grew by a quarter since the last one, and a
full collection visits every tracked object. A process that hosts hundreds of servers
or clients holds hundreds of thousands of them from start-up on, none of which ever
becomes garbage; each full collection then walks all of them, a pause of tens to
hundreds of milliseconds in the middle of a snapshot's prepare. ``gc.freeze()`` moves
every object alive now to a permanent generation that collections skip.

That is a decision about the whole process's collector, so only the code that owns the
process makes it: ``turnpoint serve`` once its participant is serving, the demo trainer
(and the embedded trainer example) once its job is set up, the bench's worker processes
once their servers are, and the bench itself around each figure. The libraries never
touch the collector: a trainer that embeds the coordinator or a server that embeds the
participant SDK decides for itself (docs/participant.md, Hosting; docs/embedding.md).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_start_up_heap() -> None:
    """Collect what start-up left as garbage, then freeze every object still alive out
    of the collector's reach for the rest of the process's life."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """:func:`freeze_start_up_heap` for a while: on exit the frozen objects are handed
    back to the collector, so that what was built for the while (and is dropped after
    it) can still be freed."""
    freeze_start_up_heap()
    try:
        yield
    finally:
        gc.unfreeze()
