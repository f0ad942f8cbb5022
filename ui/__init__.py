"""LoRA Studio's Gradio UI. Talks only to ``backend.service.Studio``; never imports torch.

    from ui import build_ui, mount
    mount(fastapi_app, studio, auth=("user", "pass"))   # UI + HTTP API on one server
"""
from .blocks import CSS, build_ui, end_streams, launch, mount, parse_auth, share_link

__all__ = ["CSS", "build_ui", "end_streams", "launch", "mount", "parse_auth", "share_link"]
