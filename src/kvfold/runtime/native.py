"""Native kernels, compiled on first use with the system's C compiler and cached.

Two kernels:

* ``kernels/attend_codes.c`` (:func:`attend_codes_kernel`): the stored part of the attention over
  quantized rows, called by :mod:`kvfold.runtime.quantized_attention`. Eager PyTorch reads packed
  codes in several passes a decode step (unpack the planes, convert, scale, multiply); the kernel
  reads each entry's codes once, with the key scales folded into the queries and the value scales
  into the probabilities. It computes what the PyTorch path computes (a test holds them equal).
* ``kernels/attend_pool.c`` (:func:`attend_pool_kernel`): one layer's attention for every request of a
  serving step on a pooled cache file (:mod:`kvfold.runtime.pool_attention`), read in the engine's
  blocks, in one call (requests that share a file's blocks read it once, in shared tiles of queries);
  parallel over (tile, KV head) with OpenMP when the compiler has it
  (``-fopenmp``; built without it otherwise, :func:`pool_status` says which).

Both are written on ``kernels/attend_blocks.h``: the code vectors of every width, the running softmax and
a block's logits and weighted values, once for the two (a decode step's few queries read the codes in
place; more unpack a block once).

The shared library is built once per kernel source (with the headers beside it), compiler flags and
machine into ``$KVFOLD_CACHE/kernels`` (default ``~/.cache/kvfold/kernels``), saying so on
standard error with the seconds it took (on 2 cores about 18 s for the codes kernel and 25 s for the
pool kernel, several times that on a loaded machine: :data:`BUILD_SECONDS`), written to a temporary name
and renamed, so concurrent processes never load a half-written file. Processes that need the same
library at once compile it once: the others wait for it under a lock beside it (and say so). A build
also removes the folder's libraries unused for a month (other versions', benchmarks' baselines:
:mod:`kvfold.runtime.machine_cache`). Without a C compiler, or with ``KVFOLD_NATIVE=0``,
:func:`attend_codes_kernel` returns None and the PyTorch path runs (:func:`status` says which and why;
``kvfold bench`` records it).

``KVFOLD_NATIVE_DEBUG=1`` builds a debug kernel instead (its own file, ``attend_codes-debug-….so``):
``-O1 -g``, the undefined-behaviour checks that need no runtime library (a trap), and
``KVFOLD_DEBUG``, under which the kernel checks every index it reads against the sizes its caller
passes and returns an error code rather than read outside them. AddressSanitizer is not used: its
runtime must be loaded before the Python interpreter, which a library opened by ``ctypes`` cannot do.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

from kvfold.runtime.defaults import cache_root
from kvfold.runtime.machine_cache import exclusive, mark_used, partial_path, remove_orphan_locks, remove_unused

SOURCE = Path(__file__).with_name("kernels") / "attend_codes.c"
POOL_SOURCE = Path(__file__).with_name("kernels") / "attend_pool.c"
OPENMP_FLAGS = ("-fopenmp",)
"""Added to the pool kernel's flags when the compiler builds with them (else it runs on one thread)."""
FLAGS = (
    "-O3",
    "-g",
    "-march=native",
    # vectorised sums (reassociation) without giving up infinities: β may be −inf
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-shared",
    "-fPIC",
)
DEBUG_FLAGS = (
    "-O1",
    "-g",
    "-DKVFOLD_DEBUG",
    "-fsanitize=undefined,bounds",
    "-fsanitize-undefined-trap-on-error",
    "-shared",
    "-fPIC",
)
"""The debug build: every index checked against its buffer's size (``KVFOLD_DEBUG``), undefined
behaviour trapped."""
DISABLE_ENV = "KVFOLD_NATIVE"
"""``KVFOLD_NATIVE=0`` keeps the PyTorch path (no compiler is run)."""
DEBUG_ENV = "KVFOLD_NATIVE_DEBUG"
"""``KVFOLD_NATIVE_DEBUG=1`` builds and loads the debug kernel (:data:`DEBUG_FLAGS`)."""
ERRORS = {
    1: "a dimension or the number of queries is past the kernel's limits",
    2: "a code width it does not read",
    3: "out of memory",
    4: "the row lengths do not fit the codes or scales passed",
    5: "an index past a buffer (debug build)",
    6: "a workspace too small for the threads asked",
    7: "a request does not fit the engine: its file, blocks, rows or chunk headers (its blocks may not hold its file)",
    8: "an engine layout the pool kernel does not read (layer, dtype, block size or key layout)",
}
"""What the kernels' nonzero return codes mean (4 is the codes kernel's; 7 and 8 the pool kernel's, and 3
when it cannot allocate its list of tiles; 7
refuses one or more requests of a call before anything is written, so the call can be made again without
them: :meth:`kvfold.runtime.pool_attention.PoolStep.attend` does)."""
REQUEST_REFUSED = 7
"""The pool kernel's code for a request that does not fit (:data:`ERRORS`)."""
BUILD_SECONDS = 900
"""How long a compiler may take on a kernel before the build counts as failed: a first build takes about
18 s (codes) and 25 s (pool) on 2 free cores (the pool kernel took 70-96 s before its segments were
functions of their own), and a machine busy with other work (a test run, a server)
slows it several times; a build cut short would leave requests on the slower PyTorch path."""
_why_not: list[str] = []
_pool_why_not: list[str] = []


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``kernels/`` under kvfold's cache folder
    (:func:`kvfold.runtime.defaults.cache_root`: ``$KVFOLD_CACHE``, default ``~/.cache/kvfold``)."""
    return cache_root() / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _machine_tag() -> str:
    """The CPU the library is built for (``-march=native``): its model name and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
        lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "|".join([platform.machine(), platform.processor(), *lines])


def _build(compiler: str, debug: bool = False, source_path: Path = SOURCE, extra: tuple[str, ...] = ()) -> Path:
    # the headers beside the source (kernels/attend_blocks.h) are part of what is built
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(source_path.parent.glob("*.h")))
    flags = (*(DEBUG_FLAGS if debug else FLAGS), *extra)
    digest = hashlib.sha256(source + " ".join(flags).encode() + _machine_tag().encode()).hexdigest()[:16]
    target = cache_dir() / f"{source_path.stem}-{'debug-' if debug else ''}{digest}.so"
    if target.exists():
        mark_used(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(target, f"compiling {source_path.name}"):
        if target.exists():  # another process built it while this one waited
            return target
        # a first build takes tens of seconds (the kernels are compiled for each code width and head size)
        said = f"kvfold: compiling {source_path.name} for this machine, once (tens of seconds)"
        print(said, file=sys.stderr, flush=True)
        began = time.monotonic()
        partial = str(partial_path(target, ".part"))
        try:
            subprocess.run(
                [compiler, *flags, "-o", partial, str(source_path), "-lm"],
                check=True,
                capture_output=True,
                timeout=BUILD_SECONDS,
            )
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        print(f"kvfold: compiled {source_path.name} in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    _sweep(target.parent, target)
    return target


def _sweep(folder: Path, built: Path) -> None:
    """After a build, remove the libraries of ``folder`` unused for
    :data:`~kvfold.runtime.machine_cache.KEEP_UNUSED_DAYS` days (other versions' kernels, benchmarks'
    baselines), partial builds left by a killed compiler, and lock files without a library."""
    remove_unused(folder.glob("*.so"), folder.glob("*.part"), keep=[built])
    remove_orphan_locks(folder)


def debug_requested() -> bool:
    """Whether ``KVFOLD_NATIVE_DEBUG=1`` asks for the debug kernel."""
    return os.environ.get(DEBUG_ENV, "0") == "1"


@cache
def attend_codes_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The compiled ``kvfold_attend_codes`` function (the debug build under ``KVFOLD_NATIVE_DEBUG=1``),
    or None (see :func:`status`). Looked up once: ``attend_codes_kernel.cache_clear()`` looks again."""
    return load_kernel(debug_requested())


def load_kernel(debug: bool = False) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """Build (once per source, flags and machine) and load the kernel, the debug build when ``debug``;
    None when disabled or unbuildable, with why in :func:`status`.

    Its C signature: ``rows, m, dim, vdim, bits, group, entries, groups`` (int64), then the pointers
    ``lengths, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, beta, queries``,
    ``scaling`` (float) and the outputs ``top, den, num``. ``entries`` and ``groups`` are the sizes
    of the buffers passed (entries the codes, value scales and β hold; key groups the key scales
    hold); the kernel reads nothing past them, and returns 4 (5 in the debug build) rather than do so
    (:data:`ERRORS`). It allocates its own workspace (a few blocks' floats)."""
    _why_not.clear()
    function, why = build_codes_kernel(debug)
    if function is None:
        _why_not.append(why)
    return function


def build_codes_kernel(debug: bool = False, source: Path = SOURCE) -> tuple[ctypes._CFuncPtr | None, str]:  # type: ignore[name-defined]
    """Build (once per source, the headers beside it, flags and machine) and load ``kvfold_attend_codes``
    from ``source`` (the project's, or another version of it: ``benchmarks/codes_kernel.py --baseline``);
    the debug build when ``debug``. Returns the function and "", or None and why not (one line)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"{DISABLE_ENV}=0"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found (cc, gcc or clang; or set CC)"
    try:
        library = ctypes.CDLL(str(_build(compiler, debug, source)))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        return None, " ".join(f"building the kernel failed: {error} {detail.decode(errors='replace')[:200]}".split())
    function = library.kvfold_attend_codes
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    function.argtypes = [i64] * 8 + [ptr] * 9 + [f32] + [ptr] * 3
    function.restype = ctypes.c_int
    return function, ""


def status() -> str:
    """``native`` when the compiled kernel reads quantized caches, else ``torch (why)``."""
    if attend_codes_kernel() is not None:
        return "native (debug build)" if debug_requested() else "native"
    return f"torch ({'; '.join(_why_not) or 'not built'})"


class PoolKernel:
    """The loaded pool kernel (``kernels/attend_pool.c``).

    Attributes:
        attend: ``kvfold_attend_pool(engine, requests, count, layer, tokens, query, query_token_stride,
            query_head_stride, out, out_token_stride, out_head_stride)``: pointers to the engine and
            request structures (:mod:`kvfold.runtime.pool_attention`), the layer, the step's tokens, the
            query and output tensors' addresses and strides in elements. Returns 0 or a code of
            :data:`ERRORS`.
        workspace_floats: floats of workspace one thread needs, for a head size.
        openmp: whether it was built with OpenMP (parallel over tiles of queries and KV heads).
        debug: whether it is the debug build (every index checked as it is read).
    """

    def __init__(self, library: ctypes.CDLL, openmp: bool, debug: bool) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self.attend = library.kvfold_attend_pool
        self.attend.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i64]
        self.attend.restype = ctypes.c_int
        workspace = library.kvfold_pool_workspace_floats
        workspace.argtypes, workspace.restype = [i64], i64
        self._workspace = workspace
        self._tiles = getattr(library, "kvfold_pool_tiles", None)  # older sources (a --baseline) lack it
        if self._tiles is not None:
            self._tiles.argtypes, self._tiles.restype = [ptr, ptr, i64, ptr, ptr, i64], i64
        self.openmp, self.debug = openmp, debug

    def workspace_floats(self, head_dim: int) -> int:
        return int(self._workspace(head_dim))

    def tiles(self, engine, requests, count: int) -> list[list[int]] | None:
        """The tiles a call attends for ``count`` requests (the engine and request structures, as for
        :attr:`attend`): for each tile, the indices of the requests whose queries it holds, in order (a
        request on a file whose blocks other requests share is in one tile with them). None for a kernel
        built from a source without it."""
        if self._tiles is None:
            return None
        capacity = 64 + sum(int(requests[n].query_len) for n in range(count))
        pieces, starts = (ctypes.c_int64 * capacity)(), (ctypes.c_int64 * (capacity + 1))()
        found = int(self._tiles(engine, requests, count, pieces, starts, capacity))
        if found < 0:
            raise ValueError(f"the pool kernel cannot plan these requests' tiles (code {found})")
        return [sorted({pieces[k] for k in range(starts[t], starts[t + 1])}) for t in range(found)]


def build_pool_kernel(debug: bool = False, source: Path = POOL_SOURCE) -> tuple[PoolKernel | None, str]:
    """Build (once per source, flags and machine) and load the pool kernel from ``source`` (the project's,
    or another version of it: ``benchmarks/pool_kernel.py --baseline``), with OpenMP when the compiler
    builds it; the debug build when ``debug``. Returns the kernel and "", or None and why not."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"{DISABLE_ENV}=0"
    compiler = _compiler()
    if compiler is None:
        return None, "no C compiler found (cc, gcc or clang; or set CC)"
    failure = ""
    for extra in (OPENMP_FLAGS, ()):
        try:
            library = ctypes.CDLL(str(_build(compiler, debug, source, extra)))
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            said = " ".join(f"{error} {detail.decode(errors='replace')[:200]}".split())  # one line
            failure = f"building the pool kernel failed: {said}"
            continue
        return PoolKernel(library, openmp=bool(extra), debug=debug), ""
    return None, failure


def load_pool_kernel(debug: bool = False) -> PoolKernel | None:
    """The project's pool kernel (:func:`build_pool_kernel`); None when disabled or unbuildable, with why in
    :func:`pool_status`."""
    _pool_why_not.clear()
    kernel, why = build_pool_kernel(debug)
    if kernel is None:
        _pool_why_not.append(why)
    return kernel


@cache
def attend_pool_kernel() -> PoolKernel | None:
    """The pool kernel (the debug build under ``KVFOLD_NATIVE_DEBUG=1``), or None (see :func:`pool_status`).
    Looked up once: ``attend_pool_kernel.cache_clear()`` looks again."""
    return load_pool_kernel(debug_requested())


def pool_status() -> str:
    """``native`` (with ``OpenMP`` or ``one thread``, and ``debug build`` when so) when the pool kernel
    is built, else ``torch (why)``: requests on files then take the per-chunk PyTorch path."""
    kernel = attend_pool_kernel()
    if kernel is None:
        return f"torch ({'; '.join(_pool_why_not) or 'not built'})"
    parts = ["OpenMP" if kernel.openmp else "one thread"] + (["debug build"] if kernel.debug else [])
    return f"native ({', '.join(parts)})"
