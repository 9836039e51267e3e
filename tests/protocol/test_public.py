"""The public surface: every name in `__all__` exists, and the layers import downward only."""

import ast
import pathlib

import kvhandoff.protocol as protocol
import kvhandoff.topology as topology

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_protocol_exports_exist() -> None:
    for name in protocol.__all__:
        assert hasattr(protocol, name), name
    assert len(set(protocol.__all__)) == len(protocol.__all__), "duplicate export"
    for name in (
        "ProtocolError",
        "ContextTicket",
        "Open",
        "decode_frame",
        "encode_frame",
        "samples",
    ):
        assert name in protocol.__all__, name


def test_topology_exports_exist() -> None:
    for name in topology.__all__:
        assert hasattr(topology, name), name
    assert len(set(topology.__all__)) == len(topology.__all__), "duplicate export"


def _imports(folder: str) -> set[str]:
    found: set[str] = set()
    for path in (ROOT / folder).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
    return found


def test_protocol_is_sans_io() -> None:
    banned = {
        "ray",
        "nixl",
        "asyncio",
        "time",
        "socket",
        "torch",
        "threading",
        "kvhandoff.topology",
        "kvhandoff.actors",
    }
    bad = {m for m in _imports("protocol") if m.split(".")[0] in banned or m in banned}
    assert not bad, f"protocol/ imports I/O or upper layers: {bad}"


def test_topology_imports_downward_only() -> None:
    banned = {"ray", "nixl", "asyncio", "time", "socket", "torch"}
    bad = {
        m
        for m in _imports("topology")
        if m.split(".")[0] in banned or m.startswith("kvhandoff.actors")
    }
    assert not bad, f"topology/ imports I/O or the actors layer: {bad}"


def test_errors_with_data_survive_pickling() -> None:
    """Errors cross Ray hops by pickle: they must rebuild with their data."""
    import pickle

    stale = protocol.StaleError("epoch", 3, 4)
    again = pickle.loads(pickle.dumps(stale))
    assert type(again) is protocol.StaleError and (again.what, again.got, again.expected) == ("epoch", 3, 4)
    illegal = protocol.IllegalTransition("ctx-edge", "state", "event")
    again2 = pickle.loads(pickle.dumps(illegal))
    assert (again2.machine, again2.state, again2.event) == ("ctx-edge", "state", "event")


def test_tools_import_the_protocol_only() -> None:
    """tools/ (the explorer and its pair model) needs no Ray, NIXL, torch or
    actors layer; and no production layer imports tools/."""
    banned = {"ray", "nixl", "torch", "asyncio"}
    bad = {m for m in _imports("tools") if m.split(".")[0] in banned or m.startswith("kvhandoff.actors")}
    assert not bad, f"tools/ imports I/O or the actors layer: {bad}"
    for layer in ("protocol", "topology"):
        assert not {m for m in _imports(layer) if m.startswith("kvhandoff.tools")}, layer


def test_production_layers_import_no_tool() -> None:
    """The runtime (protocol/, topology/, actors/ with actors/rank/,
    integrations/) imports nothing from the command and its harness (cli/)
    or the explorer (tools/), and parses no command line: a tool that
    moves back into the runtime folder fails here."""
    for layer in ("protocol", "topology", "actors", "integrations"):
        for path in (ROOT / layer).rglob("*.py"):
            modules: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules.add(node.module)
            bad = {m for m in modules if m.startswith(("kvhandoff.cli", "kvhandoff.tools")) or m == "argparse"}
            assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
