"""The command line without a Ray cluster: parsing, --version, --help, flag
errors, progress and summary output, the demo's plan. (End to end runs are in
tests/actors/test_cli.py.)"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

import kvhandoff
import kvhandoff.cli as cli
from kvhandoff.cli import _flags

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("ray", "torch", "nixl", "nixl_cu12", "nixl_cu13", "numpy")
ESC = "\x1b"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "COLUMNS"):
        env.pop(name, None)  # rich would style a pipe on request
    return env


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env()
    )


# -- parsing is light ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["demo", "--help"], ["bench", "--help"], ["explore", "--help"], ["--version"], ["demo", "--requests", "0"]],
)
def test_parsing_imports_no_ray_torch_nixl_or_numpy(argv: list[str]) -> None:
    """`kvhandoff --help` and friends go through `main` and exit from argparse
    before any subcommand body is imported; the modules loaded by then are
    printed by an exit hook."""
    code = (
        "import atexit, json, sys\n"
        "atexit.register(lambda: print('MODULES=' + json.dumps(sorted(sys.modules))))\n"
        "from kvhandoff.cli import main\n"
        f"main({argv!r})\n"
    )
    proc = _run(code)
    assert proc.returncode in (0, 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    modules = json.loads(proc.stdout.rsplit("MODULES=", 1)[1])
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert heavy == [], heavy


@pytest.mark.parametrize(("flag", "tp"), [("--ctx-tp", 3), ("--gen-tp", 16)])
def test_a_tp_the_heads_do_not_split_over_is_refused_before_ray_starts(flag: str, tp: int) -> None:
    """The demo's layout has 8 KV heads: a TP that does not divide them is
    refused at once (exit 2) with the TPs that fit, before Ray is imported,
    let alone started."""
    code = (
        "import atexit, json, sys\n"
        "atexit.register(lambda: print('MODULES=' + json.dumps(sorted(sys.modules))))\n"
        "from kvhandoff.cli import main\n"
        f"sys.exit(main(['demo', {flag!r}, '{tp}']))\n"
    )
    proc = _run(code)
    assert proc.returncode == 2, proc.stderr
    assert f"{flag} {tp}: cannot split 8 KV heads" in proc.stderr and "tp that fit: 1, 2, 4, 8" in proc.stderr
    modules = json.loads(proc.stdout.rsplit("MODULES=", 1)[1])
    assert [m for m in modules if m.split(".")[0] == "ray"] == []


def test_the_actors_package_loads_its_names_on_first_use() -> None:
    """`kvhandoff.actors` exports lazily (what makes parsing light): every name
    of `__all__` has a source, and importing the package imports no Ray."""
    import kvhandoff.actors as actors

    assert set(actors.__all__) == set(actors._SOURCES)
    assert set(actors.__all__) <= set(dir(actors))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = actors.no_such_name  # type: ignore[attr-defined]
    proc = _run("import sys, kvhandoff.actors; print(sorted(m for m in sys.modules if m.split('.')[0] == 'ray'))")
    assert proc.stdout.strip() == "[]", proc


def test_version_is_the_installed_distributions() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff.cli", "--version"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"kvhandoff {metadata.version('kvhandoff')}"
    assert kvhandoff.__version__ == metadata.version("kvhandoff")


def test_flag_choices_match_the_library() -> None:
    from kvhandoff.actors import _stager

    assert _flags.DATA_MODES == _stager.DATA_MODES


# -- help shows defaults; bad values are refused in one line --------------------------------------


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_help_shows_every_default(command: str) -> None:
    parser = _subparser(command)
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.default in (None, False, argparse.SUPPRESS):
            continue
        assert f"(default: {action.default})" in text, (action.dest, action.default)
    if command == "bench":
        assert "(default: 5)" in text and "(default: 64,256)" in text


BAD_VALUES = [
    ("bench", "--repeats", "0", "expected a positive integer, got '0'"),
    ("bench", "--repeats", "-3", "expected a positive integer"),
    ("bench", "--cancels", "0", "expected a positive integer"),
    ("bench", "--ctx-tp", "0", "expected a positive integer"),
    ("bench", "--small-n", "0", "expected a positive integer"),
    ("bench", "--chunk-mib", "0", "expected a positive integer"),
    ("bench", "--sizes-mib", "64,0", "expected comma-separated positive integers"),
    ("bench", "--concurrency", "x", "expected comma-separated positive integers"),
    ("bench", "--sustain-s", "0", "expected a positive number"),
    ("bench", "--round-timeout-s", "-1", "expected a positive number"),
    ("bench", "--cancel-spare", "-1", "expected an integer >= 0"),
    ("bench", "--sections", "data,nope", "expected a comma-separated subset"),
    ("demo", "--requests", "abc", "expected a positive integer, got 'abc'"),
    ("demo", "--requests", "0", "expected a positive integer"),
    ("demo", "--concurrency", "0", "expected a positive integer"),
    ("demo", "--cancel-rate", "1.5", "expected a number between 0 and 1"),
    ("demo", "--gpus-per-rank", "-1", "expected a number >= 0"),
    ("demo", "--timeout", "inf", "expected a positive number"),
]


@pytest.mark.parametrize("command,flag,value,expected", BAD_VALUES, ids=lambda v: str(v))
def test_bad_values_exit_2_with_a_plain_error(
    command: str, flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args([command, flag, value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {expected}" in err, err
    assert "_positive" not in err and "invalid" not in err, err


def test_count_defaults_parse_to_their_values() -> None:
    args = cli.build_parser().parse_args(["bench"])
    assert (args.repeats, args.sizes_mib, args.paged_kib, args.concurrency) == (5, [64, 256], [16, 64, 256, 1024], [1, 8, 32])
    assert args.sections == "data,paged,control,cancel"
    demo = cli.build_parser().parse_args(["demo"])
    assert (demo.requests, demo.cancel_rate, demo.ctx_tp, demo.gen_tp) == (300, 0.3, [2], [1])
    assert (demo.ctx_instances, demo.gen_instances) == (1, 1)


# -- Ray's token-auth warning; the terminal after exit ---------------------------------------------


def test_a_new_local_cluster_gets_an_explicit_auth_mode() -> None:
    """Without RAY_AUTH_MODE, Ray 2.60 enables token auth for a new local
    cluster and warns on every start; main() sets the same mode explicitly,
    but never when joining a cluster or once Ray is imported (too late)."""
    args = cli.build_parser().parse_args(["demo"])
    environ: dict[str, str] = {}
    cli.local_ray_auth(args, environ, {})
    assert environ == {"RAY_AUTH_MODE": "token"}
    environ = {"RAY_AUTH_MODE": "disabled"}
    cli.local_ray_auth(args, environ, {})
    assert environ == {"RAY_AUTH_MODE": "disabled"}
    for environ, modules in (({"RAY_ADDRESS": "10.0.0.1:6379"}, {}), ({}, {"ray": object()})):
        cli.local_ray_auth(args, environ, modules)
        assert "RAY_AUTH_MODE" not in environ
    bench = cli.build_parser().parse_args(["bench", "--address", "10.0.0.1:6379"])
    environ = {}
    cli.local_ray_auth(bench, environ, {})
    assert environ == {}


def test_no_escape_sequence_after_the_last_line_in_a_terminal() -> None:
    """`ray.init` imports a module that calls (Ray's vendored) colorama.init(),
    whose exit hook writes ESC[0m to stdout when it is a terminal."""
    pty = pytest.importorskip("pty")
    code = (
        "import ray.autoscaler._private.cli_logger\n"  # what ray.init imports: colorama.init()
        "from kvhandoff.cli import _no_color_reset_at_exit\n"
        "print('last line', flush=True)\n"
        "_no_color_reset_at_exit()\n"
    )
    main_fd, sub_fd = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=sub_fd, stderr=subprocess.PIPE, cwd=ROOT, env=_env())
    os.close(sub_fd)
    out = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=120)
    os.close(main_fd)
    assert proc.returncode == 0, proc.stderr.read() if proc.stderr else ""
    assert out.rstrip().endswith(b"last line"), out[-40:]


# -- joining a cluster where no Ray listens: one line, in seconds (issue 20) ----------------------


def _no_listener() -> socket.socket:
    """A loopback port bound but not listening: a connect to it is refused,
    and nothing else can take the port while the socket is open."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_joining_an_address_where_nothing_listens_fails_at_once_in_one_line(command: str) -> None:
    """`kvhandoff demo --address 127.0.0.1:PORT` with nothing on PORT took
    13.7 minutes (Ray's GCS retries), printed dozens of Ray warnings and a
    token hint. Now: exit status 2, one line naming the address, no Ray."""
    with _no_listener() as sock:
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        code = (
            "import atexit, json, sys\n"
            "atexit.register(lambda: print('MODULES=' + json.dumps(sorted(sys.modules))))\n"
            "from kvhandoff.cli import main\n"
            f"sys.exit(main([{command!r}, '--address', {address!r}]))\n"
        )
        env = _env()
        env.pop("RAY_ADDRESS", None)
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env
        )
        elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert elapsed < 30, elapsed
    assert proc.stderr.splitlines() == [f"kvhandoff {command}: no Ray cluster at {address} (connection refused)"]
    assert "token" not in proc.stderr.lower()
    modules = json.loads(proc.stdout.rsplit("MODULES=", 1)[1])
    assert not [m for m in modules if m.split(".")[0] == "ray"]  # Ray never started


def test_joining_a_listener_that_is_not_ray_fails_in_one_line() -> None:
    """Something accepts TCP connections but is no Ray GCS: Ray's own GCS
    connect, bounded (here to ~3 s by the user's own RAY_* settings, which
    win over the defaults the CLI sets), and its warnings held back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)  # the kernel accepts; nobody answers
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        env = {**_env(), "RAY_py_gcs_connect_timeout_s": "1", "RAY_gcs_rpc_server_connect_timeout_s": "1"}
        env.pop("RAY_ADDRESS", None)
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "kvhandoff.cli", "demo", "--address", address],
            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
        )
        elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert elapsed < 30, elapsed
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"kvhandoff demo: no Ray cluster at {address} (it accepts connections, but no Ray GCS"), line
    assert "token" not in line


def test_probe_answers_refused_at_once_and_retries_only_silence() -> None:
    from kvhandoff.cli._address import probe

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        assert probe("127.0.0.1", server.getsockname()[1]) is None
    with _no_listener() as sock:
        start = time.monotonic()
        assert probe("127.0.0.1", sock.getsockname()[1]) == "connection refused"
        assert time.monotonic() - start < 2
    # No answer: retried (each attempt at most timeout_s) until the budget is spent.
    now = [0.0]
    timeouts: list[float] = []

    def silent(target: tuple[str, int], timeout: float) -> socket.socket:
        timeouts.append(timeout)
        now[0] += timeout
        raise TimeoutError

    why = probe("127.0.0.1", 6379, timeout_s=5.0, budget_s=20.0, connect=silent, clock=lambda: now[0])
    assert why == "no answer within 20 s"
    assert timeouts == [5.0, 5.0, 5.0, 5.0] and now[0] == 20.0

    def refused(target: tuple[str, int], timeout: float) -> socket.socket:
        timeouts.append(timeout)
        raise ConnectionRefusedError

    timeouts.clear()
    assert probe("127.0.0.1", 6379, connect=refused) == "connection refused"
    assert len(timeouts) == 1  # final at once

    def unknown(target: tuple[str, int], timeout: float) -> socket.socket:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    assert probe("no-such-host", 6379, connect=unknown) == "unknown host 'no-such-host': Name or service not known"


def test_which_addresses_are_probed() -> None:
    from kvhandoff.cli import _address

    assert _address.host_port("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert _address.host_port("[::1]:6379") == ("::1", 6379)
    assert _address.host_port("ray://127.0.0.1") == ("127.0.0.1", 10001)
    assert _address.host_port("ray://127.0.0.1:10002") == ("127.0.0.1", 10002)
    for unprobed in ("127.0.0.1", "127.0.0.1:x", "127.0.0.1:0", "::1", "http://127.0.0.1:8265"):
        assert _address.host_port(unprobed) is None, unprobed
    demo = cli.build_parser().parse_args(["demo"])
    joining = cli.build_parser().parse_args(["demo", "--address", "127.0.0.1:6379"])
    assert _address.join_address(demo, {}) is None
    assert _address.join_address(demo, {"RAY_ADDRESS": "auto"}) is None
    assert _address.join_address(demo, {"RAY_ADDRESS": "127.0.0.1:1"}) == ("127.0.0.1:1", " from RAY_ADDRESS")
    assert _address.join_address(joining, {"RAY_ADDRESS": "127.0.0.1:1"}) == ("127.0.0.1:6379", "")
    assert _address.check_join(demo, {}) is None  # a local cluster: nothing to probe
    with _no_listener() as sock:
        environ = {"RAY_ADDRESS": f"127.0.0.1:{sock.getsockname()[1]}"}
        assert _address.check_join(demo, environ) == (
            f"no Ray cluster at {environ['RAY_ADDRESS']} from RAY_ADDRESS (connection refused)"
        )
    environ = {"RAY_py_gcs_connect_timeout_s": "60"}
    _address.bound_ray_connect(environ)  # the user's setting stays
    assert environ == {"RAY_py_gcs_connect_timeout_s": "60", "RAY_gcs_server_port_wait_time_s": "1"}


def test_a_failed_join_names_the_token_only_when_the_token_was_refused() -> None:
    from kvhandoff.cli._address import init_error

    try:
        try:
            raise RuntimeError("Failed to connect to GCS. Last connection error: ... InvalidAuthToken: ...")
        except RuntimeError as cause:
            raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:6379") from cause
    except ConnectionError as exc:
        refused = exc
    line = init_error(refused, "127.0.0.1:6379", {})
    assert line.startswith("could not join the Ray cluster at 127.0.0.1:6379: Failed to connect")
    assert "RAY_AUTH_MODE=token" in line and "\n" not in line
    other = init_error(ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:6379\nmore"), "127.0.0.1:6379", {})
    assert other == "could not join the Ray cluster at 127.0.0.1:6379: Failed to connect to Ray cluster at 127.0.0.1:6379"


# -- progress -------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_plain_lines_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhandoff.cli._console import Reporter

    monkeypatch.setenv("TERM", "xterm")
    stream = io.StringIO()
    reporter = Reporter("kvhandoff demo", quiet=False, stream=stream)
    with reporter.step("launching the ranks", done="ranks ready"):
        pass
    reporter.start_requests(20, "running 20 requests")
    for i in range(20):
        reporter.request_done("completed" if i % 3 else "cancelled")
    reporter.end_requests()
    lines = stream.getvalue().splitlines()
    assert ESC not in stream.getvalue()
    assert lines[0] == "kvhandoff demo: launching the ranks..."
    assert re.fullmatch(r"kvhandoff demo: ranks ready \(\d+\.\d s\)", lines[1]), lines[1]
    assert lines[2] == "kvhandoff demo: running 20 requests..."
    progress = [line for line in lines if "requests " in line and "/20" in line]
    assert len(progress) == 10 and progress[-1].startswith("kvhandoff demo: requests 20/20: cancelled 7, completed 13")


def test_progress_is_silent_when_quiet_and_live_in_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvhandoff.cli._console import Reporter

    quiet = io.StringIO()
    reporter = Reporter("kvhandoff demo", quiet=True, stream=quiet)
    with reporter.step("launching", done="ready"):
        reporter.line("something")
    reporter.start_requests(3, "running")
    reporter.request_done("completed")
    reporter.end_requests()
    assert quiet.getvalue() == ""
    monkeypatch.setenv("TERM", "xterm")
    from rich.console import Console
    from rich.errors import LiveError

    set_live = Console.set_live

    def one_at_a_time(self: Console, live: object) -> bool:  # rich before 15: no nesting
        if getattr(self, "_live_stack", None) or getattr(self, "_live", None):
            raise LiveError("Only one live display may be active at once")
        return set_live(self, live)  # type: ignore[arg-type]

    monkeypatch.setattr(Console, "set_live", one_at_a_time)
    terminal = _Terminal()
    live = Reporter("kvhandoff bench", quiet=False, stream=terminal)
    assert live.live
    with live.step("section", done="section done"), live.step("launching", done="ranks ready"):
        live.line("a line inside two steps")  # nested live displays would raise in rich
    assert "ranks ready" in terminal.getvalue() and "section done" in terminal.getvalue()
    monkeypatch.setenv("TERM", "dumb")
    assert not Reporter("kvhandoff demo", quiet=False, stream=_Terminal()).live


# -- the demo's plan and summary --------------------------------------------------------------------


def test_a_short_run_cancels_in_every_way() -> None:
    from kvhandoff.cli._demo import DELAYED, EXACT_PHASES, plan_workload

    ways = {*EXACT_PHASES, DELAYED}
    for seed in range(20):
        for requests in range(5, 12):
            plan = plan_workload(requests, 0.3, seed, exact_phases=True)
            assert {p.cancel for p in plan if p.cancel} == ways, (seed, requests)
    assert len([p for p in plan_workload(5, 0.3, 0, exact_phases=True) if p.cancel]) == 5
    three = plan_workload(3, 0.3, 0, exact_phases=True)
    assert len([p for p in three if p.cancel]) == 3  # as many ways as there are requests
    assert [p for p in plan_workload(20, 0.01, 0, exact_phases=False) if p.cancel][0].cancel == DELAYED
    assert not any(p.cancel for p in plan_workload(20, 0.0, 0, exact_phases=True))
    big = plan_workload(300, 0.3, 0, exact_phases=True)
    assert sum(p.cancel is not None for p in big) == 90


def _report(requests: int = 3, cancel_rate: float = 0.3):  # type: ignore[no-untyped-def]
    from kvhandoff.cli._demo import DemoReport, Finished, plan_workload

    plan = plan_workload(requests, cancel_rate, 0, exact_phases=True)
    results = [
        Finished(p, "cancelled" if p.cancel else "completed", 0 if p.cancel else 4096, 0.01, 0.1) for p in plan
    ]
    rank = {"pool": 64, "free": 64, "leased": 0, "quarantined": 0, "violations": []}
    return DemoReport(
        args={"ctx_tp": 2, "gen_tp": 1, "memory": "DRAM", "pool_blocks": 64, "chaos": False, "concurrency": 4,
              "cancel_rate": cancel_rate, "seed": 0, "cancel_at_phases": True},
        qualified=True,
        unqualified_reasons=[],
        results=results,
        ranks=[
            {"role": "ctx", "rank": 0, **rank, "counters": {"refused_StaleError": 5, "frames_reject": 2}},
            {"role": "gen", "rank": 0, **rank, "counters": {"bytes_verified": 8192, "refused_UnknownSessionError": 1}},
        ],
        coordinators={"ctx": {"state": "running"}, "gen": {"state": "running"}},
        durations={"ray_init_s": 4.0, "import_s": 1.0, "launch_s": 9.0, "workload_s": 2.0, "settle_s": 0.1,
                   "shutdown_s": 0.1, "ray_shutdown_s": 1.5, "other_s": 0.3, "total_s": 18.0},
        settled=True,
        violations=[],
    )


def test_summary_explains_its_numbers_and_its_time_adds_up() -> None:
    from kvhandoff.cli._demo import render_summary

    report = _report(requests=8)
    text = render_summary(report)
    flat = " ".join(text.split())
    assert ESC not in text
    assert "refused: stale 5" in flat and "Expected on a clean run: the protocol working" in flat
    assert "REJECT frames 2" in flat and "not rejected requests" in flat
    assert "refused: unknown 1" in flat
    assert "JSON bytes_verified" in flat and "JSON counters.bytes_verified" in flat
    assert re.search(r"invariants\s+OK", text)
    parts = report.time_parts()
    assert sum(seconds for _, seconds in parts) == pytest.approx(report.durations["total_s"])
    assert "wall time 18.0 s " + " + ".join(f"{label} {seconds:.1f}" for label, seconds in parts) in flat
    assert report.to_json()["notes"] == []


def test_summary_says_why_a_short_run_misses_a_way() -> None:
    from kvhandoff.cli._demo import render_summary

    report = _report(requests=3)
    notes = report.to_json()["notes"]
    assert len(notes) == 1 and "too few to cancel in every way" in notes[0]
    assert "too few to cancel in every way" in " ".join(render_summary(report).split())
    assert _report(requests=3, cancel_rate=0.0).to_json()["notes"] == ["no request was cancelled (--cancel-rate 0)"]


# -- packaging: the license, one NIXL build --------------------------------------------------------


def test_license_is_declared_the_way_setuptools_wants_it() -> None:
    """PEP 639: an SPDX expression and the license file (a TOML table made
    setuptools print a deprecation warning on every install)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    setuptools = [r for r in project["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == ["setuptools>=77"]  # the first that reads both fields
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) == 202


def test_one_nixl_build_is_enough() -> None:
    """The project depends on nixl-cu13 alone (not the `nixl` meta package,
    which pulls the CUDA 12 build too), and finds its API without the meta
    package."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    nixl = [d for d in deps if d.startswith("nixl")]
    assert nixl == ["nixl-cu13==1.5.1"], nixl
    assert any(d.startswith("rich") for d in deps)
    pytest.importorskip("nixl_cu13")
    # sys.modules["nixl"] = None makes `import nixl` fail, as without the meta package.
    proc = _run(
        "import sys; sys.modules['nixl'] = None\n"
        "from kvhandoff.actors._nixl import nixl_agent; print(nixl_agent.__module__)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "nixl_cu13._api"
