"""The I/O layer: Ray actors, the NIXL data plane, the client API and the CLI."""
