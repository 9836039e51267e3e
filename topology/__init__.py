"""kvhandoff.topology: rank layouts, canonical digests, the qualified-scope gate,
KV layout and shard mapping across heterogeneous TP, placement.

Pure functions over frozen structs; imports only `kvhandoff.protocol`.
"""

from . import _digest, _gate, _layout, _memory, _placement, _shard, _spec
from ._digest import *  # noqa: F403
from ._gate import *  # noqa: F403
from ._layout import *  # noqa: F403
from ._memory import *  # noqa: F403
from ._placement import *  # noqa: F403
from ._shard import *  # noqa: F403
from ._spec import *  # noqa: F403

__all__ = [
    *_spec.__all__,
    *_digest.__all__,
    *_gate.__all__,
    *_layout.__all__,
    *_shard.__all__,
    *_memory.__all__,
    *_placement.__all__,
]
