"""Host time of calling an attention-shaped op through torch.library's registration paths, on the CPU.

The compiled layer (torch.compile) calls flashlite's kernels through their custom ops, and at small shapes host time
decides a call's speed: the K1 probe on the H200 host measured 44.8 us for the attention op against 14.4 us for
``attention(backend="triton")``. This probe times one stand-in implementation (it allocates the two outputs the
attention forward returns, nothing else) called directly, through ``torch.library.custom_op`` with
``register_autograd`` (how flashlite registers its ops), through a ``torch.library.Library`` schema with a CPU kernel,
and through that schema with ``register_autograd``: what each registration path adds per call.
Usage: python scripts/custom_op_probe.py   (best of 5 timeit means of 5000 calls, microseconds)
"""
from __future__ import annotations

import platform
import timeit
from typing import Optional

import torch

SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? key_lengths, int causal_mode, "
          "float scale, str precision, int window_left=-1, int window_right=-1, float softcap=0.0, "
          "Tensor? alibi_slopes=None) -> (Tensor, Tensor)")


def forward_stand_in(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left=-1,
                     window_right=-1, softcap=0.0, alibi_slopes=None):
    """The attention forward's outputs, allocated: (out like q, float32 lse [B, H, S_q])."""
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _no_grads(ctx, grad_out, grad_lse):
    return (None,) * 12


@torch.library.custom_op("flashlite_probe::via_custom_op", mutates_args=())
def via_custom_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                  key_lengths: Optional[torch.Tensor], causal_mode: int, scale: float, precision: str,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_stand_in(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left,
                            window_right, softcap, alibi_slopes)


via_custom_op.register_autograd(_no_grads)

_LIB = torch.library.Library("flashlite_probe", "FRAGMENT")
for name in ("via_library", "via_library_autograd"):
    _LIB.define(name + SCHEMA)
    _LIB.impl(name, forward_stand_in, "CPU")
torch.library.register_autograd("flashlite_probe::via_library_autograd", _no_grads)


def main() -> None:
    q, k, v = (torch.randn(1, 16, 128, 64, dtype=torch.float16) for _ in range(3))
    env = {"torch": torch, "forward_stand_in": forward_stand_in, "q": q, "k": k, "v": v}
    args = "(q, k, v, None, None, 1, 0.125, 'fp16')"
    paths = {"the implementation alone": "forward_stand_in" + args,
             "custom_op + register_autograd": "torch.ops.flashlite_probe.via_custom_op.default" + args,
             "Library schema + CPU kernel": "torch.ops.flashlite_probe.via_library.default" + args,
             "Library + register_autograd": "torch.ops.flashlite_probe.via_library_autograd.default" + args}
    print(f"python {platform.python_version()} | torch {torch.__version__} | {platform.machine()} | CPU tensors, "
          "B=1 H=16 S=128 D=64 fp16; host time per call")
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for name, statement in paths.items():
                eval(statement, env)  # the first call registers and caches what dispatch needs
                best = min(timeit.repeat(statement, number=5000, repeat=5, globals=env)) / 5000 * 1e6
                print(f"grad {'on ' if grad else 'off'}  {name:30s} {best:6.2f} us")


if __name__ == "__main__":
    main()
