"""The README's Python snippets, run exactly as printed on a tiny Llama.

Each snippet runs in a namespace holding the names it takes from the surrounding text
(`model`, `args`, `data`, `torch_opt`, `path`); the only edits are directories: a snippet's
`/nvme` becomes a temporary directory, and relative paths land in one (the test runs in
tmp_path). The snippet loading Trainer's converted optimizer.pt by hand runs in
test_transformers_integration.py, after the conversion it needs. A snippet added to the
README is picked up here by position: the count below makes adding one without a test fail.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

import pagedoptim as po
from ranks import run_ranks
from test_transformers_integration import byte_dataset, tiny_llama

README = Path(__file__).resolve().parents[2] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def snippet_with(first_line_start: str) -> str:
    found = [s for s in snippets() if s.startswith(first_line_start)]
    assert len(found) == 1, f"README has {len(found)} snippets starting {first_line_start!r}"
    return found[0]


def run(snippet: str, tmp_path: Path, **names) -> dict:
    namespace = {"torch": torch, "po": po, **names}
    exec(compile(snippet.replace('"/nvme"', repr(str(tmp_path))), str(README), "exec"),
         namespace)
    return namespace


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield
    po.unpatch()  # the one-flag snippet patches torch.optim


def test_every_snippet_is_run_somewhere():
    starts = ["import pagedoptim as po\nopt = ", "po.patch(", "import pagedoptim as po\nfrom "
              "transformers", "torch.save(opt.torch_state_dict()", "decay = trainer.",
              "from torch.distributed.fsdp"]
    assert len(snippets()) == len(starts)
    for start in starts:
        snippet_with(start)


def test_the_optimizer_snippet(tmp_path):
    model = tiny_llama()
    namespace = run(snippet_with("import pagedoptim as po\nopt = "), tmp_path, model=model)
    assert type(namespace["opt"]) is po.SkewAdam
    assert set(namespace["opt"].settings) >= {"state_bits", "offload"}


def test_the_one_flag_snippet(tmp_path):
    model = tiny_llama()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    namespace = run(snippet_with("po.patch("), tmp_path, torch_opt=torch_opt)
    assert isinstance(torch.optim.AdamW(model.parameters()), po.AdamW)  # patched
    assert namespace["opt"].settings["offload"] == "host"
    assert namespace["sched"].optimizer is namespace["opt"]


def test_the_trainer_snippet(tmp_path):
    model = tiny_llama()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "args"), max_steps=2,
                                          per_device_train_batch_size=4, report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True,
                                          learning_rate=2e-5)
    namespace = run(snippet_with("import pagedoptim as po\nfrom transformers"), tmp_path,
                    model=model, args=args, data=byte_dataset(8))
    trainer = namespace["trainer"]
    assert trainer.state.global_step > 0  # route 4's own arguments: three epochs of one step
    opt = namespace["unwrap_optimizer"](trainer.optimizer)
    assert opt.settings["offload"] == "host" and opt.settings["cache_bytes"] == 1 << 30


def test_the_checkpoint_snippet(tmp_path):
    model = tiny_llama()
    opt = po.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    run(snippet_with("torch.save(opt.torch_state_dict()"), tmp_path, model=model, opt=opt)
    assert "exp_avg" in next(iter(torch.load(tmp_path / "optimizer.pt")["state"].values()))


def _fsdp2_snippet(rank: int, world_size: int, path: str) -> list[str]:
    import torch.distributed.checkpoint as dcp  # noqa: F401  (the snippet imports it itself)
    snippet = snippet_with("from torch.distributed.fsdp")
    model = tiny_llama()
    namespace = {"torch": torch, "po": po, "model": model, "path": path}
    exec(compile(snippet, str(README), "exec"), namespace)
    return sorted(namespace["sd"]["optimizer"]["state"])


def test_the_fsdp2_snippet(tmp_path):
    (names,) = run_ranks(_fsdp2_snippet, 1, str(tmp_path / "dcp"), tmp_path=tmp_path)
    assert names  # the optimizer state went through dcp.save and dcp.load
