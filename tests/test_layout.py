"""The package's shape: one installed namespace (``icr``), imports that point one way (the server
reaches no training loop, objective or analysis code, not even lazily), and a README that lists every
registered objective."""

from __future__ import annotations

import ast
import itertools
import re
import runpy
from pathlib import Path

import pytest
from typer.testing import CliRunner

import icr
from icr.training.losses import load_all

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("core", "training", "index", "service")
# What the server must never import: the training loop and its entry points, the objectives, target
# decoding (LTD/ITD), the analysis tools, the import of stock models, the CLI and the benchmarks.
NOT_FOR_THE_SERVER = (
    "icr.training.train",
    "icr.training.cli.train",
    "icr.training.losses",
    "icr.training.target_decoding",
    "icr.training.analysis",
    "icr.training.cli.evaluate",
    "icr.training.cli.model",
    "icr.training.pretrained_import",
    "icr.cli",
    "icr.demo",
    "bench",
)


def _source(module: str) -> Path | None:
    """The file of a project module (``icr.service.main`` -> service/main.py), None for others."""
    parts = module.split(".")
    if parts[0] != "icr":
        return None
    base = ROOT / parts[1] if len(parts) > 1 and parts[1] in STAGES else ROOT / "icr"
    rest = parts[2:] if len(parts) > 1 and parts[1] in STAGES else parts[1:]
    path = base.joinpath(*rest)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """Every module an ``import`` anywhere in ``path`` names, at module level or inside a function;
    not those under ``if TYPE_CHECKING:``, which never run."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        for statement in node.body
        for inner in ast.walk(statement)
    }
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # submodules, if any
    return names


def _reachable(start: list[str]) -> dict[str, str]:
    """Every project module reachable by imports from ``start`` -> the module that first imports it."""
    seen: dict[str, str] = dict.fromkeys(start, "")
    todo = list(start)
    while todo:
        module = todo.pop()
        path = _source(module)
        if path is None:
            continue
        names = _imports(path)
        for name in sorted(names):
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)]
            for target in parents:  # importing a.b.c runs a/__init__ and a/b/__init__ too
                if target not in seen and (_source(target) is not None or target.split(".")[0] == "bench"):
                    seen[target] = module
                    todo.append(target)
    return seen


# Which package may import which, lazily or not: an allow-list. The core is what every stage may use;
# training reaches nothing above it, the index no server code. ``icr`` is the CLI, the demo and the
# client (which reads the service's schemas); bench and the tests may import anything.
ALLOWED = {
    "icr.core": set(),
    "icr.training": {"icr.core"},
    "icr.index": {"icr.core", "icr.training"},
    "icr.service": {"icr.core", "icr.training", "icr.index"},
    "icr.client": {"icr.service"},
    "icr": {"icr.core", "icr.training", "icr.index", "icr.service", "bench"},
}


def _modules() -> dict[str, Path]:
    """Every module of the project (installed namespace and bench) -> its file."""
    out = {}
    for folder, prefix in [*((s, f"icr.{s}") for s in STAGES), ("icr", "icr"), ("bench", "bench")]:
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((prefix, *parts)).removesuffix(".__init__")
            out[name] = path
    return out


def _package(module: str) -> str:
    """The package an import belongs to for the allow-list: a stage, the client, the rest of icr."""
    parts = module.split(".")
    if parts[0] == "bench":
        return "bench"
    if len(parts) > 1 and parts[1] in (*STAGES, "client"):
        return f"icr.{parts[1]}"
    return "icr"


def test_every_import_between_packages_is_on_the_allow_list() -> None:
    bad = []
    for module, path in _modules().items():
        if module.startswith("bench"):
            continue
        source = _package(module)
        for name in _imports(path):
            if name.split(".")[0] not in ("icr", "bench"):
                continue
            target = _package(name)
            if target != source and target not in ALLOWED[source]:
                bad.append(f"{module} imports {name}")
    assert not bad, "imports off the allow-list:\n" + "\n".join(sorted(bad))


def _graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (at module level or inside a function)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in _imports(path):
            # ``from a.b import c``: the module a.b.c if it exists, else a.b
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_even_through_lazy_imports() -> None:
    """Not even a package's ``__init__`` and one of its modules; imports under ``TYPE_CHECKING``
    (annotations only) are not edges."""
    assert _cycles(_graph()) == []


def test_architecture_names_every_module() -> None:
    """docs/ARCHITECTURE.md's "Every module" tables list each module by its path."""
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for path in _modules().values()
        if path.name != "__init__.py" and f"`{path.relative_to(ROOT)}`" not in doc
    ]
    assert not missing, "add these to docs/ARCHITECTURE.md (Every module): " + ", ".join(sorted(missing))


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_server_reaches_no_training_loop_objective_or_analysis_even_lazily() -> None:
    server = [
        "icr.service." + ".".join(p.relative_to(ROOT / "service").with_suffix("").parts)
        for p in (ROOT / "service").rglob("*.py")
    ]
    reached = _reachable([m.removesuffix(".__init__") for m in server])
    bad = {m: by for m, by in reached.items() if m.startswith(NOT_FOR_THE_SERVER)}
    assert not bad, f"the server imports (module: imported by) {bad}"
    assert "icr.training.models" in reached  # the closure is real: the server does embed queries


def test_the_closure_finds_a_lazy_import(tmp_path, monkeypatch) -> None:
    """The check above would see an import hidden inside a function."""
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "__init__.py").write_text("")
    (tmp_path / "service" / "x.py").write_text("def f():\n    from icr.training.losses import base\n")
    (tmp_path / "training" / "losses").mkdir(parents=True)
    for name in ("training/__init__.py", "training/losses/__init__.py", "training/losses/base.py"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    reached = _reachable(["icr.service.x"])
    assert reached["icr.training.losses.base"] in ("icr.service.x", "icr.training.losses")


def test_only_the_icr_namespace_is_installed(monkeypatch) -> None:
    """setup.py's packages: everything under icr., every stage subpackage included, data files too."""
    import setuptools

    given: dict = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: given.update(kwargs))
    monkeypatch.chdir(ROOT)  # setuptools runs setup.py from the project folder
    runpy.run_path(str(ROOT / "setup.py"))
    packages, package_dir = given["packages"], given["package_dir"]
    assert {p.split(".")[0] for p in packages} == {"icr"}
    on_disk = {
        "icr." + ".".join(p.parent.relative_to(ROOT).parts)
        for stage in STAGES
        for p in (ROOT / stage).rglob("__init__.py")
    }
    assert on_disk <= set(packages), on_disk - set(packages)  # no subpackage left out
    assert not any(p.startswith(("icr.bench", "icr.tests", "icr.api_tests")) for p in packages)
    for package, folder in package_dir.items():
        assert (ROOT / folder / "__init__.py").is_file(), (package, folder)
    assert given["package_data"] == {
        "icr": ["demo_weights/*"],
        "icr.training": ["configs/*.toml"],
        "icr.service": ["static/*"],
    }
    assert {p.name for p in (ROOT / "icr" / "demo_weights").iterdir()} == {
        "SHIPPED.json",
        "config.json",
        "model.safetensors",
    }


def test_version_and_the_training_entry_point() -> None:
    from icr.cli import app
    from icr.training.cli import train as train_cli

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"icr {icr.__version__}"
    assert callable(train_cli.main)  # torchrun -m icr.training.cli.train


def test_the_readme_lists_every_registered_objective() -> None:
    section = (ROOT / "README.md").read_text().split("### Objectives", 1)
    if len(section) < 2:
        pytest.fail("README.md has no '### Objectives' section")
    lines = section[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| name |"))  # the first table
    table = list(itertools.takewhile(lambda line: line.startswith("|"), lines[start:]))
    listed = {m.group(1) for line in table if (m := re.match(r"\| `(\w+)` \|", line))}
    assert listed == set(load_all()), (
        f"README only: {listed - set(load_all())}; registry only: {set(load_all()) - listed}"
    )
