"""The package's layers as the code imports them: the host core runs without JAX, the model
imports no backend, and no backend is chosen where it would run in interpret mode."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_core_imports_without_jax():
    """Every jaxserve.core module imports in a process where `import jax` (and numpy's device
    cousins) fail."""
    modules = sorted(p.stem for p in (ROOT / "jaxserve" / "core").glob("*.py")
                     if p.stem != "__init__")
    assert {"scheduler", "kv_manager", "page_pool", "output_processor"} <= set(modules)
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "orbax"):
            raise ImportError(f"{{name}} is blocked in this test")
sys.meta_path.insert(0, Block())
import importlib
for m in {modules!r}:
    importlib.import_module("jaxserve.core." + m)
assert not any(n.split(".")[0] in ("jax", "jaxlib") for n in sys.modules), "jax was imported"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_model_imports_no_backend_and_core_no_runtime():
    """The model takes its backend as an object passed down (model.attention.AttentionBackend):
    it imports no backend, not even the registry, so nothing below the runtime looks one up by
    name."""
    for path in (ROOT / "jaxserve" / "model").glob("*.py"):
        upward = {m for m in _imports(path)
                  if m.startswith(("jaxserve.backends", "jaxserve.runtime", "jaxserve.engine"))
                  or m == "jaxserve"}
        assert not upward, f"{path.name} imports {upward}"
    for path in (ROOT / "jaxserve" / "core").glob("*.py"):
        upward = {m for m in _imports(path)
                  if m.startswith(("jaxserve.runtime", "jaxserve.engine", "jaxserve.model",
                                   "jaxserve.backends", "jaxserve.server"))}
        assert not upward, f"core/{path.name} imports {upward}"


def test_declared_dependencies_are_the_imported_ones():
    """pyproject's core dependencies are all imported by the package and its kernels, and what
    they import is declared: in the core, or in the bench, eval or ray extra (whose modules go
    through jaxserve.tools.require first, so a missing one names the extra)."""
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ;]", name, 1)[0]).lower()

    declared = {canonical(d) for d in project["dependencies"]}
    extra = {canonical(d) for name in ("bench", "eval", "ray")
             for d in project["optional-dependencies"][name]}
    owners = importlib.metadata.packages_distributions()
    imported, undeclared = set(), set()
    for path in [*ROOT.glob("jaxserve/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]:
        for name in _imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("jaxserve", "pallas_kernels"):
                continue
            assert top in owners, f"{path.name} imports {top}, which no installed package provides"
            dists = {canonical(d) for d in owners[top]}  # a module may ship in several
            imported |= dists
            if not dists & (declared | extra):
                undeclared.add(f"{top} ({path.name})")
    assert not declared - imported, f"declared, never imported: {declared - imported}"
    assert not undeclared, f"imported, not declared: {undeclared}"


def test_an_optional_dependency_that_is_missing_names_its_extra():
    from jaxserve.tools import MissingExtra, require

    with pytest.raises(MissingExtra, match=r"pip install 'jaxserve\[bench\]'"):
        require("jaxserve_no_such_module")


def test_no_source_file_over_450_lines():
    sources = [p for pattern in ("jaxserve/**/*.py", "pallas_kernels/**/*.py",
                                 "jaxserve/**/*.cc", "jaxserve/**/*.h")
               for p in ROOT.glob(pattern)]
    assert len(sources) > 40
    long = {str(p.relative_to(ROOT)): n for p in sources
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


def test_no_interpret_mode_by_accident(monkeypatch, caplog):
    """auto picks the device's own Pallas kernels, compiled, on GPU and TPU (xla on a GPU when
    the Triton kernels refuse the shapes); an explicit pallas interprets only on a CPU, logged,
    with the family pallas_kernels names; a foreign family on an accelerator is refused."""
    import logging

    import jax

    from jaxserve import backends

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert backends.resolve("auto", "bfloat16", head_dim=64, page_size=16) == "pallas-gpu"
    assert backends.resolve("auto", "bfloat16", head_dim=80, page_size=16) == "xla"
    assert backends.resolve("pallas") == "pallas-gpu"
    with pytest.raises(ValueError, match="never chosen on an accelerator"):
        backends.resolve("pallas", pallas_kernels="tpu")
    assert backends.resolve_dtype("auto") == "bfloat16"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert backends.resolve("auto", "bfloat16") == "pallas-tpu"
    assert backends.get("pallas-tpu").name == "pallas-tpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert backends.resolve_dtype("auto") == "float32"
    with caplog.at_level(logging.WARNING, logger="jaxserve.backends"):
        assert backends.resolve("pallas") == "pallas-tpu-interpret"
        assert backends.resolve("pallas", pallas_kernels="gpu") == "pallas-gpu-interpret"
    assert "interpret mode" in caplog.text
    for name in backends.PALLAS:
        assert backends.get(name).packed  # the entry point takes rows in any order
