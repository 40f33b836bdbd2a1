"""Float32 CPU linears through oneDNN (``ditsp/cpu/gemm.py``): the same values as ``F.linear`` within
summation-order rounding, the BLAS kept where the route does not apply (autograd, bf16, the
deterministic policy, ``DITSP_CPU_GEMM=blas``), and the compiled route."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ditsp import fixed_shape
from ditsp.cpu import gemm as cpu_gemm

onednn = pytest.mark.skipif(cpu_gemm.route() != "onednn", reason="this torch build has no oneDNN linear")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@onednn
@pytest.mark.parametrize("shape", [(1, 64), (300, 64), (2, 77, 64)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_onednn_matches_the_blas_within_rounding(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g), torch.randn(96, 64, generator=g)
    b = torch.randn(96, generator=g) if with_bias else None
    y = cpu_gemm.linear(x, w, b)
    assert y.shape == F.linear(x, w, b).shape and y.dtype == torch.float32
    assert _rel(y, F.linear(x.double(), w.double(), None if b is None else b.double())) < 1e-5


@onednn
def test_a_transposed_input_is_read_as_its_values():
    x = torch.randn(64, 50).t()  # (50, 64), not contiguous
    w = torch.randn(32, 64)
    assert _rel(cpu_gemm.linear(x, w), F.linear(x, w)) < 1e-5


def test_where_the_route_does_not_apply_the_blas_runs_bit_for_bit():
    x, w, b = torch.randn(40, 64), torch.randn(96, 64), torch.randn(96)
    with cpu_gemm.use_route("blas"):
        assert cpu_gemm.route() == "blas"
        assert torch.equal(cpu_gemm.linear(x, w, b), F.linear(x, w, b))
    xb, wb = x.bfloat16(), w.bfloat16()
    assert torch.equal(cpu_gemm.linear(xb, wb), F.linear(xb, wb))  # bf16 already runs on oneDNN
    with fixed_shape.use(fixed_shape.DETERMINISTIC):
        assert torch.equal(fixed_shape.plain_linear(x, w, b), F.linear(x, w, b))


def test_inputs_that_need_a_gradient_keep_autograd():
    x = torch.randn(40, 64, requires_grad=True)
    w = torch.randn(96, 64, requires_grad=True)
    y = cpu_gemm.linear(x, w)
    y.sum().backward()
    assert y.grad_fn is not None and w.grad.shape == w.shape
    assert torch.allclose(x.grad, w.detach().sum(0).expand_as(x), rtol=1e-4, atol=1e-4)


@onednn
def test_the_fast_policy_sends_token_rows_through_onednn():
    x, w = torch.randn(300, 64), torch.randn(96, 64)
    with fixed_shape.use(fixed_shape.FAST):
        y = fixed_shape.linear_rows(x, w)
    with cpu_gemm.use_route("blas"):
        blas = F.linear(x, w)
    assert _rel(y, blas) < 1e-5


@onednn
def test_compiled_code_calls_the_same_route():
    from ditsp.models.seedvr2.compiled import kernel_set_cache

    kernel_set_cache()  # as every compile of ditsp's does: inductor's cache per CPU kernel set
    w, b = torch.randn(96, 64), torch.randn(96)
    f = torch.compile(lambda x: cpu_gemm.linear(x, w, b) * 2, dynamic=False)
    x = torch.randn(2, 30, 64)
    assert _rel(f(x), F.linear(x, w, b) * 2) < 1e-5


def _route_in_subprocess(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DITSP_CPU_GEMM=value)
    return subprocess.run([sys.executable, "-c", "from ditsp.cpu import gemm; print(gemm.route())"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_environment_chooses_the_route_and_a_bad_value_is_one_clear_error():
    assert _route_in_subprocess("blas").stdout.strip() == "blas"
    bad = _route_in_subprocess("mkl")
    assert bad.returncode != 0 and "DITSP_CPU_GEMM='mkl': expected one of onednn, blas" in bad.stderr


@onednn
def test_operands_that_do_not_fit_raise_f_linear_error_and_leave_the_route_on():
    x, w = torch.randn(4, 64), torch.randn(96, 63)
    with pytest.raises(RuntimeError) as ours:
        cpu_gemm.linear(x, w)
    with pytest.raises(RuntimeError) as theirs:
        F.linear(x, w)
    assert str(ours.value) == str(theirs.value)
    # one bad call does not move later calls off oneDNN (ranks that saw it would differ from those that did not)
    assert cpu_gemm.route() == "onednn" and cpu_gemm.applies(x, torch.randn(96, 64), None)
