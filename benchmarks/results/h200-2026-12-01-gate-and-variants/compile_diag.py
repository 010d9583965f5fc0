import os, torch, itertools
import flashlite._attention.plans as plans
from flashlite.attention import attention
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
def make(seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 19, 16, generator=gen)
    k, v = (torch.randn(2, 2, 23, 16, generator=gen) for _ in range(2))
    return tuple(t.to(DEVICE).requires_grad_() for t in (q, k, v))
slopes = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEVICE)
variants = {"all": dict(causal="lower_right", window=(6, 1), softcap=2.0, alibi_slopes=slopes),
            "dense-lr": dict(causal="lower_right"), "window": dict(causal="lower_right", window=(6, 1)),
            "softcap": dict(causal="lower_right", softcap=2.0), "alibi": dict(causal="lower_right", alibi_slopes=slopes),
            "all-nograd": None}
for name, opts in variants.items():
    nograd = opts is None
    opts = variants["all"] if nograd else opts
    torch._dynamo.reset(); plans._PLANS.clear()
    q, k, v = make(9)
    def block(q, k, v):
        return attention(q, k, v, backend="triton", precision="ieee", **opts)
    res = []
    for fn in (block, torch.compile(block, fullgraph=True, backend="aot_eager")):
        for t in (q, k, v): t.grad = None
        if nograd:
            with torch.no_grad(): res.append([fn(q, k, v)])
            continue
        out = fn(q, k, v); out.sum().backward()
        res.append([out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()])
    diffs = [(a - b).abs().max().item() for a, b in zip(*res)]
    cfgs = {str(key[16]): (p.configs, list(p.recorded)) for key, p in plans._PLANS.items()}
    print(f"{name:12s} max|eager-compiled| out,dq,dk,dv = {['%.2e' % d for d in diffs]}")
    for kk, vv in cfgs.items(): print("    plan", kk, vv)
