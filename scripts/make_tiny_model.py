"""Saves a tiny random Llama (fixed seed) with a byte-level tokenizer into a folder `cbserve serve --model`
can load. The SDK test suites (Go, Java) start a real server on it; the tokens are meaningless but
deterministic, and text prompts work because every byte is a token.

    python3 scripts/make_tiny_model.py OUT_DIR
"""

from __future__ import annotations

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB_SIZE = 256


def byte_symbols() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable stand-in for each byte: printable Latin-1 bytes stand
    for themselves, the others map to code points from 256 up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = {byte: chr(byte) for byte in printable}
    next_code_point = 256
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(next_code_point)
            next_code_point += 1
    return symbols


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {symbol: byte for byte, symbol in byte_symbols().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=1024)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(max_new_tokens=16)
    return model


def main(out_dir: str) -> None:
    tiny_llama().save_pretrained(out_dir)
    byte_tokenizer().save_pretrained(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
