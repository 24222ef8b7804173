"""The model with attention_backend="pallas" (interpret mode on CPU) or "cpu" (the C++ kernel)
produces the same greedy tokens as the XLA path on the default model. Interpret mode is slow:
short prompts, few tokens for Pallas."""

from __future__ import annotations

import pytest

from jaxserve.backends.cpu import kernels as cpu_kernels
from jaxserve.config import EngineConfig
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import LLMEngine

pytestmark = pytest.mark.slow  # every test runs the real default model


def _generate(loaded, backend, prompts, params, **options):
    engine = LLMEngine(EngineConfig.from_options(
        attention_backend=backend, num_pages=32, max_num_seqs=2, max_num_batched_tokens=64,
        enable_prefix_caching=False, **options), loaded)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[i] for i in ids], engine.backend.name


@pytest.mark.parametrize("family", ["tpu", "gpu"])
def test_pallas_greedy_equals_xla(default_loaded, family):
    """Each family's ragged_paged_attention, interpreted, in the engine's packed steps: a
    prefill of two prompts, then decode rows (G = 3 query heads per KV head, head dim 64)."""
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    xla, xla_name = _generate(default_loaded, "xla", prompts, params)
    pallas, pallas_name = _generate(default_loaded, "pallas", prompts, params,
                                    pallas_kernels=family)
    assert (xla_name, pallas_name) == ("xla", f"pallas-{family}-interpret")
    assert pallas == xla


@pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernel did not build")
def test_cpu_kernel_greedy_equals_xla_with_chunked_prefill(default_loaded):
    """Prompts longer than the 64-token step budget: prefill in chunks that attend earlier
    pages, then decode rows sharing steps with another request's prefill."""
    prompts = ["Once upon a time, " * 12, "The history of the Roman empire begins", "1, 2, 3,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    xla, _ = _generate(default_loaded, "xla", prompts, params)
    cpu, name = _generate(default_loaded, "cpu", prompts, params)
    assert name == "cpu"
    assert cpu == xla
