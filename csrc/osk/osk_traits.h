// Compile-time configuration of the OSK kernel: tile shapes, warp roles, register split,
// shared-memory layouts and the two tiled warpgroup MMAs (S = Q K^T, O += P V).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

namespace cosa::osk {

using namespace cute;

template <int kHeadDim_, class Element_, int kStages_>
struct OskTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // query rows of a tile (the spec's logical block)
  static constexpr int kBlockN = 128;  // keys of a block
  static constexpr int kStages = kStages_;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "OSK supports head_dim 64 and 128");

  // Warpgroup 0 produces (Q, K, V loads through the page table); warpgroups 1 and 2 consume,
  // each owning 64 rows of the 128-row tile.
  static constexpr int kNumProducerThreads = 128;
  static constexpr int kNumConsumerWarpgroups = 2;
  static constexpr int kNumConsumerThreads = 128 * kNumConsumerWarpgroups;
  static constexpr int kNumThreads = kNumProducerThreads + kNumConsumerThreads;
  // setmaxnreg split: 128 * 80 + 256 * 208 = 63488, within the 168 * 384 = 64512 registers the
  // CTA is launched with (setmaxnreg.inc waits forever for registers the CTA does not hold). The
  // producer spills below 48; the consumers fit in 200.
  static constexpr int kProducerRegisters = 80;
  static constexpr int kConsumerRegisters = 208;

  // 16-byte chunks: how a warpgroup (128 threads) covers a 128 x kHeadDim tile, one chunk per
  // thread and pass: the producer's Q load, the epilogue's O store (64 rows per warpgroup).
  static constexpr int kChunksPerRow = kHeadDim * int(sizeof(Element)) / 16;
  static constexpr int kRowsPerPass = kNumProducerThreads / kChunksPerRow;
  static constexpr int kPasses = kBlockN / kRowsPerPass;
  static_assert(kRowsPerPass % 8 == 0, "a pass must cover whole 8-row swizzle atoms");

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using AtomLayout = Layout<Shape<Int<kNumConsumerWarpgroups>, _1, _1>>;
  // S = Q K^T: both operands from shared memory (K-major).
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  // O += P V: P from registers, V from shared memory read as V^T (MN-major, no transpose).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayout{}));

  // Rows of 64 elements (128 bytes) with the 128-byte swizzle, for both head dims.
  using SmemAtomRowMajor = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomRowMajor{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(
      SmemAtomRowMajor{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // The same bytes as SmemLayoutKV seen as V^T (head_dim, keys, stage): the MN-major atom tiled
  // keys-first addresses element (d, n) exactly where SmemLayoutKV puts (n, d).
  using SmemAtomVt = GMMA::Layout_MN_SW128_Atom<Element>;
  using SmemLayoutVt = decltype(tile_to_shape(
      SmemAtomVt{}, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // Element offset of 16-byte chunk `chunk` of row `row` inside one 128 x kHeadDim tile of
  // SmemLayoutQ / SmemLayoutKV (checked against the CuTe layouts by the dev harness):
  // 8-row x 64-element atoms stacked rows-first, chunk index XOR-ed with the row inside the atom.
  static constexpr int kTileElems = kBlockN * kHeadDim;
  __host__ __device__ static constexpr int swizzled_offset(int row, int chunk) {
    return (row >> 3) * 512 + (row & 7) * 64 + (chunk >> 3) * (kBlockN * 64) +
           (((chunk & 7) ^ (row & 7)) << 3);
  }
};

}  // namespace cosa::osk
