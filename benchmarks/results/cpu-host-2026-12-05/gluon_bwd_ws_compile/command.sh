# Every Gluon backward config (both schedules, both kernels) compiled for sm_90 on the development CPU, as
# tests/flashlite/test_gluon_bwd_compile.py compiles them, with ptxas's register and spill report.
export TRITON_CACHE_DIR=$(mktemp -d)
python - <<'PY'
import json
from tests.flashlite.test_gluon_bwd_compile import _COMPILE
from tests.flashlite.sm90 import run_script
for d in (64, 128):
    for line in run_script(f"HEAD_DIM = {d}\n" + _COMPILE).splitlines():
        if line.startswith("{"):
            print(json.dumps({"head_dim": d, **json.loads(line)}))
PY
