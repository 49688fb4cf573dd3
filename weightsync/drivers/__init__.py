"""Clients the RL framework runs in its own process to drive engines through one version:
:mod:`.vllm` (vLLM's HTTP routes, with the sender's ``Publisher``) and :mod:`.sglang` (SGLang's
HTTP routes, standard library only). They sit above the sender and the receivers."""
