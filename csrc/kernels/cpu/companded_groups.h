// Hand-vectorized full groups of the 8-bit (companded) step kernels, for AVX2 and AVX-512.
//
// GCC vectorizes the generic group loops of step_kernels_isa.cpp, but keeps a group's
// decoded moments in stack arrays between its loops, evaluates both sides of every select,
// and does the per-group scale work (fp16 conversions, rounding a scale up) in portable
// integer code: about 21 instructions and 6.5 cycles per element on AVX-512, three times the
// arithmetic the step needs. Here a batch of groups (kBatchGroups) goes through three phases:
//   1. decode, update and store the parameters, keeping the new moments in a stack buffer and
//      each group's scale key (its largest magnitude);
//   2. turn the batch's keys into fp16 scales and their reciprocals, a vector of groups at a
//      time, with the F16C conversions (rounding up is one conversion);
//   3. encode the buffered moments.
// A group's encode waits on its scale, which waits on all of its elements. Done a group at a
// time (kept in registers, scales in scalar code) that chain stalls the core; in batches
// the independent groups overlap: 2.43 against 2.85 cycles per element in cache for fp32
// params on AVX-512, 2.78 against 3.51 on AVX2 (same run, interleaved, Zen 4).
// Out of cache the batches are a pipeline (pipeline_batches): a batch's phase 3 runs
// interleaved with the next batch's phase 1, and phase 1 prefetches every stream
// kPrefetchGroups ahead. Phase 3 has no loads of its own, and with the phases in sequence the
// memory idled through it while the update's loads waited on it. On the Intel Xeon (single
// thread, 64M params, ns per element) 8-bit AdamW on fp32 params went 1.20 -> 0.91, with
// bf16 params and master_bits=24 1.25 -> 1.19-1.22, Lion and SGD on bf16 masters 1.73 -> 0.85
// and 1.64 -> 0.77; in cache (1M params) from 20% faster (Lion, fp32 params) to 1% slower
// (AdamW, bf16 masters).
//
// The step issues more operations than the core retires per cycle long before the divider
// runs out (on Zen 3, replacing an encode's division or square root by a refined hardware
// estimate plus the check that its code is the exact one made the step slower, and so did a
// table gather for the decode), so what is left is to issue fewer:
//   - a group's codes and 8-bit residuals are stored with one set of packs for the group
//     (Ops::store_32_8bit), a quarter of the shuffles of per-vector stores on AVX2;
//   - a group whose scale bounds it encodes without the clamps (scale_bounds_its_group);
//   - AdamW's second-moment key is the unmasked pattern of sqrt(v) (ScaleKey);
//   - the bf16 master split takes a shorter integer form when the group's masters all round
//     to finite bf16 values (Bf16MasterParams::store_params).
// Together, in cache on Zen 3 (AVX2, interleaved in one process): fp32 params 1.27 -> 1.15
// ns per element, bf16 with the 8-bit residual 2.58 -> 1.68. Then, on another Zen 3 VM
// (single thread, 1M elements, builds run in turn, three pairs each):
//   - AdamW takes one square root of the new v for both its denominator and v's encode
//     (a group with a zero v code takes a second, see adamw_groups);
//   - on AVX2, bf16 masters are joined and split outside the update loop
//     (Bf16MasterParams::kStageMasters).
// fp32 params 1.45 -> 1.20 ns per element, bf16 with the 8-bit residual 2.12 -> 1.72.
// Then (a fourth Zen 3 VM, same measure, four triples): on AVX2, a short join for groups
// whose parameters are all finite and nonzero (join_finite_nonzero, in the staging pass);
// and on both ISAs, one sign transfer for the split's residual (psignd on AVX2) and 16-bit
// stores a group at a time. bf16 with the 8-bit residual went from 1.71-1.84 to 1.56-1.71
// ns per element.
// On an Intel Xeon with AVX-512 (2026-12-04) it is the other way round: AVX-512 ran no faster
// than AVX2 there, because a 16-lane division or square root takes the divider twice as long
// as an 8-lane one. There AdamW on AVX-512 reads the moment decode from a table
// (MomentDecoder): fp32 params 1.09 -> 1.01 ns per element (single thread, 1M elements).
//
// Every lane evaluates exactly the scalar expressions of codec/companding.h,
// codec/update_rules.h and codec/master_split.h, in the same order, with the same IEEE
// operations (simd.h says why min, max and the rounding match), so a group's bytes equal the
// generic kernel's, and so the CUDA kernels' and reference.py's: the ISA tests compare them
// byte for byte (tests/cpp/kernels/test_isa_kernels.cpp). Partial groups and the variants
// without a vector form (amsgrad, fp16 params) take the generic loops.
#pragma once

#include "kernels/cpu/simd.h"

#if defined(PO_SIMD_GROUPS)

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/element_access.h"
#include "pagedoptim/codec/companding.h"
#include "pagedoptim/codec/update_rules.h"

namespace pagedoptim::kernels::PO_CPU_ISA::simd {

// Inlined whatever GCC's size heuristics say, for two reasons:
//   - a kernel's lambdas: GCC keeps a large one out of line, and in there it reads every local
//     the lambda captures by reference from memory again after each store that may alias it
//     (an int8 store may alias anything): 8-bit AdamW on 1M fp32 params took 1.02 ns per
//     element that way, against 0.89 inlined (Intel Xeon, AVX-512, single thread);
//   - the prefetches: GCC counts a function that only prefetches as free of side effects, and
//     deletes a call to it that it did not inline.
#define PO_FORCE_INLINE __attribute__((always_inline))

using F = Ops::F;
using I = Ops::I;
using M = Ops::M;
constexpr int kLanes = Ops::kLanes;
constexpr int kVectorsPerGroup = kGroupSize / kLanes;
static_assert(kGroupSize % kLanes == 0, "a group is a whole number of vectors");

// ---------------------------------------------------------------------------------------------
// Group scales, a vector of groups at a time, with the F16C conversions (the scalar codec
// converts in integer code so that nvcc and every ISA share it; these give the same values).

// Groups per batch (see the top of this file). Longer batches spread each batch's fixed work
// (its scales, a vector of groups at a time, and the turns between the phases) over more
// groups. On an Intel Xeon with AVX-512, single thread, 64M params, ns per element:
//   fp32 params: 1.25 (16 groups), 1.17 (32), 1.16 (64), 1.19 (128); in cache 1.02 -> 0.93;
//   bf16 + 8-bit residual: 1.41, 1.35, 1.33, 1.25-1.30; in cache 1.37-1.42 -> 1.28;
// and two threads, compressed_throughput.py: 1.53-1.56 -> 1.58-1.62 Gparam/s (fp32), 1.39-1.40
// -> 1.50-1.52 (bf16). AVX2 stays at 16: on that machine 32 and 64 made its staged bf16 step
// slower (1.54-1.57 -> 1.64-1.74) and 128 faster (1.48-1.51), a shape too uneven to carry
// over to the AVX2-only Zen 3 machines this was tuned on without measuring there.
constexpr int kBatchGroups = kLanes == 16 ? 128 : 16;
static_assert(kBatchGroups % kLanes == 0, "a batch's scales are whole vectors");

// fp16 -> fp32 (exact in hardware too) of `groups` <= kBatchGroups scales. A signalling-NaN
// pattern comes back quieted here and as it is from the portable conversion; a scale is only
// ever an operand of arithmetic and comparisons, which quiet it the same way, so the bits the
// kernels store do not differ.
inline void decode_scales(const uint16_t* scales, int groups, float* PO_RESTRICT decoded) {
  alignas(64) uint16_t padded[kBatchGroups] = {};
  std::memcpy(padded, scales, sizeof(uint16_t) * size_t(groups));
  for (int g = 0; g < kBatchGroups; g += kLanes) Ops::store(decoded + g, Ops::load_fp16(padded + g));
}

// codec::fp16_scale_at_least of non-negative magnitudes whose patterns are `bits`: NaN for
// inf and NaN, 65504 above it, else rounded up to the next fp16 (one conversion).
inline I scale_at_least(I bits, F magnitude) {
  const I rounded = Ops::fp16_rounded_up(magnitude);
  const I saturated = Ops::select_int(Ops::greater_int(bits, Ops::splat_int(codec::kFp16MaxAsFloatBits)),
                                      Ops::splat_int(codec::kScaleSaturated), rounded);
  return Ops::select_int(Ops::less_unsigned(bits, Ops::splat_int(0x7f800000u)), saturated,
                         Ops::splat_int(codec::kScaleNaN));
}

// A batch's new scales from its keys, the largest magnitude patterns of its groups (first
// moments: codec::moment_order_bits; second moments: the patterns of sqrt(v), see ScaleKey),
// as fp16 patterns and as codec::scale_reciprocal of their values.
inline void scales_from_keys(const uint32_t* PO_RESTRICT keys, int groups,
                             uint16_t* PO_RESTRICT scales, float* PO_RESTRICT inverses) {
  alignas(64) uint32_t patterns[kBatchGroups];
  for (int g = 0; g < kBatchGroups; g += kLanes) {
    I key;
    std::memcpy(&key, keys + g, sizeof(key));
    const I pattern = scale_at_least(key, Ops::from_bits(key));
    std::memcpy(patterns + g, &pattern, sizeof(pattern));
  }
  alignas(64) uint16_t narrow[kBatchGroups];
  for (int g = 0; g < kBatchGroups; ++g) narrow[g] = uint16_t(patterns[g]);
  std::memcpy(scales, narrow, sizeof(uint16_t) * size_t(groups));
  for (int g = 0; g < kBatchGroups; g += kLanes) {
    const F value = Ops::load_fp16(narrow + g);
    // codec::scale_reciprocal: 0 for a zero or NaN scale.
    Ops::store(inverses + g, Ops::select(Ops::greater(value, Ops::splat(0.0f)),
                                         Ops::div(Ops::splat(1.0f), value), Ops::splat(0.0f)));
  }
}

// The vectors of one group.
using GroupF = F[kVectorsPerGroup];
using GroupI = I[kVectorsPerGroup];

// ---------------------------------------------------------------------------------------------
// Codes of one vector of a group.

// codec::decode_moment under a scale of 1 (exact) for the codes 0..127, and the magnitude of
// -128's: the codec's own decode, evaluated by the compiler. It must be constant: this header
// is compiled once per ISA, and a table built by a constructor would run, vectorized for that
// ISA, when the library loads, on whatever CPU loads it (an AVX-512 constructor killed
// `import pagedoptim` with SIGILL on every CPU without AVX-512). scripts/check_isa_objects.py
// holds every ISA translation unit to that.
struct MomentMagnitudes {
  alignas(64) float entries[128];
  float of_minus_128;
};
constexpr MomentMagnitudes moment_magnitudes() {
  MomentMagnitudes magnitudes{};
  for (int q = 0; q < 128; ++q) magnitudes.entries[q] = codec::decode_moment(int8_t(q), 1.0f);
  magnitudes.of_minus_128 = -codec::decode_moment(int8_t(-128), 1.0f);
  return magnitudes;
}
inline constexpr MomentMagnitudes kMomentMagnitudes = moment_magnitudes();

// codec::decode_moment of a vector of codes.
// Where a 128-entry table fits in registers (AVX-512), the division is a lookup: Intel's
// divider takes as long for 16 lanes as for 8 (a vdivps zmm every ~10 cycles), and with three
// divisions and a square root per vector it bounds AdamW's step there; replacing one by a
// wrong multiply as an experiment took 1.10 -> 0.95 ns per element. The bits are the same:
// IEEE division is symmetric in sign, so q / (254 - |q|) is the entry of |q| with q's sign,
// and -128 (never written, but a loaded state may hold it) is 128 / 126 negated.
// Only AdamW's kernel looks up (kLookup), and not on bf16 masters:
//   - Lion's and SGD's updates divide nowhere else, the divider does not bound them, and
//     there the lookup's extra operations cost more than the division they replace (Lion,
//     fp32 params: 0.70 -> 0.74 ns per element);
//   - the bf16 master join and split need the registers the table would take. Staging the
//     masters to make room (as AVX2 does) was 3% faster in cache but slower at 64M params,
//     where loads spread across the update pay: 1.41 ns per element without the table,
//     1.45 staged with it, 1.51 in the loop with it (single thread, Intel).
template <bool kLookup>
class MomentDecoder {
 public:
  // Copied into the decoder, a local of the kernel: read from the global, they would be
  // reloaded after every int8 store (which may alias anything as far as GCC knows).
  MomentDecoder()
      : table_(kMomentMagnitudes.entries), minus_128_(Ops::splat(kMomentMagnitudes.of_minus_128)) {}
  // A template so that the branch not taken is not compiled against the other ISA's Ops.
  template <class O = Ops>
  inline F operator()(const int8_t* codes, F scale) const {
    const I q = O::load_i8(codes);
    if constexpr (kLookup) {
      static_assert(O::kHasTable128, "a lookup needs the ISA's table");
      const I magnitude = O::abs_int(q);
      F value = O::lookup(table_, magnitude);
      value = O::select(O::equal_int(magnitude, O::splat_int(128)),
                        minus_128_, value);
      value = O::from_bits(O::or_(O::bits(value), O::and_(q, O::splat_int(0x80000000u))));
      return O::mul(value, scale);
    } else {
      const F value = O::to_float(q);
      return O::mul(
          O::div(value, O::sub(O::splat(2.0f * codec::kMomentCodeMax), O::abs(value))), scale);
    }
  }

 private:
  Ops::Table128 table_;
  F minus_128_;  // -128's decoded magnitude
};

// Encoding under a scale this step computed from the group's own values: the clamps of
// codec::encode_moment and encode_second_moment bind only where the scale does not bound
// them -- a saturated scale (65504 below a larger value) or a NaN one. Under any other, every
// value is finite and no larger than the scale, so |x| = |value * (1 / scale)| <= 1 + 2^-23
// after both roundings, 254 x / (1 + |x|) and sqrt(v) * (1 / scale) * 255 stay below 127.5
// and 255.5 (and sqrt(v) >= 0), and the clamped and unclamped values round to the same code.
inline bool scale_bounds_its_group(uint16_t scale) { return scale < codec::kScaleSaturated; }

// codec::encode_moment, as codes in 32-bit lanes.
template <bool kClamp>
inline I encode_moments(F values, F inverse_scale) {
  const F x = Ops::mul(values, inverse_scale);
  F code = Ops::div(Ops::mul(Ops::splat(2.0f * codec::kMomentCodeMax), x),
                    Ops::add(Ops::splat(1.0f), Ops::abs(x)));
  if constexpr (kClamp) {
    code = Ops::min(code, Ops::splat(codec::kMomentCodeMax));
    code = Ops::max(code, Ops::splat(-codec::kMomentCodeMax));
  }
  return Ops::round_to_int(code);
}

// codec::encode_second_moment, as codes in 32-bit lanes, of the second moments' square roots
// (the update computes them, see adamw_groups).
template <bool kClamp>
inline I encode_second_moments(F roots, F inverse_scale) {
  F code = Ops::mul(Ops::mul(roots, inverse_scale), Ops::splat(codec::kSecondMomentCodeMax));
  if constexpr (kClamp) {
    code = Ops::min(code, Ops::splat(codec::kSecondMomentCodeMax));
    code = Ops::max(code, Ops::splat(0.0f));
  }
  return Ops::round_to_int(code);
}

// A group's codes under the scale `scale` (this step's) with reciprocal `inverse`.
template <class Encode>
inline void encode_group(const float* values, uint16_t scale, float inverse, GroupI& codes) {
  const F inv = Ops::splat(inverse);
  if (scale_bounds_its_group(scale)) {
    for (int k = 0; k < kVectorsPerGroup; ++k) {
      codes[k] = Encode::template apply<false>(Ops::load(values + k * kLanes), inv);
    }
  } else {
    for (int k = 0; k < kVectorsPerGroup; ++k) {
      codes[k] = Encode::template apply<true>(Ops::load(values + k * kLanes), inv);
    }
  }
}
struct EncodeMoments {
  template <bool kClamp>
  static inline I apply(F values, F inverse) { return encode_moments<kClamp>(values, inverse); }
};
struct EncodeSecondMoments {
  template <bool kClamp>
  static inline I apply(F values, F inverse) {
    return encode_second_moments<kClamp>(values, inverse);
  }
};

// Whether a group's 8-bit codes include a zero (AVX2's byte compare, which AVX-512 machines
// have too).
static_assert(kGroupSize == 32, "a group's codes are one 256-bit load");
inline bool group_has_zero_code(const uint8_t* codes) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  return _mm256_movemask_epi8(_mm256_cmpeq_epi8(bytes, _mm256_setzero_si256())) != 0;
}

// The running key of a group's scale, a lane at a time, and its maximum. kNonNegativeOrNaN:
// the values are +0 or more, or NaN, so their patterns need no mask.
//   First moments: codec::moment_order_bits, the magnitude's pattern.
//   AdamW's new second moments: the pattern of sqrt(v). The codec's key is v's own
//     (second_moment_order_bits) and its scale that of sqrt(largest v); the two agree:
//     - the update never produces a value below -0, nor -0 itself (which the codec's key
//       maps to all ones and to 0): it is fma((1 - beta2) * g, g, v * beta2) with
//       v = root * root >= +0 (or NaN), beta2 >= 0 and (1 - beta2) > 0, a sum of two
//       products that are each +0 or more (or NaN);
//     - a correctly rounded sqrt is monotonic, so the largest root is the root of the
//       largest v, and the patterns of non-negative floats order as their values;
//     - inf and NaN v have roots at or above 0x7f800000 (a negative NaN's pattern too), and
//       keys there give a NaN scale either way.
template <bool kNonNegativeOrNaN>
struct ScaleKey {
  I largest = Ops::splat_int(0);
  inline void add(F values) {
    if constexpr (kNonNegativeOrNaN) {
      largest = Ops::max_unsigned(largest, Ops::bits(values));
    } else {
      largest = Ops::max_unsigned(largest, Ops::and_(Ops::bits(values), Ops::splat_int(0x7fffffffu)));
    }
  }
  inline uint32_t reduce() const { return Ops::reduce_max_unsigned(largest); }
};

// ---------------------------------------------------------------------------------------------
// The batches' software pipeline and its prefetches.

// How far ahead of the group being updated its streams are prefetched into L1, in groups. The
// hardware prefetchers alone left the step waiting on memory: on the Intel Xeon (AVX-512,
// single thread, 8-bit AdamW on fp32 params) a step over 64M params took 1.20 ns per element
// against 0.92 in cache. Prefetching every stream 8 groups ahead took it to 0.99 (0.92-0.93
// with the pipeline below); with the pipeline at a turn of 4 groups, 4 ahead gave 1.00, 8
// gave 0.93-0.95 and 16 gave 0.95.
constexpr int kPrefetchGroups = 8;

// Prefetches the cache lines of a group of kGroupSize elements that starts at `p`.
template <class T>
inline PO_FORCE_INLINE void prefetch_group_of(const T* p) {
  constexpr int kLineBytes = 64;
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int offset = 0; offset < int(sizeof(T)) * kGroupSize; offset += kLineBytes) {
    _mm_prefetch(bytes + offset, _MM_HINT_T0);
  }
}

// Runs a kernel's batches (see the top of this file) as a software pipeline: the encode of a
// batch (phase 3) is interleaved with the update of the next (phase 1), `kTurn` groups of
// each in turn, so that the update's loads keep streaming while the encode computes. Run one
// after the other, memory idled through each encode: 8-bit AdamW on 64M fp32 params took 0.99
// ns per element, 0.91-0.93 pipelined (turn 1; Intel Xeon, AVX-512, single thread,
// prefetched).
//   update_batch(buffer, first, count, after_group): phases 1 and 2 of the batch of `count`
//     groups from group `first`, its moments kept in buffer `buffer` (0 or 1); it calls
//     after_group(b) once group b is updated.
//   encode(buffer, first, b): phase 3 of group b of the batch from group `first`.
// The two never touch the same group, and a batch's encode reads only what its own update
// wrote, so the order of their stores does not matter.
template <int kTurn, class UpdateBatch, class Encode>
inline PO_FORCE_INLINE void pipeline_batches(int64_t groups, const UpdateBatch& update_batch,
                                             const Encode& encode) {
  int64_t pending_first = 0;  // the batch waiting for its encode, `pending` groups long
  int pending = 0;
  int buffer = 0;
  for (int64_t first = 0; first < groups; first += kBatchGroups, buffer ^= 1) {
    const int batch = int(std::min<int64_t>(kBatchGroups, groups - first));
    const auto after_group = [&](int b) PO_FORCE_INLINE {
      if ((b + 1) % kTurn != 0) return;
      for (int e = b + 1 - kTurn; e <= b && e < pending; ++e) encode(buffer ^ 1, pending_first, e);
    };
    update_batch(buffer, first, batch, after_group);
    for (int b = batch / kTurn * kTurn; b < pending; ++b) encode(buffer ^ 1, pending_first, b);
    pending_first = first;
    pending = batch;
  }
  for (int b = 0; b < pending; ++b) encode(buffer ^ 1, pending_first, b);
}

// ---------------------------------------------------------------------------------------------
// Parameters and gradients as fp32 vectors, per storage (the vector forms of element_access.h).

// A kernel steps a batch of groups through `Params::begin_batch`, which returns the object
// that loads and stores the batch's parameters, and `end_batch`, which writes them back.
// Parameters that load and store in place (fp32, plain bf16) are that object themselves;
// Bf16MasterParams stages its masters where registers are short (see there).
template <class Self>
struct InPlaceBatch {
  static constexpr bool kJoinsMasters = false;
  inline Self begin_batch(int64_t, int, float*) const { return static_cast<const Self&>(*this); }
  inline void end_batch(int64_t, int, const float*) const {}
};

struct Fp32Params : InPlaceBatch<Fp32Params> {
  float* PO_RESTRICT param;
  const float* PO_RESTRICT grad;
  Fp32Params(const ParamSpan& span, const MasterResidual&)
      : param(static_cast<float*>(span.param)), grad(static_cast<const float*>(span.grad)) {}
  inline PO_FORCE_INLINE void prefetch_group(int64_t i) const {
    prefetch_group_of(param + i);
    prefetch_group_of(grad + i);
  }
  inline F load_param(int64_t i) const { return Ops::load(param + i); }
  inline F load_grad(int64_t i) const { return Ops::load(grad + i); }
  inline void store_params(int64_t i, const GroupF& values) const {
    for (int k = 0; k < kVectorsPerGroup; ++k) Ops::store(param + i + k * kLanes, values[k]);
  }
};

inline F bf16_to_float(I patterns) { return Ops::from_bits(Ops::shift_left<16>(patterns)); }
inline F load_bf16(const uint16_t* p) { return bf16_to_float(Ops::load_u16(p)); }

// codec::float_to_bf16, as 16-bit patterns in 32-bit lanes.
inline I float_to_bf16(F values) {
  const I bits = Ops::bits(values);
  const M is_nan = Ops::greater_int(Ops::and_(bits, Ops::splat_int(0x7fffffffu)),
                                    Ops::splat_int(0x7f800000u));
  const I rounding_bias = Ops::add_int(
      Ops::splat_int(0x7fffu), Ops::and_(Ops::shift_right<16>(bits), Ops::splat_int(1u)));
  const I rounded = Ops::shift_right<16>(Ops::add_int(bits, rounding_bias));
  const I quieted = Ops::or_(Ops::shift_right<16>(bits), Ops::splat_int(0x40u));
  return Ops::select_int(is_nan, quieted, rounded);
}

struct Bf16Params : InPlaceBatch<Bf16Params> {
  uint16_t* PO_RESTRICT param;
  const uint16_t* PO_RESTRICT grad;
  Bf16Params(const ParamSpan& span, const MasterResidual&)
      : param(static_cast<uint16_t*>(span.param)), grad(static_cast<const uint16_t*>(span.grad)) {}
  inline PO_FORCE_INLINE void prefetch_group(int64_t i) const {
    prefetch_group_of(param + i);
    prefetch_group_of(grad + i);
  }
  inline F load_param(int64_t i) const { return load_bf16(param + i); }
  inline F load_grad(int64_t i) const { return load_bf16(grad + i); }
  inline void store_params(int64_t i, const GroupF& values) const {
    for (int k = 0; k < kVectorsPerGroup; ++k) {
      Ops::store_16bit(param + i + k * kLanes, float_to_bf16(values[k]));
    }
  }
};

// A bf16 parameter plus its master residual (codec::join_master_bf16, split_master_bf16).
//
// The join and the split take about as many operations as the update itself, with constants
// of their own. Inside the update loop they leave AVX2's 16 registers short: its loop for a
// group of 32 was 432 instructions, 91 of them stack loads and stores (objdump of the
// build). So on AVX2 a batch's masters are joined into an L1 buffer in a loop of their own
// (begin_batch), the update reads and writes them there (StagedMasters), and a second loop
// splits them back (end_batch). Each element goes through the same operations either way.
// AVX-512's 32 registers hold the join and the split inside the update loop, where they
// cost no extra loads and stores, so there the batch is the params themselves.
template <class Residual>
struct Bf16MasterParams {
  static constexpr float kScale = codec::ResidualTraits<Residual>::kScale;
  static constexpr bool kStageMasters = Ops::kRegisters < 32;
  static constexpr bool kJoinsMasters = true;
  uint16_t* PO_RESTRICT param;
  Residual* PO_RESTRICT residual;
  const uint16_t* PO_RESTRICT grad;
  Bf16MasterParams(const ParamSpan& span, const MasterResidual& master)
      : param(static_cast<uint16_t*>(span.param)),
        residual(static_cast<Residual*>(master.values)),
        grad(static_cast<const uint16_t*>(span.grad)) {}
  inline PO_FORCE_INLINE void prefetch_group(int64_t i) const {
    prefetch_group_of(param + i);
    prefetch_group_of(residual + i);
    prefetch_group_of(grad + i);
  }

  // The fp32 masters of a batch whose first element is `first`, in `masters`.
  struct StagedMasters {
    float* PO_RESTRICT masters;
    int64_t first;
    const uint16_t* PO_RESTRICT grad;
    inline F load_param(int64_t i) const { return Ops::load(masters + (i - first)); }
    inline F load_grad(int64_t i) const { return load_bf16(grad + i); }
    inline void store_params(int64_t i, const GroupF& values) const {
      for (int k = 0; k < kVectorsPerGroup; ++k) {
        Ops::store(masters + (i - first) + k * kLanes, values[k]);
      }
    }
  };

  // `staging` holds kBatchGroups groups.
  inline auto begin_batch(int64_t first, int groups, float* PO_RESTRICT staging) const {
    if constexpr (kStageMasters) {
      for (int g = 0; g < groups; ++g) {
        const int64_t base = first + int64_t(g) * kGroupSize;
        float* PO_RESTRICT masters = staging + g * kGroupSize;
        if (group_is_finite_nonzero(param + base)) {
          for (int k = 0; k < kVectorsPerGroup; ++k) {
            Ops::store(masters + k * kLanes, join_finite_nonzero(base + k * kLanes));
          }
        } else {
          for (int k = 0; k < kVectorsPerGroup; ++k) {
            Ops::store(masters + k * kLanes, load_param(base + k * kLanes));
          }
        }
      }
      return StagedMasters{staging, first, grad};
    } else {
      return *this;
    }
  }

  inline void end_batch(int64_t first, int groups, const float* PO_RESTRICT staging) const {
    if constexpr (kStageMasters) {
      for (int g = 0; g < groups; ++g) {
        GroupF masters;
        for (int k = 0; k < kVectorsPerGroup; ++k) {
          masters[k] = Ops::load(staging + g * kGroupSize + k * kLanes);
        }
        store_params(first + int64_t(g) * kGroupSize, masters);
      }
    }
  }

  inline F load_grad(int64_t i) const { return load_bf16(grad + i); }

  // codec::join_master_bf16 of one vector.
  inline F load_param(int64_t i) const {
    const I bits = Ops::shift_left<16>(Ops::load_u16(param + i));
    const I sign = Ops::and_(bits, Ops::splat_int(0x80000000u));
    const I magnitude = Ops::and_(bits, Ops::splat_int(0x7fffffffu));
    const F value_steps = Ops::mul(Ops::to_float(load_residual(residual + i)),
                                   Ops::splat(32768.0f / kScale));
    const F magnitude_steps = Ops::from_bits(Ops::xor_(Ops::bits(value_steps), sign));
    I rebuilt = Ops::add_int(magnitude, Ops::round_to_int(magnitude_steps));
    rebuilt = Ops::max_int(rebuilt, Ops::splat_int(0));
    const M finite = Ops::greater_int(Ops::splat_int(0x7f800000u), magnitude);
    return Ops::from_bits(Ops::select_int(finite, Ops::or_(sign, rebuilt), bits));
  }

  // codec::join_master_bf16 of one vector of a group that group_is_finite_nonzero, in fewer
  // operations with the same results. With every magnitude at least 2^16 (bf16's smallest
  // subnormal, as an fp32 pattern) and finite:
  //   - the residual's steps, |round(r * 2^15 / K)| <= 33026, never take a magnitude below
  //     zero, so the clamp does not bind, and sign | (magnitude + d) is the pattern plus d;
  //   - round-half-even is odd, so rounding the steps signed as a change of magnitude is
  //     rounding them and then negating them for a negative parameter (its pattern is
  //     negative as an int32, and never 0).
  inline F join_finite_nonzero(int64_t i) const {
    const I bits = Ops::shift_left<16>(Ops::load_u16(param + i));
    const I steps = Ops::round_to_int(Ops::mul(Ops::to_float(load_residual(residual + i)),
                                               Ops::splat(32768.0f / kScale)));
    return Ops::from_bits(Ops::add_int(bits, Ops::negate_where_negative(steps, bits)));
  }

  // codec::split_master_bf16 of a group. When every master rounds to a finite bf16 (the
  // case training is in) the split takes fewer operations, with the same results:
  //   - bf16 rounding needs no NaN branch, and a finite residual no select;
  //   - a master and its rounding have the same sign bit, so their patterns' difference is
  //     the difference of their magnitudes' (the scalar code's `offset`), and it lies in
  //     [-2^15, 2^15]: the ratio's clamp to [-1, 1] never binds;
  //   - offset * 2^-15 is exact and negation commutes with every rounding here, so the code
  //     is offset, negated for a negative master, times K * 2^-15, rounded (the one master
  //     with pattern 0, +0, has offset 0, as negate_where_negative requires of a lane whose
  //     sign source is 0).
  inline void store_params(int64_t i, const GroupF& masters) const {
    GroupI codes;
    I largest_magnitude = Ops::splat_int(0);
    for (int k = 0; k < kVectorsPerGroup; ++k) {
      largest_magnitude = Ops::max_int(
          largest_magnitude, Ops::and_(Ops::bits(masters[k]), Ops::splat_int(0x7fffffffu)));
    }
    // 0x7f7f8000 and above round to inf (or are inf or NaN).
    if (!Ops::any(Ops::greater_int(largest_magnitude, Ops::splat_int(0x7f7f7fffu)))) {
      GroupI patterns;
      for (int k = 0; k < kVectorsPerGroup; ++k) {
        const I master_bits = Ops::bits(masters[k]);
        const I rounding_bias = Ops::add_int(
            Ops::splat_int(0x7fffu), Ops::and_(Ops::shift_right<16>(master_bits), Ops::splat_int(1u)));
        const I rounded = Ops::and_(Ops::add_int(master_bits, rounding_bias),
                                    Ops::splat_int(0xffff0000u));
        const I offset =
            Ops::negate_where_negative(Ops::sub_int(master_bits, rounded), master_bits);
        codes[k] =
            Ops::round_to_int(Ops::mul(Ops::to_float(offset), Ops::splat(kScale / 32768.0f)));
        patterns[k] = Ops::shift_right<16>(rounded);
      }
      Ops::template store_32_16bit<false>(param + i, patterns);
    } else {
      for (int k = 0; k < kVectorsPerGroup; ++k) {
        codes[k] = split(masters[k], param + i + k * kLanes);
      }
    }
    if constexpr (sizeof(Residual) == 1) {
      Ops::template store_32_8bit<true>(residual + i, codes);
    } else {
      Ops::template store_32_16bit<true>(residual + i, codes);
    }
  }

 private:
  // Whether every bf16 parameter of the group at `p` is finite and not +-0, a magnitude
  // pattern in [1, 0x7f7f], in AVX2's 16-bit operations (only the AVX2 staging pass asks):
  // x - 1 wraps a zero magnitude to 0xffff, and saturating (x - 1) - 0x7f7e is 0 exactly for
  // x in [1, 0x7f7f].
  static inline bool group_is_finite_nonzero(const uint16_t* p) {
    const __m256i magnitude = _mm256_set1_epi16(0x7fff), minus_one = _mm256_set1_epi16(-1);
    const __m256i* patterns = reinterpret_cast<const __m256i*>(p);
    const __m256i low = _mm256_and_si256(_mm256_loadu_si256(patterns), magnitude);
    const __m256i high = _mm256_and_si256(_mm256_loadu_si256(patterns + 1), magnitude);
    const __m256i largest =
        _mm256_max_epu16(_mm256_add_epi16(low, minus_one), _mm256_add_epi16(high, minus_one));
    return _mm256_testz_si256(_mm256_subs_epu16(largest, _mm256_set1_epi16(0x7f7e)),
                              _mm256_set1_epi16(-1)) != 0;
  }

  static inline I load_residual(const Residual* p) {
    if constexpr (sizeof(Residual) == 1) return Ops::load_i8(p);
    else return Ops::load_i16(p);
  }

  // codec::split_master_bf16 of any masters: stores the bf16 patterns, returns the residuals.
  static inline I split(F master, uint16_t* param) {
    const I rounded = float_to_bf16(master);
    const I master_bits = Ops::bits(master);
    const I rounded_magnitude = Ops::and_(Ops::shift_left<16>(rounded), Ops::splat_int(0x7fffffffu));
    const I offset = Ops::sub_int(Ops::and_(master_bits, Ops::splat_int(0x7fffffffu)),
                                  rounded_magnitude);
    const F magnitude_ratio = Ops::mul(Ops::to_float(offset), Ops::splat(1.0f / 32768.0f));
    F ratio = Ops::from_bits(Ops::xor_(Ops::bits(magnitude_ratio),
                                       Ops::and_(master_bits, Ops::splat_int(0x80000000u))));
    ratio = Ops::min(ratio, Ops::splat(1.0f));
    ratio = Ops::max(ratio, Ops::splat(-1.0f));
    const I code = Ops::round_to_int(Ops::mul(ratio, Ops::splat(kScale)));
    const M finite = Ops::greater_int(Ops::splat_int(0x7f800000u), rounded_magnitude);
    Ops::store_16bit(param, rounded);
    return Ops::select_int(finite, code, Ops::splat_int(0));
  }
};

// The vector form of a scalar ParamIo, where there is one.
template <class Io>
struct VectorParams {
  static constexpr bool kAvailable = false;
};
template <>
struct VectorParams<PlainIo<Float32Access>> {
  static constexpr bool kAvailable = true;
  using Type = Fp32Params;
};
template <>
struct VectorParams<PlainIo<BFloat16Access>> {
  static constexpr bool kAvailable = true;
  using Type = Bf16Params;
};
template <class Residual>
struct VectorParams<MasterIo<Bf16Master, Residual>> {
  static constexpr bool kAvailable = true;
  using Type = Bf16MasterParams<Residual>;
};

// ---------------------------------------------------------------------------------------------
// Update rules on vectors (codec/update_rules.h).

// codec::lerp with the weight's branch (kLow: weight < 0.5) taken once per call. As a bool
// member GCC re-derived it from the weight in every vector of the update loop (a reload, a
// compare and a branch each time).
template <bool kLow>
struct Lerp {
  F weight, weight_minus_one;
  explicit Lerp(float w) : weight(Ops::splat(w)), weight_minus_one(Ops::splat(w - 1.0f)) {}
  inline F operator()(F from, F to) const {
    const F difference = Ops::sub(to, from);
    if constexpr (kLow) {
      return Ops::fma(weight, difference, from);
    } else {
      return Ops::fma(weight_minus_one, difference, to);
    }
  }
};

// Full groups [0, groups) of AdamW without amsgrad: codec::adamw_element between the decode
// and the encode of 8-bit m and v, in pipelined batches (see the top of this file and
// pipeline_batches).
// `io` and the scalars are copied into locals (registers): a store through a parameter or
// code pointer could alias a caller's struct as far as GCC knows (an int8 store aliases
// anything), and it would reload and re-broadcast them after every store.
template <class LerpRule, class Params>
void adamw_groups(const Params io, int64_t groups, int8_t* PO_RESTRICT m_codes,
                  uint16_t* PO_RESTRICT m_scales, uint8_t* PO_RESTRICT v_codes,
                  uint16_t* PO_RESTRICT v_scales, const codec::AdamWScalars& scalars) {
  const codec::AdamWScalars s = scalars;
  const F grad_sign = Ops::splat(s.grad_sign), decay = Ops::splat(s.decay);
  const F one_minus_beta2 = Ops::splat(s.one_minus_beta2), beta2 = Ops::splat(s.beta2);
  const F neg_scaled_step = Ops::splat(s.neg_scaled_step), scaled_eps = Ops::splat(s.scaled_eps);
  const LerpRule lerp(s.one_minus_beta1);
  const MomentDecoder<Ops::kHasTable128 && !Params::kJoinsMasters> decode_moments;
  // Two of each: the batch being updated and the one being encoded.
  alignas(64) float m[2][kBatchGroups * kGroupSize], v_roots[2][kBatchGroups * kGroupSize];
  alignas(64) float m_inverse[2][kBatchGroups], v_inverse[2][kBatchGroups];
  alignas(64) float m_decode[kBatchGroups], v_decode[kBatchGroups];
  alignas(64) uint32_t m_keys[kBatchGroups], v_keys[kBatchGroups];
  alignas(64) float staging[kBatchGroups * kGroupSize];

  const auto update_batch = [&](int buffer, int64_t first, int batch,
                                const auto& after_group) PO_FORCE_INLINE {
    const auto batch_io = io.begin_batch(first * kGroupSize, batch, staging);
    decode_scales(m_scales + first, batch, m_decode);
    decode_scales(v_scales + first, batch, v_decode);
    float* PO_RESTRICT batch_m = m[buffer];
    float* PO_RESTRICT batch_v_roots = v_roots[buffer];
    for (int b = 0; b < batch; ++b) {
      const int64_t base = (first + b) * kGroupSize;
      const int64_t ahead = base + kPrefetchGroups * kGroupSize;
      io.prefetch_group(ahead);
      prefetch_group_of(m_codes + ahead);
      prefetch_group_of(v_codes + ahead);
      const F m_scale = Ops::splat(m_decode[b]);
      const float v_scale_value = v_decode[b];
      const F v_root_step = Ops::splat(v_scale_value * (1.0f / codec::kSecondMomentCodeMax));
      const F v_root_cap = Ops::splat(v_scale_value);
      const F zero_code_second =
          Ops::splat(codec::decode_second_moment_for_denominator(0, v_scale_value));
      ScaleKey<false> m_key;
      ScaleKey<true> v_key;
      GroupF params;
      // The denominator decodes v as the state does except at code 0
      // (codec::decode_second_moment_for_denominator), so elsewhere its square root is the
      // new v's, which the encode needs too: one square root instead of two. Only a group
      // with a zero code takes the second.
      const auto update = [&](auto has_zero_code) PO_FORCE_INLINE {
        for (int k = 0; k < kVectorsPerGroup; ++k) {
          const int64_t i = base + k * kLanes;
          F moment = decode_moments(m_codes + i, m_scale);
          const F v_code = Ops::to_float(Ops::load_u8(v_codes + i));
          const F root = Ops::min(Ops::mul(v_code, v_root_step), v_root_cap);

          const F grad = Ops::mul(batch_io.load_grad(i), grad_sign);
          F param = Ops::mul(batch_io.load_param(i), decay);
          moment = lerp(moment, grad);
          const F grad_term = Ops::mul(one_minus_beta2, grad);
          const F new_root =
              Ops::sqrt(Ops::fma(grad_term, grad, Ops::mul(Ops::mul(root, root), beta2)));
          F denominator_root = new_root;
          if constexpr (decltype(has_zero_code)::value) {
            denominator_root = Ops::select(
                Ops::equal(v_code, Ops::splat(0.0f)),
                Ops::sqrt(Ops::fma(grad_term, grad, Ops::mul(zero_code_second, beta2))),
                new_root);
          }
          params[k] = Ops::add(param, Ops::div(Ops::mul(neg_scaled_step, moment),
                                               Ops::add(denominator_root, scaled_eps)));
          Ops::store(batch_m + b * kGroupSize + k * kLanes, moment);
          Ops::store(batch_v_roots + b * kGroupSize + k * kLanes, new_root);
          m_key.add(moment);
          v_key.add(new_root);
        }
      };
      if (group_has_zero_code(v_codes + base)) {
        update(std::true_type{});
      } else {
        update(std::false_type{});
      }
      batch_io.store_params(base, params);
      m_keys[b] = m_key.reduce();
      v_keys[b] = v_key.reduce();
      after_group(b);
    }
    io.end_batch(first * kGroupSize, batch, staging);
    scales_from_keys(m_keys, batch, m_scales + first, m_inverse[buffer]);
    scales_from_keys(v_keys, batch, v_scales + first, v_inverse[buffer]);
  };
  const auto encode = [&](int buffer, int64_t first, int b) PO_FORCE_INLINE {
    const int64_t base = (first + b) * kGroupSize;
    GroupI m_group, v_group;
    encode_group<EncodeMoments>(m[buffer] + b * kGroupSize, m_scales[first + b],
                                m_inverse[buffer][b], m_group);
    encode_group<EncodeSecondMoments>(v_roots[buffer] + b * kGroupSize, v_scales[first + b],
                                      v_inverse[buffer][b], v_group);
    Ops::store_32_8bit<true>(m_codes + base, m_group);
    Ops::store_32_8bit<false>(v_codes + base, v_group);
  };
  // A group of each in turn, except where the bf16 master join and split share the update
  // loop: there four of each ran 2% faster (1.19 against 1.22 ns per element at 64M bf16
  // params with master_bits=24), and one of each 3% faster on fp32 params (0.93 against
  // 0.96), three pairs each (Intel Xeon, AVX-512, single thread).
  pipeline_batches<Params::kJoinsMasters ? 4 : 1>(groups, update_batch, encode);
}

// codec::sgd_momentum_element; the branches on hyperparameters are the same for every lane.
// A rule's scalars are broadcast once per parameter (see adamw_groups for why locals).
struct SgdMomentumRule {
  struct Vectors {
    F grad_sign, weight_decay, one_minus_dampening, momentum, neg_lr;
    bool decays, first_step, nesterov;
    explicit Vectors(const codec::SGDScalars& s)
        : grad_sign(Ops::splat(s.grad_sign)), weight_decay(Ops::splat(s.weight_decay)),
          one_minus_dampening(Ops::splat(s.one_minus_dampening)), momentum(Ops::splat(s.momentum)),
          neg_lr(Ops::splat(-s.lr)), decays(s.weight_decay != 0.0f), first_step(s.first_step),
          nesterov(s.nesterov) {}
  };
  static inline void apply(F& param, F grad, F& buffer, const Vectors& s) {
    grad = Ops::mul(grad, s.grad_sign);
    if (s.decays) grad = Ops::fma(param, s.weight_decay, grad);
    buffer = s.first_step ? grad : Ops::fma(grad, s.one_minus_dampening, Ops::mul(buffer, s.momentum));
    const F direction = s.nesterov ? Ops::fma(buffer, s.momentum, grad) : buffer;
    param = Ops::fma(direction, s.neg_lr, param);
  }
};

// codec::lion_element, with codec::sign_of as the difference of two selects.
struct LionRule {
  struct Vectors {
    F grad_sign, decay, one_minus_beta1, beta1, neg_lr, one_minus_beta2, beta2;
    explicit Vectors(const codec::LionScalars& s)
        : grad_sign(Ops::splat(s.grad_sign)), decay(Ops::splat(s.decay)),
          one_minus_beta1(Ops::splat(s.one_minus_beta1)), beta1(Ops::splat(s.beta1)),
          neg_lr(Ops::splat(-s.lr)), one_minus_beta2(Ops::splat(s.one_minus_beta2)),
          beta2(Ops::splat(s.beta2)) {}
  };
  static inline void apply(F& param, F grad, F& m, const Vectors& s) {
    grad = Ops::mul(grad, s.grad_sign);
    param = Ops::mul(param, s.decay);
    const F interpolated = Ops::fma(grad, s.one_minus_beta1, Ops::mul(m, s.beta1));
    const F one = Ops::splat(1.0f), zero = Ops::splat(0.0f);
    const F sign = Ops::sub(Ops::select(Ops::less(zero, interpolated), one, zero),
                            Ops::select(Ops::less(interpolated, zero), one, zero));
    param = Ops::fma(sign, s.neg_lr, param);
    m = Ops::fma(grad, s.one_minus_beta2, Ops::mul(m, s.beta2));
  }
};

// Full groups [0, groups) of an optimizer whose state is one 8-bit first moment (SGD's
// momentum buffer, Lion's m), updated by `Rule`, in pipelined batches as adamw_groups.
template <class Rule, class Params, class Scalars>
void momentum_groups(const Params io, int64_t groups, int8_t* PO_RESTRICT codes,
                     uint16_t* PO_RESTRICT scales, const Scalars& scalars) {
  const typename Rule::Vectors s(scalars);
  const MomentDecoder<false> decode_moments;
  alignas(64) float m[2][kBatchGroups * kGroupSize];
  alignas(64) float inverses[2][kBatchGroups];
  alignas(64) float decoded[kBatchGroups];
  alignas(64) uint32_t keys[kBatchGroups];
  alignas(64) float staging[kBatchGroups * kGroupSize];

  const auto update_batch = [&](int buffer, int64_t first, int batch,
                                const auto& after_group) PO_FORCE_INLINE {
    const auto batch_io = io.begin_batch(first * kGroupSize, batch, staging);
    decode_scales(scales + first, batch, decoded);
    float* PO_RESTRICT batch_m = m[buffer];
    for (int b = 0; b < batch; ++b) {
      const int64_t base = (first + b) * kGroupSize;
      const int64_t ahead = base + kPrefetchGroups * kGroupSize;
      io.prefetch_group(ahead);
      prefetch_group_of(codes + ahead);
      const F scale = Ops::splat(decoded[b]);
      ScaleKey<false> key;
      GroupF params;
      for (int k = 0; k < kVectorsPerGroup; ++k) {
        const int64_t i = base + k * kLanes;
        F moment = decode_moments(codes + i, scale);
        params[k] = batch_io.load_param(i);
        Rule::apply(params[k], batch_io.load_grad(i), moment, s);
        Ops::store(batch_m + b * kGroupSize + k * kLanes, moment);
        key.add(moment);
      }
      batch_io.store_params(base, params);
      keys[b] = key.reduce();
      after_group(b);
    }
    io.end_batch(first * kGroupSize, batch, staging);
    scales_from_keys(keys, batch, scales + first, inverses[buffer]);
  };
  const auto encode = [&](int buffer, int64_t first, int b) PO_FORCE_INLINE {
    GroupI group;
    encode_group<EncodeMoments>(m[buffer] + b * kGroupSize, scales[first + b],
                                inverses[buffer][b], group);
    Ops::store_32_8bit<true>(codes + (first + b) * kGroupSize, group);
  };
  pipeline_batches<Params::kJoinsMasters ? 4 : 1>(groups, update_batch, encode);
}

// The kernels' entry points: run the span's full groups hand-vectorized when its ParamIo has a
// vector form, and return where the generic loops take over (0 without one).
template <class Io>
int64_t adamw_full_groups(const ParamSpan& span, const AdamWStreams& st,
                          const codec::AdamWScalars& s) {
  if constexpr (!VectorParams<Io>::kAvailable) {
    return 0;
  } else {
    const int64_t groups = span.count / kGroupSize;
    const typename VectorParams<Io>::Type io(span, st.residual);
    const auto m_codes = static_cast<int8_t*>(st.m.values);
    const auto v_codes = static_cast<uint8_t*>(st.v.values);
    if (s.one_minus_beta1 < 0.5f) {
      adamw_groups<Lerp<true>>(io, groups, m_codes, st.m.scales, v_codes, st.v.scales, s);
    } else {
      adamw_groups<Lerp<false>>(io, groups, m_codes, st.m.scales, v_codes, st.v.scales, s);
    }
    return groups * kGroupSize;
  }
}

template <class Io, class Rule, class Scalars>
int64_t momentum_full_groups(const ParamSpan& span, const MomentumStreams& st, const Scalars& s) {
  if constexpr (!VectorParams<Io>::kAvailable) {
    return 0;
  } else {
    const int64_t groups = span.count / kGroupSize;
    momentum_groups<Rule>(typename VectorParams<Io>::Type(span, st.residual), groups,
                          static_cast<int8_t*>(st.m.values), st.m.scales, s);
    return groups * kGroupSize;
  }
}

}  // namespace pagedoptim::kernels::PO_CPU_ISA::simd

#endif  // PO_SIMD_GROUPS
