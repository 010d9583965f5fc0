
import inspect, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import flashlite
from flashlite.kernels import attention_bwd, attention_fwd

def compile_for_sm90(fn, blocks, *, head_dim=80, block_d=128, causal=2, key_mask="bool", warps=4, stages=3,
                     operand="*bf16", dot="bf16", flags=None):
    # Mirror the JIT's specialization for contiguous [B, H, S, D] inputs: unit strides are constants, pointers
    # and other strides divisible by 16. ``operand``: the q, k, v, out and gradient pointer type. ``flags``: more
    # constexprs, e.g. the variants (WINDOW, SOFTCAP, ALIBI: True).
    pointers = dict(Lse="*fp32", Delta="*fp32", KeyMask="*u8", KeyLen="*i64", Alibi="*fp32")
    constants = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal, KEY_MASK=key_mask, DOT=dot,
                     FLAT_GRID=False, EVEN_M=False, **blocks, **(flags or {}))
    # Constexpr parameters with defaults (BH_PER_PROGRAM, STORE_LSE) take them, as a launch that omits them does.
    for param in fn.params:
        if param.is_constexpr and param.name not in constants and param.default is not inspect.Parameter.empty:
            constants[param.name] = param.default
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.startswith("stride_") and (name.endswith("d") or name == "stride_mask_n"):
            signature[name], constants[name] = "constexpr", 1
        elif name[0].isupper() or name[:2] in ("dO", "dQ", "dK", "dV"):  # tensors: Q, K, ..., dOut, dQ, ...
            signature[name] = pointers.get(name, operand)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if "scale" in name or name == "softcap" else "i32"
            if name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


class _Stopped(Exception):
    pass


def _compile_until(stage, result, fn, blocks, **kwargs):
    # Compile and stop when the compiler reaches ``stage`` (a stage name of the CUDA backend), answering
    # ``result(module, metadata)`` of the stage before it; the later stages (PTX and machine code take most of a
    # compile's time) never run.
    from triton.backends.nvidia.compiler import CUDABackend
    add_stages = CUDABackend.add_stages

    def until(self, stages, options, language):
        add_stages(self, stages, options, language)

        def stop(module, metadata):
            raise _Stopped(result(module, metadata))
        stages[stage] = stop

    CUDABackend.add_stages = until
    try:
        compile_for_sm90(fn, blocks, **kwargs)
    except _Stopped as stopped:
        return stopped.args[0]
    finally:
        CUDABackend.add_stages = add_stages
    raise AssertionError(f"the compile did not reach its {stage!r} stage (a cached kernel skips the stages)")


def shared_memory_for_sm90(fn, blocks, **kwargs):
    # Bytes of shared memory the compiled kernel asks for: Triton fixes them when it lowers to LLVM IR.
    return _compile_until("ptx", lambda module, metadata: metadata["shared"], fn, blocks, **kwargs)


def ttgir_for_sm90(fn, blocks, **kwargs):
    # The TTGIR (Triton GPU IR, after layout assignment and pipelining) of the kernel compiled for sm_90.
    return _compile_until("llir", lambda module, metadata: str(module), fn, blocks, **kwargs)

import json, re
# Dense launches as the launcher makes them: several causal modes, key masks and forward tilings, bf16, D=64.
JOBS = [("fwd", attention_fwd._attn_fwd, dict(BLOCK_M=m, BLOCK_N=64, BH_PER_PROGRAM=p), 1, "none")
        for m in (64, 128) for p in (1, 2, 4)]

def renumbered(lines, keep):
    # Values are named by definition, in order: a name the printer reuses in sibling regions (it derives names
    # from Python variables) gets a fresh number at each definition, and each use the number of the latest one.
    current, out = {}, []
    for line in lines:
        block_args = line.lstrip().startswith("^")

        def rename(m):
            token, rest = m.group(0), line[m.end():]
            if token[1:] in keep:
                return token
            if re.match(r"(:\d+)?\s*=(?!=)", rest) or (block_args and rest.startswith(":")) or token not in current:
                current[token] = f"%v{len(current)}_{sum(1 for _ in out)}"
            return current[token]
        out.append(re.sub(r"%[\w$.\-]+", rename, line))
    # The numbers above carry the line of definition; make them plain counters of first appearance.
    order = {}
    return [re.sub(r"%v\d+_\d+", lambda m: order.setdefault(m.group(0), f"%v{len(order)}"), line) for line in out]

def normalised(ttgir):
    # The function's arguments keep their parameter names in the IR; every other value's name is a hint from the
    # Python variable it came from, or a counter (block arguments are numbered on after the function's, so inserted
    # parameters renumber them): they are renumbered, so that a renamed variable or an inserted parameter changes
    # no line. Locations go too.
    ttgir = re.sub(r"\s*loc\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)", "", ttgir)
    lines = [line for line in ttgir.splitlines() if not line.startswith("#loc")]
    start = next(i for i, line in enumerate(lines) if "tt.func public" in line)
    params = re.findall(r"%([\w$.\-]+): ([^,{)]+)", lines[start])
    body = renumbered(lines[:start] + lines[start + 1:], {name for name, _ in params})
    return {"params": [[name, kind.strip()] for name, kind in params], "body": body}

print(json.dumps([normalised(ttgir_for_sm90(fn, blocks, head_dim=64, block_d=64, causal=causal, key_mask=mask))
                  for _, fn, blocks, causal, mask in JOBS]))

