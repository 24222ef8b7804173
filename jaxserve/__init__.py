"""jaxserve: a JAX-native language-model serving engine.

    from jaxserve import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
"""

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.lora import LoRARequest
from jaxserve.core.outputs import CompletionOutput, RequestOutput
from jaxserve.core.sampling_params import SamplingParams


def __getattr__(name):
    # LLM and LLMEngine pull in JAX; import them lazily so `import jaxserve` stays cheap.
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    if name == "LLMEngine":
        from jaxserve.engine import LLMEngine

        return LLMEngine
    if name == "register_model":  # models from outside the tree (jaxserve/weights/custom.py)
        from jaxserve.weights.custom import register_model

        return register_model
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "register_model", "SamplingParams", "RequestOutput",
           "CompletionOutput", "EngineConfig", "LoRARequest", "ModelConfig"]
