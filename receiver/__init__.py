"""Receivers: the core every engine adapter reuses, and the plain-torch receiver."""

from weightsync.receiver.core import ReceiverCore
from weightsync.receiver.torch_receiver import TorchReceiver

__all__ = ["ReceiverCore", "TorchReceiver"]
