"""weightsync: move freshly trained weights into running inference engines, exactly and fast.

``weightsync.sender.Sender`` hosts the control plane and staging buffers;
``weightsync.sender.Publisher`` publishes HF-named tensors;
``weightsync.receiver.TorchReceiver`` receives into a torch module.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
