// Host-side model of the wgmma forward's shared-memory traffic (sparse_mla_fwd_sm90.cu over
// sm90.cuh), run on a CPU: every element the kernel writes (the producer's gathered rows, consumer
// 0's P tile) must be the element each wgmma operand reads through its descriptor. The hardware
// side is modelled from the PTX ISA's canonical layouts of the 128-byte swizzle (in bytes):
//   K-major  element (mn, k) at start + (mn % 8) * 128 + (mn / 8) * SBO + 2 k
//   MN-major element (k, n)  at start + 2 (n % 64) + (n / 64) * LBO + (k % 8) * 128 + (k / 8) * SBO
// then swizzled: bits 4-6 of the address XOR bits 7-9. The descriptor is decoded from its bits,
// so a field in the wrong place fails here too. Prints "ok" or the first mismatch; exit code 1.
#include <cstdio>

#include "sm90.cuh"

using namespace glm_sparse_mla::sm90;

namespace {

struct Desc {
  uint32_t start, lbo, sbo, mode;
};

Desc decode(uint64_t d) {
  return Desc{static_cast<uint32_t>(d & 0x3FFF) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
              static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4, static_cast<uint32_t>(d >> 62)};
}

uint32_t swizzled(uint32_t a) { return a ^ (((a >> 7) & 7u) << 4); }

uint32_t read_k_major(uint64_t desc, int mn, int k) {
  const Desc d = decode(desc);
  return swizzled(d.start + (mn % 8) * 128 + (mn / 8) * d.sbo + 2 * k);
}

uint32_t read_mn_major(uint64_t desc, int k, int n) {
  const Desc d = decode(desc);
  return swizzled(d.start + 2 * (n % 64) + (n / 64) * d.lbo + (k % 8) * 128 + (k / 8) * d.sbo);
}

// where the producer writes element (row, column) of a 64 x 576 block at base (1024-aligned)
uint32_t written(uint32_t base, int row, int col) {
  return base + (col / 64) * kTileBytes + sw128(row, (col % 64) / 8) + 2 * (col % 8);
}

int failures = 0;
void expect(bool ok, const char* what, int a, int b, int c) {
  if (!ok && failures++ == 0) std::printf("mismatch: %s at (%d, %d, %d)\n", what, a, b, c);
}

}  // namespace

int main() {
  const uint32_t q_base = 0, kv_base = 9 * kTileBytes;   // Q, then buffer 0 (both 1024-aligned)
  // S = Q K^T: for column tile d and k16 step kk, A = Q (64 heads), B = K (64 rows), both K-major
  for (int d = 0; d < 9; ++d)
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t a = make_desc(q_base + d * kTileBytes + 32 * kk, 16);
      const uint64_t b = make_desc(kv_base + d * kTileBytes + 32 * kk, 16);
      expect(decode(a).mode == 1 && decode(a).sbo == 1024, "descriptor fields", d, kk, 0);
      for (int mn = 0; mn < 64; ++mn)
        for (int k = 0; k < 16; ++k) {
          expect(read_k_major(a, mn, k) == written(q_base, mn, 64 * d + 16 * kk + k), "Q operand", d, mn, k);
          expect(read_k_major(b, mn, k) == written(kv_base, mn, 64 * d + 16 * kk + k), "K operand", d, mn, k);
        }
    }
  // P V: B = V (rows k, value columns n of half h), MN-major from tile 4 h, LBO the next tile
  for (int h = 0; h < 2; ++h)
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t b = make_desc(kv_base + 4 * h * kTileBytes + 2048 * kk, kTileBytes);
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 256; ++n)
          expect(read_mn_major(b, k, n) == written(kv_base, 16 * kk + k, 256 * h + n), "V operand", h, k, n);
    }
  // P: consumer 0 thread t stores accumulator values v, v + 1 (v even) of S as one bf16 pair at
  // tile 8 + sw128(row, v / 4) + 2 (col % 8); consumer 1 reads A = P K-major from tile 8 + 32 kk
  const uint32_t p_tile = kv_base + 8 * kTileBytes;
  static int owner[64][64];
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 64; ++c) owner[r][c] = -1;
  for (int t = 0; t < 128; ++t)
    for (int v = 0; v < 32; v += 2) {
      const int row = acc_row(t, v), col = acc_col(t, v);
      expect(acc_row(t, v + 1) == row && acc_col(t, v + 1) == col + 1 && col % 2 == 0, "pair", t, v, 0);
      const uint32_t at = p_tile + sw128(row, v / 4) + 2 * (col % 8);
      for (int e = 0; e < 2; ++e) {
        expect(owner[row][col + e] == -1, "P element written twice", row, col + e, t);
        owner[row][col + e] = t;
        const int kk = (col + e) / 16;
        expect(read_k_major(make_desc(p_tile + 32 * kk, 16), row, (col + e) % 16) == at + 2 * e, "P operand",
               row, col + e, t);
      }
    }
  // P as consumer 0's register A operand: register i of k16 slice kk holds accumulator values
  // 4 (2 kk + i / 2) + 2 (i % 2) + {0, 1}: rows lane / 4 (+ 8 for odd i) of its warp, columns
  // 16 kk + 8 (i / 2) + 2 (lane % 4) + {0, 1}, the A fragment layout of wgmma (as mma.sync m16n8k16)
  for (int t = 0; t < 128; ++t)
    for (int kk = 0; kk < 4; ++kk)
      for (int i = 0; i < 4; ++i) {
        const int v = 4 * (2 * kk + i / 2) + 2 * (i % 2);
        const int lane = t % 32;
        const int row = 16 * (t / 32) + lane / 4 + 8 * (i % 2), col = 8 * (i / 2) + 2 * (lane % 4);
        expect(acc_row(t, v) == row && acc_col(t, v) - 16 * kk == col, "A fragment", t, kk, i);
      }
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 64; ++c) expect(owner[r][c] >= 0, "P element never written", r, c, 0);
  if (failures) {
    std::printf("%d mismatches\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
