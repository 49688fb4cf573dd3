"""The trainer side: the sender daemon, the generic publisher, Megatron integration."""

from weightsync.sender.daemon import Sender
from weightsync.sender.publisher import Publisher, PublishResult

__all__ = ["Publisher", "PublishResult", "Sender"]
