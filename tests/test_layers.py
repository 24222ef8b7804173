"""The package's layers as the code imports them: every import goes down the layers' order
(LAYERS, docs/design.md), the host core runs without JAX, and no backend is chosen where it
would run in interpret mode."""

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


# The import order, top first: a module imports from its own layer and those below it only
# (docs/design.md, "Layers"). The engine asks and lower layers answer; where a lower layer must
# act on a higher one's behalf (the model's attention, a backend's kernels) the object is passed
# down, as model.attention.AttentionBackend is.
LAYERS = (
    ("front ends", ("jaxserve", "jaxserve.cli", "jaxserve.server", "jaxserve.llm",
                    "jaxserve.batch_file", "jaxserve.integrations")),
    ("tools", ("jaxserve.tools",)),
    ("engine", ("jaxserve.engine",)),
    ("runtime", ("jaxserve.runtime",)),
    ("backends", ("jaxserve.backends",)),
    ("model", ("jaxserve.model",)),
    ("host core and weights", ("jaxserve.core", "jaxserve.weights")),
    ("foundation", ("jaxserve.config", "jaxserve.pytree", "jaxserve.tokenizer", "jaxserve.chat",
                    "jaxserve.json_models", "pallas_kernels")),
)


def _layer(module: str) -> int:
    """The index in LAYERS of the longest prefix naming the module's package or module."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    assert rank is not None, f"{module} is in no layer of LAYERS"
    return rank


def _our_imports(path: pathlib.Path) -> set[str]:
    """The jaxserve and pallas_kernels modules a file imports (`from jaxserve import backends`
    names jaxserve.backends)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                module = sub if _is_module(sub) else node.module
                names.add(module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] in ("jaxserve", "pallas_kernels")}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_import_goes_down_the_layers():
    """The whole order of LAYERS, for every source file: nothing imports a layer above its own.
    So the model imports no backend, not even the registry (nothing below the runtime looks one
    up by name), and the host core imports neither the model nor the runtime."""
    sources = [*ROOT.glob("jaxserve/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py")]
    upward = []
    for path in sources:
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        rank = _layer(module)
        for name in _our_imports(path):
            if _layer(name) < rank:
                upward.append(f"{module} ({LAYERS[rank][0]}) imports {name} "
                              f"({LAYERS[_layer(name)][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_declared_dependencies_are_the_imported_ones():
    """pyproject's core dependencies are all imported by the package and its kernels, and what
    they import is declared: in the core, or in the bench, bench-reference, eval or ray extra
    (whose modules go through jaxserve.tools.require first, so a missing one names the
    extra)."""
    import importlib.metadata
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def canonical(name: str) -> str:
        return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[ ;]", name, 1)[0]).lower()

    declared = {canonical(d) for d in project["dependencies"]}
    extra = {canonical(d) for name in ("bench", "bench-reference", "eval", "ray")
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
