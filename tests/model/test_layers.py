"""Every module of ``src/moeserve`` sits in a layer of the import contract (pyproject.toml,
``[tool.importlinter]``, checked by ``lint-imports`` in CI): a new top-level module or package
must be placed in the order, or the contract would not look at it."""

import tomllib
from pathlib import Path

import moeserve

ROOT = Path(moeserve.__file__).parent
PYPROJECT = ROOT.parents[1] / "pyproject.toml"


def contracts() -> dict[str, dict]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def layer_names() -> list[str]:
    layers = contracts()["layers"]["layers"]
    return [name.strip() for layer in layers for name in layer.split("|")]


def top_level_modules() -> set[str]:
    names = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return names


def test_every_module_is_in_a_layer():
    names = layer_names()
    assert len(names) == len(set(names)), "a module is listed in two layers"
    missing = top_level_modules() - set(names)
    assert not missing, f"not in any layer of pyproject.toml's import contract: {sorted(missing)}"
    stale = set(names) - top_level_modules()
    assert not stale, f"layers name modules that do not exist: {sorted(stale)}"


def test_kernels_are_the_bottom_layer():
    assert contracts()["layers"]["layers"][-1] == "kernels"
    forbidden = set(contracts()["kernels-are-leaves"]["forbidden_modules"])
    assert forbidden == {f"moeserve.{n}" for n in top_level_modules() - {"kernels", "__main__"}}
