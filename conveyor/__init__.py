"""conveyor: an LLM serving engine where batching is a verb.

``from conveyor import LLM, SamplingParams``. The torch-backed names load lazily so that the pure-Python core can
be imported (and tested) without torch.
"""

from conveyor.core.lora_request import LoRARequest
from conveyor.core.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from conveyor.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from conveyor.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("RequestOutput", "CompletionOutput"):
        from conveyor.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
