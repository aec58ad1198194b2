"""Linear layers run on weights packed once for a fast kernel, on the CPU.

A plain `nn.Linear` on the CPU calls the BLAS (MKL in torch's x86 wheels), which repacks the weight into
its blocked layout on every call and multiplies one row on one thread: profiled on the 2-core EPYC, MKL's
packing copy took 26 % of a decode-heavy run's step time against 35 % for the multiply itself. Packing
once when the engine is built removes that copy from every step (vLLM's and SGLang's CPU backends also
pack their weights at load).

float32 layers are packed into the engine's own kernel's panels (`engine.quantization.kernel`, format
float32: sixteen channels interleaved along the input, a 6-row x 16-channel register tile; 32 channels and
12 rows where the kernel is built for AVX-512). One kernel
serves every row count, from one request's decode (bound by reading the weight, which it streams once
per call on every thread) to a prefill chunk (bound by the FMA units). Over SmolLM2's 210 decoder-layer
products on the 2-core EPYC (Zen 2, AVX2), against oneDNN on its own packed weight (`python -m
bench.linear_kernel`): 17.9 against 25.1 ms at one row, 33.8 against 45.0 at 16 rows, 50.1 against 67.2
at 32, 82.3 against 113.7 at 64, 291.2 against 372.7 at 256 (187 GFLOP/s; the FMA units peak near 209).
A row's result has the same bits however many rows share the call.

bf16 layers are packed for oneDNN, which serves them only on CPUs with AVX-512 (elsewhere they stay on
the BLAS), and so are float32 layers when the kernel cannot be built. Batch-invariant mode runs the same
packing: its trainer side (engine.runner.batch_invariant) multiplies float32 weights on the same panels.
Below `MIN_PACKED_WEIGHT_ELEMENTS`
oneDNN's fixed cost per call outweighs the copy it saves (a 256 x 256 projection ran 1.4x slower packed
on 64 rows), so those stay on the BLAS; the kernel packs every float32 layer whatever its size.

The packed copy is kept beside the model's own weight, which stays the one users and weight updates
write to: it costs the packed layers' weight memory a second time. A packed copy is used only while it is
current: a layer repacks on its next call when its weight's storage (`data_ptr`) or version counter has
changed since it was packed. Every in-place write moves the counter (`copy_` under `no_grad`,
`load_state_dict`, optimizer steps, the engine's weight updates) except one through `.data`. A repack
writes the panels where they lie, so code holding their address (engine.runner.decoder_layers) reads the
new weights.
"""

from __future__ import annotations

import itertools
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.quantization import kernel
from engine.quantization.linear import is_linear_map
from engine.system.untouched_memory import UntouchedHostTensor

logger = logging.getLogger(__name__)

# Weights of fewer elements are not packed for oneDNN (see the module docstring): 256 x 1024 is the
# smallest shape measured faster packed.
MIN_PACKED_WEIGHT_ELEMENTS = 1 << 18
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class WeightStamp:
    """What a weight was when a copy of it was packed: its storage and its version counter. A copy is
    current while the weight's stamp is the same (see the module docstring)."""

    data_ptr: int
    version: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> WeightStamp:
        return cls(weight.data_ptr(), weight._version)


@dataclass
class _PackedWeight:
    packed: torch.Tensor
    stamp: WeightStamp


def _pack(weight: torch.Tensor) -> _PackedWeight:
    detached = weight.detach()
    return _PackedWeight(torch.ops.mkldnn._reorder_linear_weight(detached, None), WeightStamp.of(weight))


class PanelledWeight:
    """A float32 weight in the linear kernel's panels (`kernel.float32_panels`), packed again whenever the
    weight it is asked for has another stamp than the one packed.

    `storage`, when given, is where the panels live (a view of `PanelArena`'s mapping): a drop then only
    marks them stale, the arena gives their pages back, and the next `current` packs into the same storage.
    Without it the panels are a tensor of their own, freed by `drop`.

    Invariant: the panels keep their storage from one repack to the next. Only `drop` (sleep) ends that
    for panels of their own, which the next `current` allocates anew; panels in an arena keep theirs."""

    def __init__(self, storage: torch.Tensor | None = None) -> None:
        self._storage = storage
        self._panels: torch.Tensor | None = None
        self._stamp: WeightStamp | None = None

    def current(self, weight: torch.Tensor) -> torch.Tensor:
        """The panels of `weight` as it is now."""
        stamp = WeightStamp.of(weight)
        if self._panels is None or stamp != self._stamp:
            out = self._panels if self._panels is not None else self._storage
            self._panels = kernel.float32_panels(weight.detach(), out=out)
            self._stamp = stamp
        return self._panels

    def drop(self) -> int:
        """Frees the panels (marks them stale when they live in an arena, which frees the pages); returns
        the bytes freed here."""
        freed = 0 if self._panels is None or self._storage is not None else self._panels.nbytes
        self._panels = None
        return freed


class PanelArena:
    """One mapping that holds the panels of all of a model's float32 layers, in the order of
    `model.modules()` (a decoder layer's products, one after the other), on transparent huge pages.

    A step reads every panel from memory (more than the caches hold: 540 MB for SmolLM2-135M's 210
    products and its LM head), and on 4 KiB pages it also walks the page table for every 4 KiB it reads:
    about 100,000 walks a step, a millisecond or so, which counts where a step is short. SmolLM2's 210
    products, huge pages against small in alternating passes of one process (`python -m
    bench.linear_kernel --rows 1 64 --repeats 31`, 2-core Xeon, 2026-12-04): at one row, 25 of 31 passes
    faster, best 22.6 against 24.3 ms, median 24.9 against 25.5; at 64 rows no difference (17 of 31,
    medians 80.7 and 80.6 ms), the products being bound by the multiply-adds there."""

    def __init__(self, shapes: list[tuple[int, int, int]], huge_pages: bool = True) -> None:
        sizes = [math.prod(shape) for shape in shapes]
        self._memory = UntouchedHostTensor((sum(sizes),), torch.float32, huge_pages=huge_pages)
        ends = itertools.accumulate(sizes)
        self.views = [
            self._memory.tensor[end - size : end].view(shape)
            for end, size, shape in zip(ends, sizes, shapes, strict=True)
        ]

    def drop_pages(self) -> int:
        """Gives every panel's pages back (sleep); returns their bytes. The views stay valid."""
        return self._memory.drop_pages()


# The forwards `PackedLinears` installed that run their layer on the linear kernel's panels, with them.
_PANELLED_FORWARDS: weakref.WeakKeyDictionary[Any, PanelledWeight] = weakref.WeakKeyDictionary()


def panelled_weight(module: torch.nn.Module) -> PanelledWeight | None:
    """The panels `module`'s float32 calls run on, when its forward is one `PackedLinears` installed on
    the linear kernel (not a hook another library set on the instance); else None."""
    forward = module.__dict__.get("forward")
    return None if forward is None else _PANELLED_FORWARDS.get(forward)


def packable_linears(model: torch.nn.Module, min_elements: int | None = None) -> list[torch.nn.Linear]:
    """The model's linear layers worth packing: plain `nn.Linear` and the subclasses whose forward is
    exactly the linear map (engine.quantization.linear.is_linear_map; not a LoRA layer) with a dense CPU
    weight of at least `min_elements` (default `MIN_PACKED_WEIGHT_ELEMENTS`) in fp32 or bf16, and no
    `forward` of their own already set on the instance (as accelerate's hooks and another engine on the
    same model do)."""
    if min_elements is None:
        min_elements = MIN_PACKED_WEIGHT_ELEMENTS
    return [
        module
        for module in model.modules()
        if is_linear_map(module)
        and "forward" not in module.__dict__
        and type(module.weight.data) is torch.Tensor
        and module.weight.device.type == "cpu"
        and module.weight.layout is torch.strided
        and module.weight.dtype in PACKED_DTYPES
        and module.weight.numel() >= min_elements
    ]


def _falls_back(module: torch.nn.Linear, hidden_states: torch.Tensor) -> bool:
    """Whether a call cannot run on packed weights: gradients wanted, autocast, an input of another dtype
    or device than the weight."""
    weight = module.weight
    return (
        torch.is_grad_enabled()
        or hidden_states.dtype != weight.dtype
        or hidden_states.device != weight.device
        or torch.is_autocast_enabled("cpu")
    )


class PackedLinears:
    """Installs packed forwards on a model's linear layers and takes them off again (`restore`).

    Invariant: a packed forward computes what `F.linear` on the layer's current weight computes; it
    falls back to `F.linear` whenever packing cannot serve the call (`_falls_back`), and repacks first
    when the weight changed in place.

    Float32 layers run on the linear kernel, whose panels give a row the same bits however many rows share
    the call; where the kernel cannot be built they are packed for oneDNN.
    Batch-invariant mode packs every oneDNN layer whatever its size (`min_elements=0`): oneDNN on a packed
    weight also gives a row the same bits at any row count, and the mode's trainer side computes those
    bits (engine.runner.batch_invariant).
    """

    def __init__(self, model: torch.nn.Module, min_elements: int | None = None) -> None:
        self._panelled: dict[torch.nn.Linear, PanelledWeight] = {}
        # None: the copy was dropped (`drop_copies`) and is made again on the layer's next call.
        self._packed: dict[torch.nn.Linear, _PackedWeight | None] = {}
        on_panels = kernel.available()
        if not on_panels:
            logger.info(
                "float32 linear layers run on oneDNN: the engine's linear kernel cannot be built here"
            )
        self._panel_arena: PanelArena | None = None
        if on_panels:
            float32_modules = [
                module for module in packable_linears(model, 0) if module.weight.dtype == torch.float32
            ]
            shapes = [kernel.float32_panels_shape(*module.weight.shape) for module in float32_modules]
            self._panel_arena = PanelArena(shapes) if shapes else None
            views = self._panel_arena.views if self._panel_arena is not None else []
            for module, storage in zip(float32_modules, views, strict=True):
                panelled = self._panelled[module] = PanelledWeight(storage)
                panelled.current(module.weight)
                module.forward = self._panelled_forward_of(module, panelled)  # type: ignore[method-assign]
        for module in packable_linears(model, min_elements):
            try:
                self._packed[module] = _pack(module.weight)
            except RuntimeError as exc:
                # oneDNN packs bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT): the BLAS serves those
                # layers then. (Builds without oneDNN never get here: `packs_linear_weights`.)
                logger.info("linear layers run on the BLAS: oneDNN cannot pack their weights here (%s)", exc)
                for packed_module in self._packed:
                    packed_module.__dict__.pop("forward", None)
                self._packed.clear()
                break
            module.forward = self._packed_forward_of(module)  # type: ignore[method-assign]
        if self._panelled or self._packed:
            num_bytes = sum(module.weight.nbytes for module in (*self._panelled, *self._packed))
            logger.info(
                "linear layers run on packed weights: %d on the engine's kernel, %d on oneDNN "
                "(%.1f MiB beside the model's own)",
                len(self._panelled),
                len(self._packed),
                num_bytes / 2**20,
            )

    @property
    def num_packed(self) -> int:
        """Layers running on packed weights, the kernel's or oneDNN's."""
        return len(self._panelled) + len(self._packed)

    def _panelled_forward_of(self, module: torch.nn.Linear, panelled: PanelledWeight) -> Any:
        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if _falls_back(module, hidden_states) or weight.dtype != torch.float32:
                return F.linear(hidden_states, weight, module.bias)
            return kernel.float_linear(
                hidden_states, panelled.current(weight), module.out_features, module.bias
            )

        _PANELLED_FORWARDS[forward] = panelled
        return forward

    def _packed_forward_of(self, module: torch.nn.Linear) -> Any:
        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if _falls_back(module, hidden_states):
                return F.linear(hidden_states, weight, module.bias)
            packed = self._packed[module]
            if packed is None or packed.stamp != WeightStamp.of(weight):
                packed = self._packed[module] = _pack(weight)
            return torch.ops.mkldnn._linear_pointwise(
                hidden_states, packed.packed, module.bias, "none", [], ""
            )

        return forward

    def drop_copies(self) -> int:
        """Frees the packed copies (sleep): each layer packs again on its next call. Returns the bytes
        freed."""
        freed = sum(panelled.drop() for panelled in self._panelled.values())
        if self._panel_arena is not None:
            freed += self._panel_arena.drop_pages()
        for module, packed in self._packed.items():
            if packed is not None:
                freed += module.weight.nbytes
                self._packed[module] = None
        return freed

    def restore(self) -> None:
        """Gives every layer its own forward back and frees the packed copies. Idempotent."""
        for module in [*self._panelled, *self._packed]:
            module.__dict__.pop("forward", None)
        for panelled in self._panelled.values():
            panelled.drop()
        self._panelled.clear()
        self._panel_arena = None
        self._packed.clear()
