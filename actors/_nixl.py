"""Import NIXL's Python API from whichever wheel is installed.

`nixl` (the meta package) on a normal install; `nixl_cu13` where only the CUDA 13
build travels (the GPU machine, see the device notes).
"""

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:  # pragma: no cover - GPU machine carries nixl_cu13 alone
    from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

__all__ = ["nixl_agent", "nixl_agent_config"]
