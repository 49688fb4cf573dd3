"""The SGLang receiver: a ``WeightTarget`` for an SGLang model and the worker-side hook for
``update_weights_from_tensor`` (``hook.sync_weights``). The RL framework drives a version
through the server with :class:`weightsync.drivers.sglang.SglangHttpClient`."""
