import torch, flashlite
from torch._dynamo.utils import counters
from tests.flashlite.tables import use_table
class MP:
    def setattr(self, o, n, v): setattr(o, n, v)
    def setitem(self, d, k, v): d[k] = v
use_table(MP(), {"bfloat16/D16/causal/B3/S64/fwd+bwd": {"backend": "triton", "why": "x"}})
torch.manual_seed(0)
layer = flashlite.TransformerLayer(32, 2)
counters.clear()
compiled = torch.compile(layer, backend="aot_eager", dynamic=True, fullgraph=True)
for b, s in ((3, 40), (2, 70), (4, 33)):
    x = torch.randn(b, s, 32, requires_grad=True)
    y = compiled(x); y.sum().backward()
    print(b, s, x.grad.abs().sum().item())
print(dict(counters["stats"]))
