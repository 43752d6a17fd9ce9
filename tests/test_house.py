"""The house rules a newcomer relies on: no import circle, the command line on top, and
the guides' tour (docs/guide/layout.md) naming every module, read from the source with
nothing imported. Modules are split by concept and functions kept short by review, not
by a line count: a cap had functions fitted to it (``tests/test_step.py`` counts the
frames from the Estimator to the model instead)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "datasets", "models")


def _files(*folders: str) -> list[pathlib.Path]:
    return sorted(f for folder in folders for f in (ROOT / folder).rglob("*.py"))


def _module(path: pathlib.Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imports() -> dict[str, set[str]]:
    """Each module's imports of the project's modules, wherever in it they are."""
    modules = {_module(path): path for path in _files(*PACKAGES)}
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    graph[name].add(sub if sub in modules else node.module)
        graph[name] -= {name, *PACKAGES}  # a package's lazy names are not a circle
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as the modules along it, or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = "open"
        path.append(name)
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other) :] + [other]
            if other not in state and (found := visit(other)):
                return found
        state[name] = "done"
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state and (found := visit(name)):
            return found
    return None


def test_no_module_imports_one_that_imports_it_back():
    graph = _imports()
    assert len(graph) > 60  # the modules were found
    assert "trainer.exit_codes" in graph["trainer.cli.flags"]
    assert _circle(graph) is None, " -> ".join(_circle(graph))


def test_the_command_line_is_the_top_layer():
    """Nothing below the command line imports it: the library, the distributed runtime
    and the datasets work without it (the ``python -m trainer`` entry point aside, and
    ``python -m datasets.chat.reference``, which reads an experiment's gin as it does)."""
    graph = _imports()
    commands = {"trainer.__main__", "datasets.chat.reference"}
    below = [
        f"{name} imports {sorted(m for m in imported if m.startswith('trainer.cli'))}"
        for name, imported in graph.items()
        if not name.startswith("trainer.cli") and name not in commands
        if any(m.startswith("trainer.cli") for m in imported)
    ]
    assert graph["trainer.__main__"] == {"trainer.cli.flags"}  # the modules were read
    assert not below, below


def test_tests_share_code_through_the_support_package_only():
    """A test imports ``tests.support`` (and gets fixtures from conftest), never another
    test module or conftest, in its own process or the ones it starts."""
    found = []
    for path in _files("tests"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = re.findall(r"\btests\.[\w.]+", node.value)  # a subprocess's module
            else:
                continue
            found += [
                f"{path.relative_to(ROOT)}: {name}"
                for name in names
                if re.match(r"tests\.(conftest|test_)", name)
            ]
    assert len(_files("tests/support")) > 10  # the package was read
    assert not found, found


def test_a_circle_is_found():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_the_guides_tour_names_every_module_of_the_framework():
    tour = (ROOT / "docs" / "guide" / "layout.md").read_text()
    named, package = set(), ""
    for line in tour.splitlines():  # " group" or " package/" headings, "  module.py" under them
        heading = re.match(r"^ (\S+)", line)
        if heading:
            package = heading.group(1) if heading.group(1).endswith("/") else ""
        elif found := re.match(r"^  (\w+\.py)\b", line):
            named.add(package + found.group(1))
    trainer = ROOT / "trainer"
    modules = {p.relative_to(trainer).as_posix() for p in _files("trainer")}
    modules = {m for m in modules if not m.endswith(("__init__.py", "__main__.py"))}
    assert "distributed/placement.py" in modules and "step.py" in modules
    assert modules <= named, f"not in the tour (docs/guide/layout.md): {sorted(modules - named)}"
    for package in ("models", "datasets"):  # one entry each, its modules listed in prose
        entry = re.search(rf"^{package}/ +(.*?)\n(?=\S)", tour, re.M | re.S).group(1)
        files = {p.name for p in _files(package)} - {"__init__.py"}
        missing = sorted(f for f in files if not re.search(rf"\b{re.escape(f)}\b", entry))
        assert len(files) > 8 and not missing, f"{package}/ in the tour lacks {missing}"


def test_the_readme_stays_a_front_page():
    """README.md is what this is, five minutes, and where the rest is: a subject of its
    own (text and sequences regrew it to 315 lines) is a guide under docs/guide/."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 300, f"README.md is {lines} lines: move a subject into a guide, docs/guide/"
