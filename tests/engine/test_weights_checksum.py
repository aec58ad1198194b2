"""The weights' digest (engine.weights.checksum, of cbserve_checksum's algorithm): equal weights, equal
digests; any difference shows, in the tensor it is in."""

from __future__ import annotations

import cbserve_checksum
import pytest
import torch
from cbserve_checksum import TensorDigester, combined_digest

from engine import ContinuousBatchingConfig, ContinuousBatchingManager
from engine.weights.checksum import weights_checksum
from tests.helpers.models import fresh_tiny_model, seeded_tiny_llama

CONFIG = ContinuousBatchingConfig(page_size=8, num_blocks=64, max_batch_tokens=64)


def tensor_digest(tensor: torch.Tensor) -> str:
    return TensorDigester().digest(tensor)


@pytest.fixture
def manager():
    manager = ContinuousBatchingManager(fresh_tiny_model("llama"), continuous_batching_config=CONFIG)
    manager.start()
    yield manager
    manager.destroy()


def test_the_servers_digest_equals_the_digest_of_the_same_weights_elsewhere(manager) -> None:
    served = manager.weights_checksum()
    expected = weights_checksum(fresh_tiny_model("llama").state_dict())
    assert served.algorithm == expected.algorithm == "xxh3-128"
    assert served.digest == expected.digest
    assert served.tensors == expected.tensors
    assert served.weight_version == 1
    names = [checksum.name for checksum in served.tensors]
    assert names == sorted(fresh_tiny_model("llama").state_dict()), "every state-dict name, tied ones too"


def test_after_an_update_the_digest_is_the_new_weights_and_names_what_changed(manager) -> None:
    before = {checksum.name: checksum.digest for checksum in manager.weights_checksum().tensors}
    other = seeded_tiny_llama(7).state_dict()
    changed = "model.layers.0.mlp.up_proj.weight"
    manager.update_weights({changed: other[changed]})
    after = manager.weights_checksum()
    assert after.weight_version == 2
    differing = [checksum.name for checksum in after.tensors if before[checksum.name] != checksum.digest]
    assert differing == [changed]
    assert dict((c.name, c.digest) for c in after.tensors)[changed] == tensor_digest(other[changed])
    assert after.digest == combined_digest({c.name: c.digest for c in after.tensors})


def test_one_changed_element_changes_the_digest() -> None:
    weights = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    nudged = weights.clone()
    nudged[31, 17] = torch.nextafter(nudged[31, 17], torch.tensor(float("inf")))
    assert tensor_digest(weights) != tensor_digest(nudged)
    assert tensor_digest(weights) == tensor_digest(weights.clone())


def test_moved_bytes_change_the_digest() -> None:
    weights = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    assert tensor_digest(weights) != tensor_digest(weights.flip(0))
    assert tensor_digest(weights) != tensor_digest(weights.reshape(6, 4)), "the shape counts"


def test_the_dtype_held_counts_and_the_memory_layout_does_not() -> None:
    weights = torch.randn(5, 7, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    assert tensor_digest(weights) != tensor_digest(weights.float())
    transposed = weights.t().contiguous().t()  # the same values, column-major
    assert not transposed.is_contiguous()
    assert tensor_digest(transposed) == tensor_digest(weights)
    odd_offset = torch.cat([torch.zeros(1, dtype=torch.bfloat16), weights.reshape(-1)])[1:].reshape(5, 7)
    assert tensor_digest(odd_offset) == tensor_digest(weights), "a view at an unaligned offset"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensors_digest_equals_its_host_copys() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool):
        host = (torch.randn(257, 33) * 100).to(dtype)
        assert tensor_digest(host.cuda()) == tensor_digest(host), dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_tensor_of_many_chunks_streams_through_two_buffers_to_its_host_copys_digest(
    monkeypatch,
) -> None:
    """Chunk k reuses chunk k - 2's pinned buffer: a chunk hashed after its buffer was refilled would
    change the digest."""
    monkeypatch.setattr(cbserve_checksum, "CHUNK_BYTES", 4096)
    host = torch.randn(1003, 7, generator=torch.Generator().manual_seed(3))
    digester = TensorDigester()
    assert digester.digest(host.cuda()) == digester.digest(host)
    assert digester.digest(host.cuda() * 2) == digester.digest(host * 2), "the staging buffers reused"
