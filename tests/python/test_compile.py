"""torch.compile over pagedoptim's optimizers: the step is one custom op (see
pagedoptim/engine/compiled_step.py and docs/torch_compile.md).

Every test compares a compiled optimizer with an eager twin that sees the same initial
params and the same gradients: the results must be bit-identical (the compiled step runs the
same native kernels), and the compiler must trace once: Dynamo's error_on_recompile turns
any recompile into an error, and its counters say how many graphs and frames were made.
"""

import copy
import logging
import re
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import pagedoptim as po
from pagedoptim.engine import compiled_step

# Mixed shapes (a 0-dim scalar, sizes that are not multiples of 32, 2-D and 3-D tensors)
# and dtypes: 20 params. The names follow SkewAdam's default tier patterns: the [E, rows,
# cols] tensor is an expert tensor, `mlp.gate` the router, the rest the backbone.
_SHAPES = [(), (7,), (33,), (64,), (5, 13), (3, 31), (16, 8), (40,), (2, 3, 5), (9, 9)]
_PARAM_SPECS = ([(f"layers.{i}.weight", shape, torch.float32) for i, shape in enumerate(_SHAPES)]
                + [(f"layers.{i}.bias", shape, torch.bfloat16) for i, shape in enumerate(_SHAPES)
                   if shape != (2, 3, 5)]
                + [("mlp.gate.weight", (4, 6), torch.float32),
                   ("mlp.experts.up_proj", (4, 6, 8), torch.bfloat16)])

# One page of 4 KiB, several pages of state, a cache of three pages: most steps page.
# Paged to the page file (on the CPU the cache is host memory already: offload="host" there
# would hold the state twice, and warns).
_PAGED = dict(offload="nvme", page_bytes=4096, cache_bytes=3 * 4096)

_BASE_OPTIMIZERS = {
    "adamw-8bit": lambda params, **paging: po.AdamW(params, lr=1e-2, **paging),
    "adamw-exact": lambda params, **paging: po.AdamW(params, lr=1e-2, state_bits=32,
                                                     master_bits=None, **paging),
    "adamw-amsgrad": lambda params, **paging: po.AdamW(params, lr=1e-2, amsgrad=True,
                                                       maximize=True, **paging),
    "sgd-nesterov": lambda params, **paging: po.SGD(params, lr=1e-2, momentum=0.9,
                                                    nesterov=True, weight_decay=1e-3, **paging),
    "sgd-plain": lambda params, **paging: po.SGD(params, lr=1e-2, **paging),
    "lion": lambda params, **paging: po.Lion(params, lr=1e-3, weight_decay=0.1, **paging),
    "skewadam": lambda params, **paging: po.SkewAdam(params, lr=1e-2, **paging),
}
# The paged variants; their eager twins are unpaged: paging must not change a single bit.
_PAGED_VARIANTS = ("adamw-8bit", "lion", "skewadam")
_UNPAGED_TWIN = {f"{kind}-paged": kind for kind in _PAGED_VARIANTS}
OPTIMIZERS = {**_BASE_OPTIMIZERS,
              **{paged: (lambda params, kind=kind: _BASE_OPTIMIZERS[kind](params, **_PAGED))
                 for paged, kind in _UNPAGED_TWIN.items()}}

# Logged (not warned) by Dynamo for torch.optim.Optimizer's own step wrapper, whatever the
# optimizer: torch.optim.AdamW logs it too.
_TORCH_PROFILER_NOTICE = "Profiler record function"


def _make_params(kind: str) -> list:
    """The 20 params, identical for every call (seeded); SkewAdam gets their names, and
    its backbone, which keeps factored statistics of matrices, gets no 3-D tensor."""
    skewadam = kind.startswith("skewadam")
    generator = torch.Generator().manual_seed(0)
    params = []
    for name, shape, dtype in _PARAM_SPECS:
        if skewadam and len(shape) == 3 and ".experts." not in name:
            shape = (shape[0] * shape[1], shape[2])
        value = torch.randn(shape, generator=generator).to(dtype)
        params.append((name, torch.nn.Parameter(value)))
    if skewadam:
        return params
    return [p for _, p in params]


def _tensors(params: list) -> list:
    return [p[1] if isinstance(p, tuple) else p for p in params]


def _set_grads(step: int, *param_lists: list) -> None:
    """The same gradients for every list, drawn from the step's own seed."""
    generator = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(p.shape, generator=generator).to(p.dtype)
             for p in _tensors(param_lists[0])]
    for params in param_lists:
        for p, grad in zip(_tensors(params), grads):
            p.grad = grad.clone()


def _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params) -> None:
    for index, (p, q) in enumerate(zip(_tensors(compiled_params), _tensors(eager_params))):
        assert torch.equal(p, q), f"param {index} differs"
    compiled_state = compiled_opt.state_dict()["state"]
    eager_state = eager_opt.state_dict()["state"]
    assert compiled_state.keys() == eager_state.keys()
    for index, state in eager_state.items():
        assert compiled_state[index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(compiled_state[index][key], value), f"state {index} {key}"


@pytest.fixture
def fresh_dynamo(caplog):
    """A clean Dynamo with recompiles as errors; yields the records it logged at warning
    level or above, less torch's own profiler notice."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True), \
            caplog.at_level(logging.WARNING, logger="torch"):
        yield caplog
    torch._dynamo.reset()


def _dynamo_warnings(caplog) -> list:
    return [record.getMessage() for record in caplog.records
            if _TORCH_PROFILER_NOTICE not in record.getMessage()]


def _user_warnings(caught) -> list:
    """Python warnings from pagedoptim or from the compiler (torch's own modules may warn
    about their deprecations while Inductor imports them the first time)."""
    return [str(w.message) for w in caught
            if not issubclass(w.category, (DeprecationWarning, FutureWarning))]


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_compiled_step_with_scheduler_traces_once_and_matches_eager(kind, fresh_dynamo):
    """(a) torch.compile(opt.step) for 5 steps, lr changed by a scheduler every step: one
    graph, no recompile, no warning, bit-identical params and state."""
    compiled_params, eager_params = _make_params(kind), _make_params(kind)
    compiled_opt = OPTIMIZERS[kind](compiled_params)
    eager_opt = OPTIMIZERS[_UNPAGED_TWIN.get(kind, kind)](eager_params)
    schedules = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
                 for opt in (compiled_opt, eager_opt)]
    step = torch.compile(compiled_opt.step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(5):
            _set_grads(index, compiled_params, eager_params)
            step()
            eager_opt.step()
            for schedule in schedules:
                schedule.step()
    assert counters["stats"]["unique_graphs"] == 1
    assert _user_warnings(caught) == []
    assert _dynamo_warnings(fresh_dynamo) == []
    assert compiled_opt.param_groups[0]["lr"] == eager_opt.param_groups[0]["lr"] != 1e-2
    _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("kind", ["adamw-8bit", "skewadam-paged"])
def test_fullgraph_step(kind, backend, fresh_dynamo):
    """(b) fullgraph=True: the whole step is one graph around one custom op. aot_eager runs
    the op on functional copies of params and step counters (Inductor updates in place):
    both must give the eager result. lr is assigned every step, as schedulers do."""
    compiled_params, eager_params = _make_params(kind), _make_params(kind)
    compiled_opt = OPTIMIZERS[kind](compiled_params)
    eager_opt = OPTIMIZERS[kind](eager_params)
    step = torch.compile(compiled_opt.step, fullgraph=True, backend=backend)
    for index in range(5):
        _set_grads(index, compiled_params, eager_params)
        step()
        eager_opt.step()
        for opt in (compiled_opt, eager_opt):
            opt.param_groups[0]["lr"] = 1e-2 / (index + 2)
    assert counters["stats"]["unique_graphs"] == 1
    _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params)


def test_fullgraph_graph_is_one_custom_op(fresh_dynamo):
    """What the compiler sees of a step: the op, and nothing of the engine."""
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    params = _make_params("adamw-8bit")
    opt = po.AdamW(params, lr=1e-2)
    _set_grads(0, params)
    torch.compile(opt.step, fullgraph=True, backend=record)()
    calls = [node.target for node in graphs[0].graph.nodes if node.op == "call_function"
             and node.target is not torch._C._set_grad_enabled]  # step() runs under no_grad
    assert calls == [torch.ops.pagedoptim.step_params_.default]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 16), torch.nn.GELU(),
                               torch.nn.Linear(16, 3))


@pytest.mark.parametrize("kind", ["adamw-8bit", "adamw-8bit-paged", "sgd-nesterov", "lion"])
def test_compiled_training_step_compiles_once(kind, fresh_dynamo):
    """(c) @torch.compile over forward, backward, opt.step() and opt.zero_grad(): Dynamo
    breaks the graph at backward() and at zero_grad() (torch disables Dynamo there), so it
    makes two graphs (forward+loss, step), all on the first call: later calls add no graph
    and no frame. Losses, params and state are bit-identical to the eager loop."""
    compiled_model, eager_model = _model(0), _model(0)
    compiled_opt = OPTIMIZERS[kind](list(compiled_model.parameters()))
    eager_opt = OPTIMIZERS[_UNPAGED_TWIN.get(kind, kind)](list(eager_model.parameters()))

    def train_step(model, opt, x, y):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    # aot_eager: the model's forward and backward run the eager kernels, so the compiled loop
    # can be compared bit for bit (Inductor's fused kernels round differently).
    compiled_train_step = torch.compile(train_step, backend="aot_eager")
    generator = torch.Generator().manual_seed(7)
    after_first = None
    for index in range(5):
        x, y = torch.randn(8, 12, generator=generator), torch.randn(8, 3, generator=generator)
        compiled_loss = compiled_train_step(compiled_model, compiled_opt, x, y)
        eager_loss = train_step(eager_model, eager_opt, x, y)
        assert torch.equal(compiled_loss, eager_loss), f"loss of step {index}"
        made = (counters["stats"]["unique_graphs"], counters["frames"]["total"])
        after_first = after_first or made
        assert made == after_first, f"step {index} compiled again"
    assert after_first[0] == 2
    _assert_identical(compiled_opt, eager_opt, list(compiled_model.parameters()),
                      list(eager_model.parameters()))


def test_add_param_group_and_load_state_dict_retrace(fresh_dynamo):
    """A new group is stepped from the next call on (the compiler traces again), and so is
    state loaded from a checkpoint: never a stale param list or step counter."""
    compiled_params, eager_params = _make_params("adamw-8bit"), _make_params("adamw-8bit")
    compiled_opt = po.AdamW(compiled_params[:10], lr=1e-2)
    eager_opt = po.AdamW(eager_params[:10], lr=1e-2)
    step = torch.compile(compiled_opt.step)
    with torch._dynamo.config.patch(error_on_recompile=False):
        for index in range(6):
            if index == 2:
                compiled_opt.add_param_group({"params": compiled_params[10:], "lr": 1e-3})
                eager_opt.add_param_group({"params": eager_params[10:], "lr": 1e-3})
            if index == 4:
                checkpoint = eager_opt.state_dict()  # its step counters are copies
                compiled_opt.load_state_dict(checkpoint)
                eager_opt.load_state_dict(checkpoint)
            _set_grads(index, compiled_params, eager_params)
            step()
            eager_opt.step()
    _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params)


@pytest.mark.parametrize("reset", ["del", "clear", "assign_entry", "assign_step"])
def test_state_reset_retraces_with_the_new_step_counters(reset, fresh_dynamo):
    """Resetting a param's state (or assigning its step) replaces its step counter: the
    compiled step must advance the new one, as the eager step does."""
    compiled_params, eager_params = _make_params("adamw-8bit"), _make_params("adamw-8bit")
    compiled_opt = po.AdamW(compiled_params, lr=1e-2)
    eager_opt = po.AdamW(eager_params, lr=1e-2)
    step = torch.compile(compiled_opt.step, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=False):
        for index in range(5):
            if index == 3:
                for opt, params in ((compiled_opt, compiled_params), (eager_opt, eager_params)):
                    if reset == "del":
                        del opt.state[params[0]]
                    elif reset == "clear":
                        opt.state.clear()
                    elif reset == "assign_entry":
                        opt.state[params[0]] = {}
                    else:
                        opt.state[params[0]]["step"] = torch.tensor(10.0)
            _set_grads(index, compiled_params, eager_params)
            step()
            eager_opt.step()
    _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params)
    assert float(compiled_opt.state[compiled_params[0]]["step"]) == \
        float(eager_opt.state[eager_params[0]]["step"])


def test_frozen_params_keep_no_state(fresh_dynamo):
    """Params without a gradient are left out of the op, as the eager step leaves them."""
    compiled_params, eager_params = _make_params("lion"), _make_params("lion")
    compiled_opt, eager_opt = po.Lion(compiled_params), po.Lion(eager_params)
    step = torch.compile(compiled_opt.step, fullgraph=True)
    for index in range(3):
        _set_grads(index, compiled_params, eager_params)
        for params in (compiled_params, eager_params):
            params[3].grad = None
        step()
        eager_opt.step()
    assert compiled_params[3] not in compiled_opt.state
    _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params)


def test_bad_hyperparameter_raises_under_compile(fresh_dynamo):
    """The op validates the hyperparameters when it runs, with the eager step's message."""
    compiled_params, eager_params = _make_params("adamw-8bit"), _make_params("adamw-8bit")
    compiled_opt = po.AdamW(compiled_params, lr=1e-2)
    eager_opt = po.AdamW(eager_params, lr=1e-2)
    step = torch.compile(compiled_opt.step, fullgraph=True)
    _set_grads(0, compiled_params, eager_params)
    step()
    for opt in (compiled_opt, eager_opt):
        opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError) as eager_error:
        eager_opt.step()
    with pytest.raises(ValueError, match=re.escape(str(eager_error.value))):
        step()


def test_tensor_lr_under_compile(fresh_dynamo):
    """lr as a 0-dim tensor (torch's recipe for compiled optimizers) works the same."""
    compiled_params, eager_params = _make_params("adamw-exact"), _make_params("adamw-exact")
    compiled_opt = po.AdamW(compiled_params, lr=torch.tensor(1e-2), state_bits=32,
                            master_bits=None)
    eager_opt = po.AdamW(eager_params, lr=torch.tensor(1e-2), state_bits=32, master_bits=None)
    step = torch.compile(compiled_opt.step, fullgraph=True)
    for index in range(3):
        _set_grads(index, compiled_params, eager_params)
        step()
        eager_opt.step()
        for opt in (compiled_opt, eager_opt):
            opt.param_groups[0]["lr"].fill_(1e-2 / (index + 2))
    _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params)


def test_op_called_without_a_live_optimizer_raises():
    param = torch.zeros(3)
    with pytest.raises(RuntimeError, match="no live pagedoptim optimizer"):
        torch.ops.pagedoptim.step_params_(-1, [param], [param], [torch.zeros(())], [0])


def test_op_rejects_arguments_that_do_not_fit():
    params = _make_params("sgd-plain")
    opt = po.SGD(params, lr=1e-2)
    _set_grads(0, params)
    torch.compile(opt.step, fullgraph=True)()
    optimizer_id = compiled_step._ids[opt]
    with pytest.raises(ValueError, match="one entry per param"):
        torch.ops.pagedoptim.step_params_(optimizer_id, [params[0]], [], [], [0])
    with pytest.raises(IndexError, match="out of range"):
        torch.ops.pagedoptim.step_params_(optimizer_id, [params[0]], [params[0].grad],
                                          [torch.zeros(())], [len(params)])
    with pytest.raises(ValueError, match="the tensor for param 1"):
        torch.ops.pagedoptim.step_params_(optimizer_id, [params[0]], [params[0].grad],
                                          [torch.zeros(())], [1])
    with pytest.raises(ValueError, match="grad"):
        torch.ops.pagedoptim.step_params_(optimizer_id, [params[1]], [torch.zeros(3)],
                                          [torch.zeros(())], [1])
    with pytest.raises(ValueError, match="step counter"):
        torch.ops.pagedoptim.step_params_(optimizer_id, [params[1]], [params[1].grad],
                                          [torch.zeros((), dtype=torch.int64)], [1])


def test_opcheck():
    """(e) torch.library.opcheck: the schema declares every tensor the op writes, the fake
    kernel matches, and autograd is registered correctly. Two runs of the op on equal
    inputs cannot agree (the engine's moments advance between them), so the checks that
    compare runs (test_aot_dispatch_*) do not apply to a stateful op."""
    params = _make_params("adamw-exact")
    opt = po.AdamW(params, lr=1e-2, state_bits=32, master_bits=None)
    _set_grads(0, params)
    torch.compile(opt.step, fullgraph=True)()
    plan_steps = [opt.state[p]["step"] for p in params]
    args = (compiled_step._ids[opt], params, [p.grad for p in params], plan_steps,
            list(range(len(params))))
    torch.library.opcheck(torch.ops.pagedoptim.step_params_.default, args,
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration"))


class _ScaledAdamW(po.AdamW):
    """Takes GradScaler's tensors as CUDA state does, on the CPU: the engine then refuses
    them with its message, which shows that they reached it."""

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return True


def test_grad_scaler_tensors_reach_the_engine(fresh_dynamo):
    """GradScaler.step sets found_inf and grad_scale on the optimizer just before step();
    under compile the op takes them as arguments, never from a stale attribute."""
    params = _make_params("adamw-8bit")
    opt = _ScaledAdamW(params, lr=1e-2)
    _set_grads(0, params)

    def scaler_step():  # what GradScaler.step does around optimizer.step()
        opt.found_inf, opt.grad_scale = torch.zeros(1), torch.full((1,), 1024.0)
        opt.step()
        del opt.found_inf, opt.grad_scale

    with pytest.raises(ValueError, match="found_inf and grad_scale are taken by steps of device state only"):
        torch.compile(scaler_step, fullgraph=True)()


def test_param_given_twice_steps_twice_under_compile(fresh_dynamo):
    """A param given twice in a group is stepped twice, as the eager step (and torch) does:
    the op hands it to the same round-by-round code."""
    compiled_params, eager_params = _make_params("adamw-8bit")[:3], _make_params("adamw-8bit")[:3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the duplicate, as it should
        compiled_opt = po.AdamW(compiled_params + compiled_params[:1], lr=1e-2)
        eager_opt = po.AdamW(eager_params + eager_params[:1], lr=1e-2)
    step = torch.compile(compiled_opt.step, fullgraph=True)
    for index in range(3):
        _set_grads(index, compiled_params, eager_params)
        step()
        eager_opt.step()
    assert compiled_opt.state[compiled_params[0]]["step"] == 6
    _assert_identical(compiled_opt, eager_opt, compiled_params, eager_params)


def test_the_step_op_is_left_out_of_cuda_graphs():
    # torch.compile(mode="reduce-overhead") captures CUDA graphs around what it compiles;
    # a replay of the step would reuse the captured step's host buffers and pages.
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no cudagraph_unsafe tag")
    op = getattr(torch.ops.pagedoptim, compiled_step.OP_NAME.split("::")[1]).default
    assert torch.Tag.cudagraph_unsafe in op.tags


def test_import_leaves_dynamo_unloaded_and_a_compiled_step_still_traces_once():
    """`import pagedoptim` does not import torch._dynamo (1.5 s of every PAGEDOPTIM=1
    script's start): compiled_step marks _prepare as Dynamo's decorator would. In a fresh
    process, where that mark (not the public decorator) is in force, a compiled step still
    matches eager bit for bit and compiles one frame."""
    import subprocess
    import sys
    child = """
import sys, torch, pagedoptim as po
assert "torch._dynamo" not in sys.modules, "import pagedoptim loaded torch._dynamo"
from torch._dynamo.utils import counters
torch.manual_seed(0)
params = [torch.nn.Parameter(torch.randn(40, 33)), torch.nn.Parameter(torch.randn(7))]
twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
compiled, eager = po.AdamW(params, lr=0.1), po.AdamW(twins, lr=0.1)
step = torch.compile(compiled.step)
for _ in range(3):
    for p, q in zip(params, twins):
        p.grad = torch.randn_like(p); q.grad = p.grad.clone()
    step(); eager.step()
assert all(torch.equal(p, q) for p, q in zip(params, twins))
print(counters["stats"]["unique_graphs"], counters["frames"]["ok"])
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    graphs, frames = map(int, done.stdout.split())
    assert graphs == 1, done.stdout


def test_dynamos_constant_result_decorator_still_only_marks_the_function():
    """compiled_step sets the mark itself while Dynamo is not loaded; that is only right while
    torch's decorator does nothing else."""
    def fn():
        return 0
    assert torch.compiler.assume_constant_result(fn) is fn
    assert vars(fn) == {"_dynamo_marked_constant": True}
