"""Qwen3-Next and Qwen3.5 from megatron-core 0.16.1: gated delta net (``GatedDeltaNet``) layers
and gated full-attention layers (with MoE, or dense for ``qwen3_5_text``), converted by our
rules, published, and received by transformers' models and vLLM's classes on CPU. The Qwen3.5
models carry megatron's MTP layer (a full-attention layer), converted to the checkpoints'
``mtp.*`` names and received by vLLM's ``Qwen3_5MTP`` draft model.

megatron-core cannot build ``GatedDeltaNet`` here as shipped; the test-only shims below stand in
for what is missing (nothing of the conversion is shimmed):

- ``GatedDeltaNet.__init__`` raises ImportError unless FLA (``flash-linear-attention``, Triton
  GPU kernels) imported: ``HAVE_FLA`` is set (see ``test_gdn_needs_fla_as_shipped``); its
  forward, used only by the module probe, gets FLA's ``l2norm`` formula in torch and runs
  ``deterministic_mode`` (megatron's torch ``torch_chunk_gated_delta_rule``);
- megatron's hybrid block spec (``get_transformer_block_with_experimental_attention_variant_spec``)
  asserts ``transformer_impl == "transformer_engine"``: the layers are built from the local GPT
  spec with the GDN spec's modules (``ColumnParallelLinear`` ``in_proj``, local RMSNorm
  ``out_norm``, ``RowParallelLinear`` ``out_proj``), so the input norm is ``input_layernorm``
  (TE fuses it into ``in_proj.layer_norm_weight``, a spelling the templates accept too);
- ``conv1d``, ``dt_bias`` and ``A_log`` are created on ``torch.cuda.current_device()``
  (``apply_cpu_shims`` maps it to "cpu", as for the MoE router).

Weights are filled from global names; the GDN's packed ``in_proj`` / ``conv1d`` section by
section (q, k, v, z, beta, alpha, each split over TP by key heads, as megatron's
``sharded_state_dict`` describes them), so TP=1 and TP=2 hold the same model.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.support import megatron as ms

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.megatron

LAYERS = 4
LINEAR = (0, 1, 2)
"""Gated delta net layers; layer 3 is full attention (``full_attention_interval=4``)."""
DENSE = {"qwen3_next": (0,), "qwen3_5_moe_text": (), "qwen3_5_text": tuple(range(LAYERS))}
"""Dense-MLP layers per model type (Qwen3-Next: ``mlp_only_layers``; the rest MoE)."""
MODEL_TYPES = tuple(DENSE)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 128, 4, 2, 32
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 2, 4, 32, 32, 4
EXPERTS, MOE_FFN, SHARED_FFN, FFN = 4, 64, 64, 256
HF_VOCAB, PADDED_VOCAB = 250, 256
VERSIONS = 2
CASE = ms.ModelCase("qwen3_next", "qwen3_next", experts=EXPERTS)
"""What ``ms.fill_by_global_name`` reads (the expert count) and ``ms.input_ids`` (the vocab)."""


def moe(model_type: str) -> bool:
    return len(DENSE[model_type]) < LAYERS


def mtp(model_type: str) -> int:
    """MTP layers: Qwen3.5's (vLLM's Qwen3-Next draft is checked in test_vllm_mtp.py)."""
    return 0 if model_type == "qwen3_next" else 1


def hf_config(model_type: str = "qwen3_next"):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    experts = {}
    if moe(model_type):
        experts = dict(
            moe_intermediate_size=MOE_FFN,
            shared_expert_intermediate_size=SHARED_FFN,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
        )
    if model_type == "qwen3_next":
        experts.update(decoder_sparse_step=1, mlp_only_layers=list(DENSE[model_type]))
    else:
        experts.update(mtp_num_hidden_layers=mtp(model_type))
    return AutoConfig.for_model(
        model_type,
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]],
        **experts,
        vocab_size=HF_VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=FFN,
        norm_topk_prob=True,
        layer_types=["linear_attention" if i in LINEAR else "full_attention" for i in range(4)],
        full_attention_interval=4,
        linear_num_key_heads=K_HEADS,
        linear_num_value_heads=V_HEADS,
        linear_key_head_dim=K_DIM,
        linear_value_head_dim=V_DIM,
        linear_conv_kernel_dim=CONV,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,  # vLLM's max_model_len in the sweep loader
        tie_word_embeddings=False,
        dtype=torch.float32,
    )


# --- megatron side (gloo worker processes) ---------------------------------------------------


def _fla_shims() -> None:
    import megatron.core.ssm.gated_delta_net as gdn

    gdn.HAVE_FLA = True
    gdn.l2norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def megatron_model(sizes: dict, model_type: str) -> torch.nn.Module:
    import torch.nn.functional as F
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    _fla_shims()
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=HEAD_DIM,
        ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        layernorm_epsilon=1e-6,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        attention_output_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[1 if i in LINEAR else 0 for i in range(LAYERS)],
        linear_conv_kernel_dim=CONV,
        linear_key_head_dim=K_DIM,
        linear_value_head_dim=V_DIM,
        linear_num_key_heads=K_HEADS,
        linear_num_value_heads=V_HEADS,
        deterministic_mode=True,
        mtp_num_layers=mtp(model_type) or None,
        tensor_model_parallel_size=sizes["tp"],
        pipeline_model_parallel_size=1,
        sequence_parallel=False,
        pipeline_dtype=torch.float32,
        **(megatron_moe(model_type) if moe(model_type) else {}),
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    gdn = ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear,
            out_norm=LocalSpecProvider().layer_norm(rms_norm=True),
            out_proj=RowParallelLinear,
        ),
    )
    spec.layer_specs = [
        replace(s, submodules=replace(s.submodules, self_attention=gdn)) if i in LINEAR else s
        for i, s in enumerate(spec.layer_specs)
    ]
    model = GPTModel(
        config,
        spec,
        vocab_size=PADDED_VOCAB,
        max_sequence_length=64,
        parallel_output=False,
        position_embedding_type="rope",
        rotary_base=10000,
        # the MTP layer is built from the last layer's spec: full attention, like Qwen3.5's
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
        if mtp(model_type)
        else None,
    )
    return model.eval()


def megatron_moe(model_type: str) -> dict:
    return dict(
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=MOE_FFN,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        moe_layer_freq=[0 if i in DENSE[model_type] else 1 for i in range(LAYERS)],
        moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        moe_shared_expert_intermediate_size=SHARED_FFN,
        moe_shared_expert_gate=True,
    )


_SECTIONS = {
    "self_attention.in_proj.weight": (K_DIM, K_DIM) + (V_HEADS // K_HEADS * V_DIM,) * 2 + (2, 2),
    "self_attention.conv1d.weight": (K_DIM, K_DIM, V_HEADS // K_HEADS * V_DIM),
}
"""Rows per key head of each section of the GDN's packed tensors (q, k, v, z, beta, alpha)."""


@torch.no_grad()
def fill(model: torch.nn.Module) -> None:
    """Global-name fill; the GDN's packed tensors section by section (see the module doc)."""
    from megatron.core import parallel_state as ps

    for _, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False) and not hasattr(p, "partition_dim"):
            p.partition_dim = 0  # what ms.fill_by_global_name cuts by (GDN leaves it unset)
    ms.fill_by_global_name([model], CASE)
    rank, size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    local = K_HEADS // size
    for name, p in model.named_parameters():
        units = next((u for suffix, u in _SECTIONS.items() if name.endswith(suffix)), None)
        if units is None:
            continue
        parts = []
        for s, unit in enumerate(units):
            seed = int.from_bytes(hashlib.sha256(f"{name}#{s}".encode()).digest()[:8], "little")
            gen = torch.Generator().manual_seed(seed >> 1)
            master = torch.randn((K_HEADS * unit, *p.shape[1:]), generator=gen) * 0.05
            parts.append(master[rank * local * unit : (rank + 1) * local * unit])
        p.copy_(torch.cat(parts))


def probe_input() -> torch.Tensor:
    """``[seq, batch, hidden]`` hidden states for the module probe."""
    return torch.randn((ms.SEQ, 2, HIDDEN), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def megatron_probe(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Layer 0's GDN output and layer 3's query / key / value / gate (before the q/k norms,
    whose (1 + w) form is a config matter, not a layout one) on :func:`probe_input`."""
    x = probe_input()
    gdn_out, _ = model.decoder.layers[0].self_attention(x, attention_mask=None)
    attention = model.decoder.layers[3].self_attention
    attention.q_layernorm = attention.k_layernorm = None
    q, k, v, gate = attention.get_query_key_value_tensors(x, output_gate=True)
    return {"gdn": gdn_out, "query": q, "key": k, "value": v, "gate": gate}


def collect_worker(rank: int, sizes: dict, probe: bool):
    """Every model type: its gathered shards (and the probe) on rank 0."""
    from weightsync.sender.megatron import collect_shards, gather_local_shards

    out = {}
    for model_type in MODEL_TYPES:
        torch.manual_seed(0)
        model = megatron_model(sizes, model_type)
        local = collect_shards([model])  # before fill sets partition_dim on the GDN's params
        fill(model)
        out[model_type] = {"states": gather_local_shards(local)}
        if probe:
            out[model_type]["probe"] = megatron_probe(model)
    return out if rank == 0 else None


def publish_worker(rank: int, sizes: dict, address: str):
    from weightsync.sender.megatron import MegatronPublisher, collect_shards, gather_local_shards

    torch.manual_seed(0)
    model = megatron_model(sizes, "qwen3_next")
    fill(model)
    publisher = MegatronPublisher([model], hf_config(), address)
    states = []
    for version in range(1, VERSIONS + 1):
        if version > 1:
            with torch.no_grad():  # a stand-in optimizer step
                for p in model.parameters():
                    p.mul_(0.5).add_(0.25)
        publisher.publish(version, wait=True, timeout_s=120)
        states.append(gather_local_shards(collect_shards([model])))
    publisher.close()
    return states if rank == 0 else None


# --- the tests -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    return ms.launch(tmp_path_factory.mktemp("tp1"), {"tp": 1, "pp": 1}, collect_worker, True)[0]


def convert(
    states, model_type: str = "qwen3_next", export_mtp: bool = True
) -> dict[str, torch.Tensor]:
    from weightsync.sender.megatron import convert_megatron_to_hf

    return convert_megatron_to_hf(states, hf_config(model_type), export_mtp=export_mtp)


def save(state: dict[str, torch.Tensor], directory: Path, model_type: str = "qwen3_next") -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    hf_config(model_type).save_pretrained(directory)
    save_file(
        {k: v.clone().contiguous() for k, v in state.items()}, directory / "model.safetensors"
    )
    return directory


def from_pretrained(directory: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def checkpoint_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s tensors under checkpoint names (transformers fuses the experts live)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(model.state_dict()))


def test_gdn_needs_fla_as_shipped():
    """Why the shims exist; fails once FLA imports here (then drop the ``HAVE_FLA`` shim)."""
    from megatron.core.ssm import gated_delta_net as gdn

    if gdn.HAVE_FLA:
        pytest.fail("FLA imports now: GatedDeltaNet builds without the HAVE_FLA shim")
    with pytest.raises(ImportError, match="FLA is not installed"):
        gdn.GatedDeltaNet(config=None, submodules=None)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tp1_conversion_loads_into_transformers_and_matches_megatron_modules(
    tp1, model_type, tmp_path
):
    # transformers' Qwen3.5 models have no MTP layer
    state = convert(tp1[model_type]["states"], model_type, export_mtp=False)
    hf = from_pretrained(save(state, tmp_path / "hf", model_type))
    live = checkpoint_view(hf)
    assert sorted(live) == sorted(state)
    for name, tensor in state.items():
        assert torch.equal(live[name], tensor), name
    # The layouts, checked by both libraries' own code on the same input.
    want = tp1[model_type]["probe"]
    x = probe_input().transpose(0, 1)
    with torch.no_grad():
        gdn_out = hf.model.layers[0].linear_attn(x)
        attention = hf.model.layers[3].self_attn
        query, gate = torch.chunk(attention.q_proj(x).view(2, ms.SEQ, HEADS, 2 * HEAD_DIM), 2, -1)
        key = attention.k_proj(x).view(2, ms.SEQ, KV_HEADS, HEAD_DIM)
        value = attention.v_proj(x).view(2, ms.SEQ, KV_HEADS, HEAD_DIM)
    got = {"gdn": gdn_out, "query": query, "key": key, "value": value, "gate": gate}
    for name, tensor in got.items():
        torch.testing.assert_close(
            tensor.transpose(0, 1), want[name], atol=2e-5, rtol=1e-4, msg=name
        )


def test_tp2_converts_bit_identical_to_tp1(tp1, tmp_path):
    tp2 = ms.launch(tmp_path, {"tp": 2, "pp": 1}, collect_worker, False)[0]
    for model_type in MODEL_TYPES:
        want = convert(tp1[model_type]["states"], model_type)
        got = convert(tp2[model_type]["states"], model_type)
        assert list(got) == list(want)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"{model_type}: {name}"


def test_tp_not_dividing_the_gdn_key_heads_names_the_parameter(tp1):
    from weightsync.errors import PlanError
    from weightsync.sender.megatron import RankTopology, plan_rank

    (state,) = tp1["qwen3_next"]["states"].values()
    in_proj = [s for s in state.shards if s.name.endswith("self_attention.in_proj.weight")]
    with pytest.raises(PlanError, match=r"in_proj\.weight.*key heads=2 .*parallel size 4"):
        plan_rank(in_proj, RankTopology(tp_size=4), hf_config())


def test_publish_reaches_transformers_qwen3_next_like_from_pretrained(tmp_path, sock_dir):
    from weightsync.receiver import TorchReceiver
    from weightsync.sender.daemon import Sender

    model = transformers.AutoModelForCausalLM.from_config(hf_config(), dtype=torch.float32)
    model.eval()
    ids = ms.input_ids(CASE)
    with Sender(f"unix:{sock_dir}/s.sock", bucket_size_bytes=64 * 1024) as sender:
        receiver = TorchReceiver(model, sender.address, receiver_id="hf")
        held, errors = [], []

        def receive() -> None:
            try:
                for _ in range(VERSIONS):
                    receiver.sync(timeout=300)
                    with torch.no_grad():
                        logits = model(ids).logits
                    state = {k: v.clone() for k, v in checkpoint_view(model).items()}
                    held.append((state, logits))
            except Exception as e:  # reported by the assertion below
                errors.append(e)

        thread = threading.Thread(target=receive)
        thread.start()
        states = ms.launch(tmp_path, {"tp": 2, "pp": 1}, publish_worker, sender.address)[0]
        thread.join(300)
        assert not errors, errors
    assert len(held) == VERSIONS
    for version, (state, logits) in enumerate(held, start=1):
        reference = from_pretrained(save(convert(states[version - 1]), tmp_path / f"v{version}"))
        want = checkpoint_view(reference)
        assert sorted(state) == sorted(want)
        wrong = [n for n, t in want.items() if not torch.equal(state[n], t)]
        assert not wrong, f"version {version}: {wrong[:4]}"
        with torch.no_grad():
            assert torch.equal(logits, reference(ids).logits), f"version {version}"


@pytest.mark.vllm
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_vllm_receives_the_conversion_like_its_own_loader(tp1, model_type, tmp_path):
    pytest.importorskip("vllm")
    if model_type != "qwen3_next":
        # vLLM's qwen3_5 module (shared with the VL model) imports transformers' Qwen2-VL
        # image processor, which imports torchvision (tests/conftest.py makes PyPI's import)
        pytest.importorskip("torchvision", reason="vLLM's Qwen3.5 classes import torchvision")
    from vllm.config import set_current_vllm_config

    from tests.support.vllm_models import init_distributed, load_model
    from tests.sweeps.archs import receives_like_the_engine
    from weightsync.receiver.vllm import VllmWeightTarget

    state = convert(tp1[model_type]["states"], model_type)
    directory = save(state, tmp_path / "hf", model_type)
    init_distributed()
    reference, _ = load_model(directory, "safetensors")
    model, config = load_model(directory, "dummy")
    target = VllmWeightTarget(model, config.model_config, torch.device("cpu"))
    with set_current_vllm_config(config):
        receives_like_the_engine("vLLM", target, state, model, reference)


@pytest.mark.parametrize("model_type", MODEL_TYPES[1:])
def test_mtp_layer_converts_to_qwen3_5_checkpoint_names(tp1, model_type):
    from tests.support.qwen3_5 import MTP_OWN

    hf = convert(tp1[model_type]["states"], model_type)
    full = f"model.layers.{LAYERS - 1}."  # a full-attention decoder layer, as the MTP layer is
    layer = {k.removeprefix(full) for k in hf if k.startswith(full)}
    got = {k for k in hf if k.startswith("mtp.")}
    assert got == {f"mtp.layers.0.{k}" for k in layer} | MTP_OWN
    assert not any(k.startswith(f"model.layers.{LAYERS}.") for k in hf)
    # megatron's MTP layer norms the embedding (enorm) and the hidden state (hnorm) and
    # projects cat(embedding, hidden) (eh_proj); the engines' Qwen3.5 MTP models project
    # cat(pre_fc_norm_embedding(embedding), pre_fc_norm_hidden(hidden)) with fc
    (megatron,) = tp1[model_type]["states"].values()
    own = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc"}
    for name, hf_name in {**own, "final_layernorm": "norm"}.items():
        assert torch.equal(
            hf[f"mtp.{hf_name}.weight"], megatron.tensors[f"0:mtp.layers.0.{name}.weight"]
        )


def vllm_with_draft(directory: Path, load_format: str):
    """vLLM's loader builds the target and, as its MTP proposer does (speculative decoding
    ``method: "mtp"``), the draft model from the draft ``ModelConfig``: ``dummy`` (random
    weights) or ``safetensors`` (the checkpoint)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    from tests.support.vllm_models import init_distributed, vllm_config

    init_distributed()
    config = vllm_config(
        directory,
        load_format,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    draft_config = config.speculative_config.draft_model_config
    with set_current_vllm_config(config):
        loader = get_model_loader(config.load_config)
        model = loader.load_model(vllm_config=config, model_config=config.model_config)
        draft = loader.load_model(vllm_config=config, model_config=draft_config)
    return model, draft, config


@pytest.mark.vllm
@pytest.mark.parametrize("model_type", MODEL_TYPES[1:])
def test_vllm_qwen3_5_mtp_draft_receives_the_mtp_layer_like_its_own_loader(
    tp1, model_type, tmp_path
):
    pytest.importorskip("vllm")
    pytest.importorskip("torchvision", reason="vLLM's Qwen3.5 classes import torchvision")
    from vllm.config import set_current_vllm_config

    from tests.support import drive, manifest_of
    from tests.sweeps.archs import BUCKET_BYTES, differing, live_tensors
    from weightsync.receiver.vllm import VllmWeightTarget

    state = convert(tp1[model_type]["states"], model_type)
    directory = save(state, tmp_path / "hf", model_type)
    want, want_draft, _ = vllm_with_draft(directory, "safetensors")
    model, draft, config = vllm_with_draft(directory, "dummy")
    assert type(draft).__name__.startswith("Qwen3_5") and "MTP" in type(draft).__name__
    draft_config = config.speculative_config.draft_model_config
    target = VllmWeightTarget(
        model, config.model_config, torch.device("cpu"), draft=(draft, draft_config)
    )
    with set_current_vllm_config(config):
        drive(target, manifest_of(1, state), state, BUCKET_BYTES)
    for got, reference in ((model, want), (draft, want_draft)):
        wrong = differing(live_tensors(got).items(), live_tensors(reference).items())
        assert not wrong, f"{len(wrong)} tensors differ from vLLM's own load: {wrong[:4]}"


def test_more_than_one_qwen3_5_mtp_layer_is_refused_naming_the_field():
    from weightsync.errors import PlanError
    from weightsync.sender.megatron.dims import qwen3_5_dims

    config = hf_config("qwen3_5_text")
    config.mtp_num_hidden_layers = 2
    with pytest.raises(PlanError, match=r"mtp_num_hidden_layers=2.*only 1 converts"):
        qwen3_5_dims(config)
