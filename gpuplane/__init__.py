"""GPUPlane: a control plane for training on personal and small GPU machines."""
__version__ = "0.1.0"
