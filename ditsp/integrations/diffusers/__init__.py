"""diffusers transformers under ditsp SP: ``parallelize(model, ParallelConfig(...))``, in place.

Needs the ``diffusers`` extra only to build the models; this package imports
no diffusers code itself (plans name classes and modules by their names).
"""

from .cfg import cfg_forward, guided
from .hooks import ParallelizeError
from .parallelize import parallelize, reduce_gradients, runtime_of
from .plans import PLANS

__all__ = ["parallelize", "cfg_forward", "guided", "reduce_gradients", "runtime_of", "ParallelizeError", "PLANS"]
