"""Speculative decoding: a cheap proposer drafts tokens, the target model verifies them all in one step.

config.py          SpeculativeConfig (vLLM's field names), parsed and validated
ngram.py           the prompt-lookup proposer
suffix.py          suffix decoding (method "suffix", or in front of a model): drafts from the sequence's own text
                   and earlier requests' responses
speculator.py      per step and per request: who drafts, and the acceptance counters
draft_length.py    how many draft tokens each sequence's step carries: what pays at the measured step times
confidence.py      the eagle head's calibrated confidence, which sizes a tree's rows
state.py           a sequence's speculative state (acceptance, what the draft has cached, the head's input)
draft_model.py     method "draft": loading the draft (a draft checkpoint over the target's embedding, or any model)
draft_proposer.py  running the draft over its own KV pool, sampling drafts with the target's noise
draft_format.py    the draft checkpoint file that benchmarks/train_draft.py writes
draft_reference.py the draft's forward in plain torch (training, and the tests' reference)
eagle_head.py      method "eagle": a head that drafts from the target's hidden state (file, plain-torch
                   reference for training and tests, the engine's module, loading)
eagle_proposer.py  running the head on the hidden states the runner hands back
eagle_graphs.py    CUDA graphs of the head's drafting step
drafts/            the draft and the eagle head shipped for the default model
verify.py          which drafts a step's sampled tokens accept (exact for greedy and sampling)
"""
