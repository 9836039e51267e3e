"""Import NIXL's Python API from whichever wheel is installed.

kvhandoff depends on one NIXL build, `nixl-cu13` (module `nixl_cu13`): it
serves host memory and CUDA 13 GPUs (the H200 machines run CUDA 13). Where
the `nixl` meta package is installed too (it pulls the CUDA 12 and CUDA 13
builds and picks the one matching torch's CUDA), it is used first, so a CUDA
12 machine can install `nixl` and get its build.
"""

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:  # the default install: nixl-cu13 alone
    from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]

__all__ = ["nixl_agent", "nixl_agent_config"]
