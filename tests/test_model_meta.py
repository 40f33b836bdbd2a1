"""Building a model on the meta device (``ditsp/models/meta.py``): the same structure as an ordinary
build, no ``torch.nn.init`` fill on meta tensors, and so no import of ``torch._dynamo`` (which a meta
``normal_`` pulls in: 1.3 s of CPU, once in a restoration's memory check and again on every rank)."""

from __future__ import annotations

import subprocess
import sys

import torch

from ditsp.models.meta import meta_device
from ditsp.models.seedvr2.nadit import TINY, NaDiT
from ditsp.models.seedvr2.vae import TINY as VAE_TINY
from ditsp.models.seedvr2.vae import VideoVAE

_BUILD = """
import sys
from ditsp.models.seedvr2.vae.memory import num_params
from ditsp.models.seedvr2.vae import TINY, VideoVAE
from ditsp.models.seedvr2.nadit import TINY as DIT, NaDiT
from ditsp.models.meta import meta_device
assert "torch._dynamo" not in sys.modules, "imported before any build"
num_params(TINY)
with meta_device():
    VideoVAE(TINY), NaDiT(DIT)
print("torch._dynamo" in sys.modules)
"""


def test_meta_build_imports_no_dynamo():
    out = subprocess.run([sys.executable, "-c", _BUILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_meta_build_has_the_ordinary_structure():
    for build in (lambda: VideoVAE(VAE_TINY), lambda: NaDiT(TINY)):
        with meta_device():
            meta = build()
        plain = build()
        assert all(t.is_meta for t in meta.state_dict().values())
        assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == \
               {k: (v.shape, v.dtype) for k, v in plain.state_dict().items()}


def test_init_of_a_real_tensor_still_runs():
    with meta_device():
        x = torch.zeros(64, device="cpu")
        torch.nn.init.normal_(x)
        y = torch.nn.init.ones_(torch.empty(3))
    assert x.std() > 0.5 and y.is_meta
