"""kvhandoff.protocol: the pure, sans-IO protocol layer (docs/design.md).

No Ray, no NIXL, no asyncio, no clock reads: time is always an argument. The
private modules hold the implementation; this package re-exports their public
names, and `__all__` lists exactly those (tests/protocol/test_public.py).
"""

from . import (
    _actions,
    _ctx_session,
    _decision,
    _errors,
    _gen_session,
    _memory,
    _messages,
    _negotiation,
    _pool,
    _registry,
    _round_messages,
    _rounds,
    _session,
    _staging,
    _tables,
    _ticket,
    _wire,
)
from ._actions import *  # noqa: F403
from ._ctx_session import *  # noqa: F403
from ._decision import *  # noqa: F403
from ._errors import *  # noqa: F403
from ._gen_session import *  # noqa: F403
from ._memory import *  # noqa: F403
from ._messages import *  # noqa: F403
from ._negotiation import *  # noqa: F403
from ._pool import *  # noqa: F403
from ._registry import *  # noqa: F403
from ._round_messages import *  # noqa: F403
from ._rounds import *  # noqa: F403
from ._session import *  # noqa: F403
from ._staging import *  # noqa: F403
from ._tables import *  # noqa: F403
from ._ticket import *  # noqa: F403
from ._wire import *  # noqa: F403

__all__ = [
    *_errors.__all__,
    *_ticket.__all__,
    *_messages.__all__,
    *_wire.__all__,
    *_negotiation.__all__,
    *_pool.__all__,
    *_registry.__all__,
    *_tables.__all__,
    *_actions.__all__,
    *_session.__all__,
    *_ctx_session.__all__,
    *_gen_session.__all__,
    *_round_messages.__all__,
    *_rounds.__all__,
    *_decision.__all__,
    *_staging.__all__,
    *_memory.__all__,
]
