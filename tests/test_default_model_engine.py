"""The embedded default model (SmolLM2-135M-Instruct GGUF) through the whole engine, against
transformers loading the same GGUF file with its own code. The weights are dequantized
(quantization="none"): parity with a float reference stays exact. The default, 4-bit path is tested
against this float model in test_quantized_model.py."""
import inspect

import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name three colours."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain gravity in one line."}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", quantization="none", block_size=16, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf_reference(default_reference_model):
    return default_reference_model  # tests/conftest.py: transformers' own reading of the same GGUF file


def greedy_argmax(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache. (generate()'s min_new_tokens would mask EOS,
    which ignore_eos does not: it only keeps going past it.)"""
    # transformers 5 renamed the cache argument and output field to `cache` (past_key_values goes in 5.40)
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out, past, x = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(x, use_cache=True, **{name: past})
            past = getattr(res, name)
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out


def test_greedy_chat_matches_transformers_for_32_tokens(llm, hf_reference):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.chat(CHATS, params, use_tqdm=False)
    tok = llm.get_tokenizer()
    for conv, out in zip(CHATS, outs):
        ids = tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
        assert out.prompt_token_ids == ids and out.prompt == tok.apply_chat_template(conv)  # vLLM's prompt text
        assert out.outputs[0].token_ids == greedy_argmax(hf_reference, ids, 32)


def test_capital_of_france(llm):
    out = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"


def test_chat_continues_the_final_message_as_vllms_llm_chat(llm):
    """continue_final_message and chat_template_kwargs, LLM.chat's arguments in vLLM, had been missing."""
    start = "The capital of France is"
    conv = [CHATS[0][-1], {"role": "assistant", "content": start}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4), add_generation_prompt=False,
                   continue_final_message=True, use_tqdm=False)[0]
    assert out.prompt.endswith(start) and "Paris" in out.outputs[0].text   # the turn left open, and continued
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(conv, continue_final_message=True, use_tqdm=False)


def test_stop_string_cuts_text_before_it(llm):
    out = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32, stop=["Paris"]),
                   use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is "
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    kept = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32, stop=["Paris"],
                                             include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == "The capital of France is Paris"


def test_stops_wait_for_min_tokens(llm):
    """Neither a stop string nor a stop token id ends a sequence within its first min_tokens tokens."""
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=16)
    plain = llm.chat(CHATS[0], greedy, use_tqdm=False)[0].outputs[0]      # "The capital of France is Paris."
    capital = tok.encode(" capital", add_special_tokens=False)
    assert len(capital) == 1 and plain.token_ids[1] == capital[0]

    def run(**kw):
        return llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=16, **kw), use_tqdm=False)[0].outputs[0]

    early = run(stop=["capital"])
    assert early.finish_reason == "stop" and early.text == "The " and len(early.token_ids) == 2
    held = run(stop=["capital"], min_tokens=6)
    # "capital" arrives as token 2 (inside min_tokens) and never again: the answer runs on to EOS.
    assert len(held.token_ids) >= 6 and held.text == plain.text and held.stop_reason is None

    early_tok = run(stop_token_ids=capital)
    assert early_tok.finish_reason == "stop" and early_tok.stop_reason == capital[0] and len(early_tok.token_ids) == 2
    held_tok = run(stop_token_ids=capital, min_tokens=6)
    assert len(held_tok.token_ids) >= 6 and capital[0] not in held_tok.token_ids[:6]


def test_generate_text_prompts_and_token_prompts_agree(llm):
    tok = llm.get_tokenizer()
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0, max_tokens=8)
    by_text = llm.generate(prompt, params, use_tqdm=False)[0]
    by_ids = llm.generate([tok.encode(prompt)], params, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == tok.decode(by_text.outputs[0].token_ids)
    # vLLM's TextPrompt / TokensPrompt dicts, alone or in a list.
    by_dicts = llm.generate([{"prompt": prompt}, {"prompt_token_ids": tok.encode(prompt)}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_dicts] == [by_text.outputs[0].token_ids] * 2
    alone = llm.generate({"prompt": prompt}, params, use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == by_ids.outputs[0].token_ids
    for bad in ({"prompt": prompt, "prompt_token_ids": [1]}, {"text": prompt},
                {"prompt": prompt, "multi_modal_data": {}}):
        with pytest.raises(ValueError, match="dict prompt"):
            llm.generate([bad], params, use_tqdm=False)
    # numpy token ids are ids; a float or a missing prompt is named as what it is.
    as_numpy = llm.generate([np.array(tok.encode(prompt))], params, use_tqdm=False)[0]
    assert as_numpy.outputs[0].token_ids == by_ids.outputs[0].token_ids
    with pytest.raises(ValueError, match=r"prompt token ids must be integers, got 1.0 \(float\)"):
        llm.generate([[1.0, 2.0]], params, use_tqdm=False)
    for bad in (None, 5):
        with pytest.raises(TypeError, match="prompts must be a prompt"):
            llm.generate(bad, params, use_tqdm=False)
    # One prompt's ids as a tuple, a numpy array or a tensor (each id had been taken as a prompt of its own);
    # a 2-D array is a prompt per row; bytes are refused (their bytes would be taken as ids).
    ids = tok.encode(prompt)
    for one in (tuple(ids), np.array(ids), torch.tensor(ids), [np.int64(t) for t in ids]):
        outs = llm.generate(one, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [by_ids.outputs[0].token_ids], type(one)
    rows = llm.generate(np.array([ids, ids]), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in rows] == [by_ids.outputs[0].token_ids] * 2
    for bad in (prompt.encode(), [prompt.encode()], {"prompt": prompt.encode()}, [memoryview(prompt.encode())]):
        with pytest.raises(TypeError, match="got bytes"):
            llm.generate(bad, params, use_tqdm=False)
    with pytest.raises(TypeError, match="'prompt_token_ids' is token ids, got str"):
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt token ids must be integers, got 1.0 \(float\)"):
        llm.generate(torch.tensor([1.0, 2.0]), params, use_tqdm=False)  # one prompt, of floats
    assert not llm.engine.has_unfinished_requests()


def test_fields_set_after_construction_are_converted_and_checked_as_given_to_it(llm):
    """add_request only checked a SamplingParams: a temperature of 1e-9 set afterwards sampled at it (the
    constructor takes it as greedy), a stop string set as a str stopped at its first character, top_k = -1 was
    refused with a message that offers -1."""
    greedy = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    sp = SamplingParams(max_tokens=8, seed=0)
    sp.temperature = 1e-9
    assert llm.chat(CHATS[0], sp, use_tqdm=False)[0].outputs[0].token_ids == greedy.token_ids
    sp = SamplingParams(temperature=0, max_tokens=8)
    sp.top_k = -1
    assert llm.chat(CHATS[0], sp, use_tqdm=False)[0].outputs[0].token_ids == greedy.token_ids
    sp = SamplingParams(temperature=0, max_tokens=8)
    sp.stop = "Paris"
    out = llm.chat(CHATS[0], sp, use_tqdm=False)[0].outputs[0]
    assert out.text == "The capital of France is " and out.stop_reason == "Paris"
    sp.max_tokens = -1
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got -1"):
        llm.chat(CHATS[0], sp, use_tqdm=False)


def test_a_conversion_warning_is_given_once_a_call_not_once_a_prompt(llm, caplog):
    sp = SamplingParams(max_tokens=2)
    sp.temperature = 5e-3
    with caplog.at_level("WARNING", logger="kvserve.sampling_params"):
        assert len(llm.generate(["a", "b", "c"], sp, use_tqdm=False)) == 3
    assert sum("temperature 0.005 is below" in r.getMessage() for r in caplog.records) == 1


def test_cumulative_logprob_and_finished_as_in_vllm(llm):
    """CompletionOutput.cumulative_logprob: the sum of the returned tokens' logprobs where logprobs were asked
    for (None else); finished() a method."""
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=6, n=2, logprobs=2)
    for c in llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs:
        assert c.finished() and len(c.logprobs) == len(c.token_ids)
        assert c.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)))
        assert c.cumulative_logprob < 0
    plain = llm.generate("The capital of France is", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert plain.outputs[0].cumulative_logprob is None


def test_priority_without_the_priority_policy_is_refused(llm):
    with pytest.raises(ValueError, match="scheduling_policy is fcfs"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), priority=[1, 0], use_tqdm=False)
    assert len(llm.generate(["a"], SamplingParams(max_tokens=2), priority=[0], use_tqdm=False)) == 1
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_past_the_context_ends_at_max_model_len_as_in_vllm():
    """A prompt near max_model_len with the default max_tokens (16) had failed the whole generate() call with a
    ValueError; vLLM's LLM ends such a request at the context limit, finish_reason "length"."""
    small = LLM(dtype="float32", quantization="none", max_model_len=48, num_kv_blocks=16)
    ids = small.get_tokenizer().encode(" ".join(["cat"] * 60))[:44]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 4, 16)]
    cut, short, fits = small.generate([ids, ids, ids[:8]], params, use_tqdm=False)
    assert cut.outputs[0].token_ids == short.outputs[0].token_ids and len(short.outputs[0].token_ids) == 4
    assert cut.outputs[0].finish_reason == "length" and len(fits.outputs[0].token_ids) == 16
    with pytest.raises(ValueError, match="prompt is 48 tokens, but max_model_len is 48"):
        small.generate([ids + ids[:4]], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("value", [0, -5, 2.5, True])
def test_a_bad_max_model_len_is_refused(value):
    """0 fell back to the model's length and -5 made an engine that refused every prompt."""
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1"):
        LLM(max_model_len=value)


def test_a_max_model_len_the_kv_cache_cannot_hold_is_refused():
    """Asked for, it was cut to the pool quietly (vLLM refuses it); the model's own length is still cut."""
    with pytest.raises(ValueError, match=r"max_model_len=4096 is more than the KV cache holds \(8 blocks of 16"):
        LLM(max_model_len=4096, num_kv_blocks=8)
    assert LLM(num_kv_blocks=8).engine.max_model_len == 128


def test_streamed_deltas_add_up_to_the_text(llm):
    engine = llm.engine
    engine.add_request("s", "Write a haiku about the sea.", SamplingParams(temperature=0.8, seed=3, max_tokens=40))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_texts[0])
            final = out
    assert "".join(deltas) == final.outputs[0].text
    assert "\ufffd" not in final.outputs[0].text


def test_seeded_sampling_reproduces(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=24)
    a = llm.chat(CHATS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.chat(CHATS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_prompt_logprobs_with_prefix_cache_hit(llm, hf_reference):
    tok = llm.get_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)  # warms the prefix cache
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_reference(torch.tensor([ids])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        lp = out.prompt_logprobs[pos]
        assert lp[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-3)
        assert len(lp) <= 3


def test_n_samples_compute_prompt_logprobs_once(llm):
    """With n > 1 one sequence computes the prompt logprobs (without reading the prefix cache, whose
    positions would have no logits); its siblings take the prompt's blocks from the cache."""
    engine, bs = llm.engine, llm.engine.config.block_size
    ids = llm.get_tokenizer().encode("A stitch in time saves nine, and a penny saved is a penny earned. " * 3)
    single = llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    rows_computed: list[int] = []
    execute = engine.runner.execute

    def counting_execute(sched):  # the real runner; we only count the prompt-logprob rows it returns
        result = execute(sched)
        rows_computed.extend(len(chunk) for chunk in result.prompt_logprobs.values())
        return result

    engine.runner.execute = counting_execute
    hits_before = engine.get_stats().prefix_cache_hits
    try:
        out = llm.generate([ids], SamplingParams(n=3, max_tokens=2, prompt_logprobs=3, temperature=1.0, seed=4),
                           use_tqdm=False)[0]
    finally:
        engine.runner.execute = execute
    assert sum(rows_computed) == len(ids) - 1                      # once, not once per sample
    full_blocks = (len(ids) - 1) // bs
    assert engine.get_stats().prefix_cache_hits - hits_before == 2 * full_blocks * bs  # the two siblings
    assert out.num_cached_tokens == 0                               # sequence 0 computed the whole prompt
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 2 for c in out.outputs)
    assert len(out.prompt_logprobs) == len(ids)
    for got, want in zip(out.prompt_logprobs[1:], single.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-5) for t in got)


def test_default_dtype_still_answers_correctly():
    """The default dtype (bfloat16 on CPUs with native bf16) with float weights: a numerics slip in a
    bf16 path shows up here, not in the float32 parity tests."""
    llm_auto = LLM(quantization="none")
    out = llm_auto.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out.outputs[0].text == "The capital of France is Paris."
