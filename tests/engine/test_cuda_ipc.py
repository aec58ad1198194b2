"""Weights from a colocated trainer's CUDA tensors, through CUDA IPC handles (issue 15; CUDA only, run by
bench/gpu_check.sh). The trainer is another process: it shares its tensors' handles, the engine copies
from them device to device, and then serves the trainer's model."""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch

from engine import ContinuousBatchingConfig, ContinuousBatchingManager, CudaIpcHandle
from tests.helpers.models import random_prompt, seeded_tiny_llama
from tests.helpers.oracle import reference_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA device")

SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16"}


def _share(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, fields = reduce_tensor(tensor)
    return {
        "name": name,
        "dtype": SAFETENSORS_NAMES[tensor.dtype],
        "shape": tuple(fields[1]),
        "stride": tuple(fields[2]),
        "storage_offset": fields[3],
        "device_index": fields[6],
        "storage_handle": fields[7],
        "storage_size_bytes": fields[8],
        "storage_offset_bytes": fields[9],
        "ref_counter_handle": fields[11],
        "ref_counter_offset": fields[12],
        "event_handle": fields[13],
        "event_sync_required": fields[14],
    }


def _trainer(seed: int, handles: Any, done: Any) -> None:
    """Holds its model's CUDA tensors and shares their handles until the engine has copied them."""
    model = seeded_tiny_llama(seed).cuda()
    state = model.state_dict()
    handles.put([_share(name, tensor) for name, tensor in state.items()])
    done.wait(120)


def test_weights_from_another_process_through_cuda_ipc() -> None:
    context = multiprocessing.get_context("spawn")
    handles, done = context.Queue(), context.Event()
    trainer = context.Process(target=_trainer, args=(31, handles, done))
    trainer.start()
    model = seeded_tiny_llama(0).cuda()
    manager = ContinuousBatchingManager(
        model, continuous_batching_config=ContinuousBatchingConfig(num_blocks=64)
    )
    manager.start()
    try:
        shared = [CudaIpcHandle(**fields) for fields in handles.get(timeout=120)]
        assert manager.update_weights_from_ipc(shared, version="ipc") == 2
        done.set()
        prompt = random_prompt(12, 5)
        request_id = manager.add_request(prompt, max_new_tokens=6)
        output = manager.get_result(request_id, timeout=60)
        expected = reference_greedy(seeded_tiny_llama(31).cuda(), prompt, 6)
        assert output is not None and output.generated_tokens == expected, (output, expected)
    finally:
        done.set()
        manager.destroy()
        trainer.join(30)
