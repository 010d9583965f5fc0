"""Runs a ``TransformerLayer``'s inference forward as a replayed CUDA graph (``CudaGraphRunner``), for small,
launch-bound shapes: one capture per input signature, checked before every replay against what the graph's kernels
read (``_ReplayLayout``). Imports ``flashlite.layer`` and ``flashlite.plain_block``'s argument checks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from flashlite.layer import TransformerLayer
from flashlite.plain_block import _check_bool, _check_input, _positive_int


def _layer_settings(layer: "TransformerLayer") -> tuple:
    # The layer attributes a captured forward bakes in.
    return (layer.policy, layer.fusions, layer.causal, layer.eps, layer.attention_backend, layer.dropout,
            layer.training)


@dataclass(frozen=True)
class _ReplayLayout:
    """What a captured graph's kernels read besides its static buffers, checked before every replay: which module
    sits under each name, which parameter object under each name with its memory (address, shape, strides, dtype,
    device), and the layer settings baked into the capture. A replay is valid only while all of it is unchanged.

    The check runs on every call, so it costs per call what the graph saves: it compares the recorded objects by
    identity and each parameter's fields directly (a few microseconds), where rebuilding a signature through
    ``named_parameters()`` cost 18 us on the development CPU against 9 us for this
    (benchmarks/results/cpu-host-2026-12-04/replay_check_probe.txt at commit 8ca4529), and 48 us on the H200's host
    (an 8ca4529 run).
    """

    # (parent, name, child) for every submodule: a replaced submodule carries parameters the graph never read.
    modules: tuple[tuple[nn.Module, str, Optional[nn.Module]], ...]
    # (module, name, parameter, data_ptr, shape, stride, dtype, device) for every parameter.
    params: tuple[tuple, ...]
    settings: tuple

    @classmethod
    def of(cls, layer: nn.Module) -> "_ReplayLayout":
        modules = tuple((parent, name, child) for parent in layer.modules() for name, child in parent._modules.items())
        params = tuple((module, name, p, p.data_ptr(), p.shape, p.stride(), p.dtype, p.device)
                       for module in layer.modules() for name, p in module._parameters.items() if p is not None)
        return cls(modules, params, _layer_settings(layer))

    def holds_for(self, layer: nn.Module) -> bool:
        """Whether ``layer`` still has this layout (so a graph captured with it may replay)."""
        for parent, name, child in self.modules:
            if parent._modules.get(name) is not child:
                return False
        for module, name, p, ptr, shape, stride, dtype, device in self.params:
            if (module._parameters.get(name) is not p or p.data_ptr() != ptr or p.shape != shape
                    or p.stride() != stride or p.dtype != dtype or p.device != device):
                return False
        return _layer_settings(layer) == self.settings


@dataclass
class _CapturedCall:
    graph: "torch.cuda.CUDAGraph"
    static_x: torch.Tensor
    static_mask: Optional[torch.Tensor]
    static_out: torch.Tensor
    layout: _ReplayLayout
    # The parameters' tensors at capture, held so that their memory cannot be freed and handed to a new parameter
    # at the same address, which would make a replaced storage look unchanged.
    held: tuple[torch.Tensor, ...]


class CudaGraphRunner:
    """Runs a layer's inference forward as a replayed CUDA graph: one capture per (shape, dtype, mask present).

    At small shapes (B=1, S=128) the layer's time is mostly kernel-launch overhead; a graph replays all of its
    kernels with one launch. The first call with a new input signature warms the layer up on a side stream
    (``warmup_calls`` forwards, at least 1: compiling and autotuning Triton kernels outside the capture),
    captures one forward, and then every call copies its inputs into the graph's static buffers and replays.
    Inference only: forward runs under ``torch.no_grad()``, and the layer must be in eval mode or have no dropout.

    Weight changes: the graph reads the parameters' own memory on every replay (the casts to the matmul dtype are
    kernels inside the graph, not copies made at capture), so any in-place change of a parameter's values is
    picked up: optimizer steps, ``load_state_dict``, ``param.copy_``, and writes through ``param.data``. A change
    of what the graph's kernels point at (``param.data = t``, ``layer.to(...)``, a new layer setting such as
    ``causal``) is detected before each replay by comparing every parameter's address, shape, strides, dtype and
    device, and the layer's settings, with those at capture; it triggers a re-capture.

    The returned tensor is a fresh copy unless ``clone_output=False``, in which case it is the graph's static
    output, overwritten by the next call with the same signature.

    ``layer`` may also be the layer under ``torch.compile`` (``torch.compile(layer, fullgraph=True)``): the warm-up
    calls compile it, and the graph captures Inductor's kernels instead of the eager layer's. On an H200 (d_model
    1024, "mixed", 128 to 16,384 tokens) that graph measured 1.18-1.24x the eager layer's
    (benchmarks/results/h200-2026-12-04-d/ at commit 8ca4529), so it is the one to use where torch.compile works.
    Compile it in the
    default mode: ``mode="reduce-overhead"`` records CUDA graphs of its own, which this runner does not nest.

    Example (needs a CUDA device):
        >>> layer = TransformerLayer(1024, 16, device="cuda").eval()  # doctest: +SKIP
        >>> run = CudaGraphRunner(layer)  # doctest: +SKIP
        >>> y = run(torch.randn(1, 128, 1024, device="cuda"))  # doctest: +SKIP
        >>> run_compiled = CudaGraphRunner(torch.compile(layer, fullgraph=True))  # doctest: +SKIP
    """

    def __init__(self, layer: TransformerLayer, *, warmup_calls: int = 3, clone_output: bool = True) -> None:
        if not isinstance(getattr(layer, "_orig_mod", layer), TransformerLayer):
            raise TypeError(f"layer must be a TransformerLayer or one under torch.compile, got {type(layer).__name__}")
        # At least one warm-up call: without it the layer's first forward (Triton compiling and autotuning its
        # kernels, torch.compile tracing) would run inside the capture. And a bool for clone_output: None or a
        # string would silently hand out the static output, which the next call overwrites.
        warmup_calls = _positive_int("warmup_calls", warmup_calls)
        clone_output = _check_bool("clone_output", clone_output)
        device = layer.qkv.weight.device
        if device.type != "cuda":
            raise RuntimeError(
                f"CUDA graphs need a CUDA device, but the layer's parameters are on {device}; call the layer "
                "directly (on the CPU there is no launch overhead to save)"
            )
        self.layer = layer
        # The TransformerLayer itself, also under torch.compile: the per-call checks read its attributes directly
        # (through the compiled wrapper each read is a delegated lookup) and its parameters are what a graph reads.
        self._inner: TransformerLayer = getattr(layer, "_orig_mod", layer)
        self.warmup_calls = warmup_calls
        self.clone_output = clone_output
        self._captured: dict[tuple, _CapturedCall] = {}

    def __call__(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        layer = self._inner
        _check_input(x, key_padding_mask, layer.d_model, layer.qkv.weight)
        if x.requires_grad:
            raise ValueError("CudaGraphRunner is for inference: x requires grad; call the layer directly to train")
        if layer.training and layer.dropout > 0:
            raise ValueError("CudaGraphRunner replays a fixed graph: put the layer in eval() mode (dropout > 0)")
        key = (tuple(x.shape), x.dtype, x.device, key_padding_mask is not None)
        with torch.no_grad():
            call = self._captured.get(key)
            if call is not None and not call.layout.holds_for(layer):
                # Free the stale graph (and the old parameter memory it holds) before capturing its replacement.
                del self._captured[key]
                call = None
            if call is None:
                call = self._capture(x, key_padding_mask)
                self._captured[key] = call
            call.static_x.copy_(x)
            if call.static_mask is not None:
                call.static_mask.copy_(key_padding_mask)
            call.graph.replay()
        return call.static_out.clone() if self.clone_output else call.static_out

    def clear(self) -> None:
        """Drop every captured graph and its buffers."""
        self._captured.clear()

    def _capture(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> _CapturedCall:
        static_x = x.clone()
        static_mask = key_padding_mask.clone() if key_padding_mask is not None else None
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                self.layer(static_x, static_mask)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.layer(static_x, static_mask)
        held = tuple(p.detach() for p in self.layer.parameters())
        return _CapturedCall(graph, static_x, static_mask, static_out, _ReplayLayout.of(self._inner), held)
