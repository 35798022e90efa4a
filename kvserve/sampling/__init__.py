from kvserve.sampling.logprobs import compute_prompt_logprobs
from kvserve.sampling.sampler import Sampler, SamplerOutput, SamplingInputs, make_generator

__all__ = ["Sampler", "SamplerOutput", "SamplingInputs", "compute_prompt_logprobs", "make_generator"]
