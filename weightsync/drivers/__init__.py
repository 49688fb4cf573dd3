"""Clients the RL framework runs in its own process to drive engines through one version:
:mod:`.vllm` (vLLM's HTTP routes, with the sender's ``Publisher``), :mod:`.vllm_trainer` (the
``weightsync`` backend of vLLM's trainer-side engines: ``WeightTransferTrainerFactory``) and
:mod:`.sglang` (SGLang's HTTP routes, standard library only). They sit above the sender and the
receivers."""
