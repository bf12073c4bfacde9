"""pagedoptim through HF transformers' Trainer (by name, optim_args, optimizer_cls_and_kwargs),
PEFT LoRA and accelerate, on tiny models: a Llama (hidden 32, 2 layers, byte vocabulary) and
a Mixtral with fused [experts, rows, cols] tensors. Wherever torch defines the behaviour
(state_bits=32, master_bits=None) the reference is the same run with torch.optim.AdamW."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagedoptim as po
from pagedoptim.integrations import unwrap_optimizer
from support import assert_8bit_moment_bytes

import transformers  # installed by the test command (requirements-dev.txt): never skipped
from pagedoptim.integrations.optim_args import parse_byte_size, parse_optim_args  # noqa: E402
from pagedoptim.integrations.transformers import (  # noqa: E402
    PagedOptimTrainer, PagedOptimTrainingArguments, optimizer_cls_and_kwargs_from)
# The tiny Mixtral (fused [experts, rows, cols] tensors) of SkewAdam's language-model test.
from test_skewadam_lm import make_model as tiny_mixtral  # noqa: E402

STEPS = 4
SEQ = 16
LR = 3e-3


@pytest.fixture(autouse=True)
def one_thread():
    # Models this small are all overhead; intra-op threads on a shared machine only spin.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def byte_dataset(count=16):
    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py"), "rb").read()
    data = torch.tensor(list(text[:count * SEQ]), dtype=torch.long).view(count, SEQ)
    return [{"input_ids": row, "labels": row} for row in data]


def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def training_args(tmp_path, args_cls=transformers.TrainingArguments, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS,
                    learning_rate=LR, logging_steps=1, report_to=[], use_cpu=True,
                    save_strategy="no", lr_scheduler_type="constant", disable_tqdm=True)
    settings.update(overrides)
    return args_cls(**settings)


def train(model, args, trainer_cls=transformers.Trainer, **trainer_kwargs):
    trainer = trainer_cls(model=model, args=args, train_dataset=byte_dataset(), **trainer_kwargs)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    return trainer, losses


def assert_params_close(model, reference):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# -- by name --------------------------------------------------------------------------------

def test_by_name_matches_torch_adamw(tmp_path):
    """optim="pagedoptim_adamw" takes learning_rate, adam_beta*, adam_epsilon and the decay
    groups from TrainingArguments exactly as Trainer's adamw_torch does."""
    common = dict(adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1)
    reference_model = tiny_llama()
    _, reference = train(reference_model, training_args(tmp_path / "torch", optim="adamw_torch",
                                                        **common))
    model = tiny_llama()
    args = training_args(tmp_path / "ours", PagedOptimTrainingArguments,
                         optim="pagedoptim_adamw", optim_args="state_bits=32,master_bits=none",
                         **common)
    assert args.optim == "pagedoptim_adamw"
    trainer, losses = train(model, args, PagedOptimTrainer)
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is po.AdamW
    assert opt.param_groups[0]["betas"] == (0.9, 0.95) and opt.param_groups[0]["eps"] == 1e-6
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    assert_params_close(model, reference_model)


def test_plain_trainer_with_named_helper_pages_8bit_state(tmp_path):
    """The plain-Trainer route: optimizer_cls_and_kwargs_from resolves the name and
    optim_args; the state is 8-bit and paged to host, reachable through unwrap_optimizer
    although accelerate wraps trainer.optimizer."""
    args = training_args(tmp_path, learning_rate=1e-2)
    model = tiny_llama()
    cls_and_kwargs = optimizer_cls_and_kwargs_from(
        "pagedoptim_adamw", "state_bits=8, offload=host, page_bytes=16KiB, cache_bytes=64KiB",
        args=args)
    assert cls_and_kwargs == (po.AdamW, {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8,
                                         "state_bits": 8, "offload": "host",
                                         "page_bytes": 16384, "cache_bytes": 65536})
    trainer, losses = train(model, args, optimizer_cls_and_kwargs=cls_and_kwargs)
    assert losses[-1] < losses[0]
    assert type(trainer.optimizer).__name__ == "AcceleratedOptimizer"
    report = unwrap_optimizer(trainer.optimizer).memory_report()
    stats = unwrap_optimizer(trainer.optimizer).paging_stats()
    elements = sum(p.numel() for p in model.parameters())
    assert report["num_elements"] == elements
    # 8-bit moments: 2 bytes per element plus the fp16 scales of 32-element groups (fp32
    # moments for the 1-D and small params).
    assert_8bit_moment_bytes(report)
    assert report["fp32_state_elements"] < elements
    assert report["page_bytes"] == 16384
    assert stats["offload"] == "host" and stats["cache_bytes"] == 65536
    assert stats["misses"] > 0 and stats["evictions"] > 0


def test_unwrap_optimizer_names_what_it_got():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match="pagedoptim optimizer .* got AdamW holding AdamW"):
        unwrap_optimizer(torch.optim.AdamW([p]))
    ours = po.SGD([p], lr=0.1)
    assert unwrap_optimizer(ours) is ours


# -- optim_args -----------------------------------------------------------------------------

def test_optim_args_values():
    assert parse_optim_args(
        "state_bits=8,master_bits=None,offload=nvme,nvme_dir=/tmp/x,cache_bytes=1GiB,"
        "page_bytes=64KiB,prefetch=2,policy=lru,release_grads=yes,amsgrad=0,beta2=0.95",
        po.AdamW, {"lr": 1e-3, "betas": (0.8, 0.99)}) == {
        "lr": 1e-3, "betas": (0.8, 0.95), "state_bits": 8, "master_bits": None,
        "offload": "nvme", "nvme_dir": "/tmp/x", "cache_bytes": 1 << 30, "page_bytes": 65536,
        "prefetch": 2, "policy": "lru", "release_grads": True, "amsgrad": False}
    # Without betas from elsewhere, beta1 replaces the optimizer's default's first element.
    assert parse_optim_args("beta1=0.5", po.Lion) == {"betas": (0.5, 0.99)}
    assert parse_optim_args("momentum=0.9,nesterov=true", po.SGD) == {"momentum": 0.9,
                                                                       "nesterov": True}
    assert parse_optim_args(None, po.AdamW, {"lr": 1.0}) == {"lr": 1.0}
    assert parse_byte_size("2MB") == 2_000_000 and parse_byte_size("1.5KiB") == 1536


@pytest.mark.parametrize("text,cls,match", [
    ("state_bits=8,cach_bytes=1GiB", po.AdamW,
     r"Invalid optim_args key 'cach_bytes': AdamW takes \['lr', 'beta1'"),
    ("momentum=0.9", po.AdamW, "Invalid optim_args key 'momentum'"),
    ("amsgrad=true", po.SGD, "Invalid optim_args key 'amsgrad': SGD takes"),
    ("tiers=x", po.SkewAdam, "Invalid optim_args key 'tiers'"),
    ("state_bits", po.AdamW, r"Invalid optim_args entry 'state_bits'.*key=value"),
    ("state_bits=8,", po.AdamW, "Invalid optim_args entry ''"),
    ("state_bits=eight", po.AdamW, "Invalid optim_args value for 'state_bits': 'eight' "
                                   r"\(expected an integer\)"),
    ("cache_bytes=1XB", po.AdamW, "Invalid optim_args value for 'cache_bytes'.*4GiB"),
    ("page_bytes=0.5", po.AdamW, "'page_bytes'.*whole number of bytes"),
    ("release_grads=maybe", po.AdamW, "Invalid optim_args value for 'release_grads'"),
    ("lr=1,lr=2", po.AdamW, "optim_args sets 'lr' twice"),
])
def test_optim_args_errors_name_the_key(text, cls, match):
    with pytest.raises(ValueError, match=match):
        parse_optim_args(text, cls)


def test_name_on_the_command_line(tmp_path):
    parser = transformers.HfArgumentParser(PagedOptimTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--report_to", "none", "--use_cpu",
        "--optim", "pagedoptim_lion", "--optim_args", "beta2=0.98,state_bits=8"])
    assert (args.optim, args.optim_args) == ("pagedoptim_lion", "beta2=0.98,state_bits=8")
    assert PagedOptimTrainer.get_optimizer_cls_and_kwargs(args) == (
        po.Lion, {"lr": args.learning_rate, "betas": (0.9, 0.98), "state_bits": 8})


def test_bad_names_and_values_are_reported_before_training(tmp_path):
    with pytest.raises(TypeError, match="optim_args must be a string"):
        parse_optim_args({"state_bits": 8}, po.AdamW)
    with pytest.raises(ValueError, match=r"Invalid optimizer name: 'paged_adamw_8bit' "
                                         r"\(expected one of \['pagedoptim_adamw'"):
        optimizer_cls_and_kwargs_from("paged_adamw_8bit")
    with pytest.raises(ValueError, match="Invalid optim_args key 'statebits'"):
        training_args(tmp_path, PagedOptimTrainingArguments, optim="pagedoptim_adamw",
                      optim_args="statebits=8")
    with pytest.raises(ValueError, match=r"Invalid optim: 'adamw_pagedoptim' \(expected one "
                                         r"of pagedoptim's \['pagedoptim_adamw'.* or "
                                         r"transformers' \['adamw_torch'"):
        training_args(tmp_path, PagedOptimTrainingArguments, optim="adamw_pagedoptim")
    # transformers' own names keep their meaning.
    args = training_args(tmp_path, PagedOptimTrainingArguments, optim="adamw_torch")
    assert args.optim == transformers.training_args.OptimizerNames.ADAMW_TORCH
    # Values are checked by the optimizer, which names the argument.
    args = training_args(tmp_path, PagedOptimTrainingArguments, optim="pagedoptim_adamw",
                         optim_args="state_bits=4")
    trainer = PagedOptimTrainer(model=tiny_llama(), args=args, train_dataset=byte_dataset())
    with pytest.raises(ValueError, match="Invalid state_bits: 4"):
        trainer.create_optimizer()


# -- PEFT and accelerate --------------------------------------------------------------------

def test_peft_lora_through_trainer_matches_torch_adamw(tmp_path):
    import peft
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    def lora_model():
        model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(**lora))
        # LoRA's B starts at zero; a seeded random B makes every adapter weight matter.
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return model

    reference_model = lora_model()
    _, reference = train(reference_model, training_args(tmp_path / "torch", optim="adamw_torch"))
    model = lora_model()
    trainer, losses = train(model, training_args(tmp_path / "ours"), optimizer_cls_and_kwargs=(
        po.AdamW, {"lr": LR, "state_bits": 32, "master_bits": None}))
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    assert_params_close(model, reference_model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert unwrap_optimizer(trainer.optimizer).memory_report()["num_elements"] == trainable


def test_accelerate_prepare_matches_torch_adamw():
    import accelerate
    data = byte_dataset(8)

    def run(make_optimizer):
        accelerator = accelerate.Accelerator(cpu=True)
        model = tiny_llama()
        model, opt = accelerator.prepare(model, make_optimizer(model.parameters()))
        losses = []
        for item in data[:STEPS]:
            batch = item["input_ids"][None]
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return model, opt, losses

    reference_model, _, reference = run(lambda params: torch.optim.AdamW(params, lr=LR))
    model, opt, losses = run(lambda params: po.AdamW(params, lr=LR, state_bits=32,
                                                     master_bits=None))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=0)
    assert_params_close(model, reference_model)
    ours = unwrap_optimizer(opt)
    assert ours.memory_report()["num_elements"] == sum(p.numel() for p in model.parameters())
    assert ours.paging_stats()["offload"] is None


# -- SkewAdam -------------------------------------------------------------------------------

def test_skewadam_through_trainer_matches_named_route_exactly(tmp_path):
    """Trainer hands SkewAdam unnamed decay / no-decay groups; names_from= gives them the tiers
    that model.named_parameters() gives, so training is bit-identical to the named route."""
    named_model = tiny_mixtral()
    named_opt = po.SkewAdam(named_model.named_parameters(), lr=LR)
    _, named_losses = train(named_model, training_args(tmp_path / "named"),
                            optimizers=(named_opt, None))

    by_name_model = tiny_mixtral()
    args = training_args(tmp_path / "by_name", PagedOptimTrainingArguments,
                         optim="pagedoptim_skewadam")
    trainer, losses = train(by_name_model, args, PagedOptimTrainer)
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is po.SkewAdam
    assert opt.param_tiers() == named_opt.param_tiers()  # same names too, as dicts compare
    assert set(opt.param_tiers().values()) == {"backbone", "experts", "router"}
    assert losses == named_losses
    assert losses[-1] < losses[0]
    for (name, p), (_, q) in zip(by_name_model.named_parameters(),
                                 named_model.named_parameters()):
        assert torch.equal(p, q), name

    plain_model = tiny_mixtral()
    _, plain_losses = train(plain_model, training_args(tmp_path / "plain"),
                            optimizer_cls_and_kwargs=(po.SkewAdam,
                                                      {"lr": LR, "names_from": plain_model}))
    assert plain_losses == named_losses


def test_skewadam_without_names_says_how_to_name_tiers(tmp_path):
    model = tiny_mixtral()
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path),
                                   train_dataset=byte_dataset(),
                                   optimizer_cls_and_kwargs=(po.SkewAdam, {"lr": LR}))
    with pytest.raises(ValueError, match=r"is 3-D .* pass names_from=model"):
        trainer.create_optimizer()
    with pytest.raises(ValueError, match="pagedoptim_skewadam needs model="):
        optimizer_cls_and_kwargs_from("pagedoptim_skewadam")


def test_route_2_without_lr_warns_that_trainer_learning_rate_is_unused(tmp_path, recwarn):
    """Trainer passes optimizer_cls_and_kwargs' kwargs alone: without 'lr' our default of 1e-3
    trains, not TrainingArguments.learning_rate. Said once, at construction; never where the
    lrs agree or where we built nothing through Trainer."""
    args = training_args(tmp_path)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=byte_dataset(),
                                   optimizer_cls_and_kwargs=(po.AdamW, {"offload": None}))
    with pytest.warns(UserWarning, match=r"built po.AdamW with lr=0.001, but TrainingArguments"
                                         r".learning_rate is 0.003: .*'lr': args.learning_rate"):
        trainer.create_optimizer()
    assert unwrap_optimizer(trainer.optimizer).param_groups[0]["lr"] == 1e-3  # as warned

    recwarn.clear()
    for kwargs in [dict(optimizer_cls_and_kwargs=(po.AdamW, {"lr": LR})),
                   dict(optimizer_cls_and_kwargs=optimizer_cls_and_kwargs_from(
                       "pagedoptim_adamw", args=args))]:
        transformers.Trainer(model=tiny_llama(), args=args, train_dataset=byte_dataset(),
                             **kwargs).create_optimizer()
    by_name = training_args(tmp_path, PagedOptimTrainingArguments, optim="pagedoptim_adamw")
    PagedOptimTrainer(model=tiny_llama(), args=by_name,
                      train_dataset=byte_dataset()).create_optimizer()
    po.AdamW(tiny_llama().parameters())  # not built by Trainer: nothing to compare with
    assert not [w for w in recwarn if "learning_rate" in str(w.message)]


# -- release_grads --------------------------------------------------------------------------

def _released_trainer(route, tmp_path, release, accumulation):
    """A Trainer with TrainingArguments' defaults (max_grad_norm=1.0) built by README route
    1-4 with po.AdamW; returns (model, logged grad_norms)."""
    model = tiny_llama()
    optim_args = f"release_grads={release}"
    args = training_args(tmp_path, gradient_accumulation_steps=accumulation)
    if route == 1:
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=byte_dataset(),
            optimizers=(po.AdamW(model.parameters(), lr=LR, release_grads=release), None))
    elif route == 2:
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=byte_dataset(),
            optimizer_cls_and_kwargs=(po.AdamW, {"lr": LR, "release_grads": release}))
    elif route == 3:
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=byte_dataset(),
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs_from(
                "pagedoptim_adamw", optim_args, args=args))
    else:
        args = training_args(tmp_path, PagedOptimTrainingArguments, optim="pagedoptim_adamw",
                             optim_args=optim_args, gradient_accumulation_steps=accumulation)
        trainer = PagedOptimTrainer(model=model, args=args, train_dataset=byte_dataset())
    trainer.train()
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    assert len(norms) == STEPS
    return model, norms


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("route", [1, 2, 3, 4])
def test_release_grads_trains_like_step_with_trainers_clipping_and_accumulation(
        route, accumulation, tmp_path):
    """Every README route, TrainingArguments' defaults (so Trainer clips to max_grad_norm=1.0
    through accelerate) and gradient_accumulation_steps 1 and 2: release_grads=True trains
    exactly as without it, and Trainer logs the same, real, grad_norm."""
    model, norms = _released_trainer(route, tmp_path / "plain", False, accumulation)
    released, released_norms = _released_trainer(route, tmp_path / "released", True,
                                                 accumulation)
    assert released_norms == norms
    assert any(norm > 1.0 for norm in norms)  # Trainer's clip did clip
    for (name, p), (_, q) in zip(released.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), name


def test_release_grads_is_refused_with_several_processes(tmp_path, monkeypatch):
    """Under DDP each rank would step its own gradient before the all-reduce. Two ranks are
    stood in for by TrainingArguments' world_size (a real two-process Trainer run is what
    the refusal prevents)."""
    args = training_args(tmp_path, PagedOptimTrainingArguments, max_grad_norm=0.0)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="release_grads=True cannot be used with 2 processes"):
        optimizer_cls_and_kwargs_from("pagedoptim_adamw", "release_grads=true", args=args)
    optimizer_cls_and_kwargs_from("pagedoptim_adamw", "release_grads=false", args=args)


def test_release_grads_without_clipping_trains_like_step(tmp_path):
    """Where Trainer neither clips nor accumulates, release_grads changes memory, not
    training."""
    def run(name, release):
        model = tiny_llama()
        args = training_args(tmp_path / name, PagedOptimTrainingArguments,
                             optim="pagedoptim_adamw", max_grad_norm=0.0,
                             optim_args=f"state_bits=32,master_bits=none,release_grads={release}")
        return model, train(model, args, PagedOptimTrainer)[1]

    model, losses = run("step", False)
    released_model, released_losses = run("released", True)
    assert released_losses == losses
    for (name, p), (_, q) in zip(released_model.named_parameters(), model.named_parameters()):
        assert torch.equal(p, q), name


def test_accelerate_clips_released_gradients_as_it_clips_p_grad():
    """accelerate's clip_grad_norm_ drops every param whose gradient is None before it calls
    torch, so it is routed on its own: given released params it returns the norm it returns
    for the same gradients in p.grad, and the step after it equals the one without release.
    clip_grad_value_ of released params is refused."""
    import accelerate

    def run(release, max_norm):
        accelerator = accelerate.Accelerator(cpu=True)
        model = tiny_llama()
        model, opt = accelerator.prepare(model, po.AdamW(model.parameters(), lr=LR,
                                                         release_grads=release))
        batch = byte_dataset(1)[0]["input_ids"][None]
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        if release:
            with pytest.raises(RuntimeError, match="Accelerator.clip_grad_value_.*release_grads"):
                accelerator.clip_grad_value_(model.parameters(), clip_value=0.5)
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        return model, norm

    for max_norm in (0.1, float("inf")):
        model, norm = run(False, max_norm)
        released, released_norm = run(True, max_norm)
        assert torch.equal(released_norm, norm) and float(norm) > 0.1
        for (name, p), (_, q) in zip(released.named_parameters(), model.named_parameters()):
            assert torch.equal(p, q), (max_norm, name)

    accelerator = accelerate.Accelerator(cpu=True)
    other = torch.nn.Linear(3, 3)  # params of no released optimizer: accelerate's own clip
    other(torch.randn(2, 3)).pow(2).sum().backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in other.parameters()]))
    norm = accelerator.clip_grad_norm_(other.parameters(), 0.1)
    torch.testing.assert_close(norm, expected)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in other.parameters()]))
    assert clipped <= 0.1 + 1e-6


def test_a_pagedoptim_trainer_checkpoint_resumes_with_torch_adamw_after_convert(tmp_path):
    """The README's way back to torch: the 8-bit optimizer.pt of a Trainer checkpoint (two
    param groups) converted in place, with the README's command, resumes under
    optim="adamw_torch" and trains on."""
    out = tmp_path / "out"
    args = training_args(out, args_cls=PagedOptimTrainingArguments, optim="pagedoptim_adamw",
                         max_steps=2, save_strategy="steps", save_steps=2, weight_decay=0.1)
    PagedOptimTrainer(model=tiny_llama(), args=args, train_dataset=byte_dataset()).train()
    saved = out / "checkpoint-2" / "optimizer.pt"
    assert len(torch.load(saved, weights_only=True)["param_groups"]) == 2
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    command = next(line for line in readme.splitlines()
                   if line.startswith("python -m pagedoptim convert out/checkpoint-500/"))
    argv = command.replace("out/checkpoint-500", str(out / "checkpoint-2")).split()[1:]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "exp_avg" in next(iter(torch.load(saved, weights_only=True)["state"].values()))
    resumed = transformers.Trainer(model=tiny_llama(), train_dataset=byte_dataset(),
                                   args=training_args(out, optim="adamw_torch", max_steps=4))
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    losses = [entry["loss"] for entry in resumed.state.log_history if "loss" in entry]
    assert resumed.state.global_step == 4 and len(losses) == 4  # with the first run's two
    assert all(math.isfinite(loss) for loss in losses)

    # The README's snippet for a plain loop, exactly as printed, on the converted file.
    snippet = readme.split("loading it by hand takes a torch")[1].split("```python\n")[1]
    snippet = snippet.split("```")[0].replace("out/checkpoint-500", str(out / "checkpoint-2"))
    model = tiny_llama()
    namespace = {"torch": torch, "model": model,
                 "trainer": transformers.Trainer(model=model, args=training_args(out))}
    exec(snippet, namespace)
    opt = namespace["opt"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # the saved groups
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the guard finds fp32 moments: torch steps them
    assert all(int(s["step"]) == 3 for s in opt.state.values())


def test_accelerates_clipping_methods_are_routed_once_accelerate_is_imported():
    """install() (at a release optimizer's construction and first release) wraps both of
    accelerate's clipping methods whenever accelerate is imported."""
    import accelerate
    from pagedoptim.engine import release_guard
    release_guard.install()
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        assert hasattr(getattr(accelerate.Accelerator, name), "__wrapped_by_pagedoptim__"), name
