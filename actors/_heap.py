"""The cyclic garbage collector in kvhandoff's own actor processes.

A full collection (generation 2) walks every object the process holds: in a
rank or coordinator process, most of them are what start-up made (the
imported modules, Ray's and NIXL's state, the pools' bookkeeping) and
never become garbage. Measured on the 2-core box: one such collection took
120-160 ms in each rank and coordinator process, about once every few
hundred handoffs, and whatever handoff crossed it waited (a lone handoff's
p99 went from about 4 ms to about 120 ms). `freeze_startup_heap` takes the
start-up heap out of the collector's walk (`gc.freeze`): collections still
run, over what the process made since, and 600 sequential handoffs then
saw none over 6 ms.

Only for the processes kvhandoff starts (its rank actors and coordinators):
an engine's worker that hosts an endpoint is the engine's to tune.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_startup_heap"]


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now to the collector's
    permanent generation; returns how many objects that froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
