"""Probe: does Inductor freezing fold flashlite "mixed" fp32->bf16 weight casts into constants (CPU)?

Usage: python probe.py --freezing {0,1} --fusions {auto,none} --fullgraph {0,1} --grad {no_grad,inference_mode}
Writes /tmp/freeze_probe/<tag>/{code_*.py, graph.txt, out.pt, summary.json}.
"""
import argparse
import collections
import contextlib
import json
import os
import re
import sys
import time
import warnings

p = argparse.ArgumentParser()
p.add_argument("--freezing", type=int, default=0)
p.add_argument("--fusions", default="none")
p.add_argument("--fullgraph", type=int, default=1)
p.add_argument("--grad", default="no_grad")
p.add_argument("--attn", default="auto")
args = p.parse_args()
tag = f"frz{args.freezing}_fus-{args.fusions}_fg{args.fullgraph}_{args.grad}" + ("" if args.attn == "auto" else f"_attn-{args.attn}")
outdir = f"/tmp/freeze_probe/{tag}"
os.makedirs(outdir, exist_ok=True)

warnings.simplefilter("always")
caught = []
_show = warnings.showwarning
def _record(message, category, filename, lineno, file=None, line=None):
    caught.append(f"{category.__name__}: {message} ({os.path.basename(filename)}:{lineno})")
    _show(message, category, filename, lineno, file, line)
warnings.showwarning = _record

import torch
# flashlite first: it sets TRITON_INTERPRET=1 (no CUDA) before triton is imported; importing torch._inductor
# first imports triton in compiled mode and the interpreted flashlite kernels then fail (see eager_auto_check.py).
from flashlite.layer import PlainTransformerBlock, TransformerLayer
from flashlite.attention import explain_dispatch
from flashlite import _runtime
import torch._inductor.config as ind
from torch._inductor.utils import run_and_get_code

ind.freezing = bool(args.freezing)

# --- capture the final post-grad FX graph Inductor lowers --------------------------------------------------------
graphs = []
def _post(graph):
    graphs.append(graph)
ind.post_grad_custom_post_pass = _post

torch.manual_seed(0)
D, H, DFF, B, S = 64, 4, 128, 2, 16
# As tests/perf/test_layer_ab.py: plain block in bf16, eval; layer from_plain "mixed"; bf16 input.
plain = PlainTransformerBlock(D, H, DFF, device="cpu", dtype=torch.bfloat16).eval()
fus = "auto" if args.fusions == "auto" else frozenset()
layer = TransformerLayer.from_plain(plain, precision="mixed", fusions=fus, attention_backend=args.attn).eval()
x = torch.randn(B, S, D, dtype=torch.bfloat16)

ctx = torch.no_grad if args.grad == "no_grad" else torch.inference_mode
summary = {"tag": tag, "torch": torch.__version__, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
           "interpreting": _runtime.interpreting(),
           "param_dtypes": sorted({str(p.dtype) for p in layer.parameters()})}
q = torch.randn(B, H, S, D // H, dtype=torch.bfloat16)
d = explain_dispatch(q, q, q, causal=True, backend=args.attn)
summary["attention_dispatch_eager"] = f"{d.backend}: {d.reason}"
summary["fusions_for_cpu_x"] = sorted(layer._fusions_for(x))

with ctx():
    eager = layer(x)
    compiled = torch.compile(layer, fullgraph=bool(args.fullgraph))
    t0 = time.time()
    try:
        out1, codes1 = run_and_get_code(compiled, x)
    except Exception as e:  # report and stop
        summary["compile_error"] = f"{type(e).__name__}: {str(e)[:3000]}"
        summary["warnings"] = caught
        json.dump(summary, open(f"{outdir}/summary.json", "w"), indent=1)
        print(json.dumps(summary, indent=1))
        sys.exit(0)
    summary["compile_s"] = round(time.time() - t0, 1)
    summary["n_inductor_graphs_after_first_call"] = len(graphs)
    out1b = compiled(x)  # second call, no change
    summary["n_inductor_graphs_after_second_call"] = len(graphs)
    torch.save({"eager": eager, "compiled": out1}, f"{outdir}/out.pt")

    for i, c in enumerate(codes1):
        with open(f"{outdir}/code_{i}.py", "w") as f: f.write(c)

    # --- analyze the post-grad graph --------------------------------------------------------------------------
    g = graphs[-1]
    with open(f"{outdir}/graph.txt", "w") as f: f.write(str(g))
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    getattrs = [n for n in g.nodes if n.op == "get_attr"]
    def _val(n):
        v = n.meta.get("val", None)
        return v
    def _dt(n):
        v = _val(n)
        if isinstance(v, torch.Tensor):
            return str(v.dtype), tuple(v.shape)
        gm = g.owning_module
        if n.op == "get_attr" and gm is not None and hasattr(gm, n.target):
            t = getattr(gm, n.target)
            if isinstance(t, torch.Tensor):
                return str(t.dtype), tuple(t.shape)
        return None, None
    convert_ops = {"prims.convert_element_type.default", "aten._to_copy.default", "aten.to.dtype"}
    converts = [n for n in g.nodes if n.op == "call_function" and str(n.target) in convert_ops]
    conv_of_inputs = []
    for n in converts:
        src = n.args[0]
        if src.op in ("placeholder", "get_attr"):
            conv_of_inputs.append((src.op, str(src.target), _dt(src)[0], _dt(src)[1], "->", str(n.args[1]) if len(n.args) > 1 else str(n.kwargs)))
    ops = collections.Counter(str(n.target) for n in g.nodes if n.op == "call_function")
    summary["graph"] = {
        "placeholders": [(str(n.target), *_dt(n)) for n in placeholders],
        "get_attr_constants": [(str(n.target), *_dt(n)) for n in getattrs],
        "n_convert_nodes_total": len(converts),
        "convert_nodes_on_graph_inputs_or_constants": conv_of_inputs,
        "op_counts": dict(ops),
    }

    # --- analyze the generated code ---------------------------------------------------------------------------
    code = "\n".join(codes1)
    kernels = re.findall(r"^(cpp_fused_\w+) = async_compile\.cpp", code, re.M)
    kernels += re.findall(r"^(triton_\w+) = async_compile\.triton", code, re.M)
    calls = re.findall(r"^\s+(cpp_fused_\w+)\(", code, re.M)
    externs = collections.Counter(m for m in re.findall(r"(torch\.ops\.[\w\.]+|extern_kernels\.\w+|aten\.[\w\.]+)\(", code))
    summary["code"] = {
        "n_kernel_defs": len(kernels), "kernel_defs": kernels,
        "n_kernel_calls_in_call": len(calls),
        "kernel_calls": calls,
        "kernels_with_to_copy_in_name": [k for k in kernels if "to_copy" in k or "convert" in k],
        "extern_calls": dict(externs),
        "call_signature": re.findall(r"^def call\(.*?\):\n(.*?)\n", code, re.M | re.S)[:1],
        "args_unpack": re.findall(r"^\s+(arg\w+(?:, arg\w+)*,?) = args", code, re.M),
        "frozen_param_mentions": sorted(set(re.findall(r"_frozen_param\d+", code))),
        "constants_mentions": sorted(set(re.findall(r"\b(constant\d+|_tensor_constant\d+)\b", code))),
    }

    def mad(a, b):
        return float((a.float() - b.float()).abs().max())
    summary["maxabs_compiled_vs_eager"] = mad(out1, eager)
    summary["maxabs_compiled_2nd_call_vs_1st"] = mad(out1b, out1)

    # --- staleness: in-place weight change -------------------------------------------------------------------
    with torch.no_grad():
        layer.fc1.weight.add_(1.0)
    eager2 = layer(x)
    n_before = len(graphs)
    out2 = compiled(x)  # NOT run_and_get_code: that calls torch._dynamo.reset()
    codes2 = graphs[n_before:]
    summary["inplace_add"] = {
        "recompiled (new Inductor graph compiled)": len(codes2) > 0,
        "maxabs_eager_after_vs_eager_before": mad(eager2, eager),
        "maxabs_compiled_after_vs_compiled_before": mad(out2, out1),
        "maxabs_compiled_after_vs_eager_after": mad(out2, eager2),
    }
    # --- extra: replace a weight's storage through .data (not in the brief, labeled separately) --------------
    with torch.no_grad():
        layer.fc2.weight.data = layer.fc2.weight.data * 2.0
    eager3 = layer(x)
    n_before = len(graphs)
    out3 = compiled(x)
    codes3 = graphs[n_before:]
    summary["data_assign"] = {
        "recompiled (new Inductor graph compiled)": len(codes3) > 0,
        "maxabs_eager_after_vs_before": mad(eager3, eager2),
        "maxabs_compiled_after_vs_before": mad(out3, out2),
        "maxabs_compiled_after_vs_eager_after": mad(out3, eager3),
    }
    c = torch._dynamo.utils.counters
    summary["dynamo_counters"] = {k: dict(v) for k, v in c.items() if k in ("stats", "frames", "recompiles", "graph_break")}

summary["warnings"] = collections.Counter(caught)
with open(f"{outdir}/summary.json", "w") as f: json.dump(summary, f, indent=1, default=str)
print(json.dumps(summary, indent=1, default=str))
