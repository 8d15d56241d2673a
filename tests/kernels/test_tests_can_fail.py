"""The oracle tests can fail: feed them deliberately wrong answers (a monkeypatched ssmgrad) and
check that they raise. A test that passes whatever the kernel returns proves nothing."""

import contextlib

import numpy as np
import pytest

import _ssmgrad
import ssmgrad
import test_conv
import test_decode
import test_errors
import test_inputs_unchanged
import test_scan
import test_scan_back_chunked
import test_scan_fwd_chunked
import test_threads


def _wrap(monkeypatch, name, mutate):
    real = getattr(ssmgrad, name)

    def fake(*args, **kw):
        return mutate(real(*args, **kw), args, kw)

    monkeypatch.setattr(ssmgrad, name, fake)


def _bump(flat_index, rel):
    """Return a mutator that changes one element of a (possibly tuple) result by a relative amount."""
    def mutate(res, args, kw):
        gin = res[0] if isinstance(res, tuple) else res
        gin = gin.copy()
        flat = gin.reshape(-1)
        i = flat_index % flat.size
        flat[i] += rel * (1 + abs(flat[i]))
        return (gin,) + tuple(res[1:]) if isinstance(res, tuple) else gin
    return mutate


def _expect_failure(fn, *args):
    with pytest.raises(AssertionError):
        fn(*args)


def test_forward_off_by_1e9(rng, monkeypatch):
    _wrap(monkeypatch, "ssm_scan", _bump(3, 1e-9))
    _expect_failure(test_scan.test_forward_vs_reference, rng, "m2")


@pytest.mark.parametrize("index", [0, 50, 200, 290])   # in d_s, d_x, d_B/d_C ... of case m2
def test_backward_off_by_1e7(rng, monkeypatch, index):
    _wrap(monkeypatch, "ssm_scan_back", _bump(index, 1e-7))
    _expect_failure(test_scan.test_backward_vs_autograd, rng, "m2")


def test_backward_fd_off_by_1e4(rng, monkeypatch, one_thread):
    _wrap(monkeypatch, "ssm_scan_back", _bump(60, 1e-4))
    _expect_failure(test_scan.test_backward_vs_finite_differences, rng, None, "m1")


def test_backward_ignoring_state_gradient(rng, monkeypatch):
    # a backward that drops the final-state region of grad must be caught
    real = ssmgrad.ssm_scan_back

    def fake(s, x, dt, A, B, C, ids, grad, **kw):
        grad = np.array(grad, copy=True)
        grad[np.asarray(x).size:] = 0
        return real(s, x, dt, A, B, C, ids, grad, **kw)

    monkeypatch.setattr(ssmgrad, "ssm_scan_back", fake)
    _expect_failure(test_scan.test_backward_vs_autograd, rng, "m1")
    _expect_failure(test_scan.test_gradient_regions_separately, rng, True, "state_only")


def test_d_A_off(rng, monkeypatch):
    real = ssmgrad.ssm_scan_back

    def fake(*a, **kw):
        res = real(*a, **kw)
        return (res[0], res[1] * (1 + 1e-7)) if isinstance(res, tuple) else res

    monkeypatch.setattr(ssmgrad, "ssm_scan_back", fake)
    _expect_failure(test_scan.test_return_dA, rng, "m2")


def test_unreferenced_row_not_exactly_zero(rng, monkeypatch):
    def mutate(res, args, kw):
        gin = (res[0] if isinstance(res, tuple) else res).copy()
        s = np.asarray(args[0])
        unref = np.setdiff1d(np.arange(s.shape[0]), np.asarray(args[6]))
        d_s = gin[:s.size].reshape(s.shape)
        d_s[unref[0]].reshape(-1)[0] = 1e-300
        return (gin,) + res[1:] if isinstance(res, tuple) else gin

    _wrap(monkeypatch, "ssm_scan_back", mutate)
    _expect_failure(test_scan.test_duplicate_ids_accumulate_and_unreferenced_rows_are_zero, rng, "m2_dup_extra")


def test_snapshot_slot_wrong(rng, monkeypatch):
    def mutate(out, args, kw):
        out = out.copy()
        out[-1] += 1e-9          # the last slot (must be exactly 0 when K > n_t)
        return out

    _wrap(monkeypatch, "ssm_scan", mutate)
    _expect_failure(test_scan.test_snapshots_K, rng, None, 3, 4)


def test_float32_tolerance_catches_error(rng, monkeypatch):
    _wrap(monkeypatch, "ssm_scan_back", _bump(7, 1e-3))
    _expect_failure(test_scan.test_float32_close_to_float64, rng, "m2", 1)


def test_conv_grads_off(rng, monkeypatch, one_thread):
    _wrap(monkeypatch, "ssm_conv_back_weight", _bump(1, 1e-8))
    _expect_failure(test_conv.test_backward_vs_autograd, rng, (2, 5, 4, 7))
    monkeypatch.undo()
    _wrap(monkeypatch, "ssm_conv_back", _bump(5, 1e-6))
    _expect_failure(test_conv.test_backward_vs_finite_differences, rng, None, (2, 5, 4, 7))


def test_threads_last_bit(rng, monkeypatch, restore_threads):
    def mutate(out, args, kw):
        if ssmgrad.get_num_threads() > 1:
            out = out.copy()
            out[0] = np.nextafter(out[0], np.inf)
        return out

    _wrap(monkeypatch, "ssm_scan", mutate)
    with pytest.raises(pytest.fail.Exception):
        test_threads.test_scan_bitwise_across_threads(rng, None, "m2", np.float64)


def test_inputs_modified(rng, monkeypatch):
    real = ssmgrad.ssm_scan

    def fake(s, x, *a, **kw):
        out = real(s, x, *a, **kw)
        x[(0,) * x.ndim] += 1.0       # writes through the caller's array
        return out

    monkeypatch.setattr(ssmgrad, "ssm_scan", fake)
    _expect_failure(test_inputs_unchanged.test_scan_inputs_unchanged, rng, np.float64, True)


def test_result_sharing_input_memory(rng, monkeypatch):
    monkeypatch.setattr(ssmgrad, "ssm_conv_back", lambda sx, c, grad: sx)
    _expect_failure(test_inputs_unchanged.test_conv_inputs_unchanged, rng, np.float64)


@pytest.mark.parametrize("res", [
    dict(name="conv_sx_2d", raised=None, msg=""),
    dict(name="conv_sx_2d", raised="RuntimeError", msg="argument 'sx'"),
    dict(name="conv_sx_2d", raised="ValueError", msg="bad shape"),
    dict(name="conv_sx_2d", raised="ValueError", msg="argument 'sx' is wrong"),      # no actual shape
    dict(name="scan_mixed_x", raised="TypeError", msg="argument 'xx' is float32"),   # names another argument
])
def test_error_checks_catch_bad_messages(res):
    results = dict(results={res["name"]: res}, last_started=res["name"], done=True, rc=0, stderr="")
    _expect_failure(test_errors.test_bad_input, results, res["name"])


def test_error_checks_catch_crash():
    results = dict(results={}, last_started="conv_sx_2d", done=False, rc=-11, stderr="Segmentation fault")
    with pytest.raises(pytest.fail.Exception):
        test_errors.test_bad_input(results, "conv_sx_2d")
    _expect_failure(test_errors.test_child_finished, results)


@pytest.mark.parametrize("which", ["ssm_scan", "ssm_scan_back"])
def test_softplus_threshold_off_by_one_side(rng, monkeypatch, which):
    # a kernel testing `v < 20` instead of `v <= 20`: emulated by nudging dt == 20 just above 20
    real = getattr(ssmgrad, which)

    def fake(s, x, dt, *a, **kw):
        dt = np.array(dt, dtype=np.float64, copy=True)
        dt[dt == 20.0] = np.nextafter(20.0, 21.0)
        return real(s, x, dt, *a, **kw)

    monkeypatch.setattr(ssmgrad, which, fake)
    _expect_failure(test_scan.test_softplus_derivative_values, rng)
    _expect_failure(test_scan.test_softplus_threshold, rng, None, True)


# --- each form of the scan, broken on its own ---------------------------------------------------
# The wrapper bumps one output element only when the call takes the named form (the form the glue
# reports for these arguments), counts those calls, and the form's own oracle test must then fail.
# The count proves the break reached that form: a test that never ran it could not have failed.

def _scan_form(kernel, args, kw):
    """'decode', 'recurrence' or 'chunked': the form ssm_scan (kernel 'fwd') or ssm_scan_back
    ('back') takes for these arguments; the decode path is the one that needs no work buffer."""
    scan7, K = tuple(args[:7]), int(kw.get("K", 1))
    if kernel == "fwd" and _ssmgrad._scan_work_bytes(*scan7, K, 1) == 0:
        return "decode"
    return _ssmgrad._scan_forms(*scan7, K)[kernel]


@contextlib.contextmanager
def _mode(setter, form):
    old = setter(form)
    try:
        yield
    finally:
        setter(old)


FORM_BREAKS = {
    # form: (kernel, mode to force or None, oracle test, its arguments after rng)
    "decode": ("fwd", None, test_decode.test_decode_vs_reference, ("m2_nt4",)),
    "recurrence_fwd": ("fwd", None, test_decode.test_mamba1_strided_A_falls_back, ()),
    "chunked_fwd": ("fwd", "chunked", test_scan_fwd_chunked.test_chunked_vs_reference, (None, "nt150_groups")),
    "recurrence_back": ("back", "recurrence", test_scan.test_backward_vs_autograd, ("m2",)),
    "chunked_back": ("back", "chunked", test_scan_back_chunked.test_chunked_vs_autograd, (None, "nt150_groups")),
}


@pytest.mark.parametrize("form", FORM_BREAKS)
def test_each_scan_form_broken_alone_fails(rng, monkeypatch, form):
    kernel, force, test, test_args = FORM_BREAKS[form]
    want = form.split("_")[0]
    name = "ssm_scan" if kernel == "fwd" else "ssm_scan_back"
    hits = []
    bump = _bump(7, 1e-6)

    def mutate(res, args, kw):
        if _scan_form(kernel, args, kw) != want:
            return res
        hits.append(form)
        return bump(res, args, kw)

    _wrap(monkeypatch, name, mutate)
    setter = _ssmgrad._set_scan_fwd if kernel == "fwd" else _ssmgrad._set_scan_back
    with _mode(setter, force) if force else contextlib.nullcontext():
        _expect_failure(test, rng, *test_args)
    assert hits, f"the {form} break never ran: the test did not take that form"
