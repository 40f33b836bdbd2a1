"""The SeedVR2 restoration pipeline around the DiT and the VAE.

Pixel side (``transform``): area resize, clamp, crop to 16, ``2x - 1``, and
back to uint8. Time (``padding``, ``windows``, ``latent_stitch``, ``seams``): 4n+1 padding, long-video
windows stitched by a streaming cross-fade or in latent space, and how much their joins stand out. Latent side (``condition``): seeded
noise, the 33-channel DiT input, the timestep, the sampler and the latent for
the decoder. Colour (``color_fix``, ``lab``, ``color_drift``): wavelet, AdaIN, Lab transfer or none, and how far the
output's colour drifted from the input's. ``sizing``:
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
from .seams import SeamMeter, seam_measure, seam_report
from .windows import (PIXEL_STITCHES, STITCHES, StreamingBlender, Window, WindowPlan, blend_windows, frame_weights,
                      plan_windows)

__all__ = [
    "COLOR_FIX_METHODS",
    "PIXEL_STITCHES",
    "STITCHES",
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
    "SeamMeter",
    "seam_measure",
    "seam_report",
    "to_uint8",
    "transform_frames",
    "wavelet_color_fix",
    "window_seed",
]
