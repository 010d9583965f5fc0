import torch
from flashlite.attention import attention
from tests.flashlite.tables import use_table
class MP:
    def setattr(self, o, n, v): setattr(o, n, v)
    def setitem(self, d, k, v): d[k] = v
use_table(MP(), {"float32/D16/causal/B3/S64": {"backend": "sdpa", "why": "x"}})
f = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, precision="ieee") * 2 + 1, dynamic=True)
with torch.no_grad():
    for b, s in ((3, 40), (2, 70), (4, 33)):
        q, k, v = (torch.randn(b, 2, s, 16) for _ in range(3))
        out = f(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True) * 2 + 1
        print(b, s, (out.double() - ref).abs().max().item())
from torch._dynamo.utils import counters
print(dict(counters["stats"]))
