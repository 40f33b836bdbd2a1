"""The one list of media formats ditsp reads and writes (every front door derives its lists from here).

A writable video extension maps to the PyAV container that writes it and the
audio codecs that container takes as they are (anything else is re-encoded to
AAC). No PyAV import here: front doors check names without loading codecs.
"""

from __future__ import annotations

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
VIDEO_EXTS = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".flv", ".wmv", ".gif")

# Audio codecs the MP4/MOV muxer takes as they are; Matroska takes those and raw PCM and Vorbis too.
MP4_AUDIO_CODECS = frozenset({"aac", "mp3", "ac3", "eac3", "alac", "opus", "flac"})
MKV_AUDIO_CODECS = MP4_AUDIO_CODECS | {"vorbis", "pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le"}

# writable video extension -> (PyAV container, audio codecs it copies)
VIDEO_CONTAINERS = {
    ".mp4": ("mp4", MP4_AUDIO_CODECS),
    ".m4v": ("mp4", MP4_AUDIO_CODECS),
    ".mov": ("mov", MP4_AUDIO_CODECS),
    ".mkv": ("matroska", MKV_AUDIO_CODECS),
}
WRITE_VIDEO_EXTS = tuple(VIDEO_CONTAINERS)
WRITE_IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".webp")


def container(ext: str) -> str:
    """The PyAV container name that writes a video ending in ``ext``."""
    return VIDEO_CONTAINERS[ext.lower()][0]


def audio_copy_codecs(ext: str) -> frozenset[str]:
    """The audio codecs a video ending in ``ext`` carries as they are."""
    return VIDEO_CONTAINERS[ext.lower()][1]


def output_exts(kind: str) -> tuple[str, ...]:
    """What an input of ``kind`` ("image", "video", "folder") may be written as."""
    return WRITE_IMAGE_EXTS if kind == "image" else WRITE_VIDEO_EXTS
