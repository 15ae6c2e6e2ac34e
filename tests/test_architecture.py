"""The package's shape, as docs/architecture.md draws it: layers that only import downwards, no
import circles, and backend knowledge in one place (``storage/backends/``).

Read from the source with ``ast`` (every import, also those inside functions), so a lazy import
that closes a circle or reaches up a layer is caught as well as a top-level one.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dcp_fsspec"
# Bottom up. A module may import from its own layer and the ones below it, never above.
LAYERS = {
    "errors": 0,
    "storage": 1,
    "checkpoint": 2,
    "tools": 3,
    "integrations": 3,
    "cli": 4,
    "demo": 4,
    "local_s3": 4,
    "__main__": 4,
}
# Training frameworks: only dcp_fsspec.integrations may import them, and nothing imports it.
FRAMEWORKS = (
    "lightning",
    "pytorch_lightning",
    "transformers",
    "accelerate",
    "torchtitan",
    "torch_checkpointing",
    "ray",
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (resolving relative imports), anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("dcp_fsspec."):
                out.add(target)
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    modules = _modules()
    upward = [
        f"{name} → {target}"
        for name, path in modules.items()
        for target in _imports(name, path, modules)
        if _layer(name) is not None and _layer(target) is not None and _layer(target) > _layer(name)  # type: ignore[operator]
    ]
    assert not upward, f"imports reaching up a layer (storage ← checkpoint ← tools ← CLI): {upward}"


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # A package's __init__ re-exports its modules; it is not a dependency of them.
    graph = {n: {t for t in targets if not n.startswith(t + ".")} for n, targets in graph.items()}
    circles = []
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if modules[nxt].name == "__init__.py":
                continue  # importing a package's public names, not a module cycle
            if state.get(nxt) == 1:
                circles.append(" → ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not circles, f"import circles: {circles}"


def test_backend_type_tests_and_driver_types_live_only_in_storage_backends_and_driver_errors() -> None:
    backend_specific = re.compile(
        r"_call_s3|call_s3|LocalFileSystem|\.protocol\b|\"sftp\"|\"memory\"|is_s3fs"
        r"|(from|import) (botocore|aiohttp)|[\"'](botocore|aiohttp)[.\"']"  # a driver's own types
    )
    outside = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if "backends" not in path.relative_to(PACKAGE).parts and path.name != "driver_errors.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if backend_specific.search(line) and not line.lstrip().startswith("#")
    ]
    assert not outside, (
        "backend knowledge outside storage/backends/ and storage/driver_errors.py:\n" + "\n".join(outside)
    )


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """An import circle that ``ast`` cannot see (through a package's ``__init__``) fails only
    when a particular module is imported first, as DCP's process executor does with ours."""
    import subprocess
    import sys
    import textwrap

    check = textwrap.dedent(
        """
        import importlib, sys
        failed = []
        for name in sys.argv[1:]:
            for loaded in [m for m in sys.modules if m == "dcp_fsspec" or m.startswith("dcp_fsspec.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except Exception as e:
                # An integration whose framework is not installed says so; that is its contract.
                if not (name.startswith("dcp_fsspec.integrations.") and type(e).__name__ == "MissingDriverError"):
                    failed.append(f"{name}: {type(e).__name__}: {e}")
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
        """
    )
    names = sorted(n for n in _modules() if not n.endswith("__main__"))
    done = subprocess.run(
        [sys.executable, "-c", check, *names], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def _external_imports(path: Path) -> set[str]:
    """The top-level names of the packages outside ours that ``path`` imports, anywhere."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.partition(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
            "require",
            "import_module",
        ):
            out |= {
                a.value.partition(".")[0]
                for a in node.args[:1]
                if isinstance(a, ast.Constant) and isinstance(a.value, str)
            }
    return out


def test_only_the_integrations_import_a_training_framework_and_nothing_imports_them() -> None:
    modules = _modules()
    framework_users = [
        f"{name} imports {sorted(set(FRAMEWORKS) & _external_imports(path))}"
        for name, path in modules.items()
        if not name.startswith("dcp_fsspec.integrations") and set(FRAMEWORKS) & _external_imports(path)
    ]
    assert not framework_users, f"a framework imported outside dcp_fsspec.integrations: {framework_users}"
    importers = [
        f"{name} → {target}"
        for name, path in modules.items()
        if not name.startswith("dcp_fsspec.integrations")
        for target in _imports(name, path, modules)
        if target.startswith("dcp_fsspec.integrations")
    ]
    assert not importers, f"the package or CLI imports an integration: {importers}"


def test_the_public_names_are_one_list_that_the_type_checkers_imports_match() -> None:
    import dcp_fsspec

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    imported = {
        alias.asname or alias.name for n in guarded.body if isinstance(n, ast.ImportFrom) for alias in n.names
    }
    assert imported == set(dcp_fsspec._EXPORTS)
    assert dcp_fsspec.__all__ == sorted([*dcp_fsspec._EXPORTS, "__version__"])
    for name in dcp_fsspec._EXPORTS:  # each resolves, from the module the list names
        assert getattr(dcp_fsspec, name) is not None


def _drawn_modules(page: str) -> set[str]:
    """The module paths the tree in docs/architecture.md draws, relative to the package."""
    block = page.split("```text\ndcp_fsspec/\n", 1)[1].split("```", 1)[0]
    drawn, folders = set(), []
    for line in block.splitlines():
        match = re.match(r"^((?:│   |    )*)(?:├── |└── )(\S+)", line)
        assert match, f"not a line of the tree: {line!r}"
        depth, name = len(match[1]) // 4, match[2]
        folders[depth:] = [name.rstrip("/")]
        if name.endswith(".py"):
            drawn.add("/".join(folders))
    return drawn


def test_the_architecture_page_draws_every_module_where_it_lives_and_no_other() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    actual = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    drawn = _drawn_modules(page)
    assert drawn == actual, f"not drawn: {sorted(actual - drawn)}; drawn but gone: {sorted(drawn - actual)}"


def test_every_sub_package_says_what_it_owns_and_no_folder_is_crowded() -> None:
    for init in PACKAGE.rglob("__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), f"{init.parent} has no docstring"
        modules = [p for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= 14, f"{init.parent}: {len(modules)} modules; group them by what they do"
