"""Shared helpers of the Python tests (conftest.py keeps only the fixtures), imported as
`from support import ...`: for the drop-in contract tests of pagedoptim's optimizers.

The oracles are torch.optim.AdamW / torch.optim.SGD and `LionReference` below, a plain
PyTorch Lion. Gradients are generated from a seeded generator and indexed by step, so every
run of a comparison sees the same gradients.

Error measure used throughout (`relative_error`):

    err = max_i |ours_i - ref_i| / scale,   scale = max over the run of max_i |ref_i|

fp32 rounding perturbs an element by a few units in the last place of the operands that
produced it, and every operand is bounded by the largest magnitude the tensor took during
the run (its initial value included). Relative to that scale, rounding error is bounded no
matter whether an element crosses zero, where an elementwise relative error is ill-posed
and a mixed atol/rtol needs an arbitrary atol. It is the max-norm relative error of
numerical analysis with the magnitude taken over the trajectory. FP32_TOL = 1e-6 is about
8 ulp of the largest magnitude (2**-23 = 1.19e-7).
"""

import functools

import torch
from torch import nn

import pagedoptim as po

FP32_TOL = 1e-6


def cuda_skip_reason() -> "str | None":
    """Why the GPU tests cannot run here (None: they can): no CUDA device, or a pagedoptim
    built without its CUDA kernels."""
    from pagedoptim._native import native
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        built = native.cuda_built()
    except (AttributeError, RuntimeError) as error:
        return f"pagedoptim's native extension has no CUDA backend: {error}"
    if not built:
        return ("pagedoptim was built without its CUDA kernels: rebuild it with "
                "PAGEDOPTIM_WITH_CUDA=1 pip install --no-build-isolation -e .")
    return None

# Sizes that are not multiples of 32 (the quantization group and any vector width), one
# that is, a 0-dim scalar, and multi-dimensional tensors.
SMALL_SHAPES = [(), (7,), (33,), (64,), (5, 13), (3, 31, 3)]
# More than 1M elements: spans several 2 MiB pages of fp32 state; not a multiple of 32.
LARGE_SHAPES = [((1 << 20) + 13,)]

# The drop-in contract is stated for exact mode (fp32 state, no master split); the
# compressed defaults have their own tests (test_compressed_*.py).
EXACT = dict(state_bits=32, master_bits=None)
OURS = {name: functools.partial(cls, **EXACT)
        for name, cls in (("AdamW", po.AdamW), ("SGD", po.SGD), ("Lion", po.Lion))}


class LionReference(torch.optim.Optimizer):
    """Plain PyTorch Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms", Algorithm 2 with decoupled weight decay), in the parameter's dtype:

        p <- p * (1 - lr * wd)
        p <- p - lr * sign(beta1 * m + (1 - beta1) * g)
        m <- beta2 * m + (1 - beta2) * g

    sign() is discontinuous at 0: where beta1*m + (1-beta1)*g is within rounding of zero,
    two correct fp32 implementations may take opposite signs. Each such element is
    recorded in state['tie'] (from this run's operands, |interpolation| <= TIE_ULPS ulp of
    |beta1*m| + |(1-beta1)*g|), so a comparison can exclude exactly those elements of the
    parameter and nothing else. The mask depends on the reference alone, never on the
    implementation under test.
    """

    # A rounding-level tie: |interpolation| within this many ulps of its operands' sum.
    TIE_ULPS = 16

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            beta1, beta2 = (float(b) for b in group["betas"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["tie"] = torch.zeros_like(p, dtype=torch.bool)
                state["step"] += 1
                m = state["exp_avg"]
                p.mul_(1 - lr * group["weight_decay"])
                interp = m * beta1 + grad * (1 - beta1)
                # The threshold's own rounding is irrelevant, so it is computed in fp32.
                magnitude = (m * beta1).abs() + (grad * (1 - beta1)).abs()
                ulp = torch.finfo(p.dtype).eps
                state["tie"] |= interp.abs() <= magnitude * (self.TIE_ULPS * ulp)
                p.add_(interp.sign(), alpha=-lr)
                m.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss

    def state_dict(self):
        sd = super().state_dict()
        for s in sd["state"].values():
            s.pop("tie", None)
        return sd


REFERENCE = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD, "Lion": LionReference}


def make_params(shapes, seed=0, dtype=torch.float32):
    """Leaf parameters with seeded N(0, 1) values, one per shape."""
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def clone_params(params, dtype=None):
    """Independent leaf copies (same values; optionally cast) of a parameter list."""
    return [nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


class Grads:
    """Seeded fp32 gradients for `shapes`, indexed by step: `grads[t]` is a list of tensors.

    By default each parameter gets its own magnitude (1e-3 .. 1e1) so that the moments of
    different parameters differ by orders of magnitude. Small sets are precomputed; sets
    with a large tensor are regenerated on each access from the same seed (identical
    values, no hundreds of MB held).
    """

    def __init__(self, shapes, steps, seed=1234, precompute=None, magnitudes=None):
        self.shapes = list(shapes)
        self.steps = steps
        self.seed = seed
        if magnitudes is None:
            magnitudes = [10.0 ** ((i % 5) - 3) for i in range(len(self.shapes))]
        self.magnitudes = list(magnitudes)
        numel = sum(torch.Size(s).numel() for s in self.shapes)
        if precompute is None:
            precompute = numel * steps <= (1 << 22)
        self._cache = [self._make(t) for t in range(steps)] if precompute else None

    def _make(self, t):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + t)
        return [torch.randn(s, generator=gen) * m for s, m in zip(self.shapes, self.magnitudes)]

    def __len__(self):
        return self.steps

    def __getitem__(self, t):
        if not 0 <= t < self.steps:
            raise IndexError(t)
        return self._cache[t] if self._cache is not None else self._make(t)


def set_grads(params, grads):
    """p.grad <- g cast to p's dtype (a fresh tensor each time)."""
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype).clone()


def assert_8bit_moment_bytes(report, moments=2):
    """memory_report() of an optimizer with state_bits=8: 1 B a code for the params that keep
    8-bit moments, 4 B an fp32 moment for the rest (1-D, fewer than min_8bit_size elements:
    report['fp32_state_elements']), `moments` moments each; scales only where codes are."""
    n, fp32 = report["num_elements"], report["fp32_state_elements"]
    assert 0 <= fp32 <= n
    assert report["moment_bytes"] == moments * ((n - fp32) + 4 * fp32), report
    assert (report["scale_bytes"] > 0) == (fp32 < n), report


def relative_error(ours, ref, scale):
    """max|ours - ref| / scale; 0 when both agree exactly, inf for a mismatch at scale 0."""
    diff = (ours.detach().double() - ref.detach().double()).abs().max().item()
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else float("inf")


def max_abs(t):
    """max_i |t_i| as a Python float (exact: no rounding in abs or max)."""
    return torch.linalg.vector_norm(t.detach(), float("inf")).item() if t.numel() else 0.0


class TrajectoryScale:
    """Running max of max|ref| per tensor, starting from the initial values."""

    def __init__(self, tensors):
        self.values = [max_abs(t) for t in tensors]

    def update(self, tensors):
        for i, t in enumerate(tensors):
            self.values[i] = max(self.values[i], max_abs(t))


def tie_mask(ref_opt, p):
    """Elements of reference param `p` whose Lion direction was a rounding-level tie."""
    state = ref_opt.state.get(p, {})
    return state.get("tie") if isinstance(ref_opt, LionReference) else None


def assert_params_close(ours_params, ref_params, scale, tol, where, ref_opt=None):
    """Assert every parameter pair is within `tol` (see module docstring).

    For a LionReference, rounding-level ties are excluded (see LionReference) and they
    must stay rare, so the exclusion cannot hide a systematic error.
    """
    for i, (a, b) in enumerate(zip(ours_params, ref_params)):
        a_cmp, b_cmp = a.detach(), b.detach()
        mask = tie_mask(ref_opt, b) if ref_opt is not None else None
        if mask is not None and mask.any():
            frac = mask.double().mean().item()
            # Expected about TIE_ULPS * eps * steps ~ 2e-4 of the elements after 100 steps.
            assert frac <= 1e-3 or mask.sum().item() <= 2, (
                f"{where}, param {i} {tuple(b.shape)}: {frac:.2e} of elements are Lion "
                f"sign ties; ties must be rounding-level rare")
            a_cmp, b_cmp = a_cmp[~mask], b_cmp[~mask]
        err = relative_error(a_cmp, b_cmp, scale.values[i])
        assert err <= tol, (
            f"{where}, param {i} shape {tuple(b.shape)} dtype {b.dtype}: relative error "
            f"{err:.3e} > {tol:.0e} (max|diff| / trajectory max|ref| = {scale.values[i]:.3e})")


def run_lockstep(ours, ours_params, ref, ref_params, grads, steps=None, tol=FP32_TOL,
                 before_step=None, check_every=1, label=""):
    """Step `ours` and `ref` side by side on the same gradients, comparing parameters
    after every `check_every` steps and after the last one.

    before_step(t, ours, ref) runs before step t (0-based) for hyperparameter changes.
    """
    steps = len(grads) if steps is None else steps
    scale = TrajectoryScale(ref_params)
    for t in range(steps):
        g = grads[t]
        set_grads(ours_params, g)
        set_grads(ref_params, g)
        if before_step is not None:
            before_step(t, ours, ref)
        ours.step()
        ref.step()
        scale.update(ref_params)
        if (t + 1) % check_every == 0 or t + 1 == steps:
            assert_params_close(ours_params, ref_params, scale, tol,
                                f"{label} after step {t + 1}", ref_opt=ref)
    return scale


def run_steps(opt, params, grads, start, stop):
    """Apply grads[start:stop] to `params` with `opt`, one step each."""
    for t in range(start, stop):
        set_grads(params, grads[t])
        opt.step()


def state_tensors(opt):
    """{(param index, key): tensor} from opt.state_dict(), for bitwise comparisons."""
    out = {}
    for idx, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            if torch.is_tensor(v):
                out[(idx, k)] = v.detach().clone()
    return out


def assert_state_equal(a, b, where):
    assert a.keys() == b.keys(), f"{where}: state keys {sorted(a)} != {sorted(b)}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (
            f"{where}: state {k} is {a[k].dtype}{tuple(a[k].shape)} vs "
            f"{b[k].dtype}{tuple(b[k].shape)}")
        assert torch.equal(a[k], b[k]), f"{where}: state {k} differs"


class TinyModel(nn.Module):
    """Two linear layers with odd sizes and a 0-dim scale."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor(1.0))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + (1.0 if p.dim() == 0 else 0.0))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


def model_loss(model, batch):
    x, y = batch
    return (model(x) - y).pow(2).mean()
