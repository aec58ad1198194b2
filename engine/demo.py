"""`python -m engine.demo`: runs the engine on a tiny random Llama and prints what it did.

The model is built from a config with a fixed seed (nothing is downloaded), so the tokens are
meaningless; the point is to see requests of different lengths batched, finished and timed.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from engine import ContinuousBatchingConfig, generate_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(config).eval()
    rng = random.Random(0)
    prompts = [
        [rng.randrange(1, config.vocab_size) for _ in range(rng.randint(16, 256))]
        for _ in range(args.requests)
    ]
    started = time.perf_counter()
    outputs = generate_batch(
        model,
        prompts,
        generation_config=GenerationConfig(max_new_tokens=args.new_tokens, eos_token_id=None),
        continuous_batching_config=ContinuousBatchingConfig(page_size=16),
        progress_bar=True,
    )
    elapsed = time.perf_counter() - started
    for request_id, output in outputs.items():
        print(
            f"{request_id}: {len(output.prompt_ids)} prompt tokens -> {output.generated_tokens[:8]}... "
            f"({output.finish_reason})"
        )
    generated = sum(len(output.generated_tokens) for output in outputs.values())
    print(
        json.dumps(
            {
                "requests": len(outputs),
                "generated_tokens": generated,
                "wall_s": round(elapsed, 2),
                "tokens_per_s": round(generated / elapsed, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
