"""Plain-PyTorch reference of PagedOptim's compressed state: the oracle of the tests.

It restates, one tensor operation at a time, the element math of the native kernels:
include/pagedoptim/codec/companding.h (companded 8-bit moments), master_split.h (16-bit
parameter + integer residual) and update_rules.h (the AdamW / SGD / Lion update of one
element), and the 8-bit step of csrc/kernels/cpu/step_kernels_isa.cpp built from them:
decode the group's state -> update in fp32 -> re-encode with the group's new scale. It is
written for reading, not for speed; docs/compression.md explains the formats.

Arithmetic. Every fp32 operation of the headers is an fp32 operation here, in the same order,
so results agree bit for bit. Three header operations have no bit-exact one-liner in torch and
get a helper:
  - sqrtf: torch's CPU fp32 sqrt is not correctly rounded for every input (torch 2.13);
    the fp64 root rounded to fp32 is (53 >= 2 * 24 + 2 bits), `sqrt32`.
  - fmaf (one rounding of a * b + c): torch has no fused multiply-add; `fma32` computes it
    exactly in fp64 with round-to-odd and rounds once to fp32.
  - round-half-even to an integer: torch.round rounds half to even, as the header's
    (x + 1.5 * 2^23) - 1.5 * 2^23 does for |x| < 2^22.
Scalars (beta1, 1 - beta1, lr / bias correction, ...) are computed in Python floats (fp64)
and rounded to fp32 once, as make_*_scalars does in C++.

Formats (state_dict()['state'][i] of the optimizers uses the same names):
  first moment X:   'X_codes' int8 (param shape), 'X_scales' fp16 [..., ceil(d / 32)] (one per
                    group of 32 elements of a row of the last dimension d; a row ends in a
                    partial group where d % 32 != 0; a 1-D tensor is one row)
  second moment X:  'X_codes' uint8 codes of sqrt(v), 'X_scales' fp16
  master residual:  'master_residual' int8 (master_bits=24) or int16 (master_bits=32)
  fp32 state (state_bits=32, and with state_bits=8 for params of one dimension, fewer than
  min_8bit_size elements or complex values): 'X' fp32 (param shape)
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

GROUP_SIZE = 32
MOMENT_CODE_MAX = 127.0
SECOND_MOMENT_CODE_MAX = 255.0
FP16_MAX = 65504.0
RESIDUAL = "master_residual"

# K of the master split per master_bits, and the residual's dtype.
RESIDUAL_SCALE = {24: 127.0, 32: 32767.0}
RESIDUAL_DTYPE = {24: torch.int8, 32: torch.int16}


def f32(value: float) -> torch.Tensor:
    """A Python float (fp64) rounded once to an fp32 scalar tensor, like C++'s float(x)."""
    return torch.tensor(value, dtype=torch.float32)


# fp32 constants the headers fold at compile time (an fp32 division each).
_INV_SECOND_MOMENT_CODE_MAX = f32(1.0) / f32(SECOND_MOMENT_CODE_MAX)
_HALF = f32(0.5)
_ONE = f32(1.0)


# ---------------------------------------------------------------------------------------------
# Exact fp32 arithmetic the headers use and torch does not spell directly.

def sqrt32(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (sqrtf)."""
    return x.double().sqrt().float()


def fma32(a: torch.Tensor | float, b: torch.Tensor | float, c: torch.Tensor | float
          ) -> torch.Tensor:
    """fmaf(a, b, c) for fp32 operands: a * b + c rounded once to fp32.

    a * b of two fp32 values is exact in fp64 (48 significant bits). The sum with c is taken
    in fp64 with its exact error (TwoSum), then rounded to odd (a sum that is not exact is
    moved to the odd one of the two fp64 values around it), and rounding that to fp32 gives
    the correctly rounded fp32 result (round-to-odd at 53 bits, then to 24, is exact
    rounding since 53 >= 2 * 24 + 2)."""
    a, b, c = (torch.as_tensor(t, dtype=torch.float32) for t in (a, b, c))
    product = a.double() * b.double()
    addend = c.double()
    total = product + addend
    addend_part = total - product
    error = (product - (total - addend_part)) + (addend - addend_part)
    inexact = (error != 0) & torch.isfinite(total)
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(error > 0, math.inf, -math.inf).double()
    rounded_to_odd = torch.where(inexact & even, torch.nextafter(total, toward), total)
    return rounded_to_odd.float()


def clamp_like_c(x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`x < high ? x : high` then `x > low ? x : low`: a NaN becomes `high` (the header's
    clamps keep codes defined for any input; the group's NaN scale carries the NaN)."""
    x = torch.where(x < high, x, torch.full_like(x, high))
    return torch.where(x > low, x, torch.full_like(x, low))


# ---------------------------------------------------------------------------------------------
# Scales

def fp16_scale_at_least(magnitude: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= magnitude (>= 0), as fp32. inf/NaN give NaN (the non-finite
    policy); finite values above 65504 saturate to 65504. Rounding *up* keeps the group's
    largest element inside the code range (nearest could land below it)."""
    clamped = magnitude.clamp(max=FP16_MAX)
    nearest = clamped.to(torch.float16)
    next_up = (nearest.view(torch.int16) + 1).view(torch.float16)  # positive: next pattern
    scale = torch.where(nearest.float() < clamped, next_up, nearest).float()
    return torch.where(torch.isfinite(magnitude), scale, torch.full_like(scale, math.nan))


def scale_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """1 / scale in fp32, or 0 for a zero or NaN scale (an all-zero group encodes to codes 0,
    not to NaN from 0 * inf; a NaN group's codes do not matter)."""
    positive = scale > 0
    safe = torch.where(positive, scale, torch.ones_like(scale))
    return torch.where(positive, _ONE / safe, torch.zeros_like(scale))


# ---------------------------------------------------------------------------------------------
# Codecs on groups: values [groups, 32] fp32 -> codes [groups, 32] (integer-valued fp32) and
# scales [groups, 1] fp32 (values representable in fp16). A partial last group is padded with
# zeros by the callers below; zeros change neither a group's absmax nor its max.

def _magnitude_bits(values: torch.Tensor) -> torch.Tensor:
    return values.view(torch.int32).long() & 0x7FFFFFFF


def encode_moment_groups(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First moments: s = absmax rounded up to fp16, q = round(127 * 2x / (1 + |x|)), x = m/s.

    A group holding inf or NaN gets the NaN scale (its absmax is found on the fp32 bit
    patterns, where inf and NaN sort above every finite value)."""
    largest = _magnitude_bits(values).amax(dim=1, keepdim=True)
    absmax = largest.int().view(torch.float32)
    scale = fp16_scale_at_least(absmax)
    x = values * scale_reciprocal(scale)
    code = (2.0 * MOMENT_CODE_MAX) * x / (_ONE + x.abs())
    return torch.round(clamp_like_c(code, -MOMENT_CODE_MAX, MOMENT_CODE_MAX)), scale


def decode_moment_groups(code: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """m = q / (254 - |q|) * s  (z / (2 - |z|) with z = q / 127, one division)."""
    return code / (2.0 * MOMENT_CODE_MAX - code.abs()) * scale


def encode_second_moment_groups(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Second moments: s = max sqrt(v) rounded up to fp16, q = round(255 * sqrt(v) / s).

    A group holding inf, NaN or a negative value (not -0.0) gets the NaN scale."""
    bits = values.view(torch.int32).long() & 0xFFFFFFFF
    negative = (bits > 0x80000000).any(dim=1, keepdim=True)
    largest = (bits & 0x7FFFFFFF).amax(dim=1, keepdim=True)
    poisoned = negative | (largest >= 0x7F800000)
    root_of_max = sqrt32(largest.int().view(torch.float32))
    scale = fp16_scale_at_least(root_of_max)
    scale = torch.where(poisoned, torch.full_like(scale, math.nan), scale)
    # sqrtf(v) * (1 / s), then the product with 255 rounded to fp32 on its own.
    code = (sqrt32(values) * scale_reciprocal(scale)) * SECOND_MOMENT_CODE_MAX
    return torch.round(clamp_like_c(code, 0.0, SECOND_MOMENT_CODE_MAX)), scale


def decode_second_moment_groups(code: torch.Tensor, scale: torch.Tensor,
                                code_zero_as: float = 0.0) -> torch.Tensor:
    """v = min(q * (s / 255), s)^2, with code 0 decoded as if it were `code_zero_as`:
    0.0 is the plain decode (the stored moving average), 0.5 the denominator floor (the top of
    code 0's interval, decode_second_moment_for_denominator). The root is capped at s because
    q * (s / 255) can round an ulp above s at q = 255, which would make decode -> encode grow
    the scale; a NaN scale stays NaN (the comparison is false)."""
    q = code.clamp(min=code_zero_as) if code_zero_as > 0 else code
    root = q * (scale * _INV_SECOND_MOMENT_CODE_MAX)
    root = torch.where(root < scale, root, scale)
    return root * root


# ---------------------------------------------------------------------------------------------
# Codecs on tensors of any shape, in the stored format: codes (int8 / uint8, the values' shape)
# and scales (fp16, one per group of 32 consecutive elements of a row of the last dimension,
# shaped `group_shape`).

DEFAULT_MIN_8BIT_SIZE = 4096


def num_groups(numel: int) -> int:
    return (numel + GROUP_SIZE - 1) // GROUP_SIZE


def group_shape(shape: torch.Size) -> torch.Size:
    """The scales' shape of state shaped `shape`: the last dimension d becomes ceil(d / 32);
    a tensor of fewer than two dimensions is one row."""
    if len(shape) >= 2:
        return torch.Size([*shape[:-1], num_groups(shape[-1])])
    return torch.Size([num_groups(math.prod(shape))])


def keeps_8bit_state(param: torch.Tensor, min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE) -> bool:
    """Whether state_bits=8 gives `param` 8-bit moments: two or more dimensions, at least
    min_8bit_size elements, real, and rows of the last dimension d for which a moment's 8-bit
    page bytes (a 32-byte code slot and a 2-byte scale per group of the row) are below fp32's
    4 bytes an element."""
    if param.dim() < 2 or param.numel() < min_8bit_size or param.is_complex():
        return False
    row = param.shape[-1]
    return row > 0 and num_groups(row) * (GROUP_SIZE + 2) < 4 * row


def _rows(shape: torch.Size) -> tuple[int, int]:
    """(rows, row length) of a tensor shaped `shape`."""
    if len(shape) >= 2:
        return math.prod(shape[:-1]), int(shape[-1])
    return 1, math.prod(shape)


def _to_groups(values: torch.Tensor) -> torch.Tensor:
    """[groups, 32]: each row of the last dimension padded with zeros to whole groups."""
    rows, length = _rows(values.shape)
    padded = torch.zeros(rows, num_groups(length) * GROUP_SIZE, dtype=torch.float32)
    padded[:, :length] = values.detach().reshape(rows, length).to(torch.float32)
    return padded.view(-1, GROUP_SIZE)


def _from_groups(grouped: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    rows, length = _rows(like.shape)
    return grouped.reshape(rows, -1)[:, :length].reshape(like.shape)


def _group_scales(scales: torch.Tensor) -> torch.Tensor:
    return scales.reshape(-1).float().view(-1, 1)


def encode_moment(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = encode_moment_groups(_to_groups(values))
    return (_from_groups(codes, values).to(torch.int8),
            scales.view(group_shape(values.shape)).to(torch.float16))


def decode_moment(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    decoded = decode_moment_groups(_to_groups(codes), _group_scales(scales))
    return _from_groups(decoded, codes)


def encode_second_moment(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales = encode_second_moment_groups(_to_groups(values))
    return (_from_groups(codes, values).to(torch.uint8),
            scales.view(group_shape(values.shape)).to(torch.float16))


def decode_second_moment(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    decoded = decode_second_moment_groups(_to_groups(codes), _group_scales(scales))
    return _from_groups(decoded, codes)


def decode_second_moment_for_denominator(codes: torch.Tensor, scales: torch.Tensor
                                         ) -> torch.Tensor:
    """As decode_second_moment, but code 0 decodes to (0.5 / 255 * s)^2: AdamW's denominator
    floor (docs/compression.md, "The known failure")."""
    decoded = decode_second_moment_groups(_to_groups(codes), _group_scales(scales), 0.5)
    return _from_groups(decoded, codes)


# ---------------------------------------------------------------------------------------------
# Master split: fp32 master w <-> 16-bit parameter w' = rne(w) and residual
#   r = round(clamp((w - w') / (u / 2), -1, 1) * K),   w = w' + r / K * u / 2
# with u the 16-bit spacing next to w' on the side of w (finer below a power of two).

def _uint16_to_int16(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)


def _split_bf16(master: torch.Tensor, k: float) -> tuple[torch.Tensor, torch.Tensor]:
    bits = master.view(torch.int32).long() & 0xFFFFFFFF
    rounded = master.to(torch.bfloat16)
    rounded_bits = rounded.view(torch.int16).long() & 0xFFFF
    rounded_magnitude = (rounded_bits << 16) & 0x7FFFFFFF
    # fp32's spacing changes at the same binades as bf16's, so the difference of the
    # magnitudes' fp32 patterns is (|w| - |w'|) in fp32 steps, and u / 2 is 2^15 of them.
    offset = (bits & 0x7FFFFFFF) - rounded_magnitude
    ratio = offset.float() * (1.0 / 32768.0)  # exact
    ratio = torch.where(bits >= 0x80000000, -ratio, ratio)  # towards larger value
    ratio = clamp_like_c(ratio, -1.0, 1.0)
    code = torch.round(ratio * k)  # the product rounded to fp32 first, as the header pins it
    finite = rounded_magnitude < 0x7F800000
    return rounded, torch.where(finite, code, torch.zeros_like(code))


def _join_bf16(param: torch.Tensor, residual: torch.Tensor, k: float) -> torch.Tensor:
    bits = param.view(torch.int16).long() << 16 & 0xFFFFFFFF
    negative = bits >= 0x80000000
    magnitude = bits & 0x7FFFFFFF
    steps_per_code = f32(32768.0) / f32(k)  # the header's fp32 constant
    steps = torch.round(residual.float() * steps_per_code)  # fp32 steps on w's side
    steps = torch.where(negative, -steps, steps)  # as a change of magnitude
    rebuilt = (magnitude + steps.long()).clamp(min=0)
    rebuilt_bits = torch.where(magnitude < 0x7F800000, rebuilt | (bits & 0x80000000), bits)
    return torch.where(rebuilt_bits >= 0x80000000, rebuilt_bits - (1 << 32),
                       rebuilt_bits).int().view(torch.float32)


def _fp16_half_spacing(param_bits: torch.Tensor, toward_zero: torch.Tensor) -> torch.Tensor:
    """Half the fp16 spacing next to |w'| on the given side, as fp32 (a power of two)."""
    exponent = (param_bits >> 10) & 0x1F
    mantissa = param_bits & 0x3FF
    binade = exponent.clamp(min=1)  # subnormals share the lowest binade's spacing
    finer = toward_zero & (mantissa == 0) & (exponent > 1)
    return torch.pow(2.0, (binade - 26 - finer.long()).double()).float()


def _split_fp16(master: torch.Tensor, k: float) -> tuple[torch.Tensor, torch.Tensor]:
    rounded = master.to(torch.float16)
    rounded_value = rounded.float()
    difference = master - rounded_value  # exact (Sterbenz, or w' = 0)
    toward_zero = torch.signbit(difference) != torch.signbit(rounded_value)
    param_bits = rounded.view(torch.int16).long() & 0xFFFF
    ratio = difference / _fp16_half_spacing(param_bits, toward_zero)  # exact: a power of two
    code = torch.round(clamp_like_c(ratio, -1.0, 1.0) * k)
    finite = torch.isfinite(rounded)
    return rounded, torch.where(finite, code, torch.zeros_like(code))


def _join_fp16(param: torch.Tensor, residual: torch.Tensor, k: float) -> torch.Tensor:
    rounded_value = param.float()
    param_bits = param.view(torch.int16).long() & 0xFFFF
    toward_zero = (residual < 0) != torch.signbit(rounded_value)
    correction = (residual.float() * (f32(1.0) / f32(k))) * _fp16_half_spacing(param_bits,
                                                                               toward_zero)
    rebuilt = rounded_value + correction
    keep = ~torch.isfinite(rounded_value) | (residual == 0)  # r = 0 keeps a -0 parameter
    return torch.where(keep, rounded_value, rebuilt)


def split_master(master: torch.Tensor, dtype: torch.dtype, master_bits: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (16-bit parameter of `dtype`, int8 / int16 residual)."""
    k = RESIDUAL_SCALE[master_bits]
    master = master.detach().to(torch.float32).contiguous()
    split = _split_bf16 if dtype == torch.bfloat16 else _split_fp16
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the master split is for bfloat16 / float16 params, not {dtype}")
    param, code = split(master, k)
    return param, code.to(RESIDUAL_DTYPE[master_bits])


def join_master(param: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """(16-bit parameter, residual) -> the fp32 master weight."""
    master_bits = 24 if residual.dtype == torch.int8 else 32
    k = RESIDUAL_SCALE[master_bits]
    param = param.detach().contiguous()
    residual = residual.reshape(param.shape)
    join = _join_bf16 if param.dtype == torch.bfloat16 else _join_fp16
    return join(param, residual, k)


# ---------------------------------------------------------------------------------------------
# Per-element update rules (update_rules.h), on fp32 tensors. Each returns the new values.

def lerp(start: torch.Tensor, end: torch.Tensor, weight: float) -> torch.Tensor:
    """torch's lerp as ATen's vector path computes it: one fma, stable on both halves."""
    w = f32(weight)
    if weight < 0.5:
        return fma32(w, end - start, start)
    return fma32(w - _ONE, end - start, end)


def power_of(base: float, exponent: int) -> float:
    """beta**step by repeated squaring, the sequence of double multiplications the kernels
    use on both backends (codec/update_rules.h power_of)."""
    result = 1.0
    exponent = int(exponent)
    while exponent > 0:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return result


def adamw_update(param, grad, m, v, v_denominator, v_max, v_max_denominator, *, lr, beta1,
                 beta2, eps, weight_decay, step, maximize, amsgrad):
    """One AdamW element update; v_denominator / v_max_denominator are the previous v / v_max
    as the denominator sees them (the floored decode for 8-bit state, the state itself for
    fp32 state). Returns (param, m, v, v_max)."""
    decay = f32(1.0 - lr * weight_decay)
    # torch's lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps), multiplied through by sqrt(bc2) as
    # codec/update_rules.h does (one division per element).
    bias_correction2_sqrt = math.sqrt(1.0 - power_of(beta2, step))
    neg_scaled_step = f32(-lr / (1.0 - power_of(beta1, step)) * bias_correction2_sqrt)
    scaled_eps = f32(eps * bias_correction2_sqrt)
    grad = -grad if maximize else grad
    param = param * decay
    m = lerp(m, grad, 1.0 - beta1)
    grad_term = f32(1.0 - beta2) * grad
    v_new = fma32(grad_term, grad, v * f32(beta2))
    second_moment = fma32(grad_term, grad, v_denominator * f32(beta2))
    if amsgrad:
        v_max = torch.where(v_max > v_new, v_max, v_new)
        second_moment = torch.where(v_max_denominator > second_moment, v_max_denominator,
                                    second_moment)
    param = param + (neg_scaled_step * m) / (sqrt32(second_moment) + scaled_eps)
    return param, m, v_new, v_max


def sgd_update(param, grad, buffer, *, lr, momentum, dampening, weight_decay, nesterov,
               maximize, first_step):
    """One SGD element update; buffer is None without momentum. Returns (param, buffer)."""
    grad = -grad if maximize else grad
    if weight_decay != 0.0:
        grad = fma32(param, f32(weight_decay), grad)
    if buffer is not None:
        if first_step:
            buffer = grad.clone()
        else:
            buffer = fma32(grad, f32(1.0 - dampening), buffer * f32(momentum))
        grad = fma32(buffer, f32(momentum), grad) if nesterov else buffer
    return fma32(grad, -f32(lr), param), buffer


def lion_update(param, grad, m, *, lr, beta1, beta2, weight_decay, maximize):
    """One Lion element update. Returns (param, m)."""
    grad = -grad if maximize else grad
    param = param * f32(1.0 - lr * weight_decay)
    interpolated = fma32(grad, f32(1.0 - beta1), m * f32(beta1))
    sign = (interpolated > 0).float() - (interpolated < 0).float()  # sign(NaN) = 0, as in C++
    param = fma32(sign, -f32(lr), param)
    m = fma32(grad, f32(1.0 - beta2), m * f32(beta2))
    return param, m


# ---------------------------------------------------------------------------------------------
# Whole-parameter steps on a state dict in the optimizers' format.

_SECOND_MOMENTS = {"exp_avg_sq", "max_exp_avg_sq"}


def init_state(param: torch.Tensor, moments: list[str], state_bits: int = 8,
               master_bits: Optional[int] = 24,
               min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE) -> dict[str, torch.Tensor]:
    """The state a parameter's pages start with: zero codes and scales (or zero fp32 moments:
    state_bits=32, or a param that keeps_8bit_state says keeps fp32 moments), a zero
    residual (the master is the 16-bit weight), step 0."""
    state: dict[str, torch.Tensor] = {"step": torch.tensor(0.0)}
    for name in moments:
        if state_bits == 32 or not keeps_8bit_state(param, min_8bit_size):
            state[name] = torch.zeros(param.shape, dtype=torch.float32)
        else:
            codes = torch.uint8 if name in _SECOND_MOMENTS else torch.int8
            state[f"{name}_codes"] = torch.zeros(param.shape, dtype=codes)
            state[f"{name}_scales"] = torch.zeros(group_shape(param.shape),
                                                  dtype=torch.float16)
    if master_bits is not None and param.dtype in (torch.bfloat16, torch.float16):
        state[RESIDUAL] = torch.zeros(param.shape, dtype=RESIDUAL_DTYPE[master_bits])
    return state


def _load_moment(state: dict, name: str, floor: bool = False) -> torch.Tensor:
    if name in state:
        return state[name].float()
    codes, scales = state[f"{name}_codes"], state[f"{name}_scales"]
    if name not in _SECOND_MOMENTS:
        return decode_moment(codes, scales)
    if floor:
        return decode_second_moment_for_denominator(codes, scales)
    return decode_second_moment(codes, scales)


def _store_moment(state: dict, name: str, value: torch.Tensor) -> None:
    if name in state:
        state[name] = value
        return
    encode = encode_second_moment if name in _SECOND_MOMENTS else encode_moment
    state[f"{name}_codes"], state[f"{name}_scales"] = encode(value)


def _load_param(param: torch.Tensor, state: dict) -> torch.Tensor:
    if RESIDUAL in state:
        return join_master(param, state[RESIDUAL])
    return param.detach().float()


def _store_param(param: torch.Tensor, state: dict, value: torch.Tensor) -> None:
    if RESIDUAL in state:
        master_bits = 24 if state[RESIDUAL].dtype == torch.int8 else 32
        rounded, state[RESIDUAL] = split_master(value, param.dtype, master_bits)
        param.copy_(rounded)
    else:
        param.copy_(value.to(param.dtype))


@torch.no_grad()
def adamw_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float,
               betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, amsgrad: bool = False, maximize: bool = False,
               v_floor: bool = True) -> None:
    """One AdamW step of `param` (updated in place) and `state` (init_state's format).

    v_floor=False decodes code 0 of v as 0 in the denominator: the format's known failure,
    which the native kernels never do (kept here to measure it)."""
    state["step"] = state["step"] + 1
    floor = v_floor and "exp_avg_sq" not in state  # the floor is for 8-bit state only
    m = _load_moment(state, "exp_avg")
    v = _load_moment(state, "exp_avg_sq")
    v_den = _load_moment(state, "exp_avg_sq", floor)
    v_max = v_max_den = None
    if amsgrad:
        v_max = _load_moment(state, "max_exp_avg_sq")
        v_max_den = _load_moment(state, "max_exp_avg_sq", floor)
    new_param, m, v, v_max = adamw_update(
        _load_param(param, state), grad.float(), m, v, v_den, v_max, v_max_den, lr=lr,
        beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay,
        step=int(state["step"].item()), maximize=maximize, amsgrad=amsgrad)
    _store_param(param, state, new_param)
    _store_moment(state, "exp_avg", m)
    _store_moment(state, "exp_avg_sq", v)
    if amsgrad:
        _store_moment(state, "max_exp_avg_sq", v_max)


@torch.no_grad()
def sgd_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float,
             momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
             nesterov: bool = False, maximize: bool = False) -> None:
    first_step = float(state["step"]) == 0.0
    state["step"] = state["step"] + 1
    buffer = _load_moment(state, "momentum_buffer") if momentum != 0.0 else None
    new_param, buffer = sgd_update(
        _load_param(param, state), grad.float(), buffer, lr=lr, momentum=momentum,
        dampening=dampening, weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
        first_step=first_step)
    _store_param(param, state, new_param)
    if buffer is not None:
        _store_moment(state, "momentum_buffer", buffer)


@torch.no_grad()
def lion_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float,
              betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
              maximize: bool = False) -> None:
    state["step"] = state["step"] + 1
    new_param, m = lion_update(
        _load_param(param, state), grad.float(), _load_moment(state, "exp_avg"), lr=lr,
        beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, maximize=maximize)
    _store_param(param, state, new_param)
    _store_moment(state, "exp_avg", m)


class ReferenceAdamW(torch.optim.Optimizer):
    """AdamW on the reference 8-bit state, as a torch optimizer (slow; for measurements).

    `v_floor=False` is the variant the native optimizer does not offer: code 0 of v decodes to
    0 in the denominator. `min_8bit_size` as the optimizers' (keeps_8bit_state)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, state_bits: int = 8,
                 master_bits: Optional[int] = 24, v_floor: bool = True,
                 min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_bits, self.master_bits, self.v_floor = state_bits, master_bits, v_floor
        self.min_8bit_size = min_8bit_size

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self.state[p] = init_state(p, ["exp_avg", "exp_avg_sq"], self.state_bits,
                                               self.master_bits, self.min_8bit_size)
                adamw_step(p, p.grad, self.state[p], lr=float(group["lr"]),
                           betas=group["betas"], eps=group["eps"],
                           weight_decay=group["weight_decay"], v_floor=self.v_floor)
        return loss
