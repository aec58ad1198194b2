"""Structured output: JSON schema, any JSON object, regex and EBNF grammars, with xgrammar.

`GrammarCompiler` belongs to one tokenizer and model vocabulary. It compiles a request's
`SamplingParams.structured_output` once per (kind, spec) into an LRU cache and gives each request its own
`xgrammar.GrammarMatcher` (`request.structured_state`). A spec that does not compile raises ValueError
quoting xgrammar's message.

Each step, `apply_grammar_masks` lets a constrained row sample only the tokens its grammar allows next: the
matchers fill one packed bitmask for the constrained rows, which is copied to the logits' device and applied
as one masked fill; unconstrained rows are untouched and a step without constrained rows does nothing. Ids
past the tokenizer's vocabulary (padded rows of the model's head) are never allowed. The stop check
(`engine.request.check_stop`) feeds each newly sampled token to the matcher (`GrammarState.accept_token`;
tokens recomputed after a preemption are never fed again).

As in vLLM, the grammar ends the request through EOS: once it is complete its mask allows the request's
EOS ids (the tokenizer's when the request has none) and nothing else, and a matcher that accepted one is
terminated. Where there is no EOS id at all, the request ends (with FinishReason.EOS) as soon as its
grammar is complete and allows no further token. With async batching a constrained request waits for its
previous token before its next step is launched (engine.scheduling.scheduler), since its mask depends on
that token.

`min_new_tokens` holds EOS back even where the grammar allows nothing else: such a request fails.

JSON schemas and json_object compile without free whitespace (xgrammar's `any_whitespace=False`: ", " and
": " separators): free whitespace lets a weak model emit blanks forever.
"""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch
import xgrammar as xgr

from engine.request import Request
from engine.sampling.params import StructuredOutput
from engine.system.device_copies import to_device

# Compiled grammars kept per tokenizer (least recently used dropped first).
MAX_CACHED_GRAMMARS = 256
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: ".
_LOCATION_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_BITS = 32


class GrammarCacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int


class GrammarCompiler:
    """Compiles and caches the grammars of one tokenizer, for a model whose head has `vocab_size` rows
    (the tokenizer's vocabulary, more when padded, or fewer). Thread-safe: requests are compiled on their
    callers' threads. The tokenizer's vocabulary is read on the first compile (a fraction of a second)."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0

    def compile(self, structured_output: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of `structured_output`, from the cache when it was compiled before; raises
        ValueError with xgrammar's message when it does not compile."""
        key = (structured_output.kind, structured_output.spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self._hits += 1
                return compiled
        # Compiled outside the lock: two threads may both compile a new spec, and one result is kept.
        compiler = self._xgrammar_compiler()
        try:
            compiled = _compile(compiler, structured_output)
        except Exception as exc:
            raise ValueError(
                f"structured_output: the {structured_output.kind} does not compile: {_library_message(exc)}"
            ) from exc
        with self._lock:
            self._misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return compiled

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                try:
                    info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                except Exception as exc:
                    raise ValueError(
                        f"structured_output cannot use this tokenizer: {_library_message(exc)}"
                    ) from exc
                threads = min(8, os.cpu_count() or 1)
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def new_state(self, request: Request) -> GrammarState:
        """A fresh matcher of the request's grammar (for `request.structured_state`); its EOS ids (the
        tokenizer's when it has none) are the tokens that end the grammar."""
        structured_output = request.sampling.structured_output
        assert structured_output is not None
        stop_tokens = sorted(request.sampling.eos_token_ids) or None
        matcher = xgr.GrammarMatcher(self.compile(structured_output), override_stop_tokens=stop_tokens)
        return GrammarState(matcher, self.vocab_size)

    def cache_info(self) -> GrammarCacheInfo:
        with self._lock:
            return GrammarCacheInfo(self._hits, self._misses, len(self._cache))


class GrammarState:
    """A request's matcher (`request.structured_state`, an `engine.request.Grammar`) and the vocabulary
    its bitmask rows cover."""

    __slots__ = ("matcher", "vocab_size", "words")

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.words = (vocab_size + _BITS - 1) // _BITS

    def accept_token(self, token_id: int) -> str | None:
        """Feeds a newly sampled token to the matcher; the reason the request must fail when the grammar
        refuses it (a step sampled it without the mask), else None."""
        if self.matcher.is_terminated() or self.matcher.accept_token(token_id):
            return None
        return (
            f"structured_output: token {token_id} was sampled but the grammar does not allow it "
            "(min_new_tokens holds EOS back where the grammar allows nothing else)"
        )

    def is_complete(self) -> bool:
        """Whether the grammar has ended: it accepted one of its EOS ids, or, with no EOS id to end on
        (neither the request nor the tokenizer has one), it allows no further token."""
        matcher = self.matcher
        if matcher.is_terminated():
            return True
        if matcher.stop_token_ids or not matcher.is_completed():
            return False
        bitmask = torch.empty(1, self.words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return not bool(bitmask.any())

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # A request pickled for the other tensor-parallel ranks (engine.loop.lockstep) arrives without its
        # matcher:
        # each rank's engine gives it a fresh one, from its own tokenizer, when it adds the request.
        return (type(None), ())


def constrained_rows(requests: list[Request]) -> list[int]:
    """The rows (of a step's sampling requests) whose tokens a grammar constrains."""
    return [row for row, request in enumerate(requests) if request.structured_state is not None]


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Sets to -inf, in place, every logit of `rows` (of logits [R, V]) that the row's grammar does not
    allow next. The matchers fill a host bitmask; one copy to the device and one masked fill apply it."""
    if not rows:
        return
    states = [_state(requests[row]) for row in rows]
    grammar_vocab, words = states[0].vocab_size, states[0].words
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)
    for index, state in enumerate(states):
        assert state.vocab_size == grammar_vocab, "every grammar of an engine has the model's vocabulary"
        state.matcher.fill_next_token_bitmask(bitmask, index)
    device = logits.device
    if device.type == "cuda":
        bitmask = bitmask.pin_memory().to(device, non_blocking=True)
    bits = torch.bitwise_left_shift(1, torch.arange(_BITS, dtype=torch.int32, device=device))
    refused = (bitmask.unsqueeze(-1) & bits).view(len(rows), words * _BITS) == 0
    vocab = logits.shape[1]
    refused = refused[:, : min(vocab, grammar_vocab)]
    if vocab > grammar_vocab:  # logits wider than the vocabulary the grammar knows: extra ids refused
        refused = torch.nn.functional.pad(refused, (0, vocab - grammar_vocab), value=True)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(refused, float("-inf"))
        return
    index_rows = to_device(rows, torch.long, device)
    logits.index_copy_(0, index_rows, logits.index_select(0, index_rows).masked_fill_(refused, float("-inf")))


def _state(request: Request) -> GrammarState:
    state = request.structured_state
    assert isinstance(state, GrammarState)
    return state


def _compile(compiler: xgr.GrammarCompiler, structured_output: StructuredOutput) -> xgr.CompiledGrammar:
    kind, spec = structured_output.kind, structured_output.spec
    if kind == "json_schema":
        return compiler.compile_json_schema(spec, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    raise ValueError(f"kind {kind!r} is not supported")


def _library_message(exc: Exception) -> str:
    message = str(exc).strip() or type(exc).__name__
    return _LOCATION_PREFIX.sub("", message)
