"""ssmgrad: forward and backward (vector-Jacobian product) of ggml's SSM_CONV, SSM_SCAN and
GATED_DELTA_NET.

Shapes are NumPy order, ggml's ``ne`` reversed (see README.md and docs/ssm-ops.md, the semantics):

    sx  (n_s, d_inner, d_conv-1+n_t)     c  (d_inner, d_conv)      y  (n_s, n_t, d_inner)
    s   (n_rs, n_head, head_dim, d_state)
    x   (n_seqs, n_t, n_head, head_dim)  dt (n_seqs, n_t, n_head)
    A   (n_head, d_state)  Mamba-1, or (n_head, 1)  Mamba-2
    B,C (n_seqs, n_t, n_group, d_state)  ids (n_seqs,) integers in [0, n_rs)
    Gated DeltaNet: q, k (n_seqs_k, n_t, H_k, S)   v (n_seqs, n_t, H_v, S)
                    g (n_seqs, n_t, H_v, 1) or (.., S)   beta (n_seqs, n_t, H_v, 1)   state (n_seqs, H_v, S, S)

float32 and float64 are supported (one dtype per call); any strides are accepted and inputs
are never modified. Work runs on ``get_num_threads()`` threads with the GIL released, and the
results are bitwise identical for every thread count.
"""
import math as _math
import operator as _operator
import os as _os
import re as _re
import warnings as _warnings


def _openmp_runtimes():
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty elsewhere)."""
    try:
        with open("/proc/self/maps") as f:
            return {ln.split()[-1] for ln in f if any(k in ln for k in ("libgomp", "libomp", "libiomp"))}
    except OSError:
        return set()


# OpenMP's default wait policy keeps idle team threads spinning for a while after each parallel
# region. Next to another busy process that is what made short calls 25-100x slower than on a
# quiet machine (the spinning threads take the cores the working ones need), so ssmgrad asks for
# sleeping threads (OMP_WAIT_POLICY=passive) unless the user chose a policy. The runtime reads it
# once (libgomp when it is loaded, with the extension below; LLVM's libomp at its first call, which
# the extension makes while it loads), so it is set only for the import and then removed again:
# child processes and later programs see the environment as it was. A runtime of the same name
# that another library loaded first keeps its own policy (show_config says which applies).
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_user_wait = [v for v in _WAIT_VARS if v in _os.environ]
_omp_before = _openmp_runtimes()
if not _user_wait:
    _os.environ["OMP_WAIT_POLICY"] = "passive"
# OMP_NUM_THREADS must be a list of positive integers ("4", "4,2"). The runtimes disagree on any
# other value: libgomp warns and ignores it, LLVM's libomp 14 warns and then aborts the process at
# its first parallel region ("Out of heap memory" or an assertion). So a value the runtime would
# reject is hidden from it for the import, as the wait policy is set, and ignored with a warning
# (ssmgrad's own default, below, ignores it too).
_OMP_LIST = _re.compile(r"\s*[1-9][0-9]*(\s*,\s*[1-9][0-9]*)*\s*")
_bad_omp_threads = _os.environ.get("OMP_NUM_THREADS")
if _bad_omp_threads is not None and _OMP_LIST.fullmatch(_bad_omp_threads):
    _bad_omp_threads = None
if _bad_omp_threads is not None:
    del _os.environ["OMP_NUM_THREADS"]
    _warnings.warn(f"ssmgrad: OMP_NUM_THREADS={_bad_omp_threads!r} is not a list of positive integers; "
                   "ignored (the OpenMP runtime would reject it too)", RuntimeWarning, stacklevel=2)
# The compiled kernels are a top-level private module, so that the pure-Python package in a
# source checkout and the extension that `pip install .` built are found together.
try:
    import _ssmgrad as _ext
except ImportError as _exc:  # a source checkout that was never built
    raise ImportError(
        "ssmgrad: the compiled kernels (module _ssmgrad) are not installed; run `pip install .` "
        "(or `python setup.py build_ext --inplace` in a source checkout)") from _exc
finally:
    if not _user_wait:
        _os.environ.pop("OMP_WAIT_POLICY", None)
    if _bad_omp_threads is not None:
        _os.environ["OMP_NUM_THREADS"] = _bad_omp_threads
if _user_wait:
    _wait_policy = "as set by you (" + ", ".join(f"{v}={_os.environ[v]}" for v in _user_wait) + ")"
elif _omp_before and not (_openmp_runtimes() - _omp_before):
    _wait_policy = "the OpenMP runtime's own (another library loaded it before ssmgrad)"
else:
    _wait_policy = "passive (threads sleep between calls; set OMP_WAIT_POLICY before import to change)"

from ._version import __version__

__all__ = [
    "ssm_conv",
    "ssm_conv_back",
    "ssm_conv_back_weight",
    "ssm_scan",
    "ssm_scan_back",
    "ssm_scan_update",
    "gated_delta_net",
    "gated_delta_net_back",
    "split",
    "set_num_threads",
    "get_num_threads",
    "MAX_THREADS",
    "show_config",
    "__version__",
]


def _usable_cores():
    try:
        return max(1, len(_os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, _os.cpu_count() or 1)


MAX_THREADS = 4096
"""The largest thread count set_num_threads accepts (each call uses at most one thread per unit
of work anyway)."""


def _env_threads():
    """OMP_NUM_THREADS as torch reads it: its first entry ("4" and "4,2" give 4), capped at
    MAX_THREADS; None when it is unset or not a list of positive integers."""
    v = _os.environ.get("OMP_NUM_THREADS", "")
    if not _OMP_LIST.fullmatch(v):
        return None
    return min(int(v.split(",")[0]), MAX_THREADS)


# The default follows the user's setting as torch's does (torchrun sets OMP_NUM_THREADS=1 for each
# rank, so ranks do not oversubscribe the cores), else every usable core. ssmgrad keeps its own
# count: torch.set_num_threads does not change it, nor set_num_threads torch's.
_num_threads = _env_threads() or _usable_cores()


def set_num_threads(n):
    """Set the number of threads the kernels use: an integer (a Python or NumPy int, not a bool)
    in [1, MAX_THREADS]. Results do not depend on it."""
    global _num_threads
    _num_threads = _int_arg("set_num_threads", "n", n, lo=1, hi=MAX_THREADS)


def get_num_threads():
    """The number of threads the kernels use. By default OMP_NUM_THREADS when it is set to a positive
    integer at import (as torch reads it: the first entry of a list), else the number of usable cores.

    This count is ssmgrad's own: ``torch.set_num_threads`` does not change it and ``set_num_threads``
    does not change torch's. The two run one after the other (an ssmgrad call returns before torch's
    next op starts), so give both the same count, the cores a process may use (one process per core
    group under DDP/torchrun, which sets OMP_NUM_THREADS=1 for each rank)."""
    return _num_threads


def ssm_conv(sx, c, *, out=None):
    """SSM_CONV forward: causal depthwise convolution over time.

    sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv) -> y (n_s, n_t, d_inner), with
    ``y[s, t, i] = sum_k sx[s, i, t+k] * c[i, k]``.

    ``out``: an optional C-contiguous, writeable array of y's shape and the inputs' dtype,
    sharing no memory with them, that receives y (and is returned). Reusing one buffer across
    calls saves the allocation and the first touch of fresh pages, which for a large n_t costs
    about as much as the convolution itself.
    """
    return _ext.ssm_conv(sx, c, _num_threads, out)


def ssm_conv_back(sx, c, grad, *, out=None):
    """Gradient of ssm_conv w.r.t. sx: grad (n_s, n_t, d_inner) -> d_sx, shaped like sx.
    ``out`` as in ssm_conv (shaped like sx)."""
    return _ext.ssm_conv_back(sx, c, grad, _num_threads, out)


def ssm_conv_back_weight(sx, c, grad, *, out=None):
    """Gradient of ssm_conv w.r.t. c: grad (n_s, n_t, d_inner) -> d_c, shaped like c.
    ``out`` as in ssm_conv (shaped like c)."""
    return _ext.ssm_conv_back_weight(sx, c, grad, _num_threads, out)


def ssm_scan(s, x, dt, A, B, C, ids, *, K=1, keep_states=False):
    """SSM_SCAN forward, as ggml computes it. Returns one 1-D packed array ``[y | states]``.

    For each sequence q the state starts at ``s[ids[q]]`` (s itself is never written) and per
    token ``H = exp(softplus(dt) * A) * H + B (x) (x * softplus(dt))``, ``y = H . C``.

    ``y, states = split(out, x.shape, (K, n_seqs) + s.shape[1:])``: y is
    (n_seqs, n_t, n_head, head_dim); state slot 0 is the final state of sequence q (slot q, not
    row ids[q]). K >= 1 rollback snapshots (newer ggml, Mamba-2 A only when K > 1): slot k,
    1 <= k < min(K, n_t), is the state after n_t - k tokens; slots k >= n_t (k >= 1) are
    zero in ssmgrad's output (ggml leaves them unwritten).

    With ``keep_states=True`` returns ``(out, chunk_states)``: for training, the states that the
    backward would otherwise recompute, to pass to ``ssm_scan_back(..., chunk_states=...)`` with
    the same arguments. Where both kernels take the chunked form (Mamba-2, K = 1, long enough
    sequences: ``_scan_forms``), chunk_states is (n_seqs, n_head, ceil(n_t / 64), head_dim,
    d_state), each sequence's and head's state after every 64 tokens; elsewhere an empty (0,)
    array (the backward recomputes nothing then). The gradients are the same bits either way.
    """
    K = _K_arg("ssm_scan", K)
    if keep_states:
        return _ext.ssm_scan_keep(s, x, dt, A, B, C, ids, K, _num_threads)
    return _ext.ssm_scan(s, x, dt, A, B, C, ids, K, _num_threads)


def ssm_scan_back(s, x, dt, A, B, C, ids, grad, *, K=1, return_dA=False, chunk_states=None):
    """Vector-Jacobian product of ssm_scan.

    grad is the whole packed gradient of ``ssm_scan``'s output (y region and state slots; the
    state region seeds the reverse recurrence). Returns one 1-D packed array
    ``[d_s | d_x | d_dt | d_B | d_C]`` (``split(gin, s.shape, x.shape, dt.shape, B.shape,
    C.shape)``); d_s covers every row of s, duplicate ids accumulate and rows no id names get
    exactly 0. With ``return_dA=True`` returns ``(gin, d_A)``, d_A shaped like A (summed over
    sequences; for Mamba-2 over states too).

    chunk_states: None, or what ``ssm_scan(..., keep_states=True)`` returned for the same
    arguments: the backward then reads those states instead of recomputing them (about a fifth
    of its work). They are not checked against the inputs: other states give other gradients.
    Ignored where this call does not take the chunked forms.
    """
    return _ext.ssm_scan_back(s, x, dt, A, B, C, ids, grad, _K_arg("ssm_scan_back", K), bool(return_dA),
                             _num_threads, chunk_states)


def ssm_scan_update(s, x, dt, A, B, C):
    """Advance generation states in place: scan x from the states in s and write the final
    states over s. Returns y (n_seqs, n_t, n_head, head_dim).

    s (n_seqs, n_head, head_dim, d_state) is a writeable float NumPy array holding one state per
    sequence (row q is sequence q's state); x, dt, A, B, C are as in ``ssm_scan``. The values are
    those of ``y, states = split(ssm_scan(s, x, dt, A, B, C, range(n_seqs)), x.shape, s.shape)``
    followed by ``s[...] = states``. For the one-token steps of a generation cache (C-contiguous s,
    not overlapping the other inputs) the kernel writes the states into s directly, without a
    fresh packed output and a copy back; otherwise it computes exactly that and copies.
    """
    # The C side checks s (a writeable 4-D ndarray, one row per sequence: the messages name
    # ssm_scan_update) and every other argument, and implies ids = arange(n_seqs) (ids None): the
    # generate step pays no Python-level checks and no temporaries.
    y = _ext._ssm_scan_update(s, x, dt, A, B, C, None, _num_threads)
    if y is None:       # not the in-place form: the packed scan, then the copy into s
        import numpy as np

        out = _ext.ssm_scan(s, x, dt, A, B, C, np.arange(s.shape[0], dtype=np.int64), 1, _num_threads)
        y, states = split(out, np.shape(x), s.shape)
        s[...] = states
    return y


_HEAD_BCAST = {"tiled": 0, "interleaved": 1}
_GDN_FORMS = {"auto": 0, "recurrence": 1, "chunked": 2}


def _gdn_form_arg(fn, form):
    try:
        return _GDN_FORMS[form]
    except (KeyError, TypeError):
        raise ValueError(f"{fn}: form must be 'auto', 'recurrence' or 'chunked', got {form!r}") from None


def _head_bcast_arg(fn, head_bcast):
    try:
        return _HEAD_BCAST[head_bcast]
    except (KeyError, TypeError):
        raise ValueError(f"{fn}: head_bcast must be 'tiled' or 'interleaved', got {head_bcast!r}") from None


def gated_delta_net(q, k, v, g, beta, state, *, K=1, head_bcast="tiled", form="auto", out=None, keep_states=False):
    """GATED_DELTA_NET forward, as ggml computes it. Returns one 1-D packed array ``[o | K state slots]``.

    q, k (n_seqs_k, n_t, H_k, S); v (n_seqs, n_t, H_v, S); g (n_seqs, n_t, H_v, 1), the log of a
    scalar decay per head, or (n_seqs, n_t, H_v, S), one per key channel (KDA); beta (n_seqs, n_t,
    H_v, 1); state (n_seqs, H_v, S, S), stored transposed: ``state[n, h, j, i]`` is ``S[i][j]``.
    Per token, with ``a = exp(g)``: ``S = diag(a) S``, ``d = beta (v - S^T k)``, ``S = S + k d^T``,
    ``o = S^T q / sqrt(S)``. q and k are used as given (no normalization).

    Value head h of sequence n reads key/query head ``h % H_k`` (``head_bcast="tiled"``, ggml's
    broadcast) or ``h // (H_v // H_k)`` (``"interleaved"``, transformers' repeat_interleave), of key
    sequence ``n // (n_seqs // n_seqs_k)``.

    ``o, slots = split(out, v.shape, (K,) + state.shape)``: slot 0 is the state after the last
    token, slot s the state s tokens back (after token n_t - 1 - s), transposed like ``state``.
    Slots s >= n_t (s >= 1) are zero in ssmgrad's output (ggml leaves them unwritten).

    ``form``: ``"recurrence"`` (the token recurrence, ggml's bits), ``"chunked"`` (64-token chunks as
    matrix products, the WY / UT-transform form; it takes either gate, scalar or per-channel, with
    K == 1, every other call runs the recurrence) or ``"auto"`` (chunked from 32 tokens on where it
    applies, with the per-channel gate from 2048). The two differ by float rounding only.

    ``out``: an optional 1-D, C-contiguous, writeable array of the packed output's size and the
    inputs' dtype, sharing no memory with them, that receives the result (and is returned). A
    one-token decode step spends most of its time on a fresh output's pages; reusing one buffer
    (e.g. two, taking turns as the next step's state: ``split(out, ...)[1][0]``) saves that.

    With ``keep_states=True`` returns ``(out, chunk_states)``: for training, what the backward of the
    chunked form would otherwise recompute by a pass over the chunks, to pass to
    ``gated_delta_net_back(..., chunk_states=...)`` with the same arguments. Where the call takes the
    chunked form, chunk_states is (n_seqs, H_v, ceil(n_t / 64), E): per sequence, head and chunk of 64
    tokens the state before it, two (64, S) matrices of the chunk and two (64, 64) ones (with the scalar
    gate a third), S padded to a multiple of 16 (the layout is the kernels' own, ``ssmgrad.h``);
    elsewhere an empty (0,) array (the backward recomputes nothing then). The gradients are the same
    bits either way. Not with ``out``.
    """
    fn = "gated_delta_net"
    if keep_states:
        if out is not None:
            raise ValueError(f"{fn}: keep_states=True returns fresh arrays; out must be None")
        return _ext.gated_delta_net_keep(q, k, v, g, beta, state, _K_arg(fn, K), _head_bcast_arg(fn, head_bcast),
                                         _gdn_form_arg(fn, form), _num_threads)
    return _ext.gated_delta_net(q, k, v, g, beta, state, _K_arg(fn, K), _head_bcast_arg(fn, head_bcast),
                                _gdn_form_arg(fn, form), _num_threads, out)


def gated_delta_net_back(q, k, v, g, beta, state, grad, *, K=1, head_bcast="tiled", form="auto", chunk_states=None):
    """Vector-Jacobian product of gated_delta_net.

    grad is the whole packed gradient of ``gated_delta_net``'s output (the o region and every state
    slot: a slot's gradient joins the reverse recurrence at the token it was taken after; the slots
    s >= n_t, which the forward does not write, are ignored). Returns one 1-D packed array
    ``[d_q | d_k | d_v | d_g | d_beta | d_state]``, each in its input's shape
    (``split(gin, q.shape, k.shape, v.shape, g.shape, beta.shape, state.shape)``). Gradients of key
    heads and key sequences shared by several value heads add up. ``form`` as for gated_delta_net
    (the backward of the chunked form keeps the state at chunk boundaries and recomputes inside).

    chunk_states: None, or what ``gated_delta_net(..., keep_states=True)`` returned for the same
    arguments: the chunked backward then reads them instead of its own pass over the chunks (about a
    quarter of its multiply-adds at S 128, either gate). They are not checked against the
    inputs: others give other gradients. Ignored where this call takes the recurrence.
    """
    fn = "gated_delta_net_back"
    return _ext.gated_delta_net_back(q, k, v, g, beta, state, grad, _K_arg(fn, K), _head_bcast_arg(fn, head_bcast),
                                     _gdn_form_arg(fn, form), _num_threads, chunk_states)


def _int_arg(fn, name, v, lo=None, hi=None):
    """An integer argument as a Python int: anything with __index__ (int, NumPy integers) but
    not a bool; TypeError otherwise (2.7, "3", True). ValueError outside [lo, hi] where given.
    The one rule for K (NumPy and torch APIs) and for set_num_threads."""
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise TypeError(f"{fn}: {name} must be an integer, got {type(v).__name__} {v!r}")
    v = _operator.index(v)
    if lo is not None and v < lo:
        raise ValueError(f"{fn}: {name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{fn}: {name} must be <= {hi}, got {v}")
    return v


def _K_arg(fn, K):
    """K >= 1 as an int; beyond int64 the C side sees the bound instead: it raises MemoryError for
    outputs that cannot exist (and Mamba-1's ValueError for K > 1) as it would for the real K."""
    return min(_int_arg(fn, "K", K, lo=1), 2 ** 62)


def _shape_arg(shp):
    """A shape as a tuple of Python ints (an int is a 1-D shape); TypeError for anything else."""
    items = (shp,) if not hasattr(shp, "__iter__") else shp
    out = []
    for d in items:
        try:
            d = _operator.index(d)
        except Exception:
            raise TypeError(f"split: shape entries must be integers, got {d!r} in {shp!r}") from None
        if d < 0:
            raise ValueError(f"split: negative dimension in shape {shp!r}")
        out.append(d)
    return tuple(out)


def split(packed, *shapes):
    """Cut a 1-D packed array into consecutive C-ordered views of the given shapes.

    Raises ValueError unless the shapes' sizes add up to ``packed.size`` exactly.
    """
    import numpy as np

    arr = packed if isinstance(packed, np.ndarray) else np.asarray(packed)
    if arr.ndim != 1:
        raise ValueError(f"split: packed must be 1-D, got shape {arr.shape}")
    shapes = [_shape_arg(shp) for shp in shapes]
    sizes = [_math.prod(shp) for shp in shapes]
    if sum(sizes) != arr.size:
        raise ValueError(f"split: the shapes {shapes} hold {sum(sizes)} elements, packed has {arr.size}")
    out, off = [], 0
    for shp, n in zip(shapes, sizes):
        out.append(arr[off:off + n].reshape(shp))
        off += n
    return tuple(out)


def show_config():
    """Print the version, thread count and what the extension was built with."""
    info = _ext.build_info()
    print(f"ssmgrad {__version__}")
    print(f"  threads        : {get_num_threads()} (usable cores: {_usable_cores()}; "
          f"OMP_NUM_THREADS: {_os.environ.get('OMP_NUM_THREADS', 'unset')})")
    print(f"  OpenMP         : {'yes (' + str(info['openmp_version']) + ')' if info['openmp'] else 'no (serial)'}")
    if info["openmp"]:
        print(f"  OpenMP waiting : {_wait_policy}")
    print(f"  SIMD compiled  : {info['simd_compiled']}")
    print(f"  SIMD selected  : {info['simd_selected']}")
    print(f"  AVX-512 scan   : {'yes' if info['avx512_kernels'] else 'no'}"
          + (f" (kernels' SIMD choice: {info['simd']})" if info["simd"] != "auto" else ""))
    print(f"  scan forms     : forward {info['scan_fwd']}, backward {info['scan_back']}")
