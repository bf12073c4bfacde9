"""Tables (Markdown) and plots (PNG) from the JSON lines of benchmarks/peers.py.

    python benchmarks/peers_report.py peers.jsonl                       # tables on stdout
    python benchmarks/peers_report.py peers.jsonl rerun.jsonl --plot-dir docs

With a second file (a rerun of the throughput part), the throughput table gains the rerun's
ratio next to the first, which is how docs/comparison.md states the run-to-run noise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PLOT_NAMES = {"throughput": "comparison_throughput.png", "memory": "comparison_memory.png",
              "loss": "comparison_loss.png"}


def load(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def by(records: list[dict], benchmark: str) -> list[dict]:
    return [r for r in records if r["benchmark"] == benchmark]


def ordered(names) -> list[str]:
    from peer_optimizers import CANDIDATES

    order = [c.name for c in CANDIDATES]
    return sorted(set(names), key=lambda n: order.index(n) if n in order else len(order))


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def throughput_table(records: list[dict], reruns: list[list[dict]]) -> str:
    rows = by(records, "peers_throughput")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["optimizer"], r["workload"]): r for r in rows}
    rerun_cells = [{(r["optimizer"], r["workload"]): r for r in by(rerun, "peers_throughput")}
                   for rerun in reruns]
    header = ["optimizer"] + [f"{w}: x torch_fused (Gparam/s; step min..max s; n)" for w in workloads]
    if reruns:
        header += [f"{w}: rerun x" for w in workloads]
    out = []
    for name in ordered(r["optimizer"] for r in rows):
        line = [name]
        for w in workloads:
            r = cell.get((name, w))
            line.append("-" if r is None else
                        f"{r['ratio_vs_torch_fused']:.3g} ({r['params_per_s'] / 1e9:.3g}; "
                        f"{r['step_s_min']:.3g}..{r['step_s_max']:.3g}; {r['repeats']})")
        for w in workloads if reruns else []:
            line.append(" / ".join(f"{c[(name, w)]['ratio_vs_torch_fused']:.3g}"
                                   if (name, w) in c else "-" for c in rerun_cells))
        out.append(line)
    return table(header, out)


def memory_table(records: list[dict]) -> str:
    rows = by(records, "peers_memory")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    cell = {(r["optimizer"], r["workload"]): r for r in rows}
    growth = "device_growth_bytes_per_param" if rows and rows[0]["device"] == "cuda" \
        else "rss_growth_bytes_per_param"
    header = ["optimizer"] + [f"{w}: storage / growth / transient B/param" for w in workloads]
    out = []
    for name in ordered(r["optimizer"] for r in rows):
        line = [name]
        for w in workloads:
            r = cell.get((name, w))
            if r is None:
                line.append("-")
                continue
            transient = r["transient_peak_bytes_per_param"]
            line.append(f"{r['state_storage_bytes_per_param']:.3g} / {r[growth]:.3g} / "
                        + ("n/a" if transient is None else f"{transient:.3g}"))
        out.append(line)
    return table(header, out)


def quality_table(records: list[dict]) -> str:
    """From the per-seed lines, so that a run stopped between seeds still has its table."""
    per_seed = by(records, "peers_quality")
    header = ["optimizer", "params", "seeds", "final loss / torch fp32: mean (max)",
              "held-out loss / torch fp32: mean (max)", "held-out loss, seed 0"]
    out = []
    for name in ordered(r["optimizer"] for r in per_seed):
        for workload in dict.fromkeys(r["workload"] for r in per_seed if r["optimizer"] == name):
            rows = [r for r in per_seed if r["optimizer"] == name and r["workload"] == workload]
            final = [r["final_ratio_vs_torch_fused"] for r in rows]
            held = [r["held_out_ratio_vs_torch_fused"] for r in rows]
            seed0 = next((r for r in rows if r["seed"] == 0), None)
            out.append([name, workload.removeprefix("lm_"), str(len(rows)),
                        f"{sum(final) / len(final):.3f} ({max(final):.3f})",
                        f"{sum(held) / len(held):.3f} ({max(held):.3f})",
                        "-" if seed0 is None else f"{seed0['held_out_loss']:.4g}"])
    return table(header, out)


def skipped_table(records: list[dict]) -> str:
    rows = by(records, "peers_skipped")
    return table(["optimizer", "part", "workload", "reason"],
                 [[r["optimizer"], r["part"], r["workload"] or "all", r["reason"]] for r in rows])


def plot_throughput(records: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = by(records, "peers_throughput")
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    names = ordered(r["optimizer"] for r in rows)
    figure, axis = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(workloads)
    for k, w in enumerate(workloads):
        cell = {r["optimizer"]: r["ratio_vs_torch_fused"] for r in rows if r["workload"] == w}
        axis.bar([i + k * width for i in range(len(names))], [cell.get(n, 0) for n in names],
                 width, label=w)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_yscale("log")
    axis.set_xticks([i + width * (len(workloads) - 1) / 2 for i in range(len(names))])
    axis.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    axis.set_ylabel("step throughput / torch_fused (log)")
    axis.set_title("optimizer step throughput relative to torch.optim.AdamW(fused=True)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_memory(records: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = by(records, "peers_memory")
    workloads = [w for w in dict.fromkeys(r["workload"] for r in rows) if not w.startswith("lora")]
    figure, axes = plt.subplots(1, len(workloads), figsize=(10, 3.8), sharey=True, squeeze=False)
    for axis, w in zip(axes[0], workloads):
        cell = {r["optimizer"]: r for r in rows if r["workload"] == w}
        names = ordered(cell)
        growth = [cell[n].get("rss_growth_bytes_per_param",
                              cell[n].get("device_growth_bytes_per_param")) for n in names]
        storage = [cell[n]["state_storage_bytes_per_param"] for n in names]
        transient = [cell[n]["transient_peak_bytes_per_param"] or 0 for n in names]
        x = range(len(names))
        axis.bar([i - 0.2 for i in x], storage, 0.4, label="state storage")
        axis.bar([i + 0.2 for i in x], growth, 0.4, label="resident growth")
        axis.bar([i + 0.2 for i in x], transient, 0.4, bottom=growth, label="+ step transient")
        axis.set_xticks(list(x))
        axis.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        axis.set_title(f"{w}: optimizer bytes per param", fontsize=9)
    axes[0][0].set_ylabel("bytes / param")
    axes[0][0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_loss(records: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in by(records, "peers_quality") if r.get("curve")]
    figure, (full, tail) = plt.subplots(1, 2, figsize=(11, 4))
    order = ordered(r["optimizer"] for r in rows)
    for r in sorted(rows, key=lambda r: (order.index(r["optimizer"]), r["workload"])):
        every = r["steps"] // len(r["curve"])
        steps = [every * (i + 1) for i in range(len(r["curve"]))]
        style = "--" if r["workload"] == "lm_bf16" else "-"
        label = r["optimizer"] + (" (bf16 params)" if r["workload"] == "lm_bf16" else "")
        for axis in (full, tail):
            axis.plot(steps, r["curve"], style, label=label, linewidth=1.1)
    full.set_title("tiny byte LM, training loss (20-step mean), seed 0", fontsize=9)
    full.set_xlabel("step")
    full.set_ylabel("cross-entropy (nats)")
    baseline = next(r["curve"] for r in rows if r["optimizer"] == "torch_fused"
                    and r["workload"] == "lm_fp32")
    half = len(baseline) // 2
    every = rows[0]["steps"] // len(rows[0]["curve"])
    tail.set_xlim(every * half, every * len(baseline))
    tail.set_ylim(min(baseline[half:]) * 0.97, max(baseline[half:]) * 1.06)
    tail.set_title("second half, zoomed", fontsize=9)
    tail.set_xlabel("step")
    full.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("jsonl", type=Path)
    parser.add_argument("reruns", type=Path, nargs="*", help="throughput reruns to compare")
    parser.add_argument("--plot-dir", type=Path, default=None)
    parser.add_argument("--plot-skip", default="",
                        help="comma-separated workloads left out of the throughput plot")
    args = parser.parse_args()
    records = load(args.jsonl)
    reruns = [load(path) for path in args.reruns]
    machine = by(records, "peers_machine")
    if machine:
        print("machine:", json.dumps(machine[0]))
    for title, text in (("Throughput", throughput_table(records, reruns)),
                        ("Memory", memory_table(records)), ("Quality", quality_table(records)),
                        ("Skipped", skipped_table(records))):
        print(f"\n### {title}\n\n{text}")
    if args.plot_dir is not None:
        import matplotlib

        matplotlib.use("Agg")
        left_out = set(filter(None, args.plot_skip.split(",")))
        plot_throughput([r for r in records if r.get("workload") not in left_out],
                        args.plot_dir / PLOT_NAMES["throughput"])
        plot_memory(records, args.plot_dir / PLOT_NAMES["memory"])
        plot_loss(records, args.plot_dir / PLOT_NAMES["loss"])


if __name__ == "__main__":
    main()
