"""``python -m ditsp.integrations.comfyui``: print the folder to link into ComfyUI's ``custom_nodes/``."""

import os

print(os.path.dirname(os.path.abspath(__file__)))
