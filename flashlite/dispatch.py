"""Shape-aware choice between flashlite's Triton kernel and PyTorch's SDPA.

A decision is looked up per (GPU model, dtype, head dim, causal, batch, sequence-length bucket) in a table of
measured A/B verdicts shipped in ``flashlite/dispatch_tables/<gpu>.json``; the table is generated from the JSON
report that ``pytest --kernel-ab --kernel-ab-report`` writes (``tools/make_dispatch_table.py``) and records the
GPU, date and commit it came from, and the source hash of the kernels it measured (``kernel_source_hash``). An
entry measured on other kernel code than this checkout's (another hash, or none recorded) decides nothing: the
call takes the rule below, and its reason says so (``explain_dispatch``), so that a table can never steer calls
to kernel code it never timed. Where no table or entry applies, a fixed rule decides:

* the kernel cannot run the call (CPU tensors without the interpreter, an arbitrary float bias, ...): SDPA;
* float32 inputs on CUDA: the kernel, because SDPA has only its memory-efficient kernel for float32 while the
  Triton kernel uses tensor cores with fp32 accumulation (see ``precision`` in ``flashlite.attention``);
* anything else: SDPA, the safe choice when nothing has been measured.

A call whose gradient will be computed is decided by what was measured for the forward and backward together
(``backward=True``: entries keyed ``.../fwd+bwd``, from the forward+backward comparisons), not by the forward's
entry: the two kernels' backwards differ in speed more than their forwards do, so the faster forward can be the
slower training step. Where no forward+backward entry applies, the same rule decides (a dense bf16/fp16 call: SDPA).

Callers decide once per call signature: ``flashlite.attention`` keeps each decision in the signature's plan.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from flashlite._intmath import seq_bucket

Backend = Literal["triton", "sdpa"]
TABLE_DIR = Path(__file__).with_name("dispatch_tables")


@dataclass(frozen=True)
class Decision:
    """Which implementation runs a call, and why.

    Example:
        >>> Decision("sdpa", "no table entry").backend
        'sdpa'
    """

    backend: Backend
    reason: str


# The kernel sources a dispatch table's measurements depend on, relative to the flashlite package: the Triton and
# Gluon attention kernels, their shared helpers and their configs. A table records their hash; an entry measured on
# other sources is not used. (The launchers are left out: they choose among these kernels by the rules beside them,
# and a refactoring of host code should not throw a table away; a change of the kernels or configs must.)
MEASURED_KERNEL_FILES = ("kernels/attention_common.py", "kernels/attention_fwd.py", "kernels/attention_bwd.py",
                         "kernels/attention_fwd_gluon.py", "kernels/attention_bwd_gluon.py",
                         "kernels/gluon_tiles.py", "kernels/tuning.py", "kernels/attention_decode.py",
                         "kernels/attention_decode_launch.py")


def source_hash(sources: dict[str, bytes]) -> str:
    """The hash a dispatch table records for kernel sources ``sources`` (path in ``MEASURED_KERNEL_FILES`` -> the
    file's bytes): SHA-256 over each path and its bytes, in ``MEASURED_KERNEL_FILES``' order, as 16 hex digits.
    Raises KeyError for a missing file.

    Example:
        >>> files = {path: b"" for path in MEASURED_KERNEL_FILES}
        >>> source_hash(files) == source_hash(dict(reversed(list(files.items()))))
        True
        >>> len(source_hash(files))
        16
    """
    digest = hashlib.sha256()
    for path in MEASURED_KERNEL_FILES:
        content = sources[path]
        digest.update(path.encode() + b"\0" + str(len(content)).encode() + b"\0" + content)
    return digest.hexdigest()[:16]


_KERNEL_HASH: list[str] = []


# Read once per process (the sources do not change under a running program); marked constant for torch.compile,
# which would otherwise trace the file reads (the name lookup of ``_device_slug`` says why on a plain function).
@torch.compiler.assume_constant_result
def kernel_source_hash() -> str:
    """``source_hash`` of this checkout's kernel sources: what a table entry must record to decide a call.

    Example:
        >>> kernel_source_hash() == kernel_source_hash() and len(kernel_source_hash()) == 16
        True
    """
    if not _KERNEL_HASH:
        package = Path(__file__).parent
        _KERNEL_HASH.append(source_hash({path: (package / path).read_bytes() for path in MEASURED_KERNEL_FILES}))
    return _KERNEL_HASH[0]


def gpu_slug(name: str) -> str:
    """File-name form of a GPU model name: ``'NVIDIA H200'`` -> ``'nvidia-h200'``.

    Example:
        >>> gpu_slug("NVIDIA H200")
        'nvidia-h200'
    """
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Suffix of the keys of forward+backward entries (what a call whose gradient is computed looks up).
BACKWARD_SUFFIX = "fwd+bwd"


def table_key(dtype: torch.dtype, head_dim: int, causal: bool | str, batch: int, seq_len: int,
              variant: str = "dense", backward: bool = False) -> str:
    """Key of one entry of a dispatch table; calls with a variant (key padding, window, softcap, ALiBi; see
    ``flashlite.attention``) have entries of their own, named by the variant, and so do calls whose gradient is
    computed (``backward``: the forward and backward measured together).

    Example:
        >>> table_key(torch.bfloat16, 64, True, 64, 256)
        'bfloat16/D64/causal/B64/S256'
        >>> table_key(torch.bfloat16, 64, True, 8, 2048, variant="key_padding")
        'bfloat16/D64/causal/B8/S2048/key_padding'
        >>> table_key(torch.bfloat16, 64, True, 8, 4096, backward=True)
        'bfloat16/D64/causal/B8/S4096/fwd+bwd'
    """
    mode = "causal" if causal is True else ("lower_right" if causal == "lower_right" else "full")
    key = f"{_dtype_name(dtype)}/D{head_dim}/{mode}/B{batch}/S{seq_bucket(seq_len)}"
    if variant != "dense":
        key = f"{key}/{variant}"
    return f"{key}/{BACKWARD_SUFFIX}" if backward else key


@functools.lru_cache(maxsize=None)
def load_table(slug: str) -> dict[str, Any] | None:
    """The dispatch table for a GPU model slug, or None when none is shipped.

    Example:
        >>> load_table("no-such-gpu") is None
        True
    """
    path = TABLE_DIR / f"{slug}.json"
    if not path.is_file():
        return None
    try:
        with path.open() as f:
            table = json.load(f, object_pairs_hook=_refuse_duplicate_keys)
    except (json.JSONDecodeError, _DuplicateKey) as exc:
        raise ValueError(f"{path}: not a readable dispatch table ({exc})") from None
    _check_table(table, slug, path)
    return table


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json keeps the last of repeated keys: two entries for one call would be decided by their order in the file.
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(f"key {key!r} appears twice")
        seen[key] = value
    return seen


# What table_key writes: dtype, head dim, causal mode, batch, sequence bucket, then an optional variant and
# forward+backward suffix. A variant is one part or several joined by "+" (validation's Problem.variant, e.g.
# "key_padding+window"): a form of one part only refused every table holding a measured combined variant, which the
# generator writes from such a comparison, and a refused table fails every call on its GPU.
_KEY = re.compile(r"(float16|bfloat16|float32)/D[1-9][0-9]*/(causal|lower_right|full)/B[1-9][0-9]*/S[1-9][0-9]*"
                  r"(/[a-z_]+(\+[a-z_]+)*)?(/fwd\+bwd)?")
BACKENDS = ("triton", "sdpa")


def _check_table(table: Any, slug: str, path: Path) -> None:
    """ValueError naming ``path`` and the field for a table ``_decide`` would misread: every entry's backend is
    one of ``BACKENDS`` (another word would be reported by explain_dispatch while SDPA ran), its key has
    ``table_key``'s form (another is never looked up), its speedup a finite number above 0 or null, its kernel hash
    (the entry's, else the origin's) 16 hex digits or absent, and the GPU of its origin is the one the file is named
    for (a table measured on another GPU decides nothing here)."""
    if not isinstance(table, dict) or not isinstance(table.get("entries"), dict) or not isinstance(
            table.get("origin"), dict):
        raise ValueError(f"{path}: a dispatch table needs 'origin' and 'entries', each a JSON object")
    measured_on = table["origin"].get("gpu")
    if not isinstance(measured_on, str) or gpu_slug(measured_on) != slug:
        raise ValueError(f"{path}: origin.gpu is {measured_on!r}, but the table is for {slug!r}: a table decides only "
                         f"for the GPU model it was measured on")
    for key, entry in table["entries"].items():
        if not _KEY.fullmatch(key):
            raise ValueError(f"{path}: entry key {key!r} is not of table_key's form (dtype/D<head dim>/"
                             f"causal|lower_right|full/B<batch>/S<bucket>[/variant[+...]][/fwd+bwd])")
        if not isinstance(entry, dict) or entry.get("backend") not in BACKENDS:
            backend = entry.get("backend") if isinstance(entry, dict) else entry
            raise ValueError(f"{path}: entry {key!r}: backend {backend!r} is not one of {', '.join(BACKENDS)}")
        measured = entry.get("kernel_hash", table["origin"].get("kernel_hash"))
        if measured is not None and not (isinstance(measured, str) and re.fullmatch(r"[0-9a-f]{16}", measured)):
            raise ValueError(f"{path}: entry {key!r}: kernel_hash {measured!r} is not 16 hex digits "
                             f"(flashlite.dispatch.source_hash)")
        speedup = entry.get("speedup")
        if speedup is not None and (isinstance(speedup, bool) or not isinstance(speedup, (int, float))
                                    or not 0 < speedup < math.inf):
            raise ValueError(f"{path}: entry {key!r}: speedup {speedup!r} is not a finite number above 0 (or null)")


_DEVICE_SLUGS: dict[int, str] = {}


# A GPU's model does not change while the process runs; telling torch.compile so lets it trace a dispatch
# decision without a graph break (the name lookup returns a string, which Dynamo cannot put in a graph). The mark
# sits on a plain function: Dynamo looks through an lru_cache wrapper and would trace the lookup instead.
@torch.compiler.assume_constant_result
def _device_slug(index: int) -> str:
    slug = _DEVICE_SLUGS.get(index)
    if slug is None:
        slug = _DEVICE_SLUGS[index] = gpu_slug(torch.cuda.get_device_name(index))
    return slug


_TABLES: dict[str, dict[str, Any] | None] = {}


# Reading a table file is nothing torch.compile can trace; marked constant, the load runs once at trace time and
# the lookups that follow read a dictionary, which Dynamo can trace.
@torch.compiler.assume_constant_result
def _table_loaded(slug: str) -> bool:
    if slug not in _TABLES:
        _TABLES[slug] = load_table(slug)
    return _TABLES[slug] is not None


def _slug_of(q: torch.Tensor) -> str | None:
    """The GPU model slug of q's device; None for CPU tensors."""
    if not q.is_cuda:
        return None
    return _device_slug(q.device.index if q.device.index is not None else torch.cuda.current_device())


def _decide(slug: str | None, dtype: torch.dtype, head_dim: int, causal: bool | str, batch: int,
            seq_len: int, variant: str = "dense", backward: bool = False, symbolic_sizes: bool = False) -> Decision:
    if slug is None:
        return Decision("sdpa", "CPU tensors: SDPA runs natively, the Triton kernel only through its interpreter")
    table = _TABLES[slug] if _table_loaded(slug) else None
    shown = ", ".join(([] if variant == "dense" else [variant]) + (["forward+backward"] if backward else []))
    shown = f" ({shown})" if shown else ""
    if symbolic_sizes:
        # Keying the table on symbolic sizes would specialize a compiled graph on them: the rule decides instead.
        return _rule(f"sizes symbolic under torch.compile, {slug} table not read{shown}", dtype, variant, backward)
    if table is not None:
        entry = table["entries"].get(table_key(dtype, head_dim, causal, batch, seq_len, variant, backward))
        if entry is not None:
            origin = {**table["origin"], **entry}  # an entry merged from an older report names its own origin
            measured, current = origin.get("kernel_hash"), kernel_source_hash()
            if measured == current:
                return Decision(entry["backend"], f"{slug} table{shown} ({origin.get('date', '?')}, commit "
                                                  f"{origin.get('commit', '?')}): {entry.get('why', entry['backend'])}")
            # Measured on other kernel code (or before tables recorded it): its verdict is about code that no
            # longer runs, so the rule decides, and the reason says which entry was set aside and why.
            on = "no kernel source hash recorded" if measured is None else f"kernel source hash {measured}"
            return _rule(f"{slug} table entry{shown} not used: measured on other kernel code ({on}; this code "
                         f"{current}; regenerate the table with tools/make_dispatch_table.py)", dtype, variant,
                         backward)
    where = f"no {slug} table entry{shown}" if table is not None else f"no dispatch table for {slug}{shown}"
    return _rule(where, dtype, variant, backward)


def _rule(where: str, dtype: torch.dtype, variant: str, backward: bool) -> Decision:
    """The decision where no table entry applies (``where`` says why none does)."""
    if variant != "dense":
        return Decision("triton", f"{where}; rule: {variant} calls use the kernel (SDPA has no fast path for "
                                  "them: it needs a dense mask or bias, or a score function it cannot take)")
    if dtype == torch.float32:
        return Decision("triton", f"{where}; rule: float32 inputs use the tensor-core kernel (SDPA has only its "
                                  "memory-efficient kernel for float32)")
    if backward:
        return Decision("sdpa", f"{where}; rule: SDPA unless a forward+backward measurement says otherwise")
    return Decision("sdpa", f"{where}; rule: SDPA unless a measurement says otherwise")


def choose_backend(q: torch.Tensor, *, causal: bool | str, seq_k: int, unsupported: str | None = None,
                   variant: str = "dense", backward: bool = False, symbolic_sizes: bool = False) -> Decision:
    """Pick the implementation for an attention call on ``q`` of shape [B, H, S_q, D].

    ``unsupported`` is the reason the Triton kernel cannot run this call at all, if there is one; SDPA then runs.
    ``variant`` names what the call adds to dense attention ("dense", or parts such as "key_padding",
    "window", "softcap", "alibi" joined by "+"): the table keys on it, and where no entry applies, the kernel
    runs such calls, since SDPA can only take them as a dense mask or bias. ``backward``: the call's gradient
    will be computed, so the forward+backward entry decides. ``symbolic_sizes``: the call is traced by
    torch.compile with dynamic sizes, so the table (keyed on sizes) is not read and the rule decides.

    Example:
        >>> choose_backend(torch.randn(1, 2, 8, 16), causal=True, seq_k=8).backend
        'sdpa'
    """
    if unsupported is not None:
        return Decision("sdpa", f"kernel cannot run this call: {unsupported}")
    slug = _slug_of(q)
    batch, _, seq_q, head_dim = q.shape
    return _decide(slug, q.dtype, head_dim, causal, batch, max(seq_q, seq_k), variant, backward, symbolic_sizes)
