"""SkewAdam's default tier patterns on the real parameter names of transformers' MoE models
(built from tiny configs with random weights), legacy per-expert names, and a dense Llama
whose gate_proj must stay in the backbone."""

import pytest
import torch

import pagedoptim as po
from pagedoptim.optim.tiers import DEFAULT_TIER_PATTERNS, compile_tier_patterns, tier_of_name

import transformers  # a test dependency (requirements-dev.txt): never a skip

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)


def build(config_name, model_name, **kwargs):
    config_cls = getattr(transformers, config_name, None)
    model_cls = getattr(transformers, model_name, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"this transformers ({transformers.__version__}) has no {model_name}")
    torch.manual_seed(0)
    return model_cls(config_cls(**kwargs))


def expected_tier(name):
    """The tier a reader would give each component of these architectures."""
    parts = name.split(".")
    if "gate" in parts or "shared_expert_gate" in parts:
        return "router"
    if "experts" in parts:
        return "experts"
    return "backbone"


def check_model(model):
    named = list(model.named_parameters())
    opt = po.SkewAdam(named, state_bits=8)
    tiers = opt.param_tiers()
    assert tiers == {name: expected_tier(name) for name, _ in named}
    # Every one of these models has all three tiers, and every 3-D tensor is an expert's.
    assert set(tiers.values()) == {"backbone", "experts", "router"}
    for name, p in named:
        if p.dim() == 3:
            assert tiers[name] == "experts", name
    return tiers


def test_mixtral():
    model = build("MixtralConfig", "MixtralForCausalLM", **TINY, num_local_experts=4,
                  num_experts_per_tok=2)
    tiers = check_model(model)
    assert tiers["model.layers.0.mlp.gate.weight"] == "router"
    assert any(t == "experts" and ".mlp.experts." in n for n, t in tiers.items())
    assert tiers["model.layers.1.self_attn.q_proj.weight"] == "backbone"


def test_qwen2_moe():
    model = build("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **TINY, moe_intermediate_size=8,
                  shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    tiers = check_model(model)
    assert tiers["model.layers.0.mlp.shared_expert_gate.weight"] == "router"
    assert tiers["model.layers.0.mlp.shared_expert.gate_proj.weight"] == "backbone"


def test_deepseek_v3():
    model = build("DeepseekV3Config", "DeepseekV3ForCausalLM", vocab_size=64, hidden_size=16,
                  intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
                  first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                  topk_group=1, q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4,
                  qk_nope_head_dim=4, v_head_dim=4)
    tiers = check_model(model)
    # The first layer is dense (first_k_dense_replace=1): its gate_proj is backbone.
    assert tiers["model.layers.0.mlp.gate_proj.weight"] == "backbone"
    assert tiers["model.layers.1.mlp.gate.weight"] == "router"
    assert tiers["model.layers.1.mlp.shared_experts.gate_proj.weight"] == "backbone"


def test_dense_llama_is_all_backbone():
    model = build("LlamaConfig", "LlamaForCausalLM", **TINY)
    opt = po.SkewAdam(list(model.named_parameters()))
    tiers = opt.param_tiers()
    assert set(tiers.values()) == {"backbone"}
    assert "model.layers.0.mlp.gate_proj.weight" in tiers


@pytest.mark.parametrize("name,tier", [
    # transformers < 5 and original checkpoints: one module per expert.
    ("model.layers.3.block_sparse_moe.experts.7.w1.weight", "experts"),
    ("model.layers.3.block_sparse_moe.experts.7.w2.weight", "experts"),
    ("model.layers.3.block_sparse_moe.gate.weight", "router"),
    ("model.layers.3.mlp.experts.12.gate_proj.weight", "experts"),
    ("model.layers.3.mlp.experts.12.down_proj.weight", "experts"),
    ("model.layers.3.mlp.shared_expert.up_proj.weight", "backbone"),
    ("model.layers.3.mlp.shared_expert_gate.weight", "router"),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", "backbone"),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "router"),
    ("model.layers.3.mlp.router.weight", "router"),
    ("model.layers.3.mlp.gate_proj.weight", "backbone"),
    ("model.layers.3.mlp.up_gate.weight", "backbone"),
    ("model.embed_tokens.weight", "backbone"),
])
def test_default_patterns_on_names(name, tier):
    assert tier_of_name(name, compile_tier_patterns(None)) == tier
    assert set(DEFAULT_TIER_PATTERNS) == {"router", "experts"}
