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

Which modules (`MODULES`): every module of ``tokcap_vllm`` that runs in the served gate
and does no I/O (no socket or ASGI ``send``/``receive``, no file, no engine or vLLM
server handler, no thread, task or ``await``, no clock or environment read of its own):

- the tables and their records: ``_rollouts`` (the rollout table, the ``RolloutBook``),
  ``_lifecycle`` (the call table), ``_records``, who holds a rollout (``_rollouts.Owners``; the
  time comes in as ``now``), ``_weight_state`` (the push's phases), ``_staging``;
- the request's way in: ``_routing`` (paths and headers to a rollout), ``_route_table``
  (every vLLM route classified), ``_wire`` (the bodies read, the response watched),
  ``_answers`` (a Messages or Responses answer read as a chat turn), ``_responses``
  (vLLM's own pure conversion of a Responses request; ``previous_turn`` reads the book);
- planning: ``fingerprints`` and every module of ``_planning`` (``_index``,
  ``_plan_text``, ``_plan_ids``, ``_splice``; ``_render_text`` and ``_render_ids`` bind a
  request to the engine's tokenizer object and call only its pure encode, decode and
  template methods);
- ``_direct_plan`` (what a push loads where, decided from facts the engine reported),
  ``_options`` (flags and ``TOKCAP_*`` variables parsed from what it is handed) and
  ``_metrics`` (Prometheus collectors in a registry of their own, in memory).

Left out, each for the I/O it does: ``_asgi`` (ASGI send/receive), ``_apis`` and
``_messages`` (await the vLLM server's handler), ``_capture``, ``_gate``,
``_middleware``, ``_control``, ``_guarded_routes``, ``_stage_writer``, ``_ready``,
``_http`` (tasks, clocks, sockets, the sink), ``_host`` and ``_logprob_text`` (wrap the
engine), ``_config`` (reads the control-token file), ``_spec`` (reads safetensors
headers, downloads), ``persist`` and ``_ledger_lock`` (files), ``_served``, ``_serve``,
``_inproc``, ``_plugin``, ``_vllm`` (environment, entry points, imports, threads), the
weight push's engine and transport side (``_weights``, ``_served_weights``,
``_direct_load``, ``_shm``, ``_worker``, ``transfer``); the trainer's side is not the
gate (``_client``, ``_closes``, ``_fleet``, ``_fleet_weights``, ``_weight_client``,
``_receipts``). Modules with no operator to flip (``api``, ``errors``, ``_hooks``,
``_fleet_gates``, ``extend``, ``weights``, the ``__init__`` doors) add no sites.
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
    "gate/_rollouts.py",
    "gate/_lifecycle.py",
    "gate/_records.py",
    "transfer/_weight_state.py",
    "gate/_staging.py",
    "gate/_routing.py",
    "control/_route_table.py",
    "gate/_wire.py",
    "gate/_answers.py",
    "gate/_responses.py",
    "fingerprints.py",
    "gate/_planning/_index.py",
    "gate/_planning/_plan_text.py",
    "gate/_planning/_plan_ids.py",
    "gate/_planning/_splice.py",
    "gate/_planning/_render_text.py",
    "gate/_planning/_render_ids.py",
    "transfer/_direct_plan.py",
    "gate/_options.py",
    "gate/_metrics.py",
)
_RULES = ("tests/vllm/test_gate_rules.py", "tests/vllm/test_gate_tables.py")
_ROUTES = "tests/vllm/test_routes_unit.py"
_ADMISSION = "tests/vllm/test_admission_unit.py"
_MISTRAL = "tests/vllm/test_mistral_planner.py"
_APIS = "tests/vllm/test_apis_unit.py"
_PLANNING = "tests/vllm/test_planning_unit.py"
_RENDER = "tests/vllm/test_render_unit.py"
_ACCESS = "tests/vllm/test_access_unit.py"
_CLAIMS = "tests/vllm/test_claims_unit.py"
EXERCISING: dict[str, tuple[str, ...]] = {
    "gate/_rollouts.py": (
        _CLAIMS,
        *_RULES,
        _ROUTES,
        _ACCESS,
        "tests/vllm/test_hostile3_fleet.py"
        "::test_q1_an_owner_silent_past_the_lease_is_taken_from_a_talking_one_never",
    ),
    "gate/_lifecycle.py": (_CLAIMS, *_RULES, _ROUTES),
    "gate/_records.py": (
        _CLAIMS,
        "tests/vllm/test_previous_response_unit.py",
        *_RULES,
        "tests/vllm/test_stage_writer.py",
    ),
    "transfer/_weight_state.py": (*_RULES, "tests/vllm/test_weight_state.py"),
    "gate/_staging.py": ("tests/vllm/test_staging_unit.py", *_RULES, _ROUTES),
    "gate/_routing.py": (_ACCESS, *_RULES, "tests/vllm/test_hostile2_unit.py"),
    "control/_route_table.py": (
        _ACCESS,
        "tests/vllm/test_hostile3_routes.py"
        "::test_b3_the_table_names_every_route_vllms_app_builder_mounts",
    ),
    "gate/_wire.py": (
        "tests/vllm/test_wire_unit.py",
        *_RULES,
        _APIS,
        "tests/vllm/test_hostile2_unit.py",
    ),
    "gate/_answers.py": ("tests/vllm/test_answers_unit.py", _APIS),
    "gate/_responses.py": ("tests/vllm/test_previous_response_unit.py", _APIS),
    "fingerprints.py": (*_RULES, _PLANNING, _ADMISSION, "tests/vllm/test_images_unit.py"),
    "gate/_planning/_index.py": (_PLANNING, *_RULES, _ROUTES),
    "gate/_planning/_plan_text.py": (_PLANNING, *_RULES, _ADMISSION),
    "gate/_planning/_plan_ids.py": (_PLANNING, *_RULES, _MISTRAL),
    "gate/_planning/_splice.py": (_PLANNING, *_RULES, _ADMISSION),
    "gate/_planning/_render_text.py": (_RENDER, _PLANNING, *_RULES, _ADMISSION, _MISTRAL),
    "gate/_planning/_render_ids.py": (_RENDER, _PLANNING, *_RULES, _MISTRAL),
    "transfer/_direct_plan.py": ("tests/vllm/test_direct_plan_unit.py",),
    "gate/_options.py": ("tests/vllm/test_serve_options.py",),
    "gate/_metrics.py": ("tests/vllm/test_metrics_unit.py",),
}
"""The engine-free tests (files, or one test of a file that also starts engines) that exercise
each module; a module none exercises keeps every mutant (``--all-tests``: every one)."""
ENGINE_FREE_TESTS = tuple(dict.fromkeys(t for tests in EXERCISING.values() for t in tests))
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
    """Whether the tests pass against the package copy under ``copy`` (no test: they pass)."""
    if not tests:
        return True, "no engine-free test exercises this module"
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
