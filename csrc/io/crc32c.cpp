// crc32c: a portable slicing-by-8 version and an SSE4.2 version chosen at run time.
//
// Both work on the raw CRC register (no pre/post inversion) internally; the public
// functions apply the standard inversion once at each end, which is what makes
// continuation (passing a prefix's crc back in) work.
#include "pagedoptim/io/crc32c.h"

#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define PO_CRC32C_X86 1
#endif

namespace pagedoptim::io {
namespace {

// Castagnoli polynomial 0x1EDC6F41, bit-reversed because the CRC is computed LSB first.
constexpr uint32_t kPolyReflected = 0x82F63B78u;

struct SliceTables {
  uint32_t t[8][256];
};

// t[0] advances the register by one byte; t[k][b] is the effect of byte b followed by k zero
// bytes, which lets eight bytes be folded with eight independent lookups.
constexpr SliceTables make_slice_tables() {
  SliceTables s{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) {
      c = (c & 1u) ? (c >> 1) ^ kPolyReflected : c >> 1;
    }
    s.t[0][i] = c;
  }
  for (int k = 1; k < 8; ++k) {
    for (uint32_t i = 0; i < 256; ++i) {
      const uint32_t prev = s.t[k - 1][i];
      s.t[k][i] = (prev >> 8) ^ s.t[0][prev & 0xFFu];
    }
  }
  return s;
}

constexpr SliceTables kSlice = make_slice_tables();

constexpr uint32_t update_byte(uint32_t reg, uint8_t byte) {
  return (reg >> 8) ^ kSlice.t[0][(reg ^ byte) & 0xFFu];
}

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

uint32_t update_portable(uint32_t reg, const uint8_t* p, size_t n) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  // The 8-byte fold reads the word little-endian: byte 0 of the input is the low byte.
  while (n >= 8) {
    const uint64_t w = load_u64(p);
    const uint32_t lo = reg ^ static_cast<uint32_t>(w);
    const uint32_t hi = static_cast<uint32_t>(w >> 32);
    reg = kSlice.t[7][lo & 0xFFu] ^ kSlice.t[6][(lo >> 8) & 0xFFu] ^
          kSlice.t[5][(lo >> 16) & 0xFFu] ^ kSlice.t[4][lo >> 24] ^
          kSlice.t[3][hi & 0xFFu] ^ kSlice.t[2][(hi >> 8) & 0xFFu] ^
          kSlice.t[1][(hi >> 16) & 0xFFu] ^ kSlice.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
#endif
  while (n > 0) {
    reg = update_byte(reg, *p++);
    --n;
  }
  return reg;
}

#if defined(PO_CRC32C_X86)

// The crc32 instruction has a latency of 3 cycles and a throughput of 1 per cycle, so one
// dependency chain runs at a third of the possible speed. Large inputs are cut into three
// interleaved streams of kStreamBytes each, the second and third starting from a zero
// register, and recombined: for the raw register, crc(s, A+B) = shift(crc(s, A), |B|) XOR
// crc(0, B), where shift advances a register over |B| zero bytes. That shift is linear over
// GF(2), so it is a 4 x 256 table lookup built at compile time.
constexpr size_t kStreamBytes = 512;

struct ShiftTable {
  uint32_t t[4][256];
  uint32_t apply(uint32_t reg) const {
    return t[0][reg & 0xFFu] ^ t[1][(reg >> 8) & 0xFFu] ^ t[2][(reg >> 16) & 0xFFu] ^
           t[3][reg >> 24];
  }
};

constexpr ShiftTable make_shift_table() {
  uint32_t basis[32]{};
  for (int bit = 0; bit < 32; ++bit) {
    uint32_t reg = 1u << bit;
    for (size_t i = 0; i < kStreamBytes; ++i) {
      reg = update_byte(reg, 0);
    }
    basis[bit] = reg;
  }
  ShiftTable s{};
  for (int k = 0; k < 4; ++k) {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t v = 0;
      for (int bit = 0; bit < 8; ++bit) {
        if (b & (1u << bit)) {
          v ^= basis[8 * k + bit];
        }
      }
      s.t[k][b] = v;
    }
  }
  return s;
}

constexpr ShiftTable kShift = make_shift_table();

__attribute__((target("sse4.2"))) uint32_t update_hardware(uint32_t reg, const uint8_t* p,
                                                           size_t n) {
  uint64_t r0 = reg;
  while (n >= 3 * kStreamBytes) {
    uint64_t r1 = 0;
    uint64_t r2 = 0;
    for (size_t i = 0; i < kStreamBytes; i += 8) {
      r0 = _mm_crc32_u64(r0, load_u64(p + i));
      r1 = _mm_crc32_u64(r1, load_u64(p + kStreamBytes + i));
      r2 = _mm_crc32_u64(r2, load_u64(p + 2 * kStreamBytes + i));
    }
    const uint32_t ab = kShift.apply(static_cast<uint32_t>(r0)) ^ static_cast<uint32_t>(r1);
    r0 = kShift.apply(ab) ^ static_cast<uint32_t>(r2);
    p += 3 * kStreamBytes;
    n -= 3 * kStreamBytes;
  }
  while (n >= 8) {
    r0 = _mm_crc32_u64(r0, load_u64(p));
    p += 8;
    n -= 8;
  }
  uint32_t r = static_cast<uint32_t>(r0);
  while (n > 0) {
    r = _mm_crc32_u8(r, *p++);
    --n;
  }
  return r;
}

bool detect_hardware() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("sse4.2");
}

#endif  // PO_CRC32C_X86

using UpdateFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);

UpdateFn select_update() {
#if defined(PO_CRC32C_X86)
  if (detect_hardware()) {
    return &update_hardware;
  }
#endif
  return &update_portable;
}

}  // namespace

bool crc32c_hardware_available() noexcept {
#if defined(PO_CRC32C_X86)
  static const bool available = detect_hardware();
  return available;
#else
  return false;
#endif
}

uint32_t crc32c_portable(const void* data, size_t size, uint32_t crc) noexcept {
  return ~update_portable(~crc, static_cast<const uint8_t*>(data), size);
}

uint32_t crc32c_hardware(const void* data, size_t size, uint32_t crc) noexcept {
#if defined(PO_CRC32C_X86)
  if (crc32c_hardware_available()) {
    return ~update_hardware(~crc, static_cast<const uint8_t*>(data), size);
  }
#endif
  return crc32c_portable(data, size, crc);
}

uint32_t crc32c(const void* data, size_t size, uint32_t crc) noexcept {
  static const UpdateFn update = select_update();
  return ~update(~crc, static_cast<const uint8_t*>(data), size);
}

}  // namespace pagedoptim::io
