"""LoRA through PEFT and HF Trainer, with pagedoptim's AdamW keeping (and paging) state for
the adapter alone: a tiny Llama (random weights, a byte vocabulary) on the Python standard
library's sources.

    pip install pagedoptim[hf]                                  # transformers, peft, accelerate
    python examples/peft_lora.py                                # state in memory, 8-bit
    python examples/peft_lora.py --offload host --cache-bytes 16384
    python examples/peft_lora.py --offload nvme --nvme-dir /nvme --cache-bytes 16384
    python examples/peft_lora.py --steps 300 --hidden-size 512 --rank 16

Trainer takes the optimizer as optimizer_cls_and_kwargs=(po.AdamW, {...}) and builds it on
its decay / no-decay groups of the trainable (adapter) parameters; it passes none of
TrainingArguments' optimizer settings on, so the learning rate is in the kwargs. With
--offload the state lives in pages, at most --cache-bytes of them resident (on the GPU when
training there), the rest in host memory or a page file under --nvme-dir. For a real model,
load it with AutoModelForCausalLM.from_pretrained before get_peft_model. The last line printed
is one JSON object: the logged losses, memory_report() and paging_stats().
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import pagedoptim as po
from pagedoptim.cli.demo import load_stdlib_bytes
from pagedoptim.integrations import unwrap_optimizer
from pagedoptim.paging.setting_text import byte_size_argument


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
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--state-bits", type=int, default=8, choices=(8, 32))
    parser.add_argument("--offload", default="none", choices=("none", "host", "nvme"))
    parser.add_argument("--nvme-dir", default=None,
                        help="directory of the page file with --offload nvme (default: "
                             "$TMPDIR or /tmp)")
    parser.add_argument("--cache-bytes", type=byte_size_argument, default=None,
                        help="bytes of state kept resident with --offload, e.g. 64MiB (default 1 GiB)")
    parser.add_argument("--output-dir", default=None,
                        help="Trainer's output_dir (default: a temporary directory)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.offload == "none" and (args.nvme_dir or args.cache_bytes is not None):
        parser.error("--nvme-dir and --cache-bytes need --offload host or nvme")

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden_size,
                         intermediate_size=4 * args.hidden_size, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.seq_len)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())

    offload = None if args.offload == "none" else args.offload
    optimizer_kwargs = {"lr": args.lr, "state_bits": args.state_bits, "offload": offload,
                        "nvme_dir": args.nvme_dir, "cache_bytes": args.cache_bytes}
    with tempfile.TemporaryDirectory() as scratch:
        training_args = TrainingArguments(
            output_dir=args.output_dir or scratch, weight_decay=0.01, max_steps=args.steps,
            per_device_train_batch_size=args.batch_size, logging_steps=max(1, args.steps // 10),
            save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
            dataloader_pin_memory=torch.cuda.is_available())
        trainer = Trainer(model=model, args=training_args,
                          train_dataset=byte_dataset(args.steps * args.batch_size, args.seq_len),
                          optimizer_cls_and_kwargs=(po.AdamW, optimizer_kwargs))
        trainer.train()

    # trainer.optimizer is accelerate's wrapper, which forwards step() but not our methods.
    optimizer = unwrap_optimizer(trainer.optimizer)
    report, paging = optimizer.memory_report(), optimizer.paging_stats()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"LoRA r={args.rank} on {training_args.device}: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f} in {args.steps} steps; {trainable:,} of {total:,} params "
          f"trainable, optimizer state {report['state_bytes'] / 2**10:.1f} KiB "
          f"({report['state_bytes_per_param']:.2f} bytes per trainable param), "
          f"placed {report['state_placement']}"
          + (f"; {paging['misses']} page misses" if offload else ""))
    print(json.dumps({"example": "peft_lora", "device": str(training_args.device),
                      "steps": args.steps, "trainable_params": trainable,
                      "total_params": total, "losses": losses, "memory_report": report,
                      "paging_stats": {key: paging[key] for key in
                                       ("offload", "hits", "misses", "bytes_read",
                                        "bytes_written")}}))


if __name__ == "__main__":
    main()
