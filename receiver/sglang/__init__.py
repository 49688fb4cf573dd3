"""The SGLang receiver: a ``WeightTarget`` for an SGLang model, the worker-side hook for
``update_weights_from_tensor`` (``hook.sync_weights``), and an HTTP client that drives one
version through a running server (``http_client.SglangHttpClient``, importable without SGLang)."""
