"""Bad-input fuzzing: nothing a caller passes may crash, hang or silently return a wrong answer.

Every call below must either raise TypeError, ValueError or MemoryError with a non-empty message,
or return a result equal to a float64 NumPy oracle (tests/reference.py: np_ssm_scan,
np_ssm_scan_back, np_ssm_conv, np_ssm_conv_back, np_ssm_conv_back_weight, evaluated on np.asarray
of the same arguments).
Where the API fixes the outcome (common contract: int/bool/complex/object/mixed float dtypes ->
TypeError; out-of-range or negative ids, wrong shapes, wrong grad size -> ValueError; read-only
inputs -> a correct result) the exact exception type is asserted, and shape errors must name the
argument.

NaN/Inf inputs must propagate like IEEE arithmetic: the forward's NaN/+Inf/-Inf pattern equals the
oracle's exactly (the spec fixes the formulas), finite values agree within 1e-9 (float64) / 1e-4
(float32) of the tensor's scale; for the backward, finite exactly where the oracle is finite.

The cases run in batches in child processes (``python test_bad_input_fuzz.py BATCH``, with a
timeout) so a segfault, an abort or a hang fails the test instead of killing pytest. The child
imports the same ssmgrad as the parent (its package directory goes first on PYTHONPATH).
"""

import json
import os
import re
import subprocess
import sys
import traceback

import numpy as np

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))    # tests/: reference.py
if TESTS not in sys.path:                                # the child runs this file as a script
    sys.path.insert(0, TESTS)
from reference import (np_ssm_conv, np_ssm_conv_back, np_ssm_conv_back_weight, np_ssm_scan,  # noqa: E402
                       np_ssm_scan_back)
ALLOWED = (TypeError, ValueError, MemoryError)
EXPECT_TYPES = {"TypeError": TypeError, "ValueError": ValueError, "MemoryError": MemoryError}
BATCHES = ("objects", "ranks", "dtypes", "nonfinite", "flags", "ids", "grad", "zero", "huge", "kwargs",
           "random")
TIMEOUT = float(os.environ.get("SSMGRAD_BAD_INPUT_TIMEOUT", "300"))


# =============================================================================================
# child side

class Case:
    """One call: fn(*args, **kwargs) with an expectation ("any", "ok", "raise", or an exception name)."""

    def __init__(self, name, fn, args, kwargs=None, expect="any", oracle=None, name_in_msg=None,
                 strict_pattern=True):
        self.name, self.fn, self.args, self.kwargs = name, fn, list(args), dict(kwargs or {})
        self.expect, self.oracle, self.name_in_msg = expect, oracle, name_in_msg
        self.strict_pattern = strict_pattern


def base_scan(dtype=np.float64, n_rs=3, n_head=2, head_dim=2, d_state=3, n_group=1, n_seqs=2, n_t=3,
              mamba2=False, seed=0):
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state)).astype(dtype)
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim)).astype(dtype)
    dt = rng.uniform(-2, 2, (n_seqs, n_t, n_head)).astype(dtype)
    A = -rng.uniform(0.1, 1.5, (n_head, 1) if mamba2 else (n_head, d_state)).astype(dtype)
    B = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    C = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    ids = (np.arange(n_seqs, dtype=np.int32) * 2) % max(n_rs, 1)
    return [s, x, dt, A, B, C, ids]


def base_conv(dtype=np.float64, n_s=2, d_inner=3, d_conv=3, n_t=4, seed=0):
    rng = np.random.default_rng(seed)
    sx = rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(dtype)
    c = rng.standard_normal((d_inner, d_conv)).astype(dtype)
    g = rng.standard_normal((n_s, n_t, d_inner)).astype(dtype)
    return [sx, c, g]


def _f64(a):
    return np.asarray(a, dtype=np.float64)


def _ids(a):
    ids = np.asarray(a)
    if ids.ndim == 1 and ids.size == 0:                 # [] converts to float64; an empty list is fine
        return ids.astype(np.int64)
    if ids.dtype.kind not in "iu" or ids.ndim != 1:
        raise ValueError("oracle: not 1-D integer ids")
    return ids.astype(np.int64)


def oracle_scan(args, kwargs):
    s, x, dt, A, B, C = (_f64(a) for a in args[:6])
    ids = _ids(args[6])
    return np_ssm_scan(s, x, dt, A, B, C, ids, K=kwargs.get("K", 1))


def oracle_scan_back(args, kwargs):
    s, x, dt, A, B, C = (_f64(a) for a in args[:6])
    ids = _ids(args[6])
    grad = _f64(args[7]).reshape(-1)
    K = kwargs.get("K", 1)
    n_out = np_ssm_scan(s, x, dt, A, B, C, ids, K=K).size
    if grad.size != n_out:
        raise ValueError("oracle: grad size")
    d = np_ssm_scan_back(s, x, dt, A, B, C, ids, grad, K=K)
    gin = np.concatenate([d[k].ravel() for k in ("s", "x", "dt", "B", "C")])
    return (gin, d["A"]) if kwargs.get("return_dA") else gin


def oracle_conv(args, kwargs):
    return np_ssm_conv(*args[:2])


def oracle_conv_back(args, kwargs):
    sx, c, g = (_f64(a) for a in args)
    if g.shape != np_ssm_conv(sx, c).shape:
        raise ValueError("oracle: grad shape")
    return np_ssm_conv_back(sx, c, g)


def oracle_conv_back_weight(args, kwargs):
    sx, c, g = (_f64(a) for a in args)
    if g.shape != np_ssm_conv(sx, c).shape:
        raise ValueError("oracle: grad shape")
    return np_ssm_conv_back_weight(sx, c, g)


def functions():
    import ssmgrad
    return {
        "ssm_conv": (ssmgrad.ssm_conv, ("sx", "c"), oracle_conv),
        "ssm_conv_back": (ssmgrad.ssm_conv_back, ("sx", "c", "grad"), oracle_conv_back),
        "ssm_conv_back_weight": (ssmgrad.ssm_conv_back_weight, ("sx", "c", "grad"), oracle_conv_back_weight),
        "ssm_scan": (ssmgrad.ssm_scan, ("s", "x", "dt", "A", "B", "C", "ids"), oracle_scan),
        "ssm_scan_back": (ssmgrad.ssm_scan_back, ("s", "x", "dt", "A", "B", "C", "ids", "grad"), oracle_scan_back),
    }


def base_args(fname, dtype=np.float64, **kw):
    if fname == "ssm_conv":
        return base_conv(dtype, **kw)[:2]
    if fname.startswith("ssm_conv"):
        return base_conv(dtype, **kw)
    args = base_scan(dtype, **kw)
    if fname == "ssm_scan_back":
        n = np_ssm_scan(*args).size
        args.append(np.random.default_rng(5).standard_normal(n).astype(dtype))
    return args


def compare(got, ref, strict_pattern):
    """None if got matches ref (NaN/Inf pattern and finite values), else a description."""
    if isinstance(ref, tuple):
        if not isinstance(got, tuple) or len(got) != len(ref):
            return f"expected a tuple of {len(ref)}, got {type(got).__name__}"
        for i, (g, r) in enumerate(zip(got, ref)):
            p = compare(g, r, strict_pattern)
            if p:
                return f"[{i}] {p}"
        return None
    if not isinstance(ref, np.ndarray):
        return None if got == ref else f"got {got!r}, expected {ref!r}"
    if not isinstance(got, np.ndarray):
        return f"result is {type(got).__name__}, not ndarray"
    if got.dtype not in (np.float32, np.float64):
        return f"result dtype {got.dtype}"
    if got.shape != ref.shape:
        return f"result shape {got.shape} != oracle {ref.shape}"
    g = got.astype(np.float64)
    if strict_pattern:
        if not np.array_equal(np.isnan(g), np.isnan(ref)):
            return (f"NaN pattern differs: got {int(np.isnan(g).sum())} NaN, oracle {int(np.isnan(ref).sum())}; "
                    f"first mismatch at {np.argwhere(np.isnan(g) != np.isnan(ref))[0].tolist()}")
        inf = np.isinf(ref)
        if not np.array_equal(np.isinf(g), inf) or not np.array_equal(g[inf], ref[inf]):
            return "Inf pattern differs"
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(g), fin):
        bad = np.argwhere(np.isfinite(g) != fin)[0].tolist()
        return f"finite pattern differs at {bad}: got {g[tuple(bad)]}, oracle {ref[tuple(bad)]}"
    if fin.any():
        scale = max(1.0, float(np.max(np.abs(ref[fin]))))
        err = float(np.max(np.abs(g[fin] - ref[fin])))
        tol = (1e-9 if got.dtype == np.float64 else 1e-4) * scale
        if err > tol:
            return f"max abs err {err:.3e} > {tol:.3e}"
    return None


def run_case(case):
    """Returns (outcome, problem) where problem is None when the behaviour is acceptable."""
    try:
        got = case.fn(*case.args, **case.kwargs)
    except ALLOWED as e:
        outcome = type(e).__name__
        msg = str(e)
        if not msg.strip():
            return outcome, f"{outcome} with an empty message"
        if case.expect == "ok":
            return outcome, f"expected a result, got {outcome}: {msg}"
        if case.expect not in ("any", "raise") and not isinstance(e, EXPECT_TYPES[case.expect]):
            return outcome, f"expected {case.expect}, got {outcome}: {msg}"
        if case.name_in_msg and not re.search(r"\b%s\b" % re.escape(case.name_in_msg), msg):
            return outcome, f"message does not name argument {case.name_in_msg!r}: {msg}"
        return outcome, None
    except PASSTHROUGH as e:
        return type(e).__name__, None
    except BaseException as e:  # noqa: BLE001 - anything else is a finding
        return type(e).__name__, f"disallowed exception {type(e).__name__}: {e}\n{traceback.format_exc()}"
    if case.expect not in ("any", "ok"):
        return "ok", f"expected {case.expect}, got a result"
    try:
        ref = case.oracle(case.args, case.kwargs)
    except Exception as e:  # noqa: BLE001
        return "ok", f"returned a result for input the oracle rejects ({type(e).__name__}: {e})"
    prob = compare(got, ref, case.strict_pattern)
    return "ok", (f"wrong result: {prob}" if prob else None)


# ---------------------------------------------------------------------------------------------
# batches of cases

class EvilArray:
    def __array__(self, *a, **k):
        raise ValueError("EvilArray refuses conversion")


class Len1:
    def __len__(self):
        return 1

    def __getitem__(self, i):
        raise IndexError(i)


WEIRD = [None, 0, 1.5, True, "str", b"bytes", [], [[1.0]], [[1.0, 2.0], [3.0]], {}, set(), object(),
         len, (lambda: 0), np.float64(1.0), np.array(1.0), np.array([]), np.array([np.nan]),
         np.zeros((2, 2, 2, 2, 2)), EvilArray(), Len1(), iter([1.0]), memoryview(b"abcd"),
         10 ** 100, -1, np.ma.masked_array([1.0, 2.0], mask=[0, 1]), complex(1, 1), float("nan")]
# exceptions an argument's own conversion protocol raises are passed through unchanged (like numpy)
PASSTHROUGH = (np.ma.MaskError,)


def batch_objects():
    cases = []
    for fname, (fn, names, oracle) in functions().items():
        base = base_args(fname)
        for pos, argname in enumerate(names):
            for j, w in enumerate(WEIRD):
                args = list(base)
                args[pos] = w
                cases.append(Case(f"{fname}[{argname}]=weird{j}:{type(w).__name__}", fn, args,
                                  expect="any", oracle=oracle))
        # too few / too many positional arguments
        cases.append(Case(f"{fname}:too_few", fn, base[:-1], expect="TypeError", oracle=oracle))
        cases.append(Case(f"{fname}:too_many", fn, base + [base[0]], expect="TypeError", oracle=oracle))
        cases.append(Case(f"{fname}:no_args", fn, [], expect="TypeError", oracle=oracle))
    import ssmgrad
    for j, w in enumerate(WEIRD + [np.arange(3.0)]):
        cases.append(Case(f"split(weird{j})", ssmgrad.split, [w, (2,)], expect="any",
                          oracle=lambda a, k: (np.asarray(a[0]).reshape(2),)))
        cases.append(Case(f"split(arr, weird{j})", ssmgrad.split, [np.arange(2.0), w], expect="any",
                          oracle=lambda a, k: (np.arange(2.0).reshape(a[1]),)))
    return cases


def batch_ranks():
    cases = []
    for fname, (fn, names, oracle) in functions().items():
        base = base_args(fname)
        for pos, argname in enumerate(names):
            a = base[pos]
            ranks = {"rank+1": a[None], "0-d": np.asarray(a.reshape(-1)[0])}
            if a.ndim >= 2:
                ranks["rank-1"] = a.reshape(a.shape[:-2] + (a.shape[-2] * a.shape[-1],))
            for vname, v in ranks.items():
                args = list(base)
                args[pos] = v
                # a grad of the wrong rank but the right size may be accepted (the packed grad is 1-D)
                same_size = argname == "grad" and fname == "ssm_scan_back" and v.size == a.size
                cases.append(Case(f"{fname}[{argname}]:{vname}{v.shape}", fn, args,
                                  expect="any" if same_size else "ValueError", oracle=oracle,
                                  name_in_msg=None if same_size else argname))
            if argname in ("ids", "grad") and fname.startswith("ssm_scan"):
                continue
            for d in range(a.ndim):
                sh = list(a.shape)
                sh[d] += 1
                # one more state row, or (ssm_conv) a longer sx / wider kernel, is a valid input
                valid = ((argname, d) == ("s", 0) or
                         (fname == "ssm_conv" and (argname, d) in (("sx", 0), ("sx", 2), ("c", 1))))
                args = list(base)
                args[pos] = np.resize(a, sh)
                cases.append(Case(f"{fname}[{argname}]:dim{d}+1", fn, args, expect="ok" if valid else "ValueError",
                                  oracle=oracle))
    return cases


def batch_dtypes():
    cases = []
    bad = {"int32": np.int32, "int64": np.int64, "bool": np.bool_, "complex64": np.complex64,
           "complex128": np.complex128, "float16": np.float16, "object": object, "uint8": np.uint8,
           "longdouble": np.longdouble}
    for fname, (fn, names, oracle) in functions().items():
        for base_dtype in (np.float32, np.float64):
            base = base_args(fname, base_dtype)
            for pos, argname in enumerate(names):
                if argname == "ids":
                    for dn, dt_ in (("float64", np.float64), ("float32", np.float32), ("complex", np.complex128),
                                    ("object", object), ("bool", np.bool_)):
                        args = list(base)
                        args[pos] = base[pos].astype(dt_)
                        cases.append(Case(f"{fname}[ids]:{dn}", fn, args,
                                          expect="any" if dn in ("bool", "object") else "TypeError", oracle=oracle))
                    for dn in ("int8", "uint16", "int64", "uint64", ">i4"):
                        args = list(base)
                        args[pos] = base[pos].astype(dn)
                        cases.append(Case(f"{fname}[ids]:{dn}", fn, args, expect="ok" if dn != ">i4" else "any",
                                          oracle=oracle))
                    continue
                for dn, dt_ in bad.items():
                    args = list(base)
                    args[pos] = base[pos].astype(dt_)
                    expect = "TypeError" if dn in ("int32", "int64", "bool", "complex64", "complex128", "object",
                                                   "uint8") else "raise"
                    cases.append(Case(f"{fname}[{argname}]:{dn}/{np.dtype(base_dtype)}", fn, args, expect=expect,
                                      oracle=oracle))
                # mixed float32/float64
                other = np.float64 if base_dtype == np.float32 else np.float32
                args = list(base)
                args[pos] = base[pos].astype(other)
                if len([n for n in names if n != "ids"]) > 1:
                    cases.append(Case(f"{fname}[{argname}]:mixed {np.dtype(other)}", fn, args, expect="TypeError",
                                      oracle=oracle))
                # byte-swapped floats of the right kind: convert or refuse, never misread
                args = list(base)
                args[pos] = base[pos].astype(np.dtype(base_dtype).newbyteorder())
                cases.append(Case(f"{fname}[{argname}]:byteswapped", fn, args, expect="any", oracle=oracle))
    return cases


def batch_nonfinite():
    cases = []
    rng = np.random.default_rng(11)
    for fname, (fn, names, oracle) in functions().items():
        for dtype in (np.float32, np.float64):
            for mamba2 in ((False, True) if fname.startswith("ssm_scan") else (False,)):
                kw = dict(mamba2=mamba2) if fname.startswith("ssm_scan") else {}
                base = base_args(fname, dtype, **kw)
                for pos, argname in enumerate(names):
                    if argname == "ids":
                        continue
                    for val in (np.nan, np.inf, -np.inf):
                        for rep in range(2):
                            args = [a.copy() for a in base]
                            a = args[pos]
                            if a.size == 0:
                                continue
                            a.reshape(-1)[rng.integers(a.size)] = val
                            cases.append(Case(f"{fname}[{argname}]={val}#{rep}/{np.dtype(dtype)}/m2={mamba2}",
                                              fn, args, expect="ok", oracle=oracle,
                                              strict_pattern=not fname.endswith("_back")))
                # everything NaN
                args = [np.full_like(a, np.nan) if a.dtype.kind == "f" else a for a in base]
                cases.append(Case(f"{fname}:all-NaN/{np.dtype(dtype)}", fn, args, expect="ok", oracle=oracle,
                                  strict_pattern=not fname.endswith("_back")))
    return cases


def _misaligned(a):
    buf = np.zeros(a.nbytes + 1, dtype=np.uint8)
    m = buf[1:].view(a.dtype).reshape(a.shape)
    m[...] = a
    assert not m.flags.aligned or a.size == 0
    return m


def batch_flags():
    cases = []
    for fname, (fn, names, oracle) in functions().items():
        for dtype in (np.float32, np.float64):
            base = base_args(fname, dtype)
            ro = [a.copy() for a in base]
            for a in ro:
                a.flags.writeable = False
            cases.append(Case(f"{fname}:read-only/{np.dtype(dtype)}", fn, ro, expect="ok", oracle=oracle))
            for pos, argname in enumerate(names):
                args = list(base)
                args[pos] = _misaligned(base[pos])
                cases.append(Case(f"{fname}[{argname}]:misaligned/{np.dtype(dtype)}", fn, args, expect="any",
                                  oracle=oracle))
            allm = [_misaligned(a) for a in base]
            cases.append(Case(f"{fname}:all-misaligned/{np.dtype(dtype)}", fn, allm, expect="any", oracle=oracle))
            # array subclasses and non-native containers
            lists = [a.tolist() for a in base]
            cases.append(Case(f"{fname}:lists/{np.dtype(dtype)}", fn, lists, expect="any", oracle=oracle))
            mats = [np.ma.masked_array(a) for a in base]
            cases.append(Case(f"{fname}:masked/{np.dtype(dtype)}", fn, mats, expect="any", oracle=oracle))
    return cases


def batch_ids():
    cases = []
    import ssmgrad
    for fname in ("ssm_scan", "ssm_scan_back"):
        fn, names, oracle = functions()[fname]
        base = base_args(fname)
        n_rs = base[0].shape[0]
        for bad in ([n_rs, 0], [-1, 0], [0, -n_rs], [0, 2 ** 31 - 1], [0, 2 ** 31], [0, -2 ** 31],
                    [2 ** 40, 0], [2 ** 63 - 1, 0], [0, -2 ** 63]):
            for dt_ in ("int64", "int32", "object"):
                try:
                    ids = np.array(bad, dtype=dt_)
                except OverflowError:
                    continue
                args = list(base)
                args[6] = ids
                cases.append(Case(f"{fname}:ids={bad}/{dt_}", fn, args,
                                  expect="ValueError" if dt_ != "object" else "raise", oracle=oracle,
                                  name_in_msg="ids" if dt_ != "object" else None))
        for bad in ([2 ** 64 - 1, 0], [2 ** 63, 0]):
            args = list(base)
            args[6] = np.array(bad, dtype=np.uint64)
            cases.append(Case(f"{fname}:ids={bad}/uint64", fn, args, expect="ValueError", oracle=oracle))
        for bad in ([0], [0, 1, 2], [[0, 1]], [[0], [1]], 0):
            args = list(base)
            args[6] = np.array(bad, dtype=np.int32)
            cases.append(Case(f"{fname}:ids shape {np.shape(bad)}", fn, args, expect="ValueError", oracle=oracle,
                              name_in_msg="ids"))
        args = list(base)
        args[6] = [2, 0]
        cases.append(Case(f"{fname}:ids list", fn, args, expect="ok", oracle=oracle))
        args = list(base)
        args[6] = np.array([2, 2], dtype=np.uint8)
        cases.append(Case(f"{fname}:ids duplicate uint8", fn, args, expect="ok", oracle=oracle))
        args = list(base)
        args[6] = np.array([2.0, 0.0])
        cases.append(Case(f"{fname}:ids float", fn, args, expect="TypeError", oracle=oracle))
        # K
        for K in (0, -1, -2 ** 63, 2 ** 31, 2 ** 62, 2 ** 64, 10 ** 30, 1.5, "2", None, np.int64(1), True):
            kw = {"K": K}
            m2 = base_args(fname, mamba2=True)
            cases.append(Case(f"{fname}:K={K!r}", fn, m2, kw, expect="any", oracle=oracle))
        cases.append(Case(f"{fname}:K=2 mamba1", fn, list(base), {"K": 2}, expect="ValueError", oracle=oracle))
    return cases


def batch_grad():
    cases = []
    for fname in ("ssm_scan_back", "ssm_conv_back", "ssm_conv_back_weight"):
        fn, names, oracle = functions()[fname]
        for dtype in (np.float32, np.float64):
            base = base_args(fname, dtype)
            g = base[-1]
            variants = {"size-1": g.reshape(-1)[:-1], "size+1": np.concatenate([g.reshape(-1), g.reshape(-1)[:1]]),
                        "empty": g.reshape(-1)[:0], "double": np.concatenate([g.reshape(-1)] * 2),
                        "2d-same-size": g.reshape(1, -1), "scalar": np.asarray(g.reshape(-1)[0])}
            for vname, v in variants.items():
                args = list(base)
                args[-1] = v
                expect = "any" if v.size == g.size else "ValueError"
                cases.append(Case(f"{fname}:grad {vname}/{np.dtype(dtype)}", fn, args, expect=expect, oracle=oracle,
                                  name_in_msg="grad" if expect == "ValueError" else None))
            if fname == "ssm_scan_back":
                for K in (2, 3):
                    m2 = base_args(fname, dtype, mamba2=True)
                    cases.append(Case(f"{fname}:K={K} with K=1 grad", fn, m2, {"K": K}, expect="ValueError",
                                      oracle=oracle))
    return cases


def batch_zero():
    cases = []
    dims = dict(n_rs=3, n_head=2, head_dim=2, d_state=3, n_group=1, n_seqs=2, n_t=3)
    for fname in ("ssm_scan", "ssm_scan_back"):
        fn, names, oracle = functions()[fname]
        for key in dims:
            for mamba2 in (False, True):
                d = dict(dims)
                d[key] = 0
                if key == "n_group":
                    continue
                if key == "n_rs":
                    d["n_seqs"] = 0
                try:
                    args = base_args(fname, mamba2=mamba2, **d)
                except Exception as e:  # noqa: BLE001
                    raise AssertionError(f"building zero case {key}: {e}")
                cases.append(Case(f"{fname}:{key}=0/m2={mamba2}", fn, args, expect="ok", oracle=oracle))
                if fname == "ssm_scan" and mamba2:
                    cases.append(Case(f"{fname}:{key}=0/K=3", fn, args, {"K": 3}, expect="ok", oracle=oracle))
        # n_group = 0 cannot divide n_head
        args = base_args(fname)
        args[4] = args[4][:, :, :0]
        args[5] = args[5][:, :, :0]
        cases.append(Case(f"{fname}:n_group=0", fn, args, expect="ValueError", oracle=oracle))
    for fname in ("ssm_conv", "ssm_conv_back", "ssm_conv_back_weight"):
        fn, names, oracle = functions()[fname]
        for key in ("n_s", "d_inner", "n_t"):
            d = dict(n_s=2, d_inner=3, d_conv=3, n_t=4)
            d[key] = 0
            cases.append(Case(f"{fname}:{key}=0", fn, base_args(fname, **d), expect="ok", oracle=oracle))
        # d_conv = 0: c (d_inner, 0) -- a ValueError, or y = 0 with n_t = sx.shape[2] + 1
        sx = np.ones((2, 3, 4))
        c = np.ones((3, 0))
        args = [sx, c] + ([np.ones((2, 5, 3))] if fname != "ssm_conv" else [])
        cases.append(Case(f"{fname}:d_conv=0", fn, args, expect="any", oracle=oracle))
        # n_t < 0: sx shorter than d_conv - 1
        args = [np.ones((2, 3, 1)), np.ones((3, 4))] + ([np.ones((2, 0, 3))] if fname != "ssm_conv" else [])
        cases.append(Case(f"{fname}:n_t<0", fn, args, expect="ValueError", oracle=oracle))
    return cases


def _huge(shape, dtype=np.float32):
    """A read-only array of the given (huge) shape backed by a single element (all strides 0)."""
    one = np.ones(1, dtype=dtype)
    return np.lib.stride_tricks.as_strided(one, shape=shape, strides=(0,) * len(shape), writeable=False)


def batch_huge():
    import ssmgrad
    cases = []
    fns = functions()
    big = 2 ** 20
    # scan: every input is small in memory, but an output / its size computation is absurd
    for dtype in (np.float32, np.float64):
        specs = {
            # (n_rs, n_head, head_dim, d_state, n_group, n_seqs, n_t)
            "state_overflows_int64": (1, big, 2 ** 19, 2 ** 19, 1, big, 1),   # N_s = 2^78
            "y_too_big_to_allocate": (1, 1, 2 ** 18, 1, 1, big, big),         # N_y = 2^58
            "both_2^40": (1, 1, 2 ** 20, 1, 1, 2 ** 20, 1),                   # N_y = N_s = 2^40
            "n_t_2^58": (1, 1, 1, 1, 1, 1, 2 ** 58),
        }
        for name, (n_rs, n_head, head_dim, d_state, n_group, n_seqs, n_t) in specs.items():
            for mamba2 in (False, True):
                s = _huge((n_rs, n_head, head_dim, d_state), dtype)
                x = _huge((n_seqs, n_t, n_head, head_dim), dtype)
                dt = _huge((n_seqs, n_t, n_head), dtype)
                A = _huge((n_head, 1) if mamba2 else (n_head, d_state), dtype)
                B = _huge((n_seqs, n_t, n_group, d_state), dtype)
                C = _huge((n_seqs, n_t, n_group, d_state), dtype)
                ids = np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), shape=(n_seqs,), strides=(0,),
                                                      writeable=False)
                args = [s, x, dt, A, B, C, ids]
                cases.append(Case(f"ssm_scan:{name}/m2={mamba2}/{np.dtype(dtype)}", fns["ssm_scan"][0], args,
                                  expect="raise", oracle=fns["ssm_scan"][2]))
                grad = _huge((2 ** 58,), dtype)
                cases.append(Case(f"ssm_scan_back:{name}/m2={mamba2}/{np.dtype(dtype)}", fns["ssm_scan_back"][0],
                                  args + [grad], expect="raise", oracle=fns["ssm_scan_back"][2]))
        # K absurd with small tensors: K * N_s overflows / cannot be allocated
        small = base_scan(dtype, mamba2=True)
        for K in (2 ** 40, 2 ** 62, 2 ** 63 - 1):
            cases.append(Case(f"ssm_scan:K={K}/{np.dtype(dtype)}", fns["ssm_scan"][0], small, {"K": K},
                              expect="raise", oracle=fns["ssm_scan"][2]))
            cases.append(Case(f"ssm_scan_back:K={K}/{np.dtype(dtype)}", fns["ssm_scan_back"][0],
                              small + [np.ones(10, dtype)], {"K": K}, expect="raise",
                              oracle=fns["ssm_scan_back"][2]))
        # conv: y (n_s, n_t, d_inner) absurd
        # (n_s, d_inner, d_conv, n_t, sx columns)
        # (ssm_conv_back_weight's output is only c's size: a huge sx with a small c is a valid, merely
        # endless, computation, so every case here makes each function's own output absurd)
        for name, (n_s, d_inner, d_conv, n_t, cols) in {"conv_d_inner_2^40": (1, 2 ** 40, 2, 1, 2),
                                                        "conv_dconv_2^58_short_sx": (1, 1, 2 ** 58, 1, 5)}.items():
            sx = _huge((n_s, d_inner, cols), dtype)
            c = _huge((d_inner, d_conv), dtype)
            g = _huge((n_s, n_t, d_inner), dtype)
            for fname in ("ssm_conv", "ssm_conv_back", "ssm_conv_back_weight"):
                args = [sx, c] + ([g] if fname != "ssm_conv" else [])
                cases.append(Case(f"{fname}:{name}/{np.dtype(dtype)}", fns[fname][0], args, expect="raise",
                                  oracle=fns[fname][2]))
    # split with absurd shapes
    packed = np.zeros(4)
    for shapes in ([(2 ** 62, 4)], [(2 ** 40, 2 ** 40)], [(-1,)], [(2, 2), (-2,)], [(2 ** 63 - 1,), (2 ** 63 - 1,)]):
        cases.append(Case(f"split:{shapes}", ssmgrad.split, [packed] + shapes, expect="raise", oracle=None))
    return cases


def batch_kwargs():
    import ssmgrad
    cases = []
    fns = functions()
    base = base_args("ssm_scan_back", mamba2=True)
    for kw in ({"bogus": 1}, {"K": 1, "k": 1}, {"return_dA": "yes"}, {"return_dA": None}, {"return_dA": 2},
               {"return_dA": np.bool_(True)}, {"grad": base[-1]}):
        cases.append(Case(f"ssm_scan_back:kwargs={list(kw)}", fns["ssm_scan_back"][0], base, kw, expect="any",
                          oracle=fns["ssm_scan_back"][2]))
    cases.append(Case("ssm_scan:kwarg bogus", fns["ssm_scan"][0], base[:7], {"bogus": 1}, expect="TypeError",
                      oracle=fns["ssm_scan"][2]))
    cases.append(Case("ssm_conv:kwarg bogus", fns["ssm_conv"][0], base_args("ssm_conv"), {"bogus": 1},
                      expect="TypeError", oracle=fns["ssm_conv"][2]))
    # thread count API
    for n in (0, -1, -2 ** 63, 2 ** 31, 2 ** 64, 10 ** 30, 1.5, "2", None, [1]):
        def setter(n=n):
            before = ssmgrad.get_num_threads()
            try:
                ssmgrad.set_num_threads(n)
            finally:
                ssmgrad.set_num_threads(before)
            return "ok"
        cases.append(Case(f"set_num_threads({n!r})", setter, [], expect="any",
                          oracle=lambda a, k: "ok"))
    return cases


def batch_random():
    """Random mutations of valid arguments (dtype, rank, one dimension, layout, weird object)."""
    rng = np.random.default_rng(1234)
    fns = functions()
    cases = []
    dtypes = [np.float32, np.float64, np.float16, np.int32, np.complex64, np.bool_]
    for i in range(int(os.environ.get("SSMGRAD_BAD_INPUT_RANDOM", "400"))):
        fname = list(fns)[rng.integers(len(fns))]
        fn, names, oracle = fns[fname]
        base_dtype = [np.float32, np.float64][rng.integers(2)]
        kw = {}
        if fname.startswith("ssm_scan"):
            kw = dict(mamba2=bool(rng.integers(2)), n_seqs=int(rng.integers(0, 3)), n_t=int(rng.integers(0, 4)))
        args = base_args(fname, base_dtype, **kw)
        for pos in range(len(args)):
            r = rng.random()
            a = np.asarray(args[pos])
            if r < 0.6:
                continue
            if r < 0.7:
                args[pos] = a.astype(dtypes[rng.integers(len(dtypes))])
            elif r < 0.78 and a.ndim:
                ax = rng.integers(a.ndim)
                sh = list(a.shape)
                sh[ax] = max(0, sh[ax] + int(rng.choice([-1, 1, 2])))
                args[pos] = np.resize(a, sh).astype(a.dtype)
            elif r < 0.84:
                args[pos] = a[None] if rng.integers(2) or a.ndim == 0 or a.shape[0] == 0 else a[0]
            elif r < 0.9 and a.ndim:
                args[pos] = a.T                             # right shape only if square...
            elif r < 0.95:
                args[pos] = WEIRD[rng.integers(len(WEIRD))]
            else:
                args[pos] = a.tolist()
        call_kw = {}
        if fname == "ssm_scan" and kw.get("mamba2") and rng.random() < 0.3:
            call_kw["K"] = int(rng.integers(1, 4))
        cases.append(Case(f"random#{i}:{fname}", fn, args, call_kw, expect="any", oracle=oracle,
                          strict_pattern=False))
    return cases


def child_main(batch):
    sys.path.insert(0, TESTS)
    import ssmgrad
    cases = globals()["batch_" + batch]()
    problems, outcomes = [], {}
    for case in cases:
        print("CASE", case.name, flush=True)            # the last one names the culprit of a crash/hang
        outcome, problem = run_case(case)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if problem:
            problems.append(f"{case.name}: {problem}")
    print("RESULT " + json.dumps({"ssmgrad": os.path.abspath(ssmgrad.__file__), "n": len(cases),
                                  "outcomes": outcomes, "problems": problems}))


# =============================================================================================
# pytest side

import pytest  # noqa: E402


@pytest.mark.parametrize("batch", BATCHES)
def test_bad_inputs_batch(batch):
    import ssmgrad
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(ssmgrad.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent, TESTS] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), batch], capture_output=True, text=True,
                              timeout=TIMEOUT, env=env, cwd=TESTS)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"batch {batch!r} hung (> {TIMEOUT} s); output so far:\n{e.stdout}\n{e.stderr}")
    tail = (proc.stdout[-4000:] + "\n--- stderr ---\n" + proc.stderr[-8000:])
    assert proc.returncode == 0, f"batch {batch!r} crashed (exit {proc.returncode}):\n{tail}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"batch {batch!r} printed no result:\n{tail}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert os.path.samefile(res["ssmgrad"], ssmgrad.__file__), (res["ssmgrad"], ssmgrad.__file__)
    assert res["n"] >= 10, f"batch {batch!r} ran only {res['n']} cases"
    assert not res["problems"], (f"batch {batch!r}: {len(res['problems'])} of {res['n']} cases misbehaved "
                                 f"(outcomes {res['outcomes']}):\n" + "\n".join(res["problems"][:40]))


if __name__ == "__main__":
    child_main(sys.argv[1])
