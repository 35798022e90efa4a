"""kvserve: an LLM inference and serving engine."""
from kvserve.config import EngineConfig
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from kvserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
