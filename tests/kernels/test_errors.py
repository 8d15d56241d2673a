"""Bad inputs raise TypeError/ValueError naming the argument -- never a crash.

All cases run in ONE child interpreter (fast), one JSON line per case, flushed before the next
case starts. A crash (segfault, abort) ends the child: the case it died in and every later one
then fail here with the child's exit status, instead of killing the pytest run.
"""

import json
import re
import subprocess
import sys
import textwrap

import pytest

PRELUDE = textwrap.dedent("""
    import json, sys, traceback
    import numpy as np
    import ssmgrad
    f32, f64 = np.float32, np.float64
    rng = np.random.default_rng(0)
    r = lambda *shape: rng.standard_normal(shape)
    # conv: n_s=2, d_inner=5, d_conv=4, n_t=3
    sx, c, g = r(2, 5, 6), r(5, 4), r(2, 3, 5)
    # scan, Mamba-2: n_rs=3, n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=2, n_t=3
    s, x, dt, A = r(3, 4, 2, 3), r(2, 3, 4, 2), r(2, 3, 4), -np.abs(r(4, 1))
    B, C, ids = r(2, 3, 2, 3), r(2, 3, 2, 3), np.array([2, 0], np.int32)
    A1 = -np.abs(r(4, 3))                      # Mamba-1 A for the same shapes
    gy = r(2 * 3 * 4 * 2 + 2 * 4 * 2 * 3)      # grad of out, K=1
    gy2 = r(2 * 3 * 4 * 2 + 2 * 2 * 4 * 2 * 3)  # grad of out, K=2
    conv, back, back_w = ssmgrad.ssm_conv, ssmgrad.ssm_conv_back, ssmgrad.ssm_conv_back_weight
    scan, scan_back = ssmgrad.ssm_scan, ssmgrad.ssm_scan_back
    def S(**kw):                                # scan args with some replaced
        a = dict(s=s, x=x, dt=dt, A=A, B=B, C=C, ids=ids); a.update(kw)
        return [a[k] for k in ("s", "x", "dt", "A", "B", "C", "ids")]
    def run(name, expr):
        try:
            eval(expr)
            res = dict(name=name, raised=None, msg="")
        except BaseException as e:
            res = dict(name=name, raised=type(e).__name__, msg=str(e))
        print(json.dumps(res), flush=True)
    for name, expr in json.loads(sys.stdin.read()):
        print(json.dumps(dict(name=name, started=True)), flush=True)
        run(name, expr)
    print(json.dumps(dict(done=True)), flush=True)
""")

T, V = "TypeError", "ValueError"
TV = (T, V)

# name: (expression, exception type(s), argument names of which one must appear as a word in the
#        message, actual shape that must appear in the message or None)
CASES = {
    # --- ssm_conv / ssm_conv_back / ssm_conv_back_weight
    "conv_sx_2d":            ("conv(sx[0], c)", V, ["sx"], (5, 6)),
    "conv_sx_4d":            ("conv(sx[None], c)", V, ["sx"], (1, 2, 5, 6)),
    "conv_c_1d":             ("conv(sx, c[0])", V, ["c"], (4,)),
    "conv_c_wrong_d_inner":  ("conv(sx, c[:-1])", V, ["c", "sx"], None),
    "conv_sx_too_short":     ("conv(sx[..., :2], c)", V, ["sx", "c"], None),
    "conv_mixed_dtypes":     ("conv(sx.astype(f32), c)", T, ["sx", "c"], None),
    "conv_int_sx":           ("conv(sx.astype(np.int64), c.astype(np.int64))", T, ["sx"], None),
    "conv_int_c":            ("conv(sx, c.astype(np.int32))", T, ["c"], None),
    "conv_bool_sx":          ("conv(sx > 0, c)", T, ["sx"], None),
    "conv_complex_c":        ("conv(sx, c.astype(complex))", T, ["c"], None),
    "conv_float16":          ("conv(sx.astype(np.float16), c.astype(np.float16))", T, ["sx"], None),
    "conv_object_sx":        ("conv(sx.astype(object), c)", T, ["sx"], None),
    "conv_none_sx":          ("conv(None, c)", T, ["sx"], None),
    "conv_str_c":            ("conv(sx, 'hello')", TV, ["c"], None),
    "conv_dict_sx":          ("conv({}, c)", T, ["sx"], None),
    "conv_ragged_list":      ("conv([[[1.0, 2.0]], [[1.0]]], c)", TV, [], None),
    "conv_missing_arg":      ("conv(sx)", T, [], None),
    "back_grad_shape":       ("back(sx, c, g[:, :-1])", V, ["grad"], (2, 2, 5)),
    "back_grad_transposed":  ("back(sx, c, g.transpose(0, 2, 1))", V, ["grad"], (2, 5, 3)),
    "back_grad_dtype":       ("back(sx, c, g.astype(f32))", T, ["grad"], None),
    "back_grad_int":         ("back(sx, c, g.astype(np.int64))", T, ["grad"], None),
    "back_grad_none":        ("back(sx, c, None)", T, ["grad"], None),
    "back_sx_shape":         ("back(sx[0], c, g)", V, ["sx"], (5, 6)),
    "back_w_grad_shape":     ("back_w(sx, c, g[:1])", V, ["grad"], (1, 3, 5)),
    "back_w_grad_dtype":     ("back_w(sx, c, g.astype(f32))", T, ["grad"], None),
    "back_w_c_int":          ("back_w(sx, c.astype(np.int16), g)", T, ["c"], None),
    "back_w_c_shape":        ("back_w(sx, c[:, :, None], g)", V, ["c"], (5, 4, 1)),
    # --- ssm_scan: shapes
    "scan_s_3d":             ("scan(*S(s=s[0]))", V, ["s"], (4, 2, 3)),
    "scan_s_n_head":         ("scan(*S(s=s[:, :3]))", V, ["s", "x"], None),
    "scan_s_d_state":        ("scan(*S(s=s[..., :2]))", V, ["s", "A", "B", "C"], None),
    "scan_x_head_dim":       ("scan(*S(x=x[..., :1]))", V, ["x", "s"], None),
    "scan_x_n_seqs":         ("scan(*S(x=x[:1]))", V, ["x", "dt", "B", "C", "ids"], None),
    "scan_x_3d":             ("scan(*S(x=x[0]))", V, ["x"], (3, 4, 2)),
    "scan_dt_n_head":        ("scan(*S(dt=dt[..., :3]))", V, ["dt"], (2, 3, 3)),
    "scan_dt_n_t":           ("scan(*S(dt=dt[:, :2]))", V, ["dt"], (2, 2, 4)),
    "scan_A_d_state":        ("scan(*S(A=A1[:, :2]))", V, ["A"], (4, 2)),
    "scan_A_n_head":         ("scan(*S(A=A[:3]))", V, ["A"], (3, 1)),
    "scan_A_1d":             ("scan(*S(A=A[:, 0]))", V, ["A"], (4,)),
    "scan_B_d_state":        ("scan(*S(B=B[..., :2]))", V, ["B"], (2, 3, 2, 2)),
    "scan_B_n_t":            ("scan(*S(B=B[:, :2]))", V, ["B"], (2, 2, 2, 3)),
    "scan_C_shape":          ("scan(*S(C=C[:, :, :1]))", V, ["C"], (2, 3, 1, 3)),
    "scan_n_group_divides":  ("scan(*S(B=r(2, 3, 3, 3), C=r(2, 3, 3, 3)))", V, ["B", "n_group"], None),
    "scan_ids_len":          ("scan(*S(ids=ids[:1]))", V, ["ids"], (1,)),
    "scan_ids_2d":           ("scan(*S(ids=ids[None]))", V, ["ids"], (1, 2)),
    "scan_ids_out_of_range": ("scan(*S(ids=[0, 3]))", V, ["ids"], None),
    "scan_ids_negative":     ("scan(*S(ids=[-1, 0]))", V, ["ids"], None),
    "scan_ids_uint64_huge":  ("scan(*S(ids=np.array([2**63, 0], np.uint64)))", V, ["ids"], None),
    "scan_ids_int64_huge":   ("scan(*S(ids=np.array([2**40, 0], np.int64)))", V, ["ids"], None),
    # --- ssm_scan: dtypes and junk
    "scan_ids_float":        ("scan(*S(ids=ids.astype(f64)))", T, ["ids"], None),
    "scan_ids_bool":         ("scan(*S(ids=np.array([True, False])))", T, ["ids"], None),
    "scan_ids_complex":      ("scan(*S(ids=np.array([1, 0], complex)))", T, ["ids"], None),
    "scan_ids_none":         ("scan(*S(ids=None))", TV, ["ids"], None),
    "scan_mixed_x":          ("scan(*S(x=x.astype(f32)))", T, ["x"], None),
    "scan_mixed_s":          ("scan(*S(s=s.astype(f32)))", T, ["s"], None),
    "scan_mixed_C":          ("scan(*S(C=C.astype(f32)))", T, ["C"], None),
    "scan_int_x":            ("scan(*S(x=x.astype(np.int32)))", T, ["x"], None),
    "scan_int_all":          ("scan(*[a.astype(np.int64) for a in S()])", T, ["s", "x", "dt", "A", "B", "C"], None),
    "scan_bool_dt":          ("scan(*S(dt=dt > 0))", T, ["dt"], None),
    "scan_complex_A":        ("scan(*S(A=A.astype(complex)))", T, ["A"], None),
    "scan_float16_B":        ("scan(*S(B=B.astype(np.float16)))", T, ["B"], None),
    "scan_object_B":         ("scan(*S(B=B.astype(object)))", T, ["B"], None),
    "scan_none_s":           ("scan(*S(s=None))", T, ["s"], None),
    "scan_str_C":            ("scan(*S(C='hello'))", TV, ["C"], None),
    "scan_missing_arg":      ("scan(s, x, dt, A, B, C)", T, [], None),
    # --- K
    "scan_K0":               ("scan(*S(), K=0)", V, ["K"], None),
    "scan_K_negative":       ("scan(*S(), K=-2)", V, ["K"], None),
    "scan_K2_mamba1":        ("scan(*S(A=A1), K=2)", V, ["K", "A"], None),
    "scan_back_K2_mamba1":   ("scan_back(*S(A=A1), gy2, K=2)", V, ["K", "A"], None),
    # --- ssm_scan_back
    "back_scan_grad_short":  ("scan_back(*S(), gy[:-1])", V, ["grad"], None),
    "back_scan_grad_long":   ("scan_back(*S(), np.concatenate([gy, gy[:1]]))", V, ["grad"], None),
    "back_scan_grad_y_only": ("scan_back(*S(), gy[:48])", V, ["grad"], None),
    "back_scan_grad_K":      ("scan_back(*S(), gy, K=2)", V, ["grad"], None),
    "back_scan_grad_dtype":  ("scan_back(*S(), gy.astype(f32))", T, ["grad"], None),
    "back_scan_grad_int":    ("scan_back(*S(), gy.astype(np.int64))", T, ["grad"], None),
    "back_scan_grad_none":   ("scan_back(*S(), None)", T, ["grad"], None),
    "back_scan_ids_range":   ("scan_back(*S(ids=[0, 5]), gy)", V, ["ids"], None),
    "back_scan_ids_neg":     ("scan_back(*S(ids=np.array([0, -3], np.int8)), gy)", V, ["ids"], None),
    "back_scan_A_shape":     ("scan_back(*S(A=A[:2]), gy)", V, ["A"], (2, 1)),
    "back_scan_x_shape":     ("scan_back(*S(x=x[:, :, :, :1]), gy)", V, ["x", "s"], None),
    "back_scan_mixed":       ("scan_back(*S(dt=dt.astype(f32)), gy)", T, ["dt"], None),
    "back_scan_complex_s":   ("scan_back(*S(s=s.astype(complex)), gy)", T, ["s"], None),
    "back_scan_K0":          ("scan_back(*S(), gy, K=0)", V, ["K"], None),
    # --- split
    "split_too_small":       ("ssmgrad.split(np.zeros(15), (2, 3))", V, [], None),
    "split_too_big":         ("ssmgrad.split(np.zeros(15), (4, 4))", V, [], None),
    "split_no_shapes":       ("ssmgrad.split(np.zeros(3))", V, [], None),
}


@pytest.fixture(scope="module")
def child_results():
    proc = subprocess.run([sys.executable, "-c", PRELUDE], input=json.dumps([[k, v[0]] for k, v in CASES.items()]),
                          capture_output=True, text=True, timeout=120)
    results, started, done = {}, None, False
    for line in proc.stdout.splitlines():
        rec = json.loads(line)
        if rec.get("started"):
            started = rec["name"]
        elif rec.get("done"):
            done = True
        else:
            results[rec["name"]] = rec
    return dict(results=results, last_started=started, done=done, rc=proc.returncode,
                stderr=proc.stderr[-3000:])


def _word(name, msg):
    return re.search(r"(?<![A-Za-z0-9_])" + re.escape(name) + r"(?![A-Za-z0-9_])", msg) is not None


def _has_shape(shape, msg):
    nums = [int(n) for n in re.findall(r"\d+", msg)]
    k = len(shape)
    return any(tuple(nums[i:i + k]) == tuple(shape) for i in range(len(nums) - k + 1))


@pytest.mark.parametrize("case", CASES)
def test_bad_input(child_results, case):
    expr, exc, names, shape = CASES[case]
    res = child_results["results"].get(case)
    if res is None:
        crashed_in = child_results["last_started"]
        pytest.fail(f"{case}: no result; the child exited with status {child_results['rc']} "
                    f"(crashed in case {crashed_in!r}): {child_results['stderr']}")
    allowed = exc if isinstance(exc, tuple) else (exc,)
    assert res["raised"] is not None, f"{case}: `{expr}` raised nothing (expected {'/'.join(allowed)})"
    assert res["raised"] in allowed, \
        f"{case}: `{expr}` raised {res['raised']}({res['msg']!r}), expected {'/'.join(allowed)}"
    if names:
        assert any(_word(n, res["msg"]) for n in names), \
            f"{case}: message {res['msg']!r} names none of {names}"
    if shape is not None:
        assert _has_shape(shape, res["msg"]), f"{case}: message {res['msg']!r} does not give the actual shape {shape}"


def test_child_finished(child_results):
    assert child_results["done"] and child_results["rc"] == 0, \
        f"child exited with status {child_results['rc']}: {child_results['stderr']}"


def test_valid_inputs_pass_in_child():
    # the prelude's arrays are valid: the same calls without the defect succeed (so each case
    # above fails because of its one defect)
    code = PRELUDE.replace("for name, expr in json.loads(sys.stdin.read()):", "for name, expr in []:") + textwrap.dedent("""
        out = scan(*S())
        scan_back(*S(), gy)
        scan(*S(), K=2); scan_back(*S(), gy2, K=2)
        scan(*S(A=A1)); scan_back(*S(A=A1), gy, return_dA=True)
        conv(sx, c); back(sx, c, g); back_w(sx, c, g)
        scan(*S(ids=[2, 2])); scan(*S(ids=np.array([1, 0], np.uint8)))
        assert out.size == gy.size
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], input="", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# messages that say what went wrong (in this process: the text is what is checked)

def _scan_case(dtype=None):
    import numpy as np
    rng = np.random.default_rng(5)
    r = lambda *shape: rng.standard_normal(shape).astype(dtype or np.float64)
    # n_rs 3, n_head 4, head_dim 2, d_state 3, n_group 2, n_seqs 2, n_t 3: N_y = 48, N_s = 48
    return [r(3, 4, 2, 3), r(2, 3, 4, 2), r(2, 3, 4), -np.abs(r(4, 1)), r(2, 3, 2, 3), r(2, 3, 2, 3), [2, 0]]


def test_grad_sized_for_another_K_says_what_K_N_y_N_s_are():
    import numpy as np
    import ssmgrad
    args = _scan_case()
    out2 = ssmgrad.ssm_scan(*args, K=2)
    with pytest.raises(ValueError) as e:
        ssmgrad.ssm_scan_back(*args, np.ones_like(out2))          # K forgotten: it defaults to 1
    msg = str(e.value)
    for part in ("argument 'grad' has shape (144,), expected (96,) = (N_y + K*N_s,)", "N_y = x.size = 48",
                 "N_s = n_seqs*n_head*head_dim*d_state = 48", "K = 1 (K defaults to 1",
                 "a grad of 144 elements fits K = 2"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError) as e:                            # no K fits: no suggestion
        ssmgrad.ssm_scan_back(*args, np.ones(out2.size + 1))
    assert "K = 1 (K defaults to 1" in str(e.value) and "fits K" not in str(e.value), str(e.value)


def test_half_precision_arguments_say_how_to_convert():
    """float16 arrays, and bfloat16 / float16 torch tensors, handed to the NumPy API: a TypeError that
    names the argument, its dtype and the conversion to make (NumPy cannot convert a bfloat16 tensor at
    all; its own error, "Got unsupported ScalarType BFloat16", names no argument)."""
    import numpy as np
    import torch
    import ssmgrad
    args = _scan_case(np.float32)
    for i, name in enumerate(("s", "x", "dt", "A", "B", "C")):
        half = list(args)
        half[i] = args[i].astype(np.float16)
        with pytest.raises(TypeError, match=rf"^ssm_scan: argument '{name}' must be a float32 or float64 array, got "
                                            rf"dtype float16; convert it with {name}\.astype\(numpy\.float32\)$"):
            ssmgrad.ssm_scan(*half)
        for dtype, shown in ((torch.bfloat16, r"torch\.bfloat16 \(NumPy cannot convert it: .*BFloat16\)"),
                             (torch.float16, "float16")):
            tens = list(args)
            tens[i] = torch.from_numpy(args[i]).to(dtype)
            with pytest.raises(TypeError, match=rf"^ssm_scan: argument '{name}' must be a float32 or float64 array, "
                                                rf"got dtype {shown}; convert it with {name}\.float\(\), or use "
                                                r"ssmgrad\.torch"):
                ssmgrad.ssm_scan(*tens)
    sx, c = np.ones((1, 2, 5), np.float32), np.ones((2, 3), np.float32)
    with pytest.raises(TypeError, match=r"^ssm_conv: argument 'c' .*convert it with c\.float\(\)"):
        ssmgrad.ssm_conv(sx, torch.ones(2, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"^ssm_conv_back: argument 'grad' .*grad\.astype\(numpy\.float32\)$"):
        ssmgrad.ssm_conv_back(sx, c, np.ones((1, 3, 2), np.float16))
    # other dtypes keep the plain message (no hint)
    with pytest.raises(TypeError, match=r"^ssm_conv: argument 'sx' must be a float32 or float64 array, got dtype "
                                        r"complex64$"):
        ssmgrad.ssm_conv(sx.astype(np.complex64), c)


def test_a_list_takes_the_dtype_of_the_array_arguments():
    """A Python list converts to float64 on its own; beside float32 arrays it converts to float32
    (as np.asarray(lst, np.float32) would), wherever it stands, instead of a dtype error that
    blames an array argument. Arrays of two dtypes still raise, naming both."""
    import numpy as np
    import ssmgrad
    args = _scan_case(np.float32)
    want = ssmgrad.ssm_scan(*args)
    for i in range(6):
        mixed = list(args)
        mixed[i] = args[i].tolist()
        got = ssmgrad.ssm_scan(*mixed)
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), i
    assert ssmgrad.ssm_scan(*[a.tolist() if i < 6 else a for i, a in enumerate(args)]).dtype == np.float64
    sx, c = np.ones((1, 2, 5), np.float32), np.ones((2, 3), np.float32)
    assert ssmgrad.ssm_conv(sx.tolist(), c).dtype == np.float32
    assert ssmgrad.ssm_conv_back(sx, c.tolist(), np.ones((1, 3, 2), np.float32).tolist()).dtype == np.float32
    mixed = list(args)
    mixed[0] = args[0].astype(np.float64)
    with pytest.raises(TypeError, match="argument 'x' has dtype float32 but 's' has dtype float64"):
        ssmgrad.ssm_scan(*mixed)
