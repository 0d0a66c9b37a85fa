"""Image inputs: decoding, resizing and patching, placeholder expansion and multimodal positions."""
