"""Full fine-tuning through HF Trainer with pagedoptim chosen by name: a tiny Llama (random
weights, a byte vocabulary) trained on the Python standard library's sources.

    pip install pagedoptim[hf]                      # transformers, peft, accelerate
    python examples/hf_trainer.py                   # pagedoptim_adamw, 8-bit state
    python examples/hf_trainer.py --optim-args "offload=host,cache_bytes=256KiB"
    python examples/hf_trainer.py --optim pagedoptim_lion --lr 1e-3
    python examples/hf_trainer.py --steps 500 --hidden-size 512 --layers 8

The optimizer comes from PagedOptimTrainingArguments(optim="pagedoptim_adamw",
optim_args="...") and PagedOptimTrainer, so learning_rate, adam_beta1/2, adam_epsilon and the
decay / no-decay groups are Trainer's own; optim_args sets any of the optimizer's keyword
arguments (state_bits, master_bits, offload, nvme_dir, cache_bytes, ...). For a real model,
load it with AutoModelForCausalLM.from_pretrained and tokenize your text instead. Trainer
uses the GPU when there is one. The last line printed is one JSON object: the logged losses,
memory_report() and paging_stats().
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedoptim.cli.demo import load_stdlib_bytes
from pagedoptim.integrations import unwrap_optimizer
from pagedoptim.integrations.transformers import (OPTIMIZERS, PagedOptimTrainer,
                                                  PagedOptimTrainingArguments)


def byte_dataset(examples: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive seq_len-byte windows (fewer if the sources run out: Trainer then starts
    another epoch); the default collator stacks them, the model shifts the labels itself."""
    corpus = load_stdlib_bytes(examples * seq_len)
    rows = corpus[:corpus.numel() // seq_len * seq_len].view(-1, seq_len)
    return [{"input_ids": row, "labels": row} for row in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--optim", default="pagedoptim_adamw", choices=list(OPTIMIZERS))
    parser.add_argument("--optim-args", default=None,
                        help='the optimizer\'s keyword arguments, e.g. "state_bits=8,'
                             'offload=nvme,nvme_dir=/nvme,cache_bytes=1GiB"')
    parser.add_argument("--output-dir", default=None,
                        help="Trainer's output_dir (default: a temporary directory)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden_size,
                         intermediate_size=4 * args.hidden_size, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as scratch:
        training_args = PagedOptimTrainingArguments(
            output_dir=args.output_dir or scratch, optim=args.optim, optim_args=args.optim_args,
            learning_rate=args.lr, weight_decay=0.1, max_steps=args.steps,
            per_device_train_batch_size=args.batch_size, logging_steps=max(1, args.steps // 10),
            save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_pin_memory=torch.cuda.is_available())
        trainer = PagedOptimTrainer(
            model=model, args=training_args,
            train_dataset=byte_dataset(args.steps * args.batch_size, args.seq_len))
        trainer.train()

    # trainer.optimizer is accelerate's wrapper, which forwards step() but not our methods.
    optimizer = unwrap_optimizer(trainer.optimizer)
    report, paging = optimizer.memory_report(), optimizer.paging_stats()
    optimizer_class = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"{optimizer_class} on {training_args.device}: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f} in {args.steps} steps; {report['num_elements']:,} params, "
          f"optimizer state {report['state_bytes'] / 2**20:.2f} MiB "
          f"({report['state_bytes_per_param']:.2f} bytes per param; torch.optim.AdamW keeps 8)")
    print(json.dumps({"example": "hf_trainer", "optimizer": optimizer_class,
                      "device": str(training_args.device), "steps": args.steps,
                      "model_params": sum(p.numel() for p in model.parameters()),
                      "losses": losses, "memory_report": report,
                      "paging_stats": {key: paging[key] for key in
                                       ("offload", "hits", "misses", "bytes_read",
                                        "bytes_written")}}))


if __name__ == "__main__":
    main()
