"""The compiled chunk kernels of the log-prob head equal the eager ones (values and gradients).

Compiling on 2 CPU cores takes ~15 s per case, hence ``slow``.
"""
import os

import pytest
import torch
from torch._dynamo.utils import counters

from streamrl.learner.logprobs import token_logprobs_chunked

# in-process compiles: no forked compiler pool on a loaded 2-core machine
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def _run(dtype, temperature, chunk, bias, compiled, n=13, seed=0, h=16, v=96, device="cpu"):
    """(logp, entropy, grad hidden, grad weight, grad bias) of g1 . logp + g2 . entropy."""
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) * 0.5).to(device, dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(device, dtype).requires_grad_() if bias else None
    tgt = torch.randint(0, v, (n,), generator=g).to(device)
    c1, c2 = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    lp, ent = token_logprobs_chunked(hid, w, tgt, temperature, chunk, with_entropy=True, bias=b, compiled=compiled)
    ((lp * c1).sum() + (ent * c2).sum()).backward()
    return [lp, ent, hid.grad, w.grad] + ([b.grad] if bias else [])


@pytest.mark.slow  # ~15 s of CPU compiling per case
@pytest.mark.parametrize("dtype,temperature,chunk,bias", [
    (torch.float32, 0.7, 5, True),      # three chunks, the last one shorter
    (torch.bfloat16, 1.3, 5, False),    # bf16 head output, fp32 statistics
    (torch.float32, 1.0, 64, False),    # one chunk: its logits kept for the backward
])
def test_compiled_chunks_equal_eager(dtype, temperature, chunk, bias):
    eager = _run(dtype, temperature, chunk, bias, compiled=False)
    comp = _run(dtype, temperature, chunk, bias, compiled=True)
    # bf16 gradients are rounded to bf16 per chunk (g_z) and at the end: a few ulps apart
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for name, a, e in zip(("logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"), comp, eager):
        assert a.dtype == e.dtype, name
        torch.testing.assert_close(a.float(), e.float(), **tol, msg=name)
    assert comp[0].dtype == torch.float32 and comp[2].dtype == dtype


@pytest.mark.slow
def test_compiled_chunks_take_any_row_count_without_recompiling():
    """Chunks of 5, 5, 3 rows, then of 5, 5, 5, 4 (a new micro-batch length) reuse the graphs."""
    _run(torch.float32, 0.9, 5, False, compiled=True, n=13)
    before = counters["stats"]["unique_graphs"]
    assert before > 0  # the compiled path did compile
    _run(torch.float32, 0.9, 5, False, compiled=True, n=19, seed=1)
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_chunks_equal_eager_on_gpu():
    """The bench's shape class on the GPU: bf16 head, 32k vocab, chunks of 1,024 rows (Triton kernels)."""
    kw = dict(n=2500, h=256, v=32000, device="cuda")
    eager = _run(torch.bfloat16, 1.0, 1024, False, compiled=False, **kw)
    comp = _run(torch.bfloat16, 1.0, 1024, False, compiled=True, **kw)
    for name, a, e in zip(("logp", "entropy", "grad_hidden", "grad_weight"), comp, eager):
        torch.testing.assert_close(a.float(), e.float(), atol=2e-2, rtol=2e-2, msg=name)
