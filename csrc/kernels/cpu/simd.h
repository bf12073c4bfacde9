// The vector vocabulary of the hand-vectorized group kernels (companded_group_kernels.h),
// for the two x86 ISAs that have them: AVX-512 (16 lanes) and AVX2 with FMA (8 lanes).
//
// Each struct names the same operations over its own register types, so one kernel template
// serves both. Every operation is the IEEE operation the scalar codec performs on one lane,
// so a lane computes the bits the scalar code computes:
//   min(a, b) is a < b ? a : b and max(a, b) is a > b ? a : b (x86's minps/maxps, which
//   return the second operand when either is NaN: the scalar selects do the same);
//   round_to_int is round-half-even under the default MXCSR rounding, the mode in which the
//   scalar (x + 1.5 * 2^23) - 1.5 * 2^23 rounds half to even too, for the |x| < 2^22 it sees.
// The baseline ISA has neither FMA nor these registers; it keeps the auto-vectorized loops.
//
// Everything here and in companded_groups.h lives in the namespace of the ISA the translation
// unit is compiled for (PO_CPU_ISA): the same inline function or template compiled with
// -mavx512f in one unit and -mavx2 in another is two different functions, and under one name
// the linker would keep either copy for both tables, AVX-512 code in the AVX2 table included.
#pragma once

#ifndef PO_CPU_ISA
#error "PO_CPU_ISA must name the ISA this translation unit is compiled for"
#endif

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__FMA__)
#define PO_SIMD_GROUPS 1
#define PO_SIMD_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PO_SIMD_GROUPS 1
#define PO_SIMD_AVX2 1
#endif

namespace pagedoptim::kernels::PO_CPU_ISA::simd {

#if defined(PO_SIMD_AVX512)

struct Ops {
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;  // zmm0-31
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;

  static inline F splat(float x) { return _mm512_set1_ps(x); }
  static inline I splat_int(uint32_t x) { return _mm512_set1_epi32(int32_t(x)); }
  static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, F x) { _mm512_storeu_ps(p, x); }

  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  static inline F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
  static inline F min(F a, F b) { return _mm512_min_ps(a, b); }
  static inline F max(F a, F b) { return _mm512_max_ps(a, b); }
  static inline F abs(F a) { return from_bits(and_(bits(a), splat_int(0x7fffffffu))); }

  static inline M equal(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static inline M less(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static inline F select(M m, F if_true, F if_false) {
    return _mm512_mask_blend_ps(m, if_false, if_true);
  }

  static inline I bits(F a) { return _mm512_castps_si512(a); }
  static inline F from_bits(I a) { return _mm512_castsi512_ps(a); }
  static inline I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static inline I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static inline I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static inline I add_int(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline I sub_int(I a, I b) { return _mm512_sub_epi32(a, b); }
  template <int kBits>
  static inline I shift_right(I a) { return _mm512_srli_epi32(a, kBits); }
  template <int kBits>
  static inline I shift_left(I a) { return _mm512_slli_epi32(a, kBits); }
  static inline I max_int(I a, I b) { return _mm512_max_epi32(a, b); }
  static inline I max_unsigned(I a, I b) { return _mm512_max_epu32(a, b); }
  static inline M greater_int(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  static inline M greater_unsigned(I a, I b) { return _mm512_cmpgt_epu32_mask(a, b); }
  static inline I select_int(M m, I if_true, I if_false) {
    return _mm512_mask_blend_epi32(m, if_false, if_true);
  }
  // `value` negated in the lanes where `sign_source` is negative. Callers pass a value that
  // is 0 wherever the source is 0 (AVX2's psignd zeroes those lanes, this keeps them).
  static inline I negate_where_negative(I value, I sign_source) {
    return _mm512_mask_sub_epi32(value, _mm512_movepi32_mask(sign_source), _mm512_setzero_si512(),
                                 value);
  }
  static inline uint32_t reduce_max_unsigned(I a) { return _mm512_reduce_max_epu32(a); }

  static inline F to_float(I a) { return _mm512_cvtepi32_ps(a); }
  static inline I round_to_int(F a) { return _mm512_cvtps_epi32(a); }
  static inline M less_unsigned(I a, I b) { return _mm512_cmplt_epu32_mask(a, b); }
  static inline M greater(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }

  // fp16 scales: kLanes patterns <-> fp32, exact one way and rounded up the other.
  static inline F load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline I fp16_rounded_up(F a) {
    return _mm512_cvtepu16_epi32(_mm512_cvt_roundps_ph(a, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
  }

  // Loads widen and stores narrow between memory's 8- and 16-bit elements and 32-bit lanes;
  // stores truncate, and every value stored fits its element.
  static inline I load_i8(const void* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static inline I load_u8(const void* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static inline I load_u16(const void* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  static inline I load_i16(const void* p) {
    return _mm512_cvtepi16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  }
  static inline void store_8bit(void* p, I a) {
    _mm_storeu_si128(static_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a));
  }
  static inline void store_16bit(void* p, I a) {
    _mm256_storeu_si256(static_cast<__m256i*>(p), _mm512_cvtepi32_epi16(a));
  }
  // The 32 8-bit values of two vectors (a group), in lane order; signed or unsigned alike.
  template <bool kSigned>
  static inline void store_32_8bit(void* p, const I (&v)[2]) {
    store_8bit(p, v[0]);
    store_8bit(static_cast<uint8_t*>(p) + kLanes, v[1]);
  }
  // The 32 16-bit values of two vectors (a group), in lane order; signed or unsigned alike.
  template <bool kSigned>
  static inline void store_32_16bit(void* p, const I (&v)[2]) {
    store_16bit(p, v[0]);
    store_16bit(static_cast<uint16_t*>(p) + kLanes, v[1]);
  }

  static inline bool any(M m) { return m != 0; }

  // A 128-entry float table held in eight registers, read by indices in [0, 127]: vpermt2ps
  // looks up 32 entries by an index's low 5 bits, and bits 5 and 6 pick among the four.
  static constexpr bool kHasTable128 = true;
  struct Table128 {
    F quarter[4][2];
    explicit Table128(const float* entries) {
      for (int q = 0; q < 4; ++q) {
        quarter[q][0] = load(entries + 32 * q);
        quarter[q][1] = load(entries + 32 * q + 16);
      }
    }
  };
  static inline F lookup(const Table128& table, I index) {
    const auto in_quarter = [&](int q) {
      return _mm512_permutex2var_ps(table.quarter[q][0], index, table.quarter[q][1]);
    };
    const M upper_half_of_pair = _mm512_test_epi32_mask(index, splat_int(32));
    const F low = _mm512_mask_mov_ps(in_quarter(0), upper_half_of_pair, in_quarter(1));
    const F high = _mm512_mask_mov_ps(in_quarter(2), upper_half_of_pair, in_quarter(3));
    return _mm512_mask_mov_ps(low, _mm512_test_epi32_mask(index, splat_int(64)), high);
  }
  static inline I abs_int(I a) { return _mm512_abs_epi32(a); }
  static inline M equal_int(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
};

#elif defined(PO_SIMD_AVX2)

struct Ops {
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;  // ymm0-15
  using F = __m256;
  using I = __m256i;
  using M = __m256i;  // all-ones lanes

  static inline F splat(float x) { return _mm256_set1_ps(x); }
  static inline I splat_int(uint32_t x) { return _mm256_set1_epi32(int32_t(x)); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, F x) { _mm256_storeu_ps(p, x); }

  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  static inline F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F min(F a, F b) { return _mm256_min_ps(a, b); }
  static inline F max(F a, F b) { return _mm256_max_ps(a, b); }
  static inline F abs(F a) { return from_bits(and_(bits(a), splat_int(0x7fffffffu))); }

  static inline M equal(F a, F b) { return bits(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  static inline M less(F a, F b) { return bits(_mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
  static inline F select(M m, F if_true, F if_false) {
    return _mm256_blendv_ps(if_false, if_true, from_bits(m));
  }

  static inline I bits(F a) { return _mm256_castps_si256(a); }
  static inline F from_bits(I a) { return _mm256_castsi256_ps(a); }
  static inline I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static inline I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static inline I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static inline I add_int(I a, I b) { return _mm256_add_epi32(a, b); }
  static inline I sub_int(I a, I b) { return _mm256_sub_epi32(a, b); }
  template <int kBits>
  static inline I shift_right(I a) { return _mm256_srli_epi32(a, kBits); }
  template <int kBits>
  static inline I shift_left(I a) { return _mm256_slli_epi32(a, kBits); }
  static inline I max_int(I a, I b) { return _mm256_max_epi32(a, b); }
  static inline I max_unsigned(I a, I b) { return _mm256_max_epu32(a, b); }
  static inline M greater_int(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  // AVX2 compares signed only: flipping the sign bit of both sides orders them unsigned.
  static inline M greater_unsigned(I a, I b) {
    const I flip = splat_int(0x80000000u);
    return _mm256_cmpgt_epi32(xor_(a, flip), xor_(b, flip));
  }
  static inline I select_int(M m, I if_true, I if_false) {
    return _mm256_blendv_epi8(if_false, if_true, m);
  }
  // `value` negated in the lanes where `sign_source` is negative; psignd also zeroes the
  // lanes where the source is 0, so callers pass a value that is 0 there.
  static inline I negate_where_negative(I value, I sign_source) {
    return _mm256_sign_epi32(value, sign_source);
  }
  static inline uint32_t reduce_max_unsigned(I a) {
    __m128i x = _mm_max_epu32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm_max_epu32(x, _mm_shuffle_epi32(x, _MM_SHUFFLE(2, 3, 0, 1)));
    return uint32_t(_mm_cvtsi128_si32(x));
  }

  static inline F to_float(I a) { return _mm256_cvtepi32_ps(a); }
  static inline I round_to_int(F a) { return _mm256_cvtps_epi32(a); }
  static inline M less_unsigned(I a, I b) { return greater_unsigned(b, a); }
  static inline M greater(F a, F b) { return bits(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }

  static inline F load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline I fp16_rounded_up(F a) {
    return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(a, _MM_FROUND_TO_POS_INF | _MM_FROUND_NO_EXC));
  }

  static inline I load_i8(const void* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  }
  static inline I load_u8(const void* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(p)));
  }
  static inline I load_u16(const void* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  static inline I load_i16(const void* p) {
    return _mm256_cvtepi16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  }
  // Every lane already fits the element it is stored to (an 8-bit code, a 16-bit pattern or
  // residual), so these only narrow: each keeps the low bytes of its lanes, which is the
  // element for signed and unsigned values alike. The 8-bit store packs to int16 first
  // (codes and residuals lie in [-127, 255]).
  static inline __m128i narrow_to_16bit(I a) {
    const I low_halves = _mm256_shuffle_epi8(
        a, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                            0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(low_halves, _MM_SHUFFLE(3, 1, 2, 0)));
  }
  static inline void store_8bit(void* p, I a) {
    const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(a),
                                           _mm256_extracti128_si256(a, 1));
    const __m128i low_bytes = _mm_shuffle_epi8(
        halves, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1));
    _mm_storel_epi64(static_cast<__m128i*>(p), low_bytes);
  }
  static inline void store_16bit(void* p, I a) {
    _mm_storeu_si128(static_cast<__m128i*>(p), narrow_to_16bit(a));
  }
  // The 32 8-bit values of four vectors (a group), in lane order: two saturating packs to
  // 16 bits and one to 8 (signed for codes in [-127, 127], unsigned for [0, 255]: either
  // keeps every value) interleave the vectors' 128-bit halves, which one permute undoes.
  // Four operations for 32 bytes where store_8bit takes four for 8.
  template <bool kSigned>
  static inline void store_32_8bit(void* p, const I (&v)[4]) {
    const I low = _mm256_packs_epi32(v[0], v[1]), high = _mm256_packs_epi32(v[2], v[3]);
    const I bytes = kSigned ? _mm256_packs_epi16(low, high) : _mm256_packus_epi16(low, high);
    _mm256_storeu_si256(static_cast<__m256i*>(p),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }

  // The 32 16-bit values of four vectors (a group), in lane order: a saturating pack per pair
  // (signed for [-32768, 32767], unsigned for [0, 65535]: either keeps every value)
  // interleaves the pair's 128-bit halves, which one permute per pair undoes. Four
  // operations for 64 bytes where store_16bit takes eight.
  template <bool kSigned>
  static inline void store_32_16bit(void* p, const I (&v)[4]) {
    const I low = kSigned ? _mm256_packs_epi32(v[0], v[1]) : _mm256_packus_epi32(v[0], v[1]);
    const I high = kSigned ? _mm256_packs_epi32(v[2], v[3]) : _mm256_packus_epi32(v[2], v[3]);
    __m256i* out = static_cast<__m256i*>(p);
    _mm256_storeu_si256(out, _mm256_permute4x64_epi64(low, _MM_SHUFFLE(3, 1, 2, 0)));
    _mm256_storeu_si256(out + 1, _mm256_permute4x64_epi64(high, _MM_SHUFFLE(3, 1, 2, 0)));
  }

  static inline bool any(M m) { return _mm256_movemask_ps(_mm256_castsi256_ps(m)) != 0; }

  // Eight lanes have no permute across 128 entries (vpermps reads 8): no table lookups.
  static constexpr bool kHasTable128 = false;
  struct Table128 {
    explicit Table128(const float*) {}
  };
};

#endif

}  // namespace pagedoptim::kernels::PO_CPU_ISA::simd
