"""The speculative-decoding configuration: vLLM's field names, defaults, and errors a user can act on, the
same from LLM(..., speculative_config=...) and from `kvserve serve --speculative-config`."""
import pytest

from kvserve.config import EngineConfig
from kvserve.entrypoints.cli import build_parser, engine_config
from kvserve.spec_decode.config import (DEFAULT_DISABLE_BY_BATCH_SIZE, DRAFT_DEFAULT_DISABLE_BY_BATCH_SIZE,
                                       SpeculativeConfig)


def test_vllm_fields_and_lookup_defaults():
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                 "prompt_lookup_min": 2})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 2, 4)
    assert c.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE
    # vLLM's method name for a standalone draft model.
    assert SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 3}).method == "draft"
    only_max = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (5, 5)
    neither = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert (neither.prompt_lookup_min, neither.prompt_lookup_max) == (2, 4)
    off = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None})
    assert off.disable_by_batch_size is None


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_model_methods_look_up_only_where_bounds_are_given(method):
    plain = SpeculativeConfig(method=method, num_speculative_tokens=3)
    assert not plain.uses_lookup and plain.prompt_lookup_min is None
    both = SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2})
    assert both.uses_lookup and (both.prompt_lookup_min, both.prompt_lookup_max) == (2, 4)
    only_min = SpeculativeConfig(method=method, num_speculative_tokens=4, prompt_lookup_min=3)
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (3, 3)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).uses_lookup
    # Each kind of draft keeps its own measured batch limit unless the user sets one for both.
    assert (both.disable_by_batch_size, both.lookup_disable_by_batch_size) == (
        DRAFT_DEFAULT_DISABLE_BY_BATCH_SIZE, DEFAULT_DISABLE_BY_BATCH_SIZE)
    given = SpeculativeConfig(method=method, num_speculative_tokens=4, prompt_lookup_max=4, disable_by_batch_size=2)
    assert (given.disable_by_batch_size, given.lookup_disable_by_batch_size) == (2, 2)
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 4, "lookup_disable_by_batch_size": 2})


@pytest.mark.parametrize("value,message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method must be one of 'ngram', 'draft', 'eagle'"),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, "method must be one of 'ngram', 'draft', 'eagle'"),
    ({"method": {"name": "ngram"}, "num_speculative_tokens": 2}, "method must be one of 'ngram', 'draft', 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 2}, "method is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 10**9}, "num_speculative_tokens (1000000000) must be below "
                                                            "max_num_batched_tokens"),
    # Suffix decoding's depth stands for the count the user did not give: the messages named the count.
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an integer"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 10**9},
     "suffix_decoding_max_tree_depth (1000000000, num_speculative_tokens' default) must be below "
     "max_num_batched_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
     "prompt_lookup_min (3) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be"),
    ({"method": "eagle", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    # -1 is no "not given": the method's default is taken only where the field is absent.
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}, "disable_by_batch_size"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 1.5}, "min_acceptance_rate"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_draft_length": "yes"}, "adaptive_draft_length"),
    ({"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 1}, "unknown field(s) ['num_lookahead']"),
    ({"method": "eagle", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (1,), (2,)]"},
     "has 3 nodes; num_speculative_tokens must equal that"),
    ({"method": "eagle", "num_speculative_tokens": 3, "speculative_token_tree": "[(0,), (0, 1), (1,)]"},
     "is not of the supported shape"),
    ({"method": "eagle", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (2,)]"},
     "is not of the supported shape"),
    ({"method": "eagle", "num_speculative_tokens": 1, "speculative_token_tree": "[(1,)]"}, "is not of the supported"),
    ({"method": "eagle", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (0,)]"}, "is not of the"),
    ({"method": "eagle", "num_speculative_tokens": 1, "speculative_token_tree": "(0,)"}, "tuples of indices"),
    ({"method": "eagle", "num_speculative_tokens": 1, "speculative_token_tree": [[0]]}, "tuples of indices"),
    # ast.literal_eval raises TypeError here (a list as a dict key), not ValueError
    ({"method": "eagle", "num_speculative_tokens": 1, "speculative_token_tree": "{[0]: 1}"}, "tuples of indices"),
    ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,), (1,)]"}, "need method 'eagle'"),
    # Suffix decoding's defaulted count was refused first, naming a 24 the user never gave.
    ({"method": "suffix", "speculative_token_tree": "[(0,), (1,)]"}, "need method 'eagle'"),
    ({"method": "suffix", "speculative_token_tree": "[(0,), (0, 0)]"},
     "got 24 (method 'suffix' defaults it to suffix_decoding_max_tree_depth)"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_invalid_configs_are_refused_with_the_field_named(value, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config=value)
    assert message in str(e.value)
    assert "speculative_config" in str(e.value)


def test_token_trees_in_vllms_notation():
    """vLLM's speculative_token_tree, node paths with num_speculative_tokens nodes: a chain of top choices and
    alternatives to the first token, in any order; a plain chain is the tree it would be without one."""
    tree = SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 4,
                                    "speculative_token_tree": "[(1,), (0,), (2,), (0, 0)]"})
    assert (tree.draft_depth, tree.num_alternatives) == (2, 2)
    chain = SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 3,
                                     "speculative_token_tree": "[(0,), (0, 0), (0, 0, 0)]"})
    assert (chain.draft_depth, chain.num_alternatives) == (3, 0)
    # A chain tree may go with any method; without a tree, the chain is num_speculative_tokens long.
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                     "speculative_token_tree": "[(0,), (0, 0)]"})
    assert (ngram.draft_depth, ngram.num_alternatives) == (2, 0)
    assert (SpeculativeConfig(method="eagle", num_speculative_tokens=3).draft_depth,
            SpeculativeConfig(method="eagle", num_speculative_tokens=3).num_alternatives) == (3, 0)


def test_a_tree_whose_chain_caps_text_drafts_at_one_token_is_warned_about(caplog):
    """Drafts from the text are as long as a tree's chain: with a chain of one, prompt lookup or suffix decoding in
    front of the head draft one token each, which the user hears about (a chain of two does not warn)."""
    one = "[(0,), (1,), (2,)]"
    for extra in ({"prompt_lookup_max": 4}, {"enable_suffix_decoding": True}, {}):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvserve.spec_decode.config"):
            SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 3, "speculative_token_tree": one,
                                     **extra})
        assert bool(extra) == ("chain of one token" in caplog.text), (extra, caplog.text)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvserve.spec_decode.config"):
        SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                 "speculative_token_tree": "[(0,), (0, 0), (1,)]"})
    assert caplog.text == ""


def test_serve_flag_parses_and_validates(capsys):
    args = build_parser().parse_args(["serve", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'])
    cfg = engine_config(args)
    assert isinstance(cfg.speculative_config, SpeculativeConfig)
    assert (cfg.speculative_config.num_speculative_tokens, cfg.speculative_config.prompt_lookup_min) == (3, 1)
    assert engine_config(build_parser().parse_args(["serve"])).speculative_config is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "ngram"}'])
    assert "num_speculative_tokens is required" in capsys.readouterr().err


def test_per_request_metrics_option_parses_and_validates(capsys):
    """--per-request-spec-decode-metrics reaches the engine config (vLLM's levels); other values are refused."""
    ngram = '{"method": "ngram", "num_speculative_tokens": 3}'
    args = build_parser().parse_args(["serve", "--speculative-config", ngram,
                                      "--per-request-spec-decode-metrics", "detailed"])
    assert engine_config(args).per_request_spec_decode_metrics == "detailed"
    assert engine_config(build_parser().parse_args(["serve"])).per_request_spec_decode_metrics == "none"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--per-request-spec-decode-metrics", "all"])
    assert "invalid choice: 'all'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="per_request_spec_decode_metrics must be none|summary|detailed"):
        EngineConfig(per_request_spec_decode_metrics="sumary")


def test_without_method_it_follows_from_model_as_in_vllm(tmp_path):
    """vLLM's rule: model "ngram" (or "[ngram]") is prompt lookup; a path is a draft, here the eagle head where
    the file holds one; neither method nor model is an error."""
    from kvserve.spec_decode.eagle_head import SHIPPED_HEAD
    from kvserve.spec_decode.draft_format import SHIPPED_DRAFT

    for given in ({"model": "ngram"}, {"model": "[ngram]"}, {"method": "ngram", "model": "ngram"},
                  {"method": "[ngram]"}):
        c = SpeculativeConfig.parse({**given, "num_speculative_tokens": 3})
        assert (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", None, 2, 4)
    assert SpeculativeConfig.parse({"model": str(SHIPPED_HEAD), "num_speculative_tokens": 1}).method == "eagle"
    assert SpeculativeConfig.parse({"model": str(SHIPPED_DRAFT), "num_speculative_tokens": 3}).method == "draft"
    # Not a head (a directory, a missing file, a file that is not safetensors at all): a draft, whose loading
    # then says what is wrong with the path.
    garbage = tmp_path / "x.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    for path in (tmp_path, tmp_path / "missing", garbage):
        assert SpeculativeConfig.parse({"model": str(path), "num_speculative_tokens": 2}).method == "draft"
    with pytest.raises(ValueError, match="method is required"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2})


def test_batch_size_schedule_in_vllms_notation():
    """num_speculative_tokens_per_batch_size: k by running sequences; a gap and the sizes past the last range
    take the range before's k, and k is at most the chain's length (vLLM's expansion). Without
    disable_by_batch_size the schedule alone says where drafting stops."""
    c = SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 4,
                                 "num_speculative_tokens_per_batch_size": [[5, 8, 0], [1, 1, 6], [2, 3, 2]]})
    assert [c.draft_tokens_at(b) for b in range(1, 11)] == [4, 2, 2, 2, 0, 0, 0, 0, 0, 0]
    assert (c.disable_by_batch_size, c.lookup_disable_by_batch_size, c.max_drafting_seqs) == (None, None, 4)
    on = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                  "num_speculative_tokens_per_batch_size": [[1, 2, 3], [8, 16, 1]]})
    assert [on.draft_tokens_at(b) for b in (1, 2, 3, 7, 8, 100)] == [3, 3, 3, 3, 1, 1]
    assert on.max_drafting_seqs is None
    limited = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 6,
                                       "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 9, 0], [10, 10, 2]]})
    assert limited.max_drafting_seqs == 6 and limited.draft_tokens_at(3) == 0 and limited.draft_tokens_at(11) == 2
    never = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                     "num_speculative_tokens_per_batch_size": [[1, 4, 0], [5, 9, 0]]})
    assert never.max_drafting_seqs == 0 and never.draft_tokens_at(1) == 0
    # A tree's draft tokens, chain and alternatives together, are what k counts (as num_speculative_tokens does).
    tree = SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 4,
                                    "speculative_token_tree": "[(0,), (0, 0), (1,), (2,)]",
                                    "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 2, 1]]})
    assert (tree.draft_tokens_at(1), tree.draft_tokens_at(2)) == (4, 1)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3).draft_tokens_at(1000) == 3
    # What verification graphs and a GPU's profiled step are sized by: 0 where the schedule never drafts.
    assert (never.drafting_seqs(64), limited.drafting_seqs(64), limited.drafting_seqs(4), on.drafting_seqs(64),
            c.drafting_seqs(64)) == (0, 6, 4, 64, 4)


def test_a_schedules_k_above_num_speculative_tokens_is_warned_about(caplog):
    """vLLM cuts a schedule's k to num_speculative_tokens without a word; here the cut is said once, at start."""
    for method, extra in (("ngram", {"num_speculative_tokens": 4}), ("suffix", {})):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvserve.spec_decode.config"):
            c = SpeculativeConfig.parse({"method": method, **extra,
                                         "num_speculative_tokens_per_batch_size": [[1, 2, 10**30], [3, 9, 3]]})
        n = c.num_speculative_tokens
        assert f"k {10**30} above num_speculative_tokens ({n}) is taken as {n}" in caplog.text, caplog.text
        assert (c.draft_tokens_at(1), c.draft_tokens_at(5)) == (n, min(3, n))
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvserve.spec_decode.config"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4,
                                 "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 9, 0]]})
    assert caplog.text == ""


def test_vllms_draft_fields_are_taken_or_refused_with_the_reason():
    c = SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 1, "draft_tensor_parallel_size": 1,
                                 "max_model_len": 512, "quantization": "int8", "enforce_eager": True,
                                 "revision": None})
    assert (c.max_model_len, c.quantization, c.enforce_eager) == (512, "int8", True)


@pytest.mark.parametrize("extra,message", [
    ({"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size must be 1"),
    ({"draft_tensor_parallel_size": True}, "draft_tensor_parallel_size must be 1"),
    ({"revision": "main"}, "revision does not apply: kvserve loads a draft from a local path"),
    ({"code_revision": "v1"}, "code_revision does not apply"),
    ({"max_model_len": 0}, "max_model_len must be an integer >= 1"),
    ({"quantization": "fp8"}, "quantization is the draft's weight format, one of 'auto', 'none', 'int8', 'int4'"),
    ({"enforce_eager": "yes"}, "enforce_eager must be true, false or null"),
    ({"num_speculative_tokens_per_batch_size": []}, "must be a non-empty list"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, 2, 8]]}, "entries must be [first batch size"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, 1, 64, 2]]}, "context ranges (5 items) are not supported"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, 2], [4, 8, 1]]}, "must not overlap"),
    ({"num_speculative_tokens_per_batch_size": [[2, 4, 2]]}, "the first range must start at batch size 1"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, "needs 1 <= first <= last and k >= 0"),
    ({"num_speculative_tokens_per_batch_size": [[3, 1, 2]]}, "needs 1 <= first <= last and k >= 0"),
])
def test_vllms_draft_fields_with_bad_values_are_refused(extra, message):
    with pytest.raises(ValueError) as e:
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2, **extra})
    assert message in str(e.value) and "speculative_config" in str(e.value)
    # A model-free method has no weights to format.
    with pytest.raises(ValueError, match="quantization applies to methods 'draft' and 'eagle'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"})
