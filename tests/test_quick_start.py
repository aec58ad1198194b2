"""The README's Quick start as a newcomer pastes it: a clone, a virtual environment that every terminal
activates before it runs cbserve (a Debian or Ubuntu python3 refuses installs outside one), and a test
command that reports each stage (issue #36)."""

from __future__ import annotations

import pathlib
import re
import shlex
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEST_SCRIPT = ROOT / "scripts" / "test.sh"

Command = list[str]
Predicate = Callable[[Command], bool]


def quick_start_block() -> str:
    """The first bash block of the README's "## Quick start" section."""
    text = README.read_text()
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, flags=re.M | re.S)
    assert section, "README.md has no '## Quick start' section"
    block = re.search(r"^```bash\n(.*?)^```", section.group(1), flags=re.M | re.S)
    assert block, f"the Quick start section has no ```bash block:\n{section.group(1)}"
    return block.group(1)


def command_lines() -> list[list[Command]]:
    """Each line a user pastes, as its `&&`-joined commands (comments dropped)."""
    lines = []
    for line in quick_start_block().splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        commands: list[Command] = [[]]
        for word in words:
            if word == "&&":
                commands.append([])
            else:
                commands[-1].append(word)
        lines.append(commands)
    return lines


def only_line(description: str, predicate: Predicate) -> list[Command]:
    """The one pasted line with a command matching `predicate`."""
    lines = [line for line in command_lines() if any(predicate(command) for command in line)]
    assert len(lines) == 1, (
        f"expected one Quick start line that {description}, found {len(lines)}:\n"
        + "\n".join(render(line) for line in command_lines())
    )
    return lines[0]


def render(line: list[Command]) -> str:
    return " && ".join(shlex.join(command) for command in line)


def index_of(line: list[Command], wanted: str, predicate: Predicate) -> int:
    for index, command in enumerate(line):
        if predicate(command):
            return index
    raise AssertionError(f"this Quick start line does not {wanted}:\n{render(line)}")


def is_serve(command: Command) -> bool:
    return command == ["cbserve", "serve"]


def is_generate(command: Command) -> bool:
    return command[:2] == ["cbserve", "generate"]


def is_venv(command: Command) -> bool:
    return command[:3] == ["python3", "-m", "venv"] and len(command) == 4


def is_clone(command: Command) -> bool:
    return command[:2] == ["git", "clone"]


def enters(folder: str) -> Predicate:
    def predicate(command: Command) -> bool:
        return command == ["cd", folder]

    return predicate


def is_pip_install(command: Command) -> bool:
    return command[:4] == ["python3", "-m", "pip", "install"]


def activates(venv: str) -> Predicate:
    def predicate(command: Command) -> bool:
        return command in ([".", f"{venv}/bin/activate"], ["source", f"{venv}/bin/activate"])

    return predicate


def serve_line() -> list[Command]:
    return only_line("runs `cbserve serve`", is_serve)


def venv_of(line: list[Command]) -> str:
    return line[index_of(line, "make a virtual environment (python3 -m venv DIR)", is_venv)][3]


def clone_folder(line: list[Command]) -> str:
    """The folder `git clone URL` makes: the URL's last part without `.git`."""
    url = line[index_of(line, "git clone", is_clone)][-1]
    return url.rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")


def test_the_serve_line_clones_makes_a_venv_and_activates_it_before_installing() -> None:
    line = serve_line()
    folder, venv = clone_folder(line), venv_of(line)
    order = [
        ("git clone", index_of(line, "git clone", is_clone)),
        (f"cd {folder}", index_of(line, f"cd {folder}", enters(folder))),
        (f"python3 -m venv {venv}", index_of(line, "make a venv", is_venv)),
        (f". {venv}/bin/activate", index_of(line, f"activate {venv}", activates(venv))),
        ("python3 -m pip install", index_of(line, "pip install", is_pip_install)),
        ("cbserve serve", index_of(line, "cbserve serve", is_serve)),
    ]
    positions = [position for _, position in order]
    assert positions == sorted(positions), (
        f"expected the order {[name for name, _ in order]} in:\n{render(line)}"
    )


def test_every_pip_install_runs_inside_the_venv() -> None:
    line = serve_line()
    activation = index_of(line, "activate the venv", activates(venv_of(line)))
    early = [shlex.join(command) for command in line[:activation] if is_pip_install(command)]
    assert not early, f"pip installs before the venv is active (PEP 668 refuses them): {early}"


def test_the_second_terminal_enters_the_clone_and_activates_the_venv_before_calling_cbserve() -> None:
    setup = serve_line()
    folder, venv = clone_folder(setup), venv_of(setup)
    line = only_line("runs `cbserve generate`", is_generate)
    enter = index_of(line, f"cd {folder}", enters(folder))
    activation = index_of(line, f"activate {venv}", activates(venv))
    generate = index_of(line, "cbserve generate", is_generate)
    assert enter < activation < generate, (
        f"expected cd {folder}, then . {venv}/bin/activate, then cbserve in:\n{render(line)}"
    )


def test_the_test_command_is_one_line_after_the_serve_line() -> None:
    lines = command_lines()
    tests = [index for index, line in enumerate(lines) if ["./scripts/test.sh"] in line]
    assert len(tests) == 1, f"expected one ./scripts/test.sh line, found {len(tests)}:\n" + "\n".join(
        render(line) for line in lines
    )
    assert lines.index(serve_line()) < tests[0], "./scripts/test.sh comes before the line that installs"


def test_each_pasted_command_is_one_line() -> None:
    continued = [line for line in quick_start_block().splitlines() if line.rstrip().endswith("\\")]
    assert not continued, f"lines continued with a backslash: {continued}"


def test_the_test_command_reports_lint_types_stubs_buf_go_java_and_pytest_as_stages() -> None:
    stages = re.findall(r"^stage (?:--stream )?(\w+) ", TEST_SCRIPT.read_text(), flags=re.M)
    expected = ["install", "lint", "types", "stubs", "buf", "go", "java", "pytest"]
    assert stages == expected, f"scripts/test.sh runs the stages {stages}, expected {expected}"
