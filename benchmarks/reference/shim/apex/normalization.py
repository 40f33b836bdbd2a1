"""CPU stand-ins for apex's fused norms, as the reference builds them.

``FusedRMSNorm(normalized_shape, elementwise_affine, eps)`` and ``FusedLayerNorm(...)`` keep apex's
parameter names (``weight``, and ``bias`` for the layer norm) so state dicts load unchanged. The
math is torch's own ``rms_norm`` / ``layer_norm`` over the trailing ``normalized_shape`` dims: the
statistics are taken in float32 and the result comes back in the input's dtype, as apex's fused
CUDA kernels do.
"""

import numbers

import torch
import torch.nn.functional as F
from torch import nn


def _shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(normalized_shape)


class FusedRMSNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, **_ignored):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class FusedLayerNorm(nn.Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, **_ignored):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
