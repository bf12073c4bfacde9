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


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current RSS


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

    before = status_bytes("VmRSS")
    reset_peak()
    model = build(config)
    optimizer = make_optimizer(args.optimizer, model.parameters())
    train(model, optimizer, steps=3, **shape)
    print(json.dumps({"peak_bytes": status_bytes("VmHWM") - before}))


if __name__ == "__main__":
    main()
