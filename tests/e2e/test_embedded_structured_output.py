"""Structured output on the embedded SmolLM2-135M-Instruct (converted once per session by
tests/e2e/conftest.py): answers to chat questions follow their JSON schemas and validate with `jsonschema`."""

from __future__ import annotations

import json

import jsonschema
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import FinishReason
from tests.helpers.models import TEST_DEVICE
from tests.helpers.structured_output import json_schema_output, object_schema, results, started_manager


def test_embedded_smollm2_follows_schemas(model_dir: str) -> None:
    smol_tokenizer = AutoTokenizer.from_pretrained(model_dir)
    smol = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(TEST_DEVICE).eval()
    person = object_schema(
        {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "city": {"type": "string", "maxLength": 40},
        },
        ["name", "age", "city"],
    )
    colors = object_schema(
        {"colors": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}}, ["colors"]
    )
    asks = [
        ("Describe a fictional person as JSON with name, age and city.", person),
        ("List three colors of the French flag as JSON.", colors),
    ]
    eos = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    manager = started_manager(smol, smol_tokenizer, max_requests_per_batch=4)
    try:
        ids = []
        for question, schema in asks:
            prompt = smol_tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
            )
            ids.append(
                manager.add_request(
                    [int(token) for token in prompt],
                    max_new_tokens=120,
                    eos_token_id=eos,
                    structured_output=json_schema_output(schema),
                )
            )
        outputs = results(manager, ids)
    finally:
        manager.destroy()
    values = []
    for (_, schema), output in zip(asks, outputs, strict=True):
        assert output.finish_reason == FinishReason.EOS, smol_tokenizer.decode(output.generated_tokens)
        value = json.loads(smol_tokenizer.decode(output.generated_tokens[:-1]))
        jsonschema.validate(value, schema)
        values.append(value)
    assert values[0]["name"] and values[1]["colors"], values
