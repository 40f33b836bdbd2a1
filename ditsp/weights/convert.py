"""Writing a float state_dict in the distributed formats (fixtures, benchmarks, conversions).

- :func:`save_fp8`: a ``.safetensors`` with every weight matrix / kernel in FP8 and the rest in
  fp16 (as ComfyUI's ``*_fp8_e4m3fn.safetensors``); ``keep(name)`` True keeps a tensor in fp16
  (the ``*_mixed_block35_fp16`` files keep their last block so); ``scaled=True`` writes a
  per-tensor ``<module>.scale_weight`` and the ``scaled_fp8`` marker (ComfyUI's scaled FP8).
- :func:`save_gguf`: a ``.gguf`` with a per-tensor type chosen by ``policy(name, shape)``
  (:func:`~.gguf_write.q8_0`, :func:`~.gguf_write.q4_k_m`).

Files are written to a temporary name and renamed.
"""

from __future__ import annotations

import os
from typing import Callable, Mapping

import torch

from . import fp8 as _fp8
from .gguf_write import write_gguf
from safetensors.torch import save_file


def save_fp8(sd: Mapping[str, torch.Tensor], path: str | os.PathLike, fmt: str = "fp8_e4m3fn",
             keep: Callable[[str], bool] | None = None, scaled: bool = False) -> str:
    fmt = _fp8.canonical(fmt)
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        v = v.detach().cpu()
        if _fp8.eligible(k, v.shape) and not (keep and keep(k)):
            if scaled:
                raw, scale = _fp8.quantize(v, fmt)
                out[k] = raw.view(_fp8.FORMATS[fmt]).contiguous()
                out[k[: -len(".weight")] + ".scale_weight"] = torch.tensor(scale, dtype=torch.float32)
            else:
                out[k] = v.to(_fp8.FORMATS[fmt]).contiguous()
        elif ".rope." in k or not v.dtype.is_floating_point:
            out[k] = v.contiguous()  # buffers keep their precision
        else:
            out[k] = v.to(torch.float16).contiguous()
    if scaled:
        out["scaled_fp8"] = torch.empty(0, dtype=_fp8.FORMATS[fmt])
    path = os.fspath(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(out, tmp)
    os.replace(tmp, path)
    return path


def save_gguf(sd: Mapping[str, torch.Tensor], path: str | os.PathLike, policy: Callable[[str, tuple], str],
              prefix: str = "model.diffusion_model.") -> str:
    """Tensors in the types ``policy`` picks; 1-D and buffers in F32."""
    items = []
    for k, v in sd.items():
        fmt = "F32" if ".rope." in k else policy(k, tuple(v.shape))
        items.append((k, v, fmt))
    return write_gguf(path, items, prefix=prefix)
