"""The house rules a newcomer relies on: short functions, no import circle, and README's
tour naming every module (read from the source, nothing imported). Modules are split by
concept, not by a line count (the step is one module)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "datasets", "models")
BODY_LINES, ESTIMATOR_LINES = 60, 350


def _files(*folders: str) -> list[pathlib.Path]:
    return sorted(f for folder in folders for f in (ROOT / folder).rglob("*.py"))


def _module(path: pathlib.Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end."""
    body = node.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1] if has_doc and len(body) > 1 else body[0]
    return node.end_lineno - first.lineno + 1


def test_functions_stay_short():
    too_long = []
    for path in _files(*PACKAGES, "benchmarks"):
        text = path.read_text()
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if _body_lines(node) > BODY_LINES:
                    too_long.append(f"{where}:{node.lineno} {node.name}: {_body_lines(node)}")
            if isinstance(node, ast.ClassDef) and node.name == "Estimator":
                lines = node.end_lineno - node.lineno + 1
                if lines > ESTIMATOR_LINES:
                    too_long.append(f"{where}: class Estimator {lines} lines")
    assert not too_long, f"over {BODY_LINES} lines a body: {too_long}"


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
    assert "trainer.cli.exit_codes" in graph["trainer.cli.flags"]
    assert _circle(graph) is None, " -> ".join(_circle(graph))


def test_a_circle_is_found():
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None


def test_readmes_tour_names_every_module_of_the_framework():
    readme = (ROOT / "README.md").read_text()
    tour = readme[readme.index("## Where things live") :]
    tour = tour[: tour.index("\n## ", 1)]
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
    assert modules <= named, f"not in README's tour: {sorted(modules - named)}"
