"""ComfyUI custom nodes: SeedVR2 restoration of one clip on several ranks (ditsp's sequence parallelism).

ComfyUI loads this folder from its ``custom_nodes/`` (link it there: see docs/comfyui.md); the imports are
absolute, so the node classes are ditsp's own whatever name ComfyUI gives this folder. The nodes are in
:mod:`.nodes`, the ranks they run on in :mod:`.group`, the ComfyUI services they use in :mod:`.host`.
"""

from ditsp.integrations.comfyui.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
