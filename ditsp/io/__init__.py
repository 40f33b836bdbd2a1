"""Media input and output: videos (PyAV), images and frame folders (Pillow), a synthetic test clip."""

from .formats import IMAGE_EXTS, VIDEO_EXTS
from .media import MIN_SIDE, MediaError, VideoInfo, media_kind
from .probe import count_frames, open_media, probe
from .read import VideoReader, list_frames, read_frame_folder, read_image, read_video
from .write import VideoWriter, atomic_path, available_encoders, video_encoder, write_image, write_video

__all__ = [
    "IMAGE_EXTS",
    "MIN_SIDE",
    "VIDEO_EXTS",
    "MediaError",
    "VideoInfo",
    "VideoReader",
    "VideoWriter",
    "atomic_path",
    "available_encoders",
    "count_frames",
    "list_frames",
    "media_kind",
    "open_media",
    "probe",
    "read_frame_folder",
    "read_image",
    "read_video",
    "video_encoder",
    "write_image",
    "write_video",
]
