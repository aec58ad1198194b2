"""Linear layers run on weights pre-packed for oneDNN, on the CPU.

A plain `nn.Linear` on the CPU calls the BLAS (MKL in torch's x86 wheels), which repacks the weight into
its blocked layout on every call. For the engine's steps that repacking is a large share of the matmul:
profiled on a 2-core AMD EPYC (Zen 3, AVX2), MKL's packing copy took 26 % of a decode-heavy run's step
time against 35 % for the multiply itself, and a 64-row product with a 32,000 x 256 LM head ran at 45
GFLOP/s against 91 with the weight packed once for oneDNN. Packing once when the engine is built removes
that copy from every step (vLLM's and SGLang's CPU backends also pack their weights at load).

The packed copy is kept beside the model's own weight, which stays the one users and weight updates
write to: it costs the packed layers' weight memory a second time. A packed copy is used only while it is
current: a layer repacks on its next call when its weight's storage (`data_ptr`) or version counter has
changed since it was packed. Every in-place write moves the counter (`copy_` under `no_grad`,
`load_state_dict`, optimizer steps, the engine's weight updates) except one through `.data`.

Small weights stay with the BLAS: below `MIN_PACKED_WEIGHT_ELEMENTS` the packed call's fixed cost
outweighs the copy it saves (a 256 x 256 projection ran 1.4x slower packed on 64 rows). Their calls of few
rows still take the kernel below: SmolLM2's 60 key and value projections (192 x 576) are each too small
to pack, and on the BLAS one request's decode step took 39.1 ms against 38.0 with them on the kernel.

A call of at most `FEW_ROWS` float32 rows (the decode of one request or a few) is bound by reading the
weight, not by arithmetic, and neither library reads it at the machine's speed there: MKL multiplies one
row on one thread, and oneDNN's packed call reaches about two thirds of what two threads stream. Such
calls run on the engine's own kernel (`engine.quantization.kernel.float_linear`, the quantized kernel's
float32 format), which reads the weight as it lies, once per call, on the thread budget's threads. Over
SmolLM2's 211 linear layers on the 2-core EPYC, weights in DRAM, one row took 62.3 ms with `F.linear`,
37.9 ms packed and 31.2 ms on the kernel (the machine streams 538 MB in about 28 ms); 8 rows 113.1, 55.2
and 47.1 ms; at 16 rows packed and the kernel were level (70.6 and 65.7 ms). Steps whose linear layers all
run on the kernel also run every decoder layer in one C call (engine.runner.decoder_layers), which tips
16 rows to the kernel: a 16-request decode step took 84.3 ms with FEW_ROWS at 8 and 75.0 at 16; at 32
rows oneDNN stays ahead (124.8 against 129.9 ms).
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.quantization import kernel
from engine.system.native_library import KernelUnavailable

logger = logging.getLogger(__name__)

# Weights of fewer elements are not packed (see the module docstring): 256 x 1024 is the smallest shape
# measured faster packed.
MIN_PACKED_WEIGHT_ELEMENTS = 1 << 18
# Calls of at most this many float32 rows run on the engine's kernel (see the module docstring).
FEW_ROWS = 16
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class _PackedWeight:
    packed: torch.Tensor
    # What the weight was when packed: its storage and its version counter.
    data_ptr: int
    version: int

    def is_current(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.data_ptr and weight._version == self.version


def _pack(weight: torch.Tensor) -> _PackedWeight:
    detached = weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(detached, None)
    return _PackedWeight(packed, detached.data_ptr(), weight._version)


# The forwards `PackedLinears` installed that run float32 calls of at most FEW_ROWS rows on the kernel.
_FEW_ROWS_KERNEL_FORWARDS: weakref.WeakSet[Any] = weakref.WeakSet()


def runs_few_rows_on_kernel(module: torch.nn.Module) -> bool:
    """Whether `module`'s float32 calls of at most `FEW_ROWS` rows run on the engine's kernel
    (`kernel.float_linear` on its weight and bias): a layer whose forward `PackedLinears` installed with
    the kernel on, not a hook another library set on the instance."""
    return module.__dict__.get("forward") in _FEW_ROWS_KERNEL_FORWARDS


def packable_linears(model: torch.nn.Module, min_elements: int | None = None) -> list[torch.nn.Linear]:
    """The model's linear layers worth packing: plain `nn.Linear` (not a subclass such as a LoRA or
    quantized layer) with a dense CPU weight of at least `min_elements` (default
    `MIN_PACKED_WEIGHT_ELEMENTS`) in fp32 or bf16, and no `forward` of their own already set on the
    instance (as accelerate's hooks and another engine on the same model do)."""
    if min_elements is None:
        min_elements = MIN_PACKED_WEIGHT_ELEMENTS
    return [
        module
        for module in model.modules()
        if type(module) is torch.nn.Linear
        and "forward" not in module.__dict__
        and type(module.weight.data) is torch.Tensor
        and module.weight.device.type == "cpu"
        and module.weight.layout is torch.strided
        and module.weight.dtype in PACKED_DTYPES
        and module.weight.numel() >= min_elements
    ]


class PackedLinears:
    """Installs packed forwards on a model's large linear layers and takes them off again (`restore`).

    Invariant: a packed forward computes what `F.linear` on the layer's current weight computes; it
    falls back to `F.linear` whenever packing cannot serve the call (gradients wanted, autocast, an input
    of another dtype or device), and repacks first when the weight changed in place.

    Batch-invariant mode packs every layer whatever its size (`min_elements=0`) and keeps calls of few
    rows on oneDNN too (`few_rows_kernel=False`): oneDNN on a packed weight gives a row the same bits
    however many rows share the call (engine.runner.batch_invariant), and a switch of library at
    `FEW_ROWS` would not.
    """

    def __init__(
        self, model: torch.nn.Module, min_elements: int | None = None, few_rows_kernel: bool = True
    ) -> None:
        self._few_rows_kernel = few_rows_kernel and _kernel_available()
        # None: the copy was dropped (`drop_copies`) and is made again on the layer's next call.
        self._packed: dict[torch.nn.Linear, _PackedWeight | None] = {}
        # Layers too small to pack whose calls of few rows take the kernel (the rest stay with the BLAS).
        self._few_rows_only: list[torch.nn.Linear] = []
        packable = packable_linears(model, min_elements)
        if self._few_rows_kernel:
            packed = set(packable)
            self._few_rows_only = [
                module
                for module in packable_linears(model, 0)
                if module not in packed and module.weight.dtype == torch.float32
            ]
        for module in self._few_rows_only:
            module.forward = self._forward_of(module)  # type: ignore[method-assign]
        for module in packable:
            try:
                self._packed[module] = _pack(module.weight)
            except RuntimeError as exc:
                # oneDNN packs bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT): the BLAS serves every
                # layer then. (Builds without oneDNN never get here: `packs_linear_weights`.)
                logger.info("linear layers run on the BLAS: oneDNN cannot pack their weights here (%s)", exc)
                self.restore()
                return
            module.forward = self._forward_of(module)  # type: ignore[method-assign]
        if self._packed:
            num_bytes = sum(module.weight.nbytes for module in self._packed)
            logger.info(
                "%d linear layers run on weights packed for oneDNN (%.1f MiB beside the model's own)",
                len(self._packed),
                num_bytes / 2**20,
            )

    @property
    def num_packed(self) -> int:
        return len(self._packed)

    def _forward_of(self, module: torch.nn.Linear) -> Any:
        # Whether few-row calls may take the kernel, as far as it depends on the layer's shape alone.
        kernel_fits = self._few_rows_kernel and module.in_features % kernel.LANES == 0

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if (
                torch.is_grad_enabled()
                or hidden_states.dtype != weight.dtype
                or hidden_states.device != weight.device
                or torch.is_autocast_enabled("cpu")
            ):
                return F.linear(hidden_states, weight, module.bias)
            if (
                kernel_fits
                and hidden_states.numel() <= FEW_ROWS * module.in_features
                and weight.dtype == torch.float32
                and weight.is_contiguous()
            ):
                return kernel.float_linear(hidden_states, weight, module.bias)
            if module not in self._packed:  # too small to pack
                return F.linear(hidden_states, weight, module.bias)
            packed = self._packed[module]
            if packed is None or not packed.is_current(weight):
                packed = self._packed[module] = _pack(weight)
            return torch.ops.mkldnn._linear_pointwise(
                hidden_states, packed.packed, module.bias, "none", [], ""
            )

        if kernel_fits:
            _FEW_ROWS_KERNEL_FORWARDS.add(forward)
        return forward

    def drop_copies(self) -> int:
        """Frees the packed copies (sleep): each layer packs again on its next call. Returns the bytes
        freed."""
        freed = 0
        for module, packed in self._packed.items():
            if packed is not None:
                freed += module.weight.nbytes
                self._packed[module] = None
        return freed

    def restore(self) -> None:
        """Gives every layer its own forward back and frees the packed copies. Idempotent."""
        for module in [*self._packed, *self._few_rows_only]:
            module.__dict__.pop("forward", None)
        self._packed.clear()
        self._few_rows_only.clear()


def _kernel_available() -> bool:
    try:
        kernel.load()
    except KernelUnavailable as exc:
        logger.info("calls of a few rows run on oneDNN: the engine's linear kernel is unavailable (%s)", exc)
        return False
    return True
