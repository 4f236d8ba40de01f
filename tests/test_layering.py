"""An op family's sources stand in one order, each importing only what is below it: the
pure-PyTorch reference (pyext/reference/), the Triton kernel that checks its launch configs
against it (pyext/kernels/), then the op (pyext/ops/) that registers both as backends. An
import back up, from a kernel or a reference into the op layer, would close a circle."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(folder: str) -> list[str]:
    """The .py files of a package folder under pyext/, as paths from the repository root."""
    names = sorted(n for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith(".py"))
    assert names, f"{folder} holds no Python files"
    return [f"{folder}/{n}" for n in names]


def _imported(path: str) -> set[str]:
    """Every module an import statement of the file names, at any depth (imports inside functions
    too): `from a import b` names a and a.b, since b may be a module; relative imports resolved."""
    package = os.path.dirname(path).replace("/", ".")
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:  # relative: the file's package, one package up for each further dot
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _taken_from(paths: list[str], *packages: str) -> list[str]:
    return [f"{path} imports {name}" for path in paths for name in sorted(_imported(path))
            if any(name == p or name.startswith(p + ".") for p in packages)]


def test_kernels_import_nothing_from_the_ops():
    assert _taken_from(_modules("pyext/kernels"), "pyext.ops") == []


def test_references_import_nothing_from_the_ops_or_the_kernels():
    assert _taken_from(_modules("pyext/reference"), "pyext.ops", "pyext.kernels") == []
