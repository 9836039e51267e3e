"""A small mutation check for the protocol layer and the rank actor's decisions.

Each mutant (tests/mutation/mutants.toml) is one edit of one source file,
named by the file, an exact snippet of the original source (one line, or a
few lines where a line alone is ambiguous) and its replacement. For each
mutant, one at a time, this script:

1. writes the mutated file into a scratch copy of the repository (the
   worktree is never touched; the scratch copy's file is restored after the
   run), and checks that it still compiles;
2. runs the chosen pytest selection against the scratch copy (`kvhandoff` is
   imported from the scratch copy, ahead of the editable install);
3. records "caught" (a test failed or errored, or the run timed out) with the
   first test that failed, or "survived" (every test passed).

A mutant whose snippet is not found is reported "stale" (the source moved on:
update the snippet), one whose snippet occurs more than once "ambiguous";
neither is silently skipped. The unmutated baseline runs first and must pass.

Usage (from the repository root, in the project's venv)::

    python tests/mutation/run.py                       # every mutant, its own tests
    python tests/mutation/run.py --file _session.py    # mutants of one file
    python tests/mutation/run.py --id receipt-bytes-check --id ctx-wrong-role
    python tests/mutation/run.py --tests "tests/actors/test_e2e.py -k happy"
    python tests/mutation/run.py --json /tmp/mutation.json --logs /tmp/mutation-logs
    python tests/mutation/run.py --list

Each mutant runs its own `tests` selection from mutants.toml, else the
default `tests/protocol` (fast); `--tests` overrides the selection for all.
The table goes to stdout, the JSON summary (caught / survived / stale /
survivors ...) to stdout and to `--json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MUTANTS = pathlib.Path(__file__).with_name("mutants.toml")
DEFAULT_TESTS = "tests/protocol"
# What the scratch copy needs: the layer folders, the tests and what they read.
COPY = ("pkg", "protocol", "topology", "actors", "cli", "tools", "integrations", "tests", "docs", "examples", "pyproject.toml")
# The import package `kvhandoff` as the editable install maps it (pyproject package-dir).
PACKAGE_DIRS = {
    "protocol": "protocol", "topology": "topology", "actors": "actors", "cli": "cli", "tools": "tools",
    "integrations": "integrations",
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # path relative to the repository root
    original: str  # exact snippet of the source
    replacement: str
    what: str = ""  # what the mutation breaks
    tests: str = ""  # pytest selection (default: DEFAULT_TESTS)
    note: str = ""  # judgement of a known survivor (equivalent / gap)


@dataclasses.dataclass
class Result:
    mutant: Mutant
    status: str  # caught | survived | stale | ambiguous | invalid
    caught_by: str = ""
    seconds: float = 0.0
    tests: str = ""


def load(path: pathlib.Path) -> list[Mutant]:
    data = tomllib.loads(path.read_text())
    mutants = [Mutant(**entry) for entry in data["mutant"]]
    ids = [m.id for m in mutants]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise SystemExit(f"duplicate mutant ids: {sorted(dupes)}")
    return mutants


def make_scratch() -> pathlib.Path:
    """A copy of the repository whose `kvhandoff` package is its own folders."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvhandoff-mutation-"))
    for name in COPY:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(
                src,
                scratch / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".hypothesis"),
            )
        elif src.exists():
            shutil.copy2(src, scratch / name)
    package = scratch / "_import" / "kvhandoff"
    package.mkdir(parents=True)
    for item in (scratch / "pkg").iterdir():
        if item.is_file():
            shutil.copy2(item, package / item.name)
    for sub, folder in PACKAGE_DIRS.items():
        (package / sub).symlink_to(scratch / folder, target_is_directory=True)
    return scratch


def scratch_env(scratch: pathlib.Path) -> dict[str, str]:
    env = dict(os.environ)
    # PathFinder (PYTHONPATH) runs before the editable install's finder, which
    # setuptools appends to sys.meta_path: the scratch package wins.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(scratch / "_import"), str(scratch), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    # No bytecode: a mutant of the same size written within the same second as
    # the original could otherwise be shadowed by a stale .pyc.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_from(scratch: pathlib.Path, env: dict[str, str]) -> None:
    probe = (
        "import kvhandoff.protocol as p, kvhandoff.topology as t; "
        "print(p.__file__); print(t.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=scratch, env=env, capture_output=True, text=True
    )
    paths = out.stdout.split()
    if (
        out.returncode
        or not paths
        or not all(pathlib.Path(p).resolve().is_relative_to(scratch.resolve()) for p in paths)
    ):
        raise SystemExit(f"scratch copy is not what gets imported: {out.stdout}{out.stderr}")


# Within a folder selection, files run in name order except these, which are
# the slowest to pass (hypothesis) and go last: with -x, a mutant that a quick
# unit test catches never waits for them.
SLOW_LAST = ("test_fuzz.py", "test_stateful.py", "test_explore.py")


def expand(scratch: pathlib.Path, selection: str) -> list[str]:
    """The pytest arguments of `selection`, folders expanded fast files first."""
    args: list[str] = []
    for arg in shlex.split(selection):
        folder = scratch / arg
        if not arg.startswith("-") and folder.is_dir():
            files = sorted(folder.glob("test_*.py"), key=lambda f: (f.name in SLOW_LAST, f.name))
            args += [str(f.relative_to(scratch)) for f in files]
        else:
            args.append(arg)
    return args


_FAILED = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - (.*))?$", re.MULTILINE)


def run_tests(
    scratch: pathlib.Path,
    env: dict[str, str],
    selection: str,
    timeout: float,
    log: pathlib.Path | None = None,
) -> tuple[bool, str, float]:
    """Run one pytest selection; (passed, first failing test or reason, seconds)."""
    shutil.rmtree(scratch / ".hypothesis", ignore_errors=True)  # no replay across mutants
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-rfE",
        "--no-header",
        "-p",
        "no:cacheprovider",
        "-o",
        f"timeout={int(timeout)}",
        *expand(scratch, selection),
    ]
    start = time.monotonic()
    try:
        out = subprocess.run(
            cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout + 30
        )
    except subprocess.TimeoutExpired:
        return False, f"timeout after {timeout:.0f} s", time.monotonic() - start
    seconds = time.monotonic() - start
    if log is not None:
        log.write_text(out.stdout + out.stderr)
    if out.returncode == 0:
        return True, "", seconds
    if out.returncode == 5:
        raise SystemExit(f"selection {selection!r} collected no tests")
    found = _FAILED.findall(out.stdout)
    if found:
        test, how = found[0]  # how: the summary's "- KeyError: ..." part, if any
        return False, f"{test} ({how[:100]})" if how else test, seconds
    tail = (out.stdout + out.stderr).strip().splitlines()[-1:] or ["?"]
    return False, f"exit {out.returncode}: {tail[0][:120]}", seconds


def apply(source: str, mutant: Mutant) -> str | None:
    """The mutated source, or None when the snippet is not there (stale)."""
    count = source.count(mutant.original)
    if count == 0:
        return None
    if count > 1:
        raise ValueError(f"snippet occurs {count} times")
    return source.replace(mutant.original, mutant.replacement, 1)


def run_one(
    scratch: pathlib.Path,
    env: dict[str, str],
    mutant: Mutant,
    selection: str,
    timeout: float,
    logs: pathlib.Path | None = None,
) -> Result:
    target = scratch / mutant.file
    original = target.read_text()
    try:
        mutated = apply(original, mutant)
    except ValueError:
        return Result(mutant, "ambiguous", tests=selection)
    if mutated is None:
        return Result(mutant, "stale", tests=selection)
    try:
        compile(mutated, str(target), "exec")
    except SyntaxError as exc:
        return Result(mutant, "invalid", caught_by=f"SyntaxError: {exc}", tests=selection)
    try:
        target.write_text(mutated)
        log = logs / f"{mutant.id}.log" if logs is not None else None
        passed, caught_by, seconds = run_tests(scratch, env, selection, timeout, log)
    finally:
        target.write_text(original)  # restore the scratch copy, whatever happened
    status = "survived" if passed else "caught"
    return Result(mutant, status, caught_by=caught_by, seconds=seconds, tests=selection)


def table(results: list[Result]) -> str:
    rows = [("id", "file", "status", "caught by / note", "s")]
    for r in results:
        detail = r.caught_by if r.status == "caught" else r.mutant.note
        rows.append((r.mutant.id, r.mutant.file, r.status, detail[:90], f"{r.seconds:.0f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(results: list[Result], baseline_s: float) -> dict[str, object]:
    def ids(status: str) -> list[str]:
        return [r.mutant.id for r in results if r.status == status]

    return {
        "mutants": len(results),
        "caught": len(ids("caught")),
        "survived": len(ids("survived")),
        "stale": len(ids("stale")),
        "ambiguous": len(ids("ambiguous")),
        "invalid": len(ids("invalid")),
        "baseline_s": round(baseline_s, 1),
        "survivors": [
            {
                "id": r.mutant.id,
                "file": r.mutant.file,
                "what": r.mutant.what,
                "note": r.mutant.note,
            }
            for r in results
            if r.status == "survived"
        ],
        "stale_ids": ids("stale") + ids("ambiguous"),
        "results": [
            {
                "id": r.mutant.id,
                "file": r.mutant.file,
                "status": r.status,
                "caught_by": r.caught_by,
                "tests": r.tests,
                "seconds": round(r.seconds, 1),
            }
            for r in results
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=pathlib.Path, default=MUTANTS)
    parser.add_argument("--id", action="append", default=[], help="run only these mutant ids")
    parser.add_argument("--file", default="", help="run only mutants of files containing this")
    parser.add_argument("--tests", default="", help="pytest selection for every mutant")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant run")
    parser.add_argument("--json", type=pathlib.Path, help="also write the JSON summary here")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy")
    parser.add_argument("--logs", type=pathlib.Path, help="write each mutant's pytest output here")
    args = parser.parse_args(argv)

    mutants = load(args.mutants)
    if args.id:
        unknown = set(args.id) - {m.id for m in mutants}
        if unknown:
            raise SystemExit(f"unknown mutant ids: {sorted(unknown)}")
        mutants = [m for m in mutants if m.id in args.id]
    if args.file:
        mutants = [m for m in mutants if args.file in m.file]
    if args.list:
        for m in mutants:
            print(f"{m.id:32} {m.file:22} {m.what}")
        return 0

    scratch = make_scratch()
    # A plain kill (SIGTERM) still removes the scratch copy.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        env = scratch_env(scratch)
        check_imports_from(scratch, env)
        selections = sorted({args.tests or m.tests or DEFAULT_TESTS for m in mutants})
        baseline_s = 0.0
        for selection in selections:
            passed, why, seconds = run_tests(scratch, env, selection, args.timeout)
            baseline_s += seconds
            print(
                f"baseline {selection!r}: {'ok' if passed else why} ({seconds:.0f} s)", flush=True
            )
            if not passed:
                raise SystemExit("the unmutated baseline fails: fix that first")
        results = []
        for n, mutant in enumerate(mutants, 1):
            selection = args.tests or mutant.tests or DEFAULT_TESTS
            if args.logs is not None:
                args.logs.mkdir(parents=True, exist_ok=True)
            result = run_one(scratch, env, mutant, selection, args.timeout, args.logs)
            results.append(result)
            print(
                f"[{n}/{len(mutants)}] {mutant.id}: {result.status} "
                f"{result.caught_by} ({result.seconds:.0f} s)",
                flush=True,
            )
        print()
        print(table(results))
        report = summary(results, baseline_s)
        text = json.dumps(report, indent=2)
        print(text)
        if args.json:
            args.json.write_text(text + "\n")
        return 0
    finally:
        if args.keep:
            print(f"scratch copy kept at {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
