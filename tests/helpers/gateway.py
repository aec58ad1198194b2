"""The real SMG gateway (PyPI `smg`, started by bench/smg_gateway.py) in front of `cbserve serve` replicas,
and the model the replicas serve, for the gateway tests."""

from __future__ import annotations

from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from bench.smg_gateway import SmgGateway, http_get


def save_tiny_model_with_tokenizer(folder: Path, tokenizer_source: str) -> str:
    """A tiny random Llama (fixed seed) that speaks the tokenizer of `tokenizer_source` (its vocabulary,
    EOS and chat template), saved to `folder`: fast to serve, with a real tokenizer for the gateway."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    eos_token_id = tokenizer.eos_token_id
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,  # tied, the random model only ever repeats one token
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class Gateway(SmgGateway):
    """The gateway of bench/smg_gateway.py, with what the tests read off it: its Prometheus samples."""

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of the gateway's Prometheus endpoint: (name, sorted labels) -> value."""
        status, body = http_get(self.metrics_url, timeout=5)
        assert status == 200, f"the gateway's metrics answered {status}"
        samples = {}
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name` over the samples whose labels include `labels`."""
        return sum(
            value
            for (sample_name, sample_labels), value in self.metrics().items()
            if sample_name == name and set(labels.items()) <= set(sample_labels)
        )
