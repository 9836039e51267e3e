"""kvhandoff's tools, apart from what runs in production: the interleaving
explorer (`kvhandoff explore`) and the pair model it and the protocol tests
drive. They import the protocol layer only (no Ray, no NIXL, no clock)."""
