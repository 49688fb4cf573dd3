"""weightsync: move freshly trained weights into running inference engines, exactly and fast.

``weightsync.Sender`` hosts the control plane and staging buffers;
``weightsync.sender.Publisher`` publishes HF-named tensors;
``weightsync.receiver.TorchReceiver`` receives into a torch module.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["Sender", "__version__"]


def __getattr__(name: str):
    # Lazy, so `import weightsync` stays light and has no import cycle with weightsync.sender.
    if name == "Sender":
        from weightsync.sender.daemon import Sender

        return Sender
    raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
