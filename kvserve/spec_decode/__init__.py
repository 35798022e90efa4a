"""Speculative decoding: a cheap proposer drafts tokens, the target model verifies them all in one step.

config.py       SpeculativeConfig (vLLM's field names), parsed and validated
ngram.py        the prompt-lookup proposer
speculator.py   per step and per request: who drafts, and the acceptance counters
verify.py       which drafts a step's sampled tokens accept (exact for greedy and sampling)
"""
