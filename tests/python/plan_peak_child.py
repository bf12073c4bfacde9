"""Child process of test_plan.py: trains a HF model from a config for a few steps and prints
the peak of its resident memory above what it held before the model existed, as JSON.

Run with MALLOC_MMAP_THRESHOLD_ set (test_plan.py does) so that glibc maps every tensor of
note and unmaps it when freed: resident memory then follows the live tensors, which a peak
of RSS can only measure when freed memory goes back to the kernel. The peak is reset
through /proc/self/clear_refs once the libraries are warm, so torch's one-time allocations
(thread pools, kernel caches) are not counted.
"""

import argparse
import gc
import json

import torch
import transformers

import pagedoptim
from pagedoptim.cli.process_memory import peak_rss_bytes, reset_peak_rss, rss_bytes


def make_optimizer(name: str, params):
    if name == "torch":
        return torch.optim.AdamW(params, foreach=False)  # the CPU default: a per-param loop
    return pagedoptim.AdamW(params, state_bits=8 if name == "8bit" else 32)


def train(model, optimizer, *, steps: int, seq_len: int, batch: int, vocab: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq_len), generator=generator)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as Trainer does: grads do not outlive a step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("--optimizer", choices=("torch", "8bit", "exact"), required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(args.config)
    dtype = getattr(torch, args.dtype)

    def build(cfg):
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)
        if args.activation_checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        return model

    shape = dict(seq_len=args.seq_len, batch=args.micro_batch, vocab=config.vocab_size)
    warm = build(transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=1, num_attention_heads=4,
                                          vocab_size=config.vocab_size))
    train(warm, make_optimizer(args.optimizer, warm.parameters()), steps=2, **shape)
    del warm
    gc.collect()

    before = rss_bytes()
    if not reset_peak_rss():
        raise RuntimeError("/proc/self/clear_refs refused: the peak would include the warm-up")
    model = build(config)
    optimizer = make_optimizer(args.optimizer, model.parameters())
    train(model, optimizer, steps=3, **shape)
    print(json.dumps({"peak_bytes": peak_rss_bytes() - before}))


if __name__ == "__main__":
    main()
