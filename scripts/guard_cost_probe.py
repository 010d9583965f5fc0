"""Host time of torch.compile's guard check per call: the compiled TransformerLayer against the compiled plain block.

Every call of a compiled module first checks its graph's guards (what the trace assumed: tensor properties, module
attributes, the globals and functions the traced code read). The layer's trace runs flashlite's Python front end
(argument checks, the attention dispatch), and each value and function it reads becomes a guard. This probe builds
both sides as ``tests/perf/test_layer_ab.py`` does (the layer "mixed" with ``fullgraph=True, dynamic=False``, the
plain block in bf16 with the same weights; the layer without fused kernels, as it runs compiled on a CUDA device),
compiles each once with the ``eager`` backend (graph capture only: the guards are the same whatever backend
compiles the graph, and the timing below calls no graph), then times the guard check itself
(``guard_manager.check`` of the cache entry, best of 7 means of 2,000 calls) and counts the guards by kind. Host
time only: it needs no GPU, and with TRITON_INTERPRET=1 the one traced call runs the attention kernel in Triton's
interpreter.

On a CUDA machine ``--device cuda`` builds both sides there, as the A/B suite does (the layer's trace then takes
its CUDA paths: no fused kernels under compile, the Gluon dispatch rule), and ``--dump DIR`` writes each side's
guard tree to DIR, one file per side, to read which guards the time goes to.

Usage: TRITON_INTERPRET=1 python scripts/guard_cost_probe.py [--d-model 1024 --heads 16 --d-ff 4096 --tokens 128]
       python scripts/guard_cost_probe.py --device cuda --dump guards/
"""
from __future__ import annotations

import argparse
import collections
import platform
import re
import time
from pathlib import Path

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from flashlite.layer import PlainTransformerBlock, TransformerLayer

CHECKS_PER_SAMPLE = 2000
SAMPLES = 7


def guard_check_us(module: torch.nn.Module, x: torch.Tensor) -> tuple[float, str]:
    """(best mean microseconds of one guard check of ``module``'s compiled forward, the guard tree as text)."""
    frame = {"self": module, "x": x, "key_padding_mask": None}
    entries = _debug_get_cache_entry_list(type(module).forward.__code__)
    manager = next(entry.guard_manager for entry in entries if entry.guard_manager.check(frame))
    means = []
    for _ in range(SAMPLES):
        start = time.perf_counter()
        for _ in range(CHECKS_PER_SAMPLE):
            manager.check(frame)
        means.append((time.perf_counter() - start) / CHECKS_PER_SAMPLE * 1e6)
    return min(means), str(manager)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--d-ff", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=128, help="one sequence of this many tokens (case 1: 128)")
    parser.add_argument("--device", default="cpu", help="where both sides and the input live (cpu or cuda)")
    parser.add_argument("--dump", default="", metavar="DIR", help="write each side's guard tree to DIR")
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()} | torch {torch.__version__} | d_model {args.d_model}, "
          f"{args.heads} heads, d_ff {args.d_ff}, B=1 S={args.tokens}, bf16 input, layer precision mixed")
    torch.manual_seed(0)
    plain = PlainTransformerBlock(args.d_model, args.heads, args.d_ff, dtype=torch.bfloat16, device=args.device)
    # No fusions: what the layer runs under torch.compile on a CUDA device (on the CPU it would run all three).
    layer = TransformerLayer.from_plain(plain.eval(), precision="mixed", fusions=()).eval()
    x = torch.randn(1, args.tokens, args.d_model, dtype=torch.bfloat16, device=args.device)
    sides = {"compiled layer": (layer, torch.compile(layer, fullgraph=True, dynamic=False, backend="eager")),
             "compiled plain block": (plain, torch.compile(plain, backend="eager"))}
    with torch.no_grad():
        for _, compiled in sides.values():
            compiled(x)
        for label, (module, _) in sides.items():
            us, tree = guard_check_us(module, x)
            kinds = collections.Counter(re.findall(r"\+- ([A-Z_]+(?:MATCH|GUARD|CONTAINS))\b", tree))
            print(f"{label}: guard check {us:.2f} us per call; {sum(kinds.values())} guards: "
                  + ", ".join(f"{kind} {n}" for kind, n in kinds.most_common()))
            if args.dump:
                path = Path(args.dump) / f"guards_{label.replace(' ', '_')}.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(tree)


if __name__ == "__main__":
    main()
