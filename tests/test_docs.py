"""The documentation stays true to the repository: every relative link in README.md, docs/ and bench/ leads
to a file that exists (and, with an #anchor, to a heading of it), and docs/architecture.md's design map names
every source file under engine/ and service/, the engine's in the order of the layering test's map."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LAYERING_TEST = ROOT / "tests" / "engine" / "test_layering.py"
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")])
SOURCE_SUFFIXES = {".py", ".c"}
README_MAX_LINES = 300

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target); the text may hold inline code, never a nested bracket.
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
MAP_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, where a '#' starts a heading and brackets make links."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets GitHub's -1, -2, ... suffixes."""
    seen: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list[str]:
    links = []
    for line in prose_lines(path.read_text()):
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            links.append(definition.group(1))
            continue
        # A link's text may be inline code, so code spans are blanked only after the links are found...
        for match in INLINE_LINK.finditer(line):
            # ...and a link written inside a code span (an example, not a link) is skipped.
            spans = [span.span() for span in INLINE_CODE.finditer(line)]
            if any(start < match.start() < end for start, end in spans):
                continue
            links.append(match.group(1))
    return [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link, flags=re.I)]


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    broken = []
    for link in relative_links(path):
        target_text, _, anchor = link.partition("#")
        target = (path.parent / target_text).resolve() if target_text else path
        if not target.exists():
            broken.append(f"{link}: {shown(target)} is missing")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: {shown(target)} has no heading with the anchor #{anchor}")
    return broken


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    broken = broken_links(path)
    assert not broken, f"{path.relative_to(ROOT)} has links that lead nowhere:\n" + "\n".join(broken)


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    """The check itself: a link to a missing file, or to a heading the file does not have, is reported."""
    (tmp_path / "other.md").write_text("# Other\n\n## A heading, with `code`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#a-heading-with-code) [gone](missing.md) [no anchor](other.md#nowhere)\n"
        "[self](#page) `[in code](missing-too.md)`\n\n```\n[in a fence](missing-three.md)\n```\n"
    )
    assert [entry.split(":")[0] for entry in broken_links(page)] == ["missing.md", "other.md#nowhere"]


def test_the_readme_stays_short_enough_for_a_newcomer() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into docs/ and link it"
    )


def test_the_readme_links_every_document_in_docs() -> None:
    readme = ROOT / "README.md"
    linked = {(readme.parent / link.partition("#")[0]).resolve() for link in relative_links(readme)}
    unlinked = sorted(path.name for path in (ROOT / "docs").glob("*.md") if path.resolve() not in linked)
    assert not unlinked, f"README.md links no way to these documents in docs/: {unlinked}"


def design_map_files() -> list[str]:
    """The files the design map's tables name, in the order they appear."""
    text = ARCHITECTURE.read_text()
    section = re.search(r"^## Design map\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert section, "docs/architecture.md has no '## Design map' section"
    return [match.group(1) for line in section.group(1).splitlines() if (match := MAP_ROW.match(line))]


def source_files() -> set[str]:
    """Every .py and .c file under engine/ and service/, tracked or new."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in ("engine", "service")
        for path in (ROOT / package).rglob("*")
        if path.suffix in SOURCE_SUFFIXES and "__pycache__" not in path.parts
    }


def test_the_design_map_names_every_source_file_and_no_other() -> None:
    named = design_map_files()
    existing = source_files()
    missing = sorted(existing - set(named))
    stale = sorted(set(named) - existing)
    repeated = sorted({name for name in named if named.count(name) > 1})
    assert not (missing or stale or repeated), (
        "docs/architecture.md's design map is out of date:\n"
        f"  missing (add a row saying what each holds): {missing}\n"
        f"  named but not in the repository: {stale}\n"
        f"  named twice: {repeated}"
    )


def engine_layers() -> list[set[str]]:
    """`ENGINE_LAYERS` as tests/engine/test_layering.py writes it, read without importing the test module."""
    for node in ast.parse(LAYERING_TEST.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(target, ast.Name) and target.id == "ENGINE_LAYERS" for target in targets):
                assert node.value is not None
                return [set(layer) for layer in ast.literal_eval(node.value)]
    raise AssertionError(f"{LAYERING_TEST.relative_to(ROOT)} no longer defines ENGINE_LAYERS")


def module_of(file: str) -> str:
    """engine/kv/block_pool.py -> engine.kv.block_pool; a package's __init__.py is the package; a C source is
    the module of the same name that builds it."""
    parts = list(Path(file).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def test_the_design_map_lists_the_engine_bottom_up_in_the_layering_tests_order() -> None:
    layer_of = {module: index for index, layer in enumerate(engine_layers()) for module in layer}
    engine_rows = [
        (file, layer_of[module_of(file)])
        for file in design_map_files()
        if file.startswith("engine/") and module_of(file) in layer_of
    ]
    out_of_order = [
        f"{file} (layer {layer}) after {previous} (layer {previous_layer})"
        for (previous, previous_layer), (file, layer) in itertools.pairwise(engine_rows)
        if layer < previous_layer
    ]
    assert not out_of_order, (
        "docs/architecture.md lists engine files out of ENGINE_LAYERS' bottom-up order:\n"
        + "\n".join(out_of_order)
    )
