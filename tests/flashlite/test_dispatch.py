"""flashlite.dispatch: table lookups, the fallback rule, and the dispatch-table generator."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashlite import dispatch
from flashlite._intmath import seq_bucket
from pytest_kernelcheck import assert_close
from flashlite.attention import explain_dispatch as flashlite_explain
from tests.flashlite.tables import use_table

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_h200_table_records_its_origin_and_measured_choices():
    table = dispatch.load_table("nvidia-h200")
    assert table is not None
    assert table["origin"]["gpu"] == "NVIDIA H200" and table["origin"]["commit"] != "unknown"
    assert (ROOT / table["origin"]["source"]).is_file(), "the report a table came from is committed"
    for source in table["origin"].get("sources", []):
        assert (ROOT / source["source"]).is_file() and source["commit"] != "unknown"
    # fp32 case 5 (B=4, S=2048) was a measured win for the kernel; bf16 case 10 (B=128, S=128) a loss (0.861x);
    # bf16 case 3 (B=1, S=8192) a win since its forward runs on the Gluon kernel (1.067x).
    assert table["entries"]["float32/D64/causal/B4/S2048"]["backend"] == "triton"
    assert table["entries"]["bfloat16/D64/causal/B128/S128"]["backend"] == "sdpa"
    assert table["entries"]["bfloat16/D64/causal/B1/S8192"]["backend"] == "triton"


def test_a_table_without_the_kernels_source_hash_decides_nothing_and_says_so():
    # The shipped table was measured before tables recorded the kernels' source hash: its entries are about kernel
    # code that may no longer run, so the rule decides each call, and the reason names the entry set aside.
    table = dispatch.load_table("nvidia-h200")
    assert all("kernel_hash" not in entry for entry in table["entries"].values())
    assert "kernel_hash" not in table["origin"]
    win = dispatch._decide("nvidia-h200", torch.bfloat16, 64, True, 1, 8192)
    assert win.backend == "sdpa" and "nvidia-h200 table entry not used" in win.reason
    assert "no kernel source hash recorded" in win.reason and dispatch.kernel_source_hash() in win.reason
    assert "rule: SDPA unless a measurement says otherwise" in win.reason
    fp32 = dispatch._decide("nvidia-h200", torch.float32, 64, True, 4, 2048)
    assert fp32.backend == "triton" and "not used" in fp32.reason and "rule: float32" in fp32.reason


def test_an_entry_measured_on_other_kernel_code_is_set_aside_in_explain_dispatch(monkeypatch):
    key = dispatch.table_key(torch.float32, 16, True, 2, 24)
    current = dispatch.kernel_source_hash()
    other = "0123456789abcdef" if current != "0123456789abcdef" else "fedcba9876543210"
    q = torch.randn(2, 4, 24, 16)
    use_table(monkeypatch, {key: {"backend": "sdpa", "why": "measured loss"}})
    measured_here = dispatch._decide("test-gpu-y", torch.float32, 16, True, 2, 24)
    assert measured_here.backend == "sdpa" and "measured loss" in measured_here.reason
    # The same entry, measured on other kernel sources (the origin's hash, or the entry's own after a merge).
    use_table(monkeypatch, {key: {"backend": "sdpa", "why": "measured loss"}}, origin={"kernel_hash": other})
    assert dispatch._decide("test-gpu-y", torch.float32, 16, True, 2, 24).backend == "triton"
    use_table(monkeypatch, {key: {"backend": "sdpa", "why": "measured loss", "kernel_hash": other}})
    stale = dispatch._decide("test-gpu-y", torch.float32, 16, True, 2, 24)
    assert stale.backend == "triton" and f"kernel source hash {other}" in stale.reason
    assert f"this code {current}" in stale.reason and "measured loss" not in stale.reason
    # explain_dispatch gives the same reason (the CPU tensors pretend to be on the made-up GPU).
    monkeypatch.setattr(dispatch, "_slug_of", lambda q: "test-gpu-y")
    from flashlite.attn import problem as problem_module
    monkeypatch.setattr(problem_module._runtime, "kernel_device_ok", lambda t: True)
    explained = flashlite_explain(q, q[:, :4], q[:, :4], causal=True)
    assert explained.backend == "triton" and "not used: measured on other kernel code" in explained.reason


def test_the_kernel_source_hash_follows_every_measured_file():
    package = ROOT / "flashlite"
    files = {path: (package / path).read_bytes() for path in dispatch.MEASURED_KERNEL_FILES}
    assert dispatch.source_hash(files) == dispatch.kernel_source_hash()
    for path in dispatch.MEASURED_KERNEL_FILES:
        changed = {**files, path: files[path] + b"\n"}
        assert dispatch.source_hash(changed) != dispatch.kernel_source_hash(), path


def test_every_triton_entry_is_a_significant_win():
    table = dispatch.load_table("nvidia-h200")
    for key, entry in table["entries"].items():
        if entry["backend"] == "triton":
            assert "Benjamini-Hochberg: win" in entry["why"] and entry["speedup"] > 1, key


def test_fallback_rule_for_shapes_and_gpus_without_an_entry():
    unknown_gpu = dispatch._decide("some-new-gpu", torch.bfloat16, 64, True, 3, 3000)
    assert unknown_gpu.backend == "sdpa" and "no dispatch table for some-new-gpu" in unknown_gpu.reason
    fp32 = dispatch._decide("some-new-gpu", torch.float32, 64, True, 3, 3000)
    assert fp32.backend == "triton" and "float32" in fp32.reason
    unmeasured_batch = dispatch._decide("nvidia-h200", torch.bfloat16, 64, True, 3, 3000)
    assert unmeasured_batch.backend == "sdpa" and "no nvidia-h200 table entry" in unmeasured_batch.reason
    cpu = dispatch.choose_backend(torch.randn(1, 2, 8, 16), causal=True, seq_k=8)
    assert cpu.backend == "sdpa" and "CPU" in cpu.reason
    assert dispatch.choose_backend(torch.randn(1, 2, 8, 16), causal=True, seq_k=8,
                                   unsupported="head dim 300").reason.endswith("head dim 300")


def test_a_table_decision_compiles_without_a_graph_break(monkeypatch):
    # On a GPU the decision reads the shipped table; Dynamo cannot trace file access, so under torch.compile the
    # decision is taken as a constant at trace time. Pretend these CPU tensors live on an H200.
    monkeypatch.setattr(dispatch, "_slug_of", lambda q: "nvidia-h200")
    dispatch.load_table.cache_clear()
    monkeypatch.setattr(dispatch, "_TABLES", {})

    def pick(q):
        decision = dispatch.choose_backend(q, causal=True, seq_k=q.shape[2])
        return q + 1 if decision.backend == "triton" else q - 1

    fp32 = torch.randn(4, 16, 2048, 64)  # case 5 in float32: a measured win for the kernel in the shipped table
    bf16 = torch.randn(16, 16, 1024, 64, dtype=torch.bfloat16)  # case 7 in bfloat16: a measured loss
    for dtype_first in (fp32, bf16):  # a fresh compile for each: the second shape would make sizes dynamic
        torch._dynamo.reset()
        compiled = torch.compile(pick, fullgraph=True, backend="eager")
        expected = dtype_first + 1 if dtype_first.dtype == torch.float32 else dtype_first - 1
        torch.testing.assert_close(compiled(dtype_first), expected)
    # Dynamic sizes: the table lookup is traced with guards on the sizes it reads, so each shape still decides.
    torch._dynamo.reset()
    dynamic = torch.compile(pick, fullgraph=True, backend="eager", dynamic=True)
    torch.testing.assert_close(dynamic(fp32), fp32 + 1)
    torch.testing.assert_close(dynamic(bf16), bf16 - 1)


def test_compiled_calls_follow_the_decision_for_their_gradient(monkeypatch):
    # Under torch.compile the plan is made at trace time, where grad mode and requires_grad are known (and guarded):
    # a training graph must hold what the forward+backward entry chose, an inference graph the forward's choice.
    from flashlite.attention import attention
    use_table(monkeypatch, {"float32/D16/causal/B1/S64": {"backend": "triton", "why": "forward win"},
                            "float32/D16/causal/B1/S64/fwd+bwd": {"backend": "sdpa", "why": "forward+backward loss"}})
    graphs = []

    def record_graph(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm.forward

    gen = torch.Generator().manual_seed(5)
    # On the device the kernel runs on (on a GPU machine a CPU tensor would go to SDPA whatever the table says).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen).to(device) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(*(t.double() for t in (q, k, v)), is_causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=True), fullgraph=True, backend=record_graph)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    out.sum().backward()
    assert all(leaf.grad is not None for leaf in leaves)
    # Each path against float64 (on a GPU the kernel's float32 default is tf32, SDPA's is not).
    assert_close(out, reference, policy="tf32")
    with torch.no_grad():
        assert_close(compiled(q, k, v), reference, policy="tf32")
    assert len(graphs) == 2, graphs
    assert any("scaled_dot_product_attention" in t for t in graphs[0]), graphs[0]
    assert not any("flashlite" in t for t in graphs[0]), graphs[0]
    assert any("flashlite.attention_inference" in t for t in graphs[1]), graphs[1]


def test_seq_bucket_and_key():
    assert [seq_bucket(s) for s in (1, 64, 65, 100_000)] == [64, 64, 128, 131072]
    assert dispatch.table_key(torch.float16, 80, "lower_right", 2, 300) == "float16/D80/lower_right/B2/S512"
    with pytest.raises(ValueError, match="positive"):
        seq_bucket(0)


def test_a_table_missing_its_origin_is_rejected(tmp_path, monkeypatch):
    (tmp_path / "broken-gpu.json").write_text(json.dumps({"entries": {}}))
    monkeypatch.setattr(dispatch, "TABLE_DIR", tmp_path)
    dispatch.load_table.cache_clear()
    try:
        with pytest.raises(ValueError, match="origin"):
            dispatch.load_table("broken-gpu")
    finally:
        dispatch.load_table.cache_clear()


GOOD_ENTRY = {"backend": "triton", "why": "Triton 1.20x SDPA, win", "speedup": 1.2}
DAMAGED_TABLES = {
    # name: (text of nvidia-h200.json, words of the error). Each was read before, and misread: the backend word
    # reported by explain_dispatch while SDPA ran, a key never looked up, a repeated key decided by file order, a
    # table of another GPU deciding this one's calls, a bare KeyError or JSONDecodeError at the first call.
    "backend word": ({"entries": {"float32/D16/causal/B1/S64": {**GOOD_ENTRY, "backend": "Triton"}}},
                     r"entry 'float32/D16/causal/B1/S64': backend 'Triton' is not one of triton, sdpa"),
    "no backend": ({"entries": {"float32/D16/causal/B1/S64": {"why": "?"}}}, r"backend None is not one of"),
    "entry not an object": ({"entries": {"float32/D16/causal/B1/S64": "triton"}}, r"backend 'triton' is not one"),
    "key form": ({"entries": {"bf16/D64/causal/B1/S64": GOOD_ENTRY}}, r"entry key 'bf16/D64/causal/B1/S64' is not"),
    "negative batch": ({"entries": {"float32/D16/causal/B-8/S64": GOOD_ENTRY}}, r"is not of table_key's form"),
    "nan speedup": ({"entries": {"float32/D16/causal/B1/S64": {**GOOD_ENTRY, "speedup": float("nan")}}},
                    r"speedup nan is not a finite number above 0"),
    "another gpu": ({"origin": {"gpu": "NVIDIA A100-SXM4-80GB"}, "entries": {}},
                    r"origin.gpu is 'NVIDIA A100-SXM4-80GB', but the table is for 'nvidia-h200'"),
    "entries a list": ({"entries": []}, r"needs 'origin' and 'entries', each a JSON object"),
    "repeated key": ('{"origin": {"gpu": "NVIDIA H200"}, "entries": {"float32/D16/causal/B1/S64": '
                     '{"backend": "triton"}, "float32/D16/causal/B1/S64": {"backend": "sdpa"}}}',
                     r"key 'float32/D16/causal/B1/S64' appears twice"),
    "not json": ('{"origin": {"gpu": "NVIDIA H200"}, "entries": {"float32', r"not a readable dispatch table"),
}


@pytest.mark.parametrize("case", DAMAGED_TABLES)
def test_a_damaged_or_foreign_table_is_refused_naming_the_file_and_field(tmp_path, monkeypatch, case):
    content, words = DAMAGED_TABLES[case]
    if isinstance(content, dict):
        content = json.dumps({"origin": {"gpu": "NVIDIA H200", "date": "2026-01-02", "commit": "abc"}, **content})
    (tmp_path / "nvidia-h200.json").write_text(content)
    monkeypatch.setattr(dispatch, "TABLE_DIR", tmp_path)
    dispatch.load_table.cache_clear()
    try:
        with pytest.raises(ValueError, match=words) as raised:
            dispatch.load_table("nvidia-h200")
        assert str(tmp_path / "nvidia-h200.json") in str(raised.value)
    finally:
        dispatch.load_table.cache_clear()


def _generate(tmp_path, report: dict):
    """(the finished run, its output folder) of tools/make_dispatch_table.py on ``report``, as commit abc123."""
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    out = tmp_path / "tables"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "make_dispatch_table.py"), str(path),
                           "--commit", "abc123", "--out", str(out)], capture_output=True, text=True, check=True)
    return done, out


def test_generator_turns_a_report_into_a_table(tmp_path):
    def record(B, S, verdict, verdict_bh, speedup):
        return {"name": "fwd triton vs sdpa torch.bfloat16", "nodeid": "t", "verdict": verdict,
                "verdict_bh": verdict_bh, "speedup": speedup, "ci": [speedup * 0.9, None], "n_pairs": 40,
                "shape": {"B": B, "S": S, "H": 16, "D": 64, "dtype": "torch.bfloat16"}}

    report = {"created": "2026-01-02T03:04:05+00:00",
              "environment": {"gpu": {"devices": ["Test GPU X"]}, "packages": {"torch": "2.11.0"}},
              "comparisons": [record(256, 64, "win", "win", 1.6), record(1, 128, "win", "inconclusive", 1.05),
                              record(8, 4096, "loss", "loss", 0.9),
                              {"name": "something else", "verdict": "win", "shape": {"B": 1}}]}
    done, out = _generate(tmp_path, report)
    assert "3 entries, 1 use the Triton kernel" in done.stdout
    table = json.loads((out / "test-gpu-x.json").read_text())
    assert table["origin"]["commit"] == "abc123" and table["origin"]["date"] == "2026-01-02"
    # abc123 is no commit of this clone: the hash is this checkout's kernels', and the script says so.
    assert table["origin"]["kernel_hash"] == dispatch.kernel_source_hash()
    assert "of this checkout's kernels (commit abc123 is not in this clone)" in done.stdout
    entries = table["entries"]
    assert entries["bfloat16/D64/causal/B256/S64"]["backend"] == "triton"
    # A win that does not survive the correction across shapes is not trusted.
    assert entries["bfloat16/D64/causal/B1/S128"]["backend"] == "sdpa"
    assert entries["bfloat16/D64/causal/B8/S4096"]["backend"] == "sdpa"


def test_generator_reads_variant_comparisons_against_the_sdpa_path_only(tmp_path):
    def record(name, variant, verdict, speedup=2.0):
        return {"name": name, "nodeid": "t", "verdict": verdict, "verdict_bh": verdict, "speedup": speedup,
                "ci": [speedup * 0.9, speedup * 1.1], "n_pairs": 20,
                "shape": {"variant": variant, "B": 1, "S": 8192, "H": 16, "D": 64, "dtype": "torch.bfloat16"}}

    report = {"created": "2026-01-02T03:04:05+00:00", "environment": {"gpu": {"devices": ["Test GPU X"]}},
              "comparisons": [record("window 1024 vs sdpa+mask", "window", "win"),
                              record("softcap vs materialized", "softcap", "loss", 0.8),
                              # the forward and backward together: an entry of its own
                              record("fwd+bwd window 1024 vs sdpa+mask", "window", "win"),
                              # not a choice auto makes between the kernel and SDPA:
                              record("alibi vs flex", "alibi", "win"),
                              record("fwd+bwd alibi vs flex", "alibi", "win"),
                              # packed sequences decide by their forward only
                              record("fwd+bwd varlen vs sdpa padded", "varlen", "win"),
                              # a dense comparison named like a variant's is not read as one
                              record("dense vs sdpa+mask", "dense", "win"),
                              record("fwd+bwd dense vs sdpa+mask", "dense", "win")]}
    done, out = _generate(tmp_path, report)
    assert "3 entries, 2 use the Triton kernel" in done.stdout
    entries = json.loads((out / "test-gpu-x.json").read_text())["entries"]
    assert entries["bfloat16/D64/causal/B1/S8192/window"]["backend"] == "triton"
    assert entries["bfloat16/D64/causal/B1/S8192/softcap"]["backend"] == "sdpa"
    assert entries["bfloat16/D64/causal/B1/S8192/window/fwd+bwd"]["backend"] == "triton"
    # the key the generator writes is the key the dispatch reads
    assert dispatch.table_key(torch.bfloat16, 64, True, 1, 8192, "window") == "bfloat16/D64/causal/B1/S8192/window"


def test_a_measured_combined_variant_loads_and_decides_its_calls(tmp_path, monkeypatch):
    # A call with several variants (key padding and a window, here) is keyed by validation's parts joined by "+";
    # the generator writes that key, and the table holding it must load on the GPU it was measured on, and decide.
    from flashlite.attn.problem import validate

    q = torch.randn(2, 4, 64, 16)
    problem = validate(q, q, q, True, None, torch.rand(2, 64) > 0.2, None, "auto", None, window=(32, 0))
    assert problem.variant == "key_padding+window"
    report = {"created": "2026-01-02T03:04:05+00:00", "environment": {"gpu": {"devices": ["Test GPU X"]}},
              "comparisons": [{"name": name, "nodeid": "t", "verdict": "loss", "verdict_bh": "loss",
                               "speedup": 0.8, "ci": [0.75, 0.85], "n_pairs": 20,
                               "shape": {"variant": problem.variant, "B": 2, "S": 64, "H": 4, "D": 16,
                                         "dtype": "torch.float32"}}
                              for name in ("padded window vs sdpa+mask", "fwd+bwd padded window vs sdpa+mask")]}
    _, out = _generate(tmp_path, report)
    monkeypatch.setattr(dispatch, "TABLE_DIR", out)
    dispatch.load_table.cache_clear()
    try:
        table = dispatch.load_table("test-gpu-x")
    finally:
        dispatch.load_table.cache_clear()
    for backward in (False, True):
        key = dispatch.table_key(torch.float32, 16, True, 2, 64, problem.variant, backward)
        assert table["entries"][key]["backend"] == "sdpa"
    monkeypatch.setitem(dispatch._TABLES, "test-gpu-x", table)
    monkeypatch.setattr(dispatch, "_table_loaded", lambda name: True)
    decision = dispatch._decide("test-gpu-x", torch.float32, 16, True, 2, 64, problem.variant)
    assert decision.backend == "sdpa" and "test-gpu-x table (key_padding+window)" in decision.reason


def test_generator_keys_forward_backward_comparisons_apart_from_forward_ones(tmp_path):
    def record(name, B, verdict, speedup):
        return {"name": name, "nodeid": "t", "verdict": verdict, "verdict_bh": verdict, "speedup": speedup,
                "ci": [speedup * 0.95, speedup * 1.05], "n_pairs": 30,
                "shape": {"B": B, "S": 4096, "H": 16, "D": 64, "dtype": "torch.bfloat16"}}

    report = {"created": "2026-01-02T03:04:05+00:00", "environment": {"gpu": {"devices": ["Test GPU X"]}},
              "comparisons": [record("fwd triton vs sdpa torch.bfloat16", 8, "win", 1.04),
                              record("fwd+bwd triton vs sdpa", 8, "loss", 0.93),
                              record("fwd+bwd triton vs sdpa", 3, "win", 1.2),
                              record("fwd+bwd triton vs sdpa", 5, "win", 1.1),
                              # the Gluon backward's own A/B is not what auto chooses between
                              record("fwd+bwd D64 gluon backward vs sdpa", 6, "win", 1.1),
                              # auto's own rows: a loss overrides the kernel's win (listed before it on purpose:
                              # auto's rows are read last), a win or a tie changes nothing
                              record("fwd+bwd auto vs sdpa", 5, "loss", 0.92),
                              record("fwd+bwd auto vs sdpa", 3, "tie", 1.0),
                              record("fwd+bwd auto vs sdpa", 8, "win", 1.1)]
              }
    report["comparisons"].insert(0, report["comparisons"].pop(-3))
    done, out = _generate(tmp_path, report)
    assert "4 entries, 2 use the Triton kernel" in done.stdout
    entries = json.loads((out / "test-gpu-x.json").read_text())["entries"]
    assert entries["bfloat16/D64/causal/B8/S4096"]["backend"] == "triton"
    assert entries["bfloat16/D64/causal/B8/S4096/fwd+bwd"]["backend"] == "sdpa"
    assert entries["bfloat16/D64/causal/B3/S4096/fwd+bwd"]["backend"] == "triton"
    overridden = entries["bfloat16/D64/causal/B5/S4096/fwd+bwd"]
    assert overridden["backend"] == "sdpa" and "auto's own row" in overridden["why"]
    key = dispatch.table_key(torch.bfloat16, 64, True, 8, 4096, backward=True)
    assert key == "bfloat16/D64/causal/B8/S4096/fwd+bwd"


def test_forward_backward_decisions_read_their_own_entries_then_the_rule(monkeypatch):
    table = use_table(monkeypatch, {
        "bfloat16/D64/causal/B8/S4096": {"backend": "triton", "why": "forward win"},
        "bfloat16/D64/causal/B8/S4096/fwd+bwd": {"backend": "sdpa", "why": "forward+backward loss"}})
    forward = dispatch._decide("test-gpu-y", torch.bfloat16, 64, True, 8, 4096)
    backward = dispatch._decide("test-gpu-y", torch.bfloat16, 64, True, 8, 4096, backward=True)
    assert forward.backend == "triton" and "forward win" in forward.reason
    assert backward.backend == "sdpa" and "(forward+backward)" in backward.reason and "loss" in backward.reason
    # Without a forward+backward entry a dense 16-bit call takes SDPA, even where its forward entry says kernel.
    monkeypatch.setitem(table["entries"], "bfloat16/D64/causal/B2/S4096", {"backend": "triton", "why": "win"})
    unmeasured = dispatch._decide("test-gpu-y", torch.bfloat16, 64, True, 2, 4096, backward=True)
    assert unmeasured.backend == "sdpa" and "forward+backward measurement" in unmeasured.reason
    # The rules for float32 and for variants stand (SDPA has no fast path for either).
    assert dispatch._decide("test-gpu-y", torch.float32, 64, True, 2, 4096, backward=True).backend == "triton"
    window = dispatch._decide("test-gpu-y", torch.bfloat16, 64, True, 2, 4096, "window", backward=True)
    assert window.backend == "triton" and "(window, forward+backward)" in window.reason


def test_generator_merges_reports_newest_last(tmp_path):
    def report(created, records):
        return {"created": created, "environment": {"gpu": {"devices": ["Test GPU X"]}},
                "comparisons": [{"name": f"fwd triton vs sdpa {dtype}", "verdict": v, "verdict_bh": v,
                                 "speedup": sp, "ci": [sp * 0.9, sp * 1.1], "n_pairs": 20,
                                 "shape": {"B": 4, "S": 2048, "H": 16, "D": 64, "dtype": dtype}}
                                for dtype, v, sp in records]}

    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(report("2026-01-01T00:00:00", [("torch.bfloat16", "win", 1.5),
                                                            ("torch.float16", "loss", 0.8)])))
    new.write_text(json.dumps(report("2026-02-01T00:00:00", [("torch.float16", "win", 1.4)])))
    out = tmp_path / "tables"
    script = str(ROOT / "tools" / "make_dispatch_table.py")
    done = subprocess.run([sys.executable, script, str(old), str(new), "--commit", "aaa", "bbb", "--out", str(out)],
                          capture_output=True, text=True, check=True)
    assert "2 entries, 2 use the Triton kernel" in done.stdout
    table = json.loads((out / "test-gpu-x.json").read_text())
    assert [s["commit"] for s in table["origin"]["sources"]] == ["aaa", "bbb"]
    assert table["entries"]["float16/D64/causal/B4/S2048"]["commit"] == "bbb"  # the newer report replaced it
    assert table["entries"]["bfloat16/D64/causal/B4/S2048"]["commit"] == "aaa"
    mismatched = subprocess.run([sys.executable, script, str(old), str(new), "--commit", "aaa", "--out", str(out)],
                                capture_output=True, text=True)
    assert mismatched.returncode != 0 and "--commit needs one value per report" in mismatched.stderr
    # Each merged entry keeps the kernel hash of the report it came from.
    subprocess.run([sys.executable, script, str(old), str(new), "--kernel-hash", "a" * 16, "b" * 16, "--out",
                    str(out)], capture_output=True, text=True, check=True)
    table = json.loads((out / "test-gpu-x.json").read_text())
    assert table["entries"]["float16/D64/causal/B4/S2048"]["kernel_hash"] == "b" * 16
    assert table["entries"]["bfloat16/D64/causal/B4/S2048"]["kernel_hash"] == "a" * 16
    assert [s["kernel_hash"] for s in table["origin"]["sources"]] == ["a" * 16, "b" * 16]


def test_generator_hashes_the_kernels_of_the_commit_a_report_measured(tmp_path):
    # A commit this clone has: the hash of its kernel files (HEAD's, which this checkout's kernels are unless
    # edited), and a report whose tree was dirty takes this checkout's files instead.
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "flashlite/kernels"],
                           capture_output=True, text=True)
    if head.returncode != 0 or dirty.stdout.strip():
        pytest.skip("needs a git clone whose kernel files are those of its HEAD commit")
    report = {"created": "2026-01-02T03:04:05+00:00", "environment": {
        "gpu": {"devices": ["Test GPU X"]}, "commit_info": {"id": head.stdout.strip(), "dirty": False}},
        "comparisons": [{"name": "fwd triton vs sdpa torch.bfloat16", "nodeid": "t", "verdict": "win",
                         "verdict_bh": "win", "speedup": 1.2, "ci": [1.1, 1.3], "n_pairs": 20,
                         "shape": {"B": 4, "S": 2048, "H": 16, "D": 64, "dtype": "torch.bfloat16"}}]}
    path, out = tmp_path / "report.json", tmp_path / "tables"
    path.write_text(json.dumps(report))
    script = str(ROOT / "tools" / "make_dispatch_table.py")
    done = subprocess.run([sys.executable, script, str(path), "--out", str(out)], capture_output=True, text=True,
                          check=True)
    assert f"of the kernels at commit {head.stdout.strip()}" in done.stdout
    assert json.loads((out / "test-gpu-x.json").read_text())["origin"]["kernel_hash"] == dispatch.kernel_source_hash()
    report["environment"]["commit_info"]["dirty"] = True
    path.write_text(json.dumps(report))
    done = subprocess.run([sys.executable, script, str(path), "--out", str(out)], capture_output=True, text=True,
                          check=True)
    assert "of this checkout's kernels (its tree was dirty)" in done.stdout


def test_decoding_entries_key_on_the_mode_attention_with_kvcache_looks_up(tmp_path, monkeypatch):
    # Decoding comparisons are read against attention_with_kvcache's own SDPA path only; a bare SDPA call with a
    # length mask is not what auto would run instead. The generator keys them on causal "lower_right" (the A/B
    # shapes name no causal mode), which is the key attention_with_kvcache's dispatch reads.
    import importlib
    kvcache = importlib.import_module("flashlite.attn.kvcache")

    def record(name, variant, verdict, speedup):
        return {"name": name, "nodeid": "t", "verdict": verdict, "verdict_bh": verdict, "speedup": speedup,
                "ci": [speedup * 0.9, speedup * 1.1], "n_pairs": 20,
                "shape": {"variant": variant, "B": 3, "S": 80, "H": 4, "H_kv": 2, "D": 16, "dtype": "torch.float32"}}

    report = {"created": "2026-01-02T03:04:05+00:00", "environment": {"gpu": {"devices": ["Test GPU X"]}},
              "comparisons": [record("decode kvcache triton vs sdpa path", "kvcache", "win", 1.3),
                              record("decode kvcache_paged vs sdpa+lengths", "kvcache_paged", "loss", 0.7)]}
    done, out = _generate(tmp_path, report)
    assert "1 entries, 1 use the Triton kernel" in done.stdout
    table = json.loads((out / "test-gpu-x.json").read_text())
    assert list(table["entries"]) == ["float32/D16/lower_right/B3/S128/kvcache"]  # S bucketed up

    # The decision attention_with_kvcache takes for a call of that shape reads the entry (the kernel is stood in
    # as runnable, and the call stops once it has decided).
    use_table(monkeypatch, table["entries"], slug="test-gpu-x", origin=table["origin"])
    monkeypatch.setattr(importlib.import_module("flashlite.attn.decide"), "kernel_unsupported",
                        lambda *a, **kw: None)
    decided = []

    class Decided(Exception):
        pass

    def record_decision(*args, **kwargs):
        decided.append(real_decide(*args, **kwargs))
        raise Decided

    real_decide = kvcache.decide
    monkeypatch.setattr(kvcache, "decide", record_decision)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 1, 16, generator=gen)
    k_cache, v_cache = torch.randn(3, 2, 80, 16, generator=gen), torch.randn(3, 2, 80, 16, generator=gen)
    with pytest.raises(Decided):
        kvcache.attention_with_kvcache(q, k_cache, v_cache, torch.tensor([5, 80, 41], dtype=torch.int32))
    assert decided[0].backend == "triton" and "test-gpu-x table (kvcache)" in decided[0].reason, decided[0].reason


def test_a_decoding_entry_takes_the_kernel_only_where_every_measured_mode_won(tmp_path):
    # A decoding step runs from an idle GPU (generation) and in a CUDA graph (servers): a back-to-back win with a
    # latency tie is no reason to send those calls to the kernel. Dense rows still decide by their verdict alone.
    def mode(name, verdict, speedup):
        return {"mode": name, "verdict": verdict, "speedup": speedup, "ci": [speedup - 0.05, speedup + 0.05],
                "n_pairs": 20}

    def decode_row(S, modes):
        return _row(B=3, S=S, speedup=1.3, ci=[1.2, 1.4], name="decode kvcache triton vs sdpa path",
                    nodeid=f"t::S{S}", shape={"variant": "kvcache", "H_kv": 2}, mode="throughput", modes=modes)

    won = [mode("throughput", "win", 1.3), mode("latency", "win", 1.2), {"mode": "graph", "unavailable": "no"}]
    tied = [mode("throughput", "win", 1.3), mode("latency", "tie", 0.99), mode("graph", "win", 1.3)]
    dense = _row(S=256, mode="throughput", modes=tied)
    done, out = _generate(tmp_path, _report([decode_row(80, won), decode_row(1000, tied), dense]))
    entries = json.loads((out / "test-gpu-x.json").read_text())["entries"]
    assert entries["bfloat16/D64/lower_right/B3/S128/kvcache"]["backend"] == "triton"
    tied_entry = entries["bfloat16/D64/lower_right/B3/S1024/kvcache"]
    assert tied_entry["backend"] == "sdpa" and "not a win from latency: tie 0.99x" in tied_entry["why"]
    assert entries["bfloat16/D64/causal/B8/S256"]["backend"] == "triton"


def _row(B=8, S=256, verdict="win", verdict_bh="win", speedup=1.4, **extra):
    shape = {"B": B, "S": S, "H": 16, "D": 64, "dtype": "torch.bfloat16", **extra.pop("shape", {})}
    return {"name": "fwd triton vs sdpa torch.bfloat16", "nodeid": f"t::B{B}-S{S}", "verdict": verdict,
            "verdict_bh": verdict_bh, "speedup": speedup, "ci": [1.1, 1.7], "n_pairs": 40, "shape": shape, **extra}


def _report(rows, devices=("Test GPU X",), created="2026-01-02T03:04:05+00:00"):
    return {"created": created, "environment": {"gpu": {"devices": list(devices)}, "packages": {"torch": "2.11.0"}},
            "comparisons": rows}


BAD_REPORTS = {
    # name: (report, words of the exit message). Each wrote a table before: a kernel entry from a NaN, negative or
    # losing speedup, a key with a negative batch, a row of another GPU, an order-dependent key, an empty table.
    "nan speedup": (_report([_row(speedup=float("nan"))]), r"field 'speedup': nan is refused"),
    "negative speedup": (_report([_row(speedup=-2.0)]), r"field 'speedup': -2.0 is refused"),
    "verdicts disagree": (_report([_row(verdict="loss", speedup=0.8, ci=[0.7, 0.9])]), r"the row contradicts itself"),
    "no bh verdict": (_report([_row(verdict_bh=None)]), r"verdict_bh None is not one of"),
    "bh verdict word": (_report([_row(verdict_bh="WIN")]), r"verdict_bh 'WIN' is not one of"),
    "negative batch": (_report([_row(B=-8)]), r"shape B=-8 is not a whole number >= 1"),
    "bool batch": (_report([_row(B=True)]), r"shape B=True is not a whole number"),
    "fractional length": (_report([_row(S=256.9)]), r"shape S=256.9 is not a whole number"),
    "causal word": (_report([_row(shape={"causal": "yes"})]), r"shape causal='yes' is not true, false"),
    "row of another gpu": (_report([_row(gpu={"name": "Test GPU Y"})]), r"measured on 'Test GPU Y', not on"),
    "several models": (_report([_row()], devices=("Test GPU X", "Test GPU Y")), r"several GPU models"),
    "conflicting rows": (_report([_row(S=200), _row(S=256, verdict="loss", verdict_bh="loss", speedup=0.9,
                                                     ci=[0.8, 0.95])]),
                         r"gives key 'bfloat16/D64/causal/B8/S256' sdpa, where comparison .* gives it triton"),
    "nothing measured": (_report([]), r"no comparison of the kernel against SDPA"),
    "no date": (_report([_row()], created=None), r"'created' is None"),
}


@pytest.mark.parametrize("case", BAD_REPORTS)
def test_the_generator_refuses_a_report_that_cannot_support_a_table(tmp_path, case):
    report, words = BAD_REPORTS[case]
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "make_dispatch_table.py"), str(path), "--out",
                           str(tmp_path / "tables")], capture_output=True, text=True)
    assert done.returncode != 0 and not (tmp_path / "tables").exists(), done.stdout
    assert re.search(words, done.stderr), done.stderr
    assert str(path) in done.stderr  # the report is named


def test_merged_reports_take_the_newer_dates_entries_whatever_the_order_given(tmp_path):
    older = _report([_row()], created="2026-01-01T00:00:00+00:00")
    newer = _report([_row(verdict="loss", verdict_bh="loss", speedup=0.9, ci=[0.8, 0.95])],
                    created="2026-02-01T00:00:00+00:00")
    paths = []
    for name, report in (("newer.json", newer), ("older.json", older)):  # newest first on the command line
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(report))
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_dispatch_table.py"), *map(str, paths), "--commit",
                    "bbb", "aaa", "--out", str(tmp_path / "tables")], check=True, capture_output=True, text=True)
    table = json.loads((tmp_path / "tables" / "test-gpu-x.json").read_text())
    entry = table["entries"]["bfloat16/D64/causal/B8/S256"]
    assert entry["backend"] == "sdpa" and entry["date"] == "2026-02-01"
    assert table["origin"]["date"] == "2026-02-01"
