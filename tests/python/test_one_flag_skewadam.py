"""SkewAdam through the one flag (PAGEDOPTIM_ALGORITHM=skewadam): scripts that build
torch.optim.AdamW(model.parameters()) for a Mixture-of-Experts model get SkewAdam, with the
tiers the named route (po.SkewAdam(model.named_parameters())) gives, bit for bit."""

import os

import pytest
import torch
import transformers

import pagedoptim as po
from pagedoptim.integrations.owning_model import model_owning
from test_one_flag import run_script
from test_skewadam_lm import corpus, make_model as tiny_mixtral, train
from test_transformers_integration import training_args, train as train_with_trainer

LR = 3e-3


@pytest.fixture(autouse=True)
def clean_patch(monkeypatch):
    for name in list(os.environ):
        if name.startswith("PAGEDOPTIM"):
            monkeypatch.delenv(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    po.unpatch()
    torch.set_num_threads(threads)


def test_adamw_by_torchs_name_is_skewadam_with_the_named_tiers():
    data = corpus()
    _, named, named_losses = train(
        lambda model: po.SkewAdam(model.named_parameters(), lr=LR, weight_decay=0.01), data,
        steps=3)
    po.patch(algorithm="skewadam")
    _, flagged, losses = train(lambda model: torch.optim.AdamW(model.parameters(), lr=LR),
                               data, steps=3)
    assert isinstance(flagged, po.SkewAdam) and isinstance(flagged, torch.optim.AdamW)
    assert flagged.param_tiers() == named.param_tiers()
    assert set(flagged.param_tiers().values()) == {"backbone", "experts", "router"}
    assert losses == named_losses


def test_trainer_with_the_flag_builds_skewadam_on_its_own_groups(tmp_path):
    named_model = tiny_mixtral()
    _, named_losses = train_with_trainer(
        named_model, training_args(tmp_path / "named"),
        optimizer_cls_and_kwargs=(po.SkewAdam, {"lr": LR, "names_from": named_model}))
    po.patch(algorithm="skewadam")
    trainer, losses = train_with_trainer(tiny_mixtral(), training_args(tmp_path / "flag"))
    assert isinstance(trainer.optimizer.optimizer, po.SkewAdam)
    assert losses == named_losses


def test_what_skewadam_cannot_take_raises():
    po.patch(algorithm="skewadam")
    model = tiny_mixtral()
    with pytest.raises(ValueError, match="amsgrad=True has no SkewAdam form"):
        torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="adds an L2 term"):
        torch.optim.Adam(model.parameters(), weight_decay=0.1)
    groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
    with pytest.raises(ValueError, match="adds an L2 term"):
        torch.optim.Adam(groups)  # a group's own coupled decay, not only the constructor's
    adam = torch.optim.Adam(model.parameters(), lr=LR)
    adam.param_groups[0]["weight_decay"] = 0.1
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="adds an L2 term"):
        adam.step()  # edited after construction
    orphan = torch.nn.Parameter(torch.randn(4, 3, 2))  # 3-D, in no model: no name
    with pytest.raises(ValueError, match="names_from"):
        torch.optim.AdamW([orphan])
    with pytest.raises(ValueError, match="Invalid algorithm"):
        po.patch(algorithm="lamb")


def test_the_owner_is_the_outermost_model_and_two_owners_raise():
    inner = torch.nn.Linear(3, 3)
    outer = torch.nn.Sequential(inner, torch.nn.ReLU())
    assert model_owning(inner.parameters()) is outer
    twin = torch.nn.ModuleList([inner])  # another root that owns them too
    with pytest.raises(ValueError, match="2 separate models"):
        model_owning(inner.parameters())
    del twin


def test_the_environment_variable_selects_skewadam(tmp_path):
    result = run_script("""
        import torch, transformers
        config = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        print(type(opt).__name__, sorted(set(opt.param_tiers().values())))
    """, tmp_path, PAGEDOPTIM="1", PAGEDOPTIM_ALGORITHM="skewadam")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["SkewAdamW", "['backbone',", "'experts',", "'router']"]
    bad = run_script("import torch", tmp_path, PAGEDOPTIM="1", PAGEDOPTIM_ALGORITHM="lion")
    assert bad.returncode != 0 and "PAGEDOPTIM_ALGORITHM='lion'" in bad.stderr
