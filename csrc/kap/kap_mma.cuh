// The tensor-core side of the KAP scoring kernel: the operand element types it multiplies, the
// proxy fence between its cp.async copies and the tensor cores, the shared-memory descriptor of a
// 128-byte-swizzled K-major tile, and the warpgroup MMAs (CuTe's SM90 GMMA atoms, m64 x {128, 256},
// fp32 accumulators) issued on those descriptors.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "kap/kap_traits.h"

namespace cosa::kap {

namespace gmma = cute::SM90::GMMA;

// cp.async writes through the generic proxy; wgmma reads shared memory through the async proxy.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Descriptor of a K-major operand tile whose rows are 128 bytes long, stored with the 128-byte
// swizzle (16-byte chunk c of row r sits at chunk c ^ (r % 8)), 8-row groups 1024 bytes apart; the
// tile must start 1024-byte aligned. Advancing the start address by 32 bytes (2 in the encoded
// address) selects the next MMA's K slice, for every element type.
__device__ __forceinline__ uint64_t sw128_kmajor_desc(uint32_t tile_addr) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((tile_addr & 0x3FFFF) >> 4);  // start address
  desc |= static_cast<uint64_t>(1) << 16;                      // leading offset: unused here
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;              // stride between 8-row groups
  desc |= static_cast<uint64_t>(1) << 62;                      // 128-byte swizzle
  return desc;
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across the asynchronous MMAs.
template <int kRegs>
__device__ __forceinline__ void wgmma_fence_operands(float (&acc)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// The SS atom (both operands K-major in shared memory) for a 64 x kCols tile of kElement.
template <ProxyElement kElement, int kCols>
struct ProxyMmaAtom;
template <>
struct ProxyMmaAtom<ProxyElement::kBFloat16, 128> {
  using type = gmma::MMA_64x128x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct ProxyMmaAtom<ProxyElement::kBFloat16, 256> {
  using type = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct ProxyMmaAtom<ProxyElement::kFloat16, 128> {
  using type = gmma::MMA_64x128x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct ProxyMmaAtom<ProxyElement::kFloat16, 256> {
  using type = gmma::MMA_64x256x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;
};
template <>
struct ProxyMmaAtom<ProxyElement::kE4M3, 128> {
  using type = gmma::MMA_64x128x32_F32E4M3E4M3_SS_TN<>;
};
template <>
struct ProxyMmaAtom<ProxyElement::kE4M3, 256> {
  using type = gmma::MMA_64x256x32_F32E4M3E4M3_SS_TN<>;
};

template <class Atom, int kRegs, size_t... kIndex>
__device__ __forceinline__ void gmma_on_registers(uint64_t desc_a, uint64_t desc_b,
                                                  float (&acc)[kRegs],
                                                  gmma::ScaleOut scale_d,
                                                  std::index_sequence<kIndex...>) {
  Atom::fma(desc_a, desc_b, acc[kIndex]..., scale_d);
}

// acc (64 rows x kCols columns, fp32, per warpgroup) = (accumulate ? acc : 0) + A * B^T for one
// MMA's K slice, A (64 rows) and B (kCols rows) K-major in shared memory. Thread t of the
// warpgroup holds acc[i] at row 16 * (t / 32) + (t % 32) / 4 + 8 * ((i / 2) % 2), column
// 8 * (i / 4) + 2 * (t % 4) + i % 2.
template <ProxyElement kElement, int kCols>
__device__ __forceinline__ void proxy_mma(float (&acc)[kCols / 2], uint64_t desc_a, uint64_t desc_b,
                                          bool accumulate) {
  using Atom = typename ProxyMmaAtom<kElement, kCols>::type;
  gmma_on_registers<Atom>(desc_a, desc_b, acc,
                          accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero,
                          std::make_index_sequence<kCols / 2>{});
}

}  // namespace cosa::kap
