"""Compiling flashlite's kernels for sm_90 (Hopper) on a machine without a GPU, for tests.

``SM90_COMPILER`` is the start of a script, run in a fresh interpreter (``run_script``) because the interpreter
switch (TRITON_INTERPRET) is read when the kernels are defined: it defines ``compile_for_sm90(fn, blocks, ...)``,
which specializes a kernel the way a launch with contiguous [B, H, S, D] tensors does and compiles it.
"""
import subprocess
import sys

SM90_COMPILER = r'''
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
    pointers = dict(Lse="*fp32", Delta="*fp32", KeyMask="*u8", KeyLen="*i64", KeyStart="*i64", Alibi="*fp32",
                    CuSeqQ="*i32", CuSeqK="*i32", BlockTable="*i32")
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
'''


# The start of a script that compiles Gluon kernels for sm_90: ``compile_gluon(fn, args, meta, options)`` specializes
# ``fn`` as a launch with the positional ``args`` (descriptors, pointers, Python ints and floats) and the
# constexprs and launch options in ``meta`` would, and returns the compiled kernel with ptxas's register and spill
# counts per function and the codes of its notes that it serialized the kernel's wgmma instructions (C7510-C7519,
# "Potential Performance Loss: wgmma.mma_async instructions are serialized due to ..."): ptxas does that to a whole
# kernel when it finds any wgmma whose registers other instructions read or write while it may be in flight, which
# took 0.61-0.68x off the backward kernels it happened to.
GLUON_COMPILER = r'''
import contextlib, io, os, re
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

def compile_gluon(fn, args, meta, options):
    signature, constants = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in meta:
            signature[name], constants[name] = "constexpr", meta[name]
        elif isinstance(args[i], float):
            signature[name] = "fp32"
        else:
            signature[name] = mangle_type(args[i])
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed: registers and spills
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(GluonASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
                                options=options)
    report = log.getvalue()
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", report)]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    serialized = sorted(set(re.findall(r"\((C751\d)\) Potential Performance Loss: wgmma", report)))
    return kernel, registers, spills, serialized
'''


def run_script(script: str) -> str:
    """stdout of ``script`` run in a fresh interpreter, which must exit cleanly."""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    # Triton 3.9's bindings report objects still alive at exit (nanobind's leak report, hundreds of lines, harmless):
    # left out, so that a failure shows its traceback rather than the report's tail.
    errors = "".join(line for line in done.stderr.splitlines(keepends=True)
                     if not line.startswith(("nanobind:", " - leaked", " - ... skipped", "See https://nanobind")))
    assert done.returncode == 0, errors[-3000:]
    return done.stdout
