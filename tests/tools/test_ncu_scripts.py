"""The Nsight Compute scripts a GPU session runs as they are (tools/ncu_attention.py, tools/ncu_summary.py):
the summary reads ncu's raw CSV page, and the driver refuses bad arguments by name before it touches a GPU."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(SCRIPTS))
import ncu_summary  # noqa: E402

# The raw page as ncu prints it: its own messages first, a header, a units row, one row per kernel (numbers with
# thousands separators), and the metrics in whatever order the sections collected them.
RAW = '''==PROF== Connected to process 4242 (/usr/bin/python3)
==PROF== Disconnected from process 4242
"ID","Process ID","Process Name","Kernel Name","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed","smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio","smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio","smsp__average_warps_issue_stalled_wait_per_issue_active.ratio","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active","sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active","launch__registers_per_thread"
"","","","","msecond","%","","","","%","%","%","register/thread"
"0","4242","python3","_attn_fwd_pingpong","1.0647","61.30","0.41","2.75","1.20","48.10","22.50","30.90","168"
"1","4242","python3","cudnn_generated_fort_native_sdpa_sm90_flash_fprop","937.3","","1,234.5","0.10","n/a","55.00","20.00","28.00","168"
'''


def test_summary_reads_units_separators_and_orders_stalls():
    kernels = ncu_summary.read_raw_csv(RAW)
    assert [k.name for k in kernels] == ["_attn_fwd_pingpong", "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"]
    ours, theirs = kernels
    assert ours.time_us == pytest.approx(1064.7)  # msecond converted to microseconds
    assert theirs.time_us == pytest.approx(937.3 * 1e3)  # the unit row holds for every row of the column
    assert ncu_summary.stall_reasons(ours) == [("long_scoreboard", 2.75), ("wait", 1.20), ("barrier", 0.41)]
    # "1,234.5" is a number; "n/a" and an empty field are no metric at all.
    assert ncu_summary.stall_reasons(theirs) == [("barrier", 1234.5), ("long_scoreboard", 0.10)]
    assert "sm__throughput.avg.pct_of_peak_sustained_elapsed" not in theirs.values
    assert ncu_summary.pipe_shares(ours) == [("tensor_op_gmma (cycles)", 48.10), ("xu (inst)", 30.90),
                                             ("fma (inst)", 22.50)]
    text = ncu_summary.summary(kernels, top=2)
    first = text.split("\n")
    assert first[0] == "_attn_fwd_pingpong: 1,064.7 us"
    assert "SM % 61.3" in first[1] and "registers per thread 168.0" in first[1]
    assert first[2] == "  pipes: tensor_op_gmma (cycles) 48.1%, xu (inst) 30.9%"
    assert first[3] == "  stalls per issued instruction: long_scoreboard 2.75, wait 1.20"


def test_summary_names_what_is_missing():
    with pytest.raises(ValueError, match="Kernel Name"):
        ncu_summary.read_raw_csv("==PROF== No kernels were profiled.\n")


def test_summary_script_end_to_end(tmp_path):
    raw = tmp_path / "raw.csv"
    raw.write_text(RAW)
    done = subprocess.run([sys.executable, str(SCRIPTS / "ncu_summary.py"), str(raw)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("_attn_fwd_pingpong: 1,064.7 us\n")
    assert "cudnn_generated_fort_native_sdpa_sm90_flash_fprop: 937,300.0 us" in done.stdout


@pytest.mark.parametrize("arguments, named", [(["--sides", "flashlite,cudnn"], "--sides"),
                                              (["--case", "99"], "--case")])
def test_driver_refuses_bad_arguments_by_name(arguments, named):
    done = subprocess.run([sys.executable, str(SCRIPTS / "ncu_attention.py"), *arguments], capture_output=True,
                          text=True, timeout=120, cwd=SCRIPTS.parent)
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr
