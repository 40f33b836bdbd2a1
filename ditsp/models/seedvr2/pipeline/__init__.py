"""The SeedVR2 restoration pipeline around the DiT and the VAE.

Pixel side (``transform``): area resize, clamp, crop to 16, ``2x - 1``, and
back to uint8. Time (``padding``, ``windows``): 4n+1 padding and long-video
windows with a streaming cross-fade. Latent side (``condition``): seeded
noise, the 33-channel DiT input, the timestep, the sampler and the latent for
the decoder. Colour (``color_fix``): wavelet, AdaIN or none. ``sizing``:
input size -> output size and latent grid.
"""

from .color_fix import METHODS as COLOR_FIX_METHODS
from .color_fix import adain_color_fix, apply_color_fix, wavelet_color_fix
from .condition import (
    augment_condition,
    decoder_latent,
    dit_input,
    dit_timestep,
    draw_noises,
    euler_sample,
    make_generator,
    make_noise,
    one_step_x0,
    scale_latent,
    window_seed,
)
from .padding import pad_frames, padded_length, reference_pad, reference_padded_length
from .sizing import FrameGeometry, frame_geometry
from .transform import area_resize, area_size, center_crop, crop_box, resize_bicubic, to_uint8, transform_frames
from .windows import (StreamingBlender, Window, WindowPlan, blend_windows, frame_weights, plan_windows, seam_metric,
                      seam_metric_from_steps)

__all__ = [
    "COLOR_FIX_METHODS",
    "FrameGeometry",
    "StreamingBlender",
    "Window",
    "WindowPlan",
    "adain_color_fix",
    "area_resize",
    "area_size",
    "augment_condition",
    "blend_windows",
    "center_crop",
    "apply_color_fix",
    "crop_box",
    "decoder_latent",
    "dit_input",
    "dit_timestep",
    "draw_noises",
    "euler_sample",
    "frame_geometry",
    "frame_weights",
    "make_generator",
    "make_noise",
    "one_step_x0",
    "pad_frames",
    "padded_length",
    "plan_windows",
    "reference_pad",
    "reference_padded_length",
    "resize_bicubic",
    "scale_latent",
    "seam_metric",
    "seam_metric_from_steps",
    "to_uint8",
    "transform_frames",
    "wavelet_color_fix",
    "window_seed",
]
