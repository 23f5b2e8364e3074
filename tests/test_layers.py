"""The layers import downwards only: errors < models < data < distributed < algorithms < engine < compat <
(train.py, bench, examples).

Every import is read from the source, those inside functions included, so a lazy import that runs back up (the
way an import cycle hides) fails here too.
"""

from __future__ import annotations

import ast

import pytest
from conftest import ROOT

LAYERS = ["errors", "models", "data", "distributed", "algorithms", "engine", "compat"]  # lowest first
TOP = ["train", "bench", "examples"]  # may import any layer; nothing imports them
PROJECT = set(LAYERS) | set(TOP)


def _layer_of(path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _project_imports(path) -> list[tuple[int, str]]:
    """(line, top-level package) of every import of a project package in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, name.split(".")[0]) for name in names if name.split(".")[0] in PROJECT]
    return found


SOURCES = sorted(
    p
    for p in [*ROOT.glob("*.py"), *(q for layer in LAYERS + TOP for q in (ROOT / layer).rglob("*.py"))]
    if _layer_of(p) in PROJECT
)


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_imports_only_its_own_layer_or_lower(path):
    layer = _layer_of(path)
    allowed = {*LAYERS, layer} if layer in TOP else set(LAYERS[: LAYERS.index(layer) + 1])
    wrong = [f"line {line}: imports {name}" for line, name in _project_imports(path) if name not in allowed]
    assert not wrong, f"{path.relative_to(ROOT)} ({layer}) may import only {sorted(allowed)}: {wrong}"


def test_every_layer_is_read():
    layers = {_layer_of(p) for p in SOURCES}
    assert set(LAYERS) <= layers and "train" in layers
    assert any(name == "engine" for p in SOURCES for _, name in _project_imports(p))  # the reader finds imports


def _modules(path) -> list[tuple[int, str]]:
    """(line, full module name) of every absolute import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


STDLIB = set(__import__("sys").stdlib_module_names)


@pytest.mark.parametrize("path", sorted((ROOT / "distributed").rglob("*.py")), ids=lambda p: p.name)
def test_the_distributed_layer_imports_only_torch(path):
    """Membership, store agreement, counted communication and topologies sit under the engine and the plugins."""
    allowed = STDLIB | {"torch", "__future__", "distributed"}
    wrong = [f"line {n}: {m}" for n, m in _modules(path) if m.split(".")[0] not in allowed]
    assert not wrong, f"{path.relative_to(ROOT)} may import only torch, the standard library and itself: {wrong}"


@pytest.mark.parametrize("path", sorted((ROOT / "engine").rglob("*.py")), ids=lambda p: p.name)
def test_the_engine_imports_from_algorithms_only_the_contract(path):
    """The engine never reaches into a plugin: it knows the contract (``algorithms.base``), and builds the plugin
    the config names through Hydra."""
    wrong = [f"line {n}: {m}" for n, m in _modules(path) if m.startswith("algorithms") and m != "algorithms.base"]
    assert not wrong, f"{path.relative_to(ROOT)} imports plugin modules: {wrong}"
