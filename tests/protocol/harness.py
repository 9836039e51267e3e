"""The pair model the protocol tests drive (it lives in the package, beside the
explorer that drives it too: `kvhandoff.tools.pair_model`)."""

from kvhandoff.tools.pair_model import *  # noqa: F403
from kvhandoff.tools.pair_model import __all__  # noqa: F401
