"""SkewAdam on a tiny Mixture-of-Experts language model: transformers' Mixtral with random
weights, a byte vocabulary, and text from the Python standard library's own sources.

Expert-heavy configuration (8 experts of 4x the hidden width, 2 layers): experts hold about
nine tenths of the weights, the situation SkewAdam is for. Checks SkewAdam's two claims
at this scale: optimizer state at most 5% of torch.optim.AdamW's, and the loss after a few
hundred steps within 5% of AdamW's (same init, same batches, same learning rate).
"""

import os

import pytest
import torch

import pagedoptim as po

import transformers  # a test dependency (requirements-dev.txt): never a skip

STEPS = 300
BATCH, SEQ = 8, 32
LR = 3e-3
STDLIB_FILES = ("textwrap.py", "argparse.py", "functools.py", "inspect.py")


def corpus():
    root = os.path.dirname(os.__file__)
    data = b"".join(open(os.path.join(root, name), "rb").read() for name in STDLIB_FILES)
    return torch.tensor(list(data), dtype=torch.long)


def make_model():
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=SEQ, tie_word_embeddings=False)
    return transformers.MixtralForCausalLM(config)


def train(make_optimizer, data, steps=STEPS):
    torch.manual_seed(0)
    model = make_model()
    opt = make_optimizer(model)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - SEQ, (BATCH,), generator=generator)
        batch = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, opt, losses


def torch_state_bytes(opt):
    return sum(t.numel() * t.element_size() for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


@pytest.fixture
def one_thread():
    # Models this small are all overhead: on a loaded machine, intra-op threads spin-wait
    # for each other and make a step ten times slower, never faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tiny_moe_memory_and_loss(one_thread):
    data = corpus()
    _, adamw, adamw_losses = train(lambda m: torch.optim.AdamW(m.parameters(), lr=LR,
                                                               weight_decay=0.0), data)
    # min_8bit_size=0: at this size the router's and the backbone's matrices are under the
    # default 4096 elements and would keep fp32 momentum, a share of the state no real MoE
    # has (docs/compression.md); the ratio below is the format's.
    _, skew, skew_losses = train(lambda m: po.SkewAdam(list(m.named_parameters()), lr=LR,
                                                       page_bytes=4096, min_8bit_size=0),
                                 data)

    report = skew.memory_report()
    experts = report["tiers"]["experts"]["num_elements"]
    assert experts >= 0.85 * report["num_elements"], "the configuration must be expert-heavy"
    ratio = report["state_bytes"] / torch_state_bytes(adamw)
    assert ratio <= 0.05, f"SkewAdam state is {ratio:.1%} of AdamW's"

    tail = 20
    adamw_final = sum(adamw_losses[-tail:]) / tail
    skew_final = sum(skew_losses[-tail:]) / tail
    assert skew_losses[0] > 5.0 and adamw_final < 0.8 * skew_losses[0], "the model must learn"
    assert abs(skew_final - adamw_final) <= 0.05 * adamw_final, (skew_final, adamw_final)
