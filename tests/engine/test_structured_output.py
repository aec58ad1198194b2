"""Structured output (engine.sampling.structured_output): JSON schema, json_object, regex and EBNF grammars.

A tiny random llama with the vocabulary of the embedded SmolLM2's tokenizer writes garbage, but under the
grammar's mask its output must still be valid. The schemas are bounded (maxLength, maxItems, enums,
numeric bounds) so that the grammar ends within max_new_tokens whatever the model prefers.
"""

from __future__ import annotations

import functools
import json
import pickle
import re
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama import LlamaConfig

from engine import (
    ContinuousBatchingConfig,
    ContinuousBatchingManager,
    FinishReason,
    GenerationOutput,
    RequestStatus,
    SamplingParams,
    StructuredOutput,
)
from engine.engine_core import EngineCore
from engine.request import Request, sequence_request_id
from service.default_model import DefaultModelUnavailable, default_model_dir, find_gguf, is_converted
from tests.helpers.engine_runs import engine_core
from tests.helpers.models import COMMON, TEST_DEVICE
from tests.helpers.structured_output import (
    STRUCTURED_OUTPUT_CONFIG,
    json_schema_output,
    object_schema,
    results,
    started_manager,
)

EOS = 2  # SmolLM2's <|im_end|>, its tokenizer's eos_token_id


@functools.cache
def _tokenizer() -> Any:
    """SmolLM2's tokenizer: from the converted model when the cache holds it (fast), else from its GGUF."""
    folder = default_model_dir()
    if is_converted(folder):
        return AutoTokenizer.from_pretrained(str(folder))
    try:
        gguf = find_gguf()
    except DefaultModelUnavailable as exc:
        pytest.skip(f"SmolLM2's tokenizer is unavailable: {exc}")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@functools.cache
def _model(extra_vocab: int = 0) -> torch.nn.Module:
    """A tiny random llama whose head covers the tokenizer's vocabulary (and `extra_vocab` padded ids)."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "vocab_size": len(_tokenizer()) + extra_vocab, "eos_token_id": EOS})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return model.to(TEST_DEVICE).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return _tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer: Any) -> torch.nn.Module:
    return _model()


def _prompt(tokenizer: Any, index: int) -> list[int]:
    return tokenizer.encode(f"Request {index}: answer in the requested format about item {index * 7}.")


def _text(tokenizer: Any, output: GenerationOutput) -> str:
    """The output's text without its final EOS; the request must have ended on it."""
    assert output.status == RequestStatus.FINISHED, output.error
    assert output.finish_reason == FinishReason.EOS, (output.finish_reason, output.generated_tokens)
    assert output.generated_tokens[-1] == EOS
    return tokenizer.decode(output.generated_tokens[:-1])


SHORT = {"type": "string", "maxLength": 6}
SCHEMAS: list[dict[str, Any]] = [
    object_schema({"name": SHORT}, ["name"]),
    object_schema({"age": {"type": "integer", "minimum": 0, "maximum": 120}}, ["age"]),
    object_schema({"price": {"type": "number", "minimum": 0.5, "maximum": 99.5}}, ["price"]),
    object_schema({"ok": {"type": "boolean"}, "nothing": {"type": "null"}}, ["ok", "nothing"]),
    object_schema({"color": {"enum": ["red", "green", "blue"]}}, ["color"]),
    object_schema(
        {"version": {"const": "v1"}, "count": {"type": "integer", "minimum": -5, "maximum": 5}}, ["version"]
    ),
    object_schema(
        {
            "address": object_schema(
                {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, ["city", "zip"]
            )
        },
        ["address"],
    ),
    object_schema(
        {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 10},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        ["scores"],
    ),
    object_schema({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4}}, ["tags"]),
    # Optional fields: any subset may appear.
    object_schema(
        {"nick": SHORT, "level": {"type": "integer", "minimum": 1, "maximum": 3}, "vip": {"type": "boolean"}}
    ),
    object_schema({"code": {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{2}$"}}, ["code"]),
    object_schema({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, SHORT]}}, ["id"]),
    object_schema(
        {
            "items": {
                "type": "array",
                "items": object_schema(
                    {"sku": {"type": "integer", "minimum": 1, "maximum": 9}, "in_stock": {"type": "boolean"}},
                    ["sku", "in_stock"],
                ),
                "maxItems": 2,
            }
        },
        ["items"],
    ),
    object_schema(
        {"a": object_schema({"b": object_schema({"c": {"enum": [1, 2, 3]}}, ["c"])}, ["b"])}, ["a"]
    ),
    object_schema({"value": {"enum": [1, "two", None, True]}}, ["value"]),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"enum": ["north", "south", "east", "west"]},
    object_schema(
        {"word": {"type": "string", "minLength": 2, "maxLength": 4}, "flag": {"type": "boolean"}},
        ["word", "flag"],
        additionalProperties=False,
    ),
    {
        "$defs": {"point": object_schema({"x": {"type": "integer", "minimum": 0, "maximum": 9}}, ["x"])},
        **object_schema(
            {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, ["start", "end"]
        ),
    },
    {
        "type": "array",
        "prefixItems": [{"enum": ["x", "y"]}, {"type": "integer", "minimum": 0, "maximum": 3}],
        "items": False,
    },
]
NUM_PLAIN = 6
PLAIN_NEW_TOKENS = 24


def _add_plain(manager: ContinuousBatchingManager, tokenizer: Any) -> list[str | None]:
    return [
        manager.add_request(_prompt(tokenizer, 100 + index), max_new_tokens=PLAIN_NEW_TOKENS, eos_token_id=[])
        for index in range(NUM_PLAIN)
    ]


def test_json_schemas_greedy_and_sampled_in_one_batch_with_unconstrained_requests(
    model: torch.nn.Module, tokenizer: Any
) -> None:
    manager = started_manager(model, tokenizer)
    try:
        constrained = []
        for index, schema in enumerate(SCHEMAS):
            for sampled in (False, True):
                sampling = {"temperature": 1.0, "seed": 1000 + index} if sampled else {}
                request_id = manager.add_request(
                    _prompt(tokenizer, index),
                    max_new_tokens=300,
                    eos_token_id=EOS,
                    structured_output=json_schema_output(schema),
                    **sampling,
                )
                constrained.append((schema, sampled, request_id))
        plain_ids = _add_plain(manager, tokenizer)
        outputs = results(manager, [request_id for _, _, request_id in constrained])
        plain = [output.generated_tokens for output in results(manager, plain_ids)]
        grammars = engine_core(manager).grammars
        assert grammars is not None
        # One compile per schema: the sampled request of each found the greedy one's grammar.
        assert grammars.cache_info().misses == len(SCHEMAS)
    finally:
        manager.destroy()
    for (schema, sampled, _), output in zip(constrained, outputs, strict=True):
        text = _text(tokenizer, output)
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"sampled={sampled} schema={schema}: invalid output {text!r}") from exc

    alone = started_manager(model)  # no tokenizer: unconstrained requests do not need one
    try:
        expected = [output.generated_tokens for output in results(alone, _add_plain(alone, tokenizer))]
    finally:
        alone.destroy()
    assert plain == expected, "constrained companions changed unconstrained requests' greedy tokens"


@pytest.mark.parametrize("async_batching", [False, True])
def test_regex_and_ebnf_grammar(model: torch.nn.Module, tokenizer: Any, async_batching: bool) -> None:
    regex = r"[a-z]{3}-\d{2,3}( [A-Z]{2})?"
    # GBNF-style EBNF: sums of one-digit numbers in parentheses.
    grammar = 'root ::= "(" expr ")"\nexpr ::= num | num "+" expr\nnum ::= [0-9]'
    manager = started_manager(model, tokenizer, use_async_batching=async_batching)
    try:
        ids = []
        for seed in range(4):
            sampling = {"temperature": 1.0, "seed": seed} if seed else {}
            for kind, spec in (("regex", regex), ("grammar", grammar)):
                ids.append(
                    manager.add_request(
                        _prompt(tokenizer, seed),
                        max_new_tokens=60,
                        eos_token_id=EOS,
                        structured_output=StructuredOutput(kind, spec),
                        **sampling,
                    )
                )
        outputs = results(manager, ids)
    finally:
        manager.destroy()
    for index, output in enumerate(outputs):
        text = _text(tokenizer, output)
        if index % 2 == 0:
            assert re.fullmatch(regex, text), text
        else:
            assert re.fullmatch(r"\(\d(\+\d)*\)", text), text


def test_json_object(model: torch.nn.Module, tokenizer: Any) -> None:
    """Any JSON object. A random model seldom closes one, so it is steered (logit_bias) towards tokens that
    the grammar allows only where JSON does: '{"' to open, '"' (closing a string soon) above it, then '}'."""
    open_key, quote, close = (tokenizer.convert_tokens_to_ids(token) for token in ('{"', '"', "}"))
    manager = started_manager(model, tokenizer)
    try:
        steered = manager.add_request(
            _prompt(tokenizer, 1),
            max_new_tokens=40,
            eos_token_id=EOS,
            structured_output=StructuredOutput("json_object"),
            logit_bias={open_key: 25.0, quote: 30.0, close: 20.0},
        )
        closed = manager.add_request(
            _prompt(tokenizer, 2),
            max_new_tokens=40,
            eos_token_id=EOS,
            structured_output=StructuredOutput("json_object"),
            logit_bias={close: 50.0},
        )
        outputs = results(manager, [steered, closed])
    finally:
        manager.destroy()
    steered_value = json.loads(_text(tokenizer, outputs[0]))
    assert isinstance(steered_value, dict) and len(steered_value) == 1, steered_value
    assert json.loads(_text(tokenizer, outputs[1])) == {}


def test_a_schema_that_does_not_compile_fails_alone(model: torch.nn.Module, tokenizer: Any) -> None:
    manager = started_manager(model, tokenizer)
    try:
        good = manager.add_request(
            _prompt(tokenizer, 0),
            max_new_tokens=100,
            eos_token_id=EOS,
            structured_output=json_schema_output(SCHEMAS[1]),
        )
        plain = _add_plain(manager, tokenizer)
        with pytest.raises(ValueError, match='does not compile: Unsupported type "strin"'):
            manager.add_request(
                _prompt(tokenizer, 1),
                structured_output=json_schema_output({"type": "strin"}),
                eos_token_id=EOS,
            )
        with pytest.raises(ValueError, match=r"does not compile: .*not defined"):
            manager.add_request(
                _prompt(tokenizer, 1),
                structured_output=StructuredOutput("grammar", "root ::= undefined_rule"),
            )
        outputs = results(manager, [good, *plain])
    finally:
        manager.destroy()
    jsonschema.validate(json.loads(_text(tokenizer, outputs[0])), SCHEMAS[1])
    assert all(output.status == RequestStatus.FINISHED for output in outputs)


def test_engine_core_fails_a_bad_grammar_request_without_raising(
    model: torch.nn.Module, tokenizer: Any
) -> None:
    manager = ContinuousBatchingManager(
        model, continuous_batching_config=ContinuousBatchingConfig(**STRUCTURED_OUTPUT_CONFIG)
    )
    try:
        engine: EngineCore = engine_core(manager)  # not started: this test steps the engine itself
        bad = Request("bad", [5, 6, 7], _sampling(json_schema_output({"type": "strin"})))
        assert not engine.add_request(bad)
        assert bad.status == RequestStatus.FAILED and "needs the model's tokenizer" in (bad.error or "")
        engine.set_tokenizer(tokenizer)
        bad = Request("bad", [5, 6, 7], _sampling(json_schema_output({"type": "strin"})))
        assert not engine.add_request(bad)
        assert bad.finish_reason == FinishReason.ERROR and 'Unsupported type "strin"' in (bad.error or "")
        good = Request("good", [5, 6, 7], _sampling(json_schema_output(SCHEMAS[4])))
        assert engine.add_request(good)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        manager.destroy()
    assert json.loads(tokenizer.decode(good.generated_tokens[:-1]))["color"] in ("red", "green", "blue")


def test_a_request_pickled_for_other_ranks_leaves_its_matcher_behind(tokenizer: Any) -> None:
    """engine.loop.lockstep pickles added requests for the other tensor-parallel ranks, which make their
    own."""
    engine = EngineCore.__new__(EngineCore)  # only the grammars: no model, no cache
    engine.grammars = None
    engine.vocab_size = len(tokenizer)
    engine.set_tokenizer(tokenizer)
    request = Request("r", [5, 6, 7], _sampling(StructuredOutput("regex", "[0-9]+")))
    engine.init_structured_output(request)
    assert request.structured_state is not None
    copy = pickle.loads(pickle.dumps(request))
    assert copy.structured_state is None and copy.sampling == request.sampling
    engine.init_structured_output(copy)
    assert copy.structured_state is not None


def _sampling(structured_output: StructuredOutput, **kwargs: Any) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=100, eos_token_ids=frozenset({EOS}), structured_output=structured_output, **kwargs
    )


def test_without_a_tokenizer_a_constrained_request_is_refused(model: torch.nn.Module, tokenizer: Any) -> None:
    manager = started_manager(model)
    try:
        with pytest.raises(ValueError, match="needs the model's tokenizer"):
            manager.add_request([5, 6, 7], structured_output=StructuredOutput("regex", "a+"))
        manager.set_tokenizer(tokenizer)
        request_id = manager.add_request(
            [5, 6, 7], max_new_tokens=10, eos_token_id=EOS, structured_output=StructuredOutput("regex", "ab?")
        )
        [output] = results(manager, [request_id])
    finally:
        manager.destroy()
    assert _text(tokenizer, output) in ("a", "ab")


def test_grammars_are_cached_per_kind_and_spec(model: torch.nn.Module, tokenizer: Any) -> None:
    manager = started_manager(model, tokenizer)
    try:
        specs = [("regex", "[0-9]{2}"), ("regex", "[0-9]{3}"), ("grammar", 'root ::= "yes" | "no"')]
        ids = [
            manager.add_request(
                _prompt(tokenizer, index),
                max_new_tokens=10,
                eos_token_id=EOS,
                structured_output=StructuredOutput(kind, spec),
            )
            for index in range(3)
            for kind, spec in specs
        ]
        outputs = results(manager, ids)
        grammars = engine_core(manager).grammars
        assert grammars is not None
        info = grammars.cache_info()
    finally:
        manager.destroy()
    assert (info.misses, info.hits, info.size) == (3, 6, 3)
    assert [len(_text(tokenizer, output)) for output in outputs[:2]] == [2, 3]


def test_a_terminated_grammar_ends_a_request_that_ignores_eos(model: torch.nn.Module, tokenizer: Any) -> None:
    """With no EOS ids of its own the request ends once its grammar accepts the tokenizer's EOS."""
    manager = started_manager(model, tokenizer)
    try:
        request_id = manager.add_request(
            [5, 6, 7], max_new_tokens=50, eos_token_id=[], structured_output=StructuredOutput("regex", "x{4}")
        )
        [output] = results(manager, [request_id])
    finally:
        manager.destroy()
    assert output.finish_reason == FinishReason.EOS
    assert tokenizer.decode(output.generated_tokens) == f"xxxx{tokenizer.eos_token}"


def test_padded_vocabulary_ids_are_never_sampled(tokenizer: Any) -> None:
    """A head with more rows than the tokenizer has tokens: the extra ids are masked, even when favoured."""
    padded = _model(extra_vocab=64)
    favoured = len(tokenizer) + 10
    manager = started_manager(padded, tokenizer)
    try:
        request_id = manager.add_request(
            [5, 6, 7],
            max_new_tokens=40,
            eos_token_id=EOS,
            logit_bias={favoured: 100.0},
            structured_output=json_schema_output(SCHEMAS[0]),
        )
        free = manager.add_request([5, 6, 7], max_new_tokens=3, eos_token_id=[], logit_bias={favoured: 100.0})
        constrained, unconstrained = results(manager, [request_id, free])
    finally:
        manager.destroy()
    assert unconstrained.generated_tokens == [favoured] * 3  # the bias works where no grammar masks it
    assert favoured not in constrained.generated_tokens
    jsonschema.validate(json.loads(_text(tokenizer, constrained)), SCHEMAS[0])


def test_preemption_and_async_batching_keep_greedy_constrained_outputs(
    model: torch.nn.Module, tokenizer: Any
) -> None:
    """Recomputed tokens are not fed to the grammar again, and a step waits for the previous token."""
    digits = {"type": "integer", "minimum": 1000, "maximum": 9999}
    schemas = [
        {"type": "array", "items": digits, "minItems": 8, "maxItems": 8},
        object_schema(
            {"a": {"type": "array", "items": digits, "minItems": 6, "maxItems": 6}, "b": SHORT}, ["a", "b"]
        ),
        *SCHEMAS[6:8],
    ]
    generator = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(3, len(tokenizer), (length,), generator=generator).tolist()
        for length in (60, 75, 90, 50)
    ]

    def run(**overrides: Any) -> tuple[list[list[int]], int]:
        manager = started_manager(model, tokenizer, **overrides)
        try:
            ids = [
                manager.add_request(
                    prompt, max_new_tokens=80, eos_token_id=EOS, structured_output=json_schema_output(schema)
                )
                for prompt, schema in zip(prompts, schemas, strict=True)
            ]
            tokens = [output.generated_tokens for output in results(manager, ids)]
            return tokens, manager.stats().preemptions
        finally:
            manager.destroy()

    expected, _ = run()
    for schema, tokens in zip(schemas, expected, strict=True):
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), schema)
    # 33 usable blocks of 8 tokens hold about two of these at full length: growth must preempt.
    small_cache = dict(num_blocks=34, page_size=8, allow_block_sharing=False)
    for overrides in (small_cache, {**small_cache, "use_async_batching": True}):
        tokens, preemptions = run(**overrides)
        assert preemptions > 0, "the cache was meant to be too small to avoid preemption"
        assert tokens == expected, overrides


def test_each_of_n_sampled_sequences_follows_the_schema_with_its_own_matcher(
    model: torch.nn.Module, tokenizer: Any
) -> None:
    schema = SCHEMAS[7]  # an array of 1..3 bounded integers: sequences diverge early
    manager = started_manager(model, tokenizer)
    try:
        request_id = manager.add_request(
            _prompt(tokenizer, 3),
            max_new_tokens=300,
            eos_token_id=EOS,
            structured_output=json_schema_output(schema),
            temperature=1.0,
            seed=5,
            n=4,
        )
        assert request_id is not None
        outputs = results(manager, [sequence_request_id(request_id, index) for index in range(4)])
    finally:
        manager.destroy()
    texts = [_text(tokenizer, output) for output in outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1, f"four seeds sampled the same output: {texts}"
