"""The shape the engine and the service keep so that a change stays local: classes and functions short
enough to read whole, a request's status written in one place, a runner that knows only what the scheduler
hands it, and an engine whose top level is a handful of modules beside its packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FILES = sorted([*(ROOT / "engine").rglob("*.py"), *(ROOT / "service").rglob("*.py")])

MAX_CLASS_LINES = 450
MAX_FUNCTION_LINES = 80
# A Triton kernel is one function by nature (it compiles to one GPU program), and the CLI's argument table is
# a list of flags, not logic.
LONG_BY_NATURE = {
    ("engine/runner/paged_attention_kernel.py", "_paged_attention_kernel"),
    ("service/cli.py", "_parser"),
}
MAX_ENGINE_TOP_LEVEL_MODULES = 12


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@pytest.mark.parametrize("path", SOURCE_FILES, ids=_relative)
def test_no_class_or_function_is_longer_than_one_can_read_whole(path: Path) -> None:
    """Spans count from the first line to the last, docstrings included."""
    too_long = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit = MAX_FUNCTION_LINES
        else:
            continue
        span = node.end_lineno - node.lineno + 1 if node.end_lineno is not None else 0
        if span > limit and (_relative(path), node.name) not in LONG_BY_NATURE:
            too_long.append(f"{node.name} (line {node.lineno}): {span} lines, at most {limit}")
    assert not too_long, f"{_relative(path)}: {too_long}"


def _status_assignments(path: Path) -> list[str]:
    found = []
    for node in ast.walk(_tree(path)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == "status":
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
    return found


@pytest.mark.parametrize("path", SOURCE_FILES, ids=_relative)
def test_only_engine_request_writes_a_request_status(path: Path) -> None:
    """`Request.finish` and the transitions beside it in engine/request.py are the one place a status changes:
    every ending (a stop, a cancel, a failure) goes through them."""
    if _relative(path) == "engine/request.py":
        return
    assert not _status_assignments(path), f"{_relative(path)} writes a status: {_status_assignments(path)}"


RUNNER_FILES = sorted((ROOT / "engine" / "runner").rglob("*.py"))


@pytest.mark.parametrize("path", RUNNER_FILES, ids=_relative)
def test_the_runner_reads_no_kv_cache_manager(path: Path) -> None:
    """The runner builds its inputs from the scheduler's output alone (block ids included), so a
    tensor-parallel follower can run a broadcast SchedulerOutput without a cache manager of its own."""
    names = {
        node.id if isinstance(node, ast.Name) else node.attr
        for node in ast.walk(_tree(path))
        if isinstance(node, (ast.Name, ast.Attribute))
    }
    imported = {
        node.module for node in ast.walk(_tree(path)) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "engine.kv.cache_manager" not in imported, f"{_relative(path)} imports engine.kv.cache_manager"
    assert not names & {"KVCacheManager", "kv_cache_manager"}, f"{_relative(path)} reads a KVCacheManager"


def test_the_engine_top_level_is_a_handful_of_modules_beside_its_packages() -> None:
    modules = sorted(path.name for path in (ROOT / "engine").glob("*.py"))
    assert len(modules) <= MAX_ENGINE_TOP_LEVEL_MODULES, (
        f"engine/ has {len(modules)} modules at its top level, at most {MAX_ENGINE_TOP_LEVEL_MODULES}: "
        f"{modules}; put the new one in the package whose job it shares"
    )
