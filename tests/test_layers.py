"""The layers import one way (ARCHITECTURE.md): platform -> architectures -> runtime -> leaves.

Every `import` in a module counts, also one under `TYPE_CHECKING` or inside
a function: a reader follows them all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import rlfabric

PACKAGE = Path(rlfabric.__file__).parent

#: Layer of each top-level subpackage or module of `rlfabric`; higher may import lower.
LAYERS = {
    "platform": 3,
    "architectures": 2,
    "runtime": 1,
    "algorithms": 0,
    "sparse": 0,
    "models": 0,
    "envs": 0,
    "errors": 0,
    "observations": 0,
}
LEAVES = [name for name, rank in LAYERS.items() if rank == 0 and (PACKAGE / name).is_dir()]


def _imports(path: Path) -> list[str]:
    """Every module name `path` imports, absolute or relative, anywhere in the file."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
                base = ".".join(parts[: len(parts) - node.level])
                names.append(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                names.append(node.module)
    return names


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rlfabric" or len(parts) < 2:
        return None
    return parts[1]


def _modules() -> list[tuple[str, Path]]:
    return [
        (path.relative_to(PACKAGE).parts[0].removesuffix(".py"), path)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent != PACKAGE or path.name != "__init__.py"
    ]


def test_every_module_belongs_to_a_layer():
    assert {layer for layer, _ in _modules()} <= set(LAYERS)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_upward_import(layer):
    upward = []
    for owner, path in _modules():
        if owner != layer:
            continue
        for module in _imports(path):
            target = _layer_of(module)
            if target is not None and target in LAYERS and LAYERS[target] > LAYERS[layer]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_never_import_ray(leaf):
    offenders = [
        str(path.relative_to(PACKAGE))
        for owner, path in _modules()
        if owner == leaf and any(m == "ray" or m.startswith("ray.") for m in _imports(path))
    ]
    assert not offenders


def test_the_check_sees_an_upward_import(tmp_path):
    """The walker itself: a TYPE_CHECKING import and a relative one are both found."""
    source = tmp_path / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from rlfabric.platform.spec import ExperimentSpec\n"
        "def f():\n    import rlfabric.architectures\n"
    )
    assert _imports(source)[1:] == ["rlfabric.platform.spec", "rlfabric.architectures"]


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("rlfabric.runtime", ("rlfabric.platform", "rlfabric.architectures")),
        ("rlfabric.architectures", ("rlfabric.platform",)),
    ],
)
def test_importing_a_layer_loads_nothing_above_it(package, forbidden):
    code = (
        f"import sys, importlib, pkgutil; import {package} as p\n"
        "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
        "    importlib.import_module(m.name)\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert not [m for m in loaded if m.startswith(forbidden)]
