"""Incremental detokenization: the deltas always add up to the whole decode, whatever the text."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from service.detokenizer import IncrementalDetokenizer
from tests.helpers.servers import ByteTokenizer

CORPUS = [
    "The capital of France is Paris. Don't split café, naïve, Zürich or 東京 across tokens!",
    "Émile a mangé une crème brûlée à 10 h 30 ; puis il a dit « merci » 🙂 et il est parti.",
    "def f(x):\n    return x ** 2  # squares\n\n\tindented\ttabs and    spaces",
]


@functools.cache
def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE (as SmolLM2's), trained here on a few lines."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def streamed_text(tokenizer: object, token_ids: list[int]) -> tuple[str, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.step(token_ids[: count + 1]) for count in range(len(token_ids))]
    deltas.append(detokenizer.flush(token_ids))
    return "".join(deltas), deltas


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(min_size=0, max_size=80))
def test_deltas_add_up_to_the_whole_decode_with_a_byte_level_bpe(text: str) -> None:
    tokenizer = byte_level_bpe()
    token_ids = tokenizer(text)["input_ids"]
    whole = tokenizer.decode(token_ids, skip_special_tokens=True)
    joined, deltas = streamed_text(tokenizer, token_ids)
    assert joined == whole, f"streamed {deltas!r}\nwhole    {whole!r}"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(min_size=1, max_size=40))
def test_no_delta_splits_a_character_with_byte_tokens(text: str) -> None:
    tokenizer = ByteTokenizer()
    token_ids = tokenizer(text)["input_ids"]
    joined, deltas = streamed_text(tokenizer, token_ids)
    assert joined == text
    assert not any("\ufffd" in delta for delta in deltas), deltas


def test_special_tokens_are_skipped_and_text_after_them_still_flows() -> None:
    tokenizer = byte_level_bpe()
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    token_ids = [*tokenizer("Paris")["input_ids"], eos, *tokenizer(" café")["input_ids"]]
    joined, _ = streamed_text(tokenizer, token_ids)
    assert joined == "Paris café"


def test_each_step_decodes_a_bounded_window() -> None:
    decoded_lengths: list[int] = []

    class CountingTokenizer(ByteTokenizer):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            decoded_lengths.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    token_ids = list(("long output " * 200).encode())
    joined, _ = streamed_text(CountingTokenizer(), token_ids)
    assert joined == "long output " * 200
    assert max(decoded_lengths) <= 8, "a step must not re-decode the whole output"
