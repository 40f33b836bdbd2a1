"""The one list of diffusers model classes ditsp can parallelize: class name -> its :class:`~.hooks.Plan`."""

from __future__ import annotations

from . import cogvideox, flux, hunyuan_video, ltx, wan

PLANS = {plan.family: plan for plan in (wan.PLAN, ltx.PLAN, cogvideox.PLAN, hunyuan_video.PLAN, flux.PLAN)}
