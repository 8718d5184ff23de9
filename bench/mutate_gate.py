"""Sampled mutation test of the gate's I/O-free modules: are their rules pinned without an engine?

Flips one comparison (``==``/``!=``, ``is``/``is not``, ``in``/``not in``, ``<``/``>=``,
``>``/``<=``) or boolean operator (``and``/``or``) at a time, at ``--sites`` sites sampled
(with ``--seed``) from the modules below (``assert`` statements and ``TYPE_CHECKING``
blocks left out), runs the engine-free tests against the mutated copy of the package
(first on ``PYTHONPATH``, so the worktree is never edited) and reports how many mutants
the tests caught. Each mutant runs the engine-free test files that exercise its module
(`EXERCISING`; ``--all-tests`` runs every one, slower and never lower); ``-x`` stops at
the first failure.

    uv run --locked --no-sync python bench/mutate_gate.py --sites 30 --seed 0
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "packages" / "tokcap-vllm" / "src" / "tokcap_vllm"
MODULES = (
    "_rollouts.py",
    "_lifecycle.py",
    "_records.py",
    "_planning/_index.py",
    "_staging.py",
    "fingerprints.py",
    "_planning/_plan_text.py",
    "_planning/_plan_ids.py",
    "_planning/_splice.py",
    "_routing.py",
    "_weight_state.py",
    "_planning/_render_ids.py",
)
ENGINE_FREE_TESTS = (
    "tests/vllm/test_gate_rules.py",
    "tests/vllm/test_gate_tables.py",
    "tests/vllm/test_weight_state.py",
    "tests/vllm/test_admission_unit.py",
    "tests/vllm/test_mistral_planner.py",
    "tests/vllm/test_routes_unit.py",
)
_RULES = ("tests/vllm/test_gate_rules.py", "tests/vllm/test_gate_tables.py")
EXERCISING: dict[str, tuple[str, ...]] = {
    "_rollouts.py": (*_RULES, "tests/vllm/test_routes_unit.py"),
    "_lifecycle.py": (*_RULES, "tests/vllm/test_routes_unit.py"),
    "_records.py": (*_RULES, "tests/vllm/test_routes_unit.py"),
    "_planning/_index.py": (*_RULES, "tests/vllm/test_routes_unit.py"),
    "_staging.py": (*_RULES, "tests/vllm/test_routes_unit.py"),
    "_weight_state.py": (*_RULES, "tests/vllm/test_weight_state.py"),
    "fingerprints.py": (*_RULES, "tests/vllm/test_admission_unit.py"),
    "_planning/_plan_text.py": (*_RULES, "tests/vllm/test_admission_unit.py"),
    "_planning/_splice.py": (*_RULES, "tests/vllm/test_admission_unit.py"),
    "_routing.py": _RULES,
    "_planning/_plan_ids.py": (*_RULES, "tests/vllm/test_mistral_planner.py"),
    "_planning/_render_ids.py": (*_RULES, "tests/vllm/test_mistral_planner.py"),
}
"""The engine-free test files that exercise each module (``--all-tests``: every one)."""
_FLIP_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
}
_SYMBOL = {
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Lt: "<",
    ast.GtE: ">=",
    ast.Gt: ">",
    ast.LtE: "<=",
    ast.And: "and",
    ast.Or: "or",
}


@dataclass(frozen=True)
class Site:
    """One place to flip: the ``index``-th operator node of its kind met walking the module."""

    module: str
    line: int
    kind: str  # "compare" or "boolop"
    index: int
    flip: str


@dataclass
class Outcome:
    """What the tests did with one mutant."""

    site: Site
    caught: bool
    seconds: float
    detail: str


def _skipped_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        checking = (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        )
        if isinstance(node, ast.Assert) or checking:
            end = node.end_lineno or node.lineno
            lines.update(range(node.lineno, end + 1))
    return lines


def _operator_nodes(tree: ast.Module) -> list[ast.Compare | ast.BoolOp]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Compare, ast.BoolOp))]


def sites_of(module: str) -> list[Site]:
    """Every flippable operator of ``module`` outside asserts and ``TYPE_CHECKING`` blocks."""
    tree = ast.parse((PACKAGE / module).read_text())
    skipped = _skipped_lines(tree)
    out = []
    for index, node in enumerate(_operator_nodes(tree)):
        if node.lineno in skipped:
            continue
        if isinstance(node, ast.Compare):
            if len(node.ops) != 1 or type(node.ops[0]) not in _FLIP_COMPARE:
                continue
            op = type(node.ops[0])
            flip = f"{_SYMBOL[op]} -> {_SYMBOL[_FLIP_COMPARE[op]]}"
            out.append(Site(module, node.lineno, "compare", index, flip))
        else:
            op = type(node.op)
            other = ast.Or if op is ast.And else ast.And
            out.append(
                Site(module, node.lineno, "boolop", index, f"{_SYMBOL[op]} -> {_SYMBOL[other]}")
            )
    return out


def mutated_source(site: Site) -> str:
    """The module's source with ``site`` flipped (re-printed by `ast.unparse`)."""
    tree = ast.parse((PACKAGE / site.module).read_text())
    node = _operator_nodes(tree)[site.index]
    if isinstance(node, ast.Compare):
        node.ops = [_FLIP_COMPARE[type(node.ops[0])]()]
    else:
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    return ast.unparse(tree)


def _tests_for(module: str, every: bool) -> list[str]:
    return list(ENGINE_FREE_TESTS if every else EXERCISING[module])


def run_tests(copy: Path, tests: list[str], timeout: float) -> tuple[bool, str]:
    """Whether the tests pass against the package copy under ``copy``."""
    env = dict(os.environ, PYTHONPATH=str(copy), RAY_ENABLE_UV_RUN_RUNTIME_ENV="0")
    command = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider"]
    command += ["--hypothesis-seed=0"]
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return False, "timeout"
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    return done.returncode == 0, tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per mutant")
    parser.add_argument("--out", type=Path, default=None, help="write the outcomes as JSON")
    parser.add_argument(
        "--all-tests", action="store_true", help="run every engine-free test file per mutant"
    )
    parser.add_argument(
        "--rerun",
        type=Path,
        default=None,
        help="an earlier --out file: run only its survivors again, report the whole sample",
    )
    args = parser.parse_args()

    everything = [s for m in MODULES for s in sites_of(m)]
    sample = random.Random(args.seed).sample(everything, min(args.sites, len(everything)))
    print(f"{len(everything)} sites in {len(MODULES)} modules; {len(sample)} sampled", flush=True)
    outcomes = []
    if args.rerun is not None:
        earlier = [
            Outcome(Site(**o["site"]), o["caught"], o["seconds"], o["detail"])
            for o in json.loads(args.rerun.read_text())
        ]
        outcomes = [o for o in earlier if o.caught]
        sample = [o.site for o in earlier if not o.caught]
        print(f"{len(outcomes)} caught before; running the {len(sample)} survivors", flush=True)
    with tempfile.TemporaryDirectory(prefix="mutate-gate-") as tmp:
        copy = Path(tmp) / "tokcap_vllm"
        shutil.copytree(PACKAGE, copy)
        env = dict(os.environ, PYTHONPATH=tmp)
        probe = [sys.executable, "-c", "import tokcap_vllm; print(tokcap_vllm.__file__)"]
        found = subprocess.run(probe, env=env, capture_output=True, text=True, check=True)
        if not found.stdout.strip().startswith(tmp):
            raise SystemExit(f"the tests would import {found.stdout.strip()}, not the copy")
        ok, tail = run_tests(Path(tmp), list(ENGINE_FREE_TESTS[:1]), args.timeout)
        if not ok:
            raise SystemExit(f"the unmutated copy fails its tests: {tail}")
        for site in sample:
            target = copy / site.module
            if _operator_nodes(ast.parse(target.read_text()))[site.index].lineno != site.line:
                raise SystemExit(f"{site.module} changed since the earlier run: {site}")
            target.write_text(mutated_source(site))
            started = time.monotonic()
            tests = _tests_for(site.module, args.all_tests)
            passed, tail = run_tests(Path(tmp), tests, args.timeout)
            shutil.copy2(PACKAGE / site.module, target)
            outcome = Outcome(site, not passed, time.monotonic() - started, tail)
            outcomes.append(outcome)
            mark = "caught  " if outcome.caught else "SURVIVED"
            print(f"{mark} {site.module}:{site.line} {site.flip}  ({tail})", flush=True)
    caught = sum(o.caught for o in outcomes)
    share = 100 * caught / len(outcomes) if outcomes else 0.0
    print(f"caught {caught}/{len(outcomes)} ({share:.0f} %)")
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))


if __name__ == "__main__":
    main()
