// The OSK main loop (spec section 3): the producer's loads of Q, K and V into the stage pipeline
// (`load`: Q, then the listed blocks through osk_paged_kv.h), and the consumers' walk over the
// tile's ordered list (`mma`): S = Q K^T, masks, row max, the tile-wide skip vote, online softmax
// and O += P V.
#pragma once

#include <cfloat>

#include <cute/tensor.hpp>
#include <cutlass/arch/mma_sm90.h>
#include <cutlass/numeric_conversion.h>

#include "osk/osk_paged_kv.h"
#include "osk/osk_params.h"
#include "osk/osk_shared_storage.h"
#include "osk/osk_softmax.h"
#include "osk/osk_sync.h"
#include "osk/osk_traits.h"
#include "osk/osk_vote.h"

namespace cosa::osk {

using namespace cute;

// Issues one warpgroup-wide MMA over the whole K extent, C (+)= A B, as one commit group, and
// returns at once: the caller waits (warpgroup_wait) and fences C before touching it.
template <bool kZeroInit, class TiledMma, class FragA, class FragB, class FragC>
__device__ __forceinline__ void warpgroup_gemm_issue(TiledMma& tiled_mma, FragA& a, FragB const& b,
                                                     FragC& c) {
  // RS form (A from registers) unless the atom's A fragment is a shared-memory descriptor.
  constexpr bool kARegisters =
      !cute::is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kARegisters) { warpgroup_fence_operand(a); }
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  tiled_mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    cute::gemm(tiled_mma, a(_, _, kb), b(_, _, kb), c);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// A list entry, read through the non-coherent path as an asm statement, which the front end leaves
// where it stands; ptxas still schedules the load (in the skip kernel it issues it among S's wgmmas)
// and keeps the entry in ordinary registers, where __ldg's entry went into a uniform one at once.
__device__ __forceinline__ int load_list_entry(const int32_t* entry) {
  int value;
  asm volatile("ld.global.nc.b32 %0, [%1];" : "=r"(value) : "l"(entry));
  return value;
}

template <class Traits>
struct OskMainloop {
  using Element = typename Traits::Element;
  using Storage = OskSharedStorage<Traits>;
  using PagedKV = OskPagedKV<Traits>;
  using KVSource = typename PagedKV::KVSource;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kChunksPerRow = Traits::kChunksPerRow;
  static constexpr int kRowsPerPass = Traits::kRowsPerPass;
  static constexpr int kPasses = Traits::kPasses;
  // Shared-memory bytes between a thread's consecutive passes (kRowsPerPass rows further down).
  static constexpr uint32_t kPassBytes =
      uint32_t(Traits::swizzled_offset(kRowsPerPass, 0) * sizeof(Element));
  // Accumulator registers of one thread for a 64 x 128 slice of S: 2 rows x 32 columns.
  static constexpr int kScoresPerThread = kBlockN / 2;

  // ---------------------------------------------------------------- producer (warpgroup 0)

  __device__ static void load(const OskKernelParams& kp, const OskTile& t, Storage& storage) {
    const OskParams& args = kp.args;
    const PagedLayout& layout = args.layout;
    const int thread = threadIdx.x % Traits::kNumProducerThreads;
    const int lane = thread % 32;
    const int chunk = thread % kChunksPerRow;
    const int row0 = thread / kChunksPerRow;
    const uint32_t thread_smem_offset =
        uint32_t(Traits::swizzled_offset(row0, chunk) * sizeof(Element));
    if (t.count == 0) { return; }

    // Q, once per tile, by cp.async; rows past Lq are zero-filled.
    {
      const Element* q_head = static_cast<const Element*>(layout.q) +
                              static_cast<int64_t>(t.head) * layout.q_head_stride + chunk * 8;
      const uint32_t smem_q = smem_addr(storage.q) + thread_smem_offset;
      CUTE_UNROLL
      for (int pass = 0; pass < kPasses; ++pass) {
        const int row_in_seq = t.block_in_seq * Traits::kBlockM + row0 + pass * kRowsPerPass;
        const bool live = row_in_seq < t.seqlen_q;
        const Element* src =
            q_head + static_cast<int64_t>(t.q_start + row_in_seq) * layout.q_row_stride;
        cp_async_16_zfill(smem_q + pass * kPassBytes, live ? src : q_head, live);
      }
      MBarrier::arrive_on_cp_async(&storage.q_full);
    }
    const int warp = thread / 32;
    const int warps_per_cache = PagedKV::kv_load_warps(kp);
    if (warp >= 2 * warps_per_cache) {
      cp_async_wait_all();  // leave only once this thread's Q copies have landed
      return;
    }
    // Warps [0, warps_per_cache) load K, the next warps_per_cache load V.
    const bool loads_v = warp >= warps_per_cache;
    const int cache_warp = loads_v ? warp - warps_per_cache : warp;
    const KVSource src =
        loads_v ? KVSource{&kp.tma_v,
                           static_cast<const Element*>(layout.v_cache) +
                               static_cast<int64_t>(t.head_kv) * layout.v_head_stride,
                           layout.v_page_stride, layout.v_row_stride, smem_addr(storage.v)}
                : KVSource{&kp.tma_k,
                           static_cast<const Element*>(layout.k_cache) +
                               static_cast<int64_t>(t.head_kv) * layout.k_head_stride,
                           layout.k_page_stride, layout.k_row_stride, smem_addr(storage.k)};
    uint64_t* full = loads_v ? storage.v_full : storage.k_full;
    uint64_t* empty = loads_v ? storage.v_empty : storage.k_empty;
    const int32_t* list =
        args.order + (static_cast<int64_t>(t.head) * layout.num_q_blocks + t.row) *
                         layout.max_k_blocks;

    // The list is read 32 entries per warp load (the first 32 by the tile scheduler), and the
    // pages of entry k+1 are looked up in the page table while entry k's copies go out, so that
    // no copy waits on a page-table read.
    int list_window = t.first_entries;
    int block = __shfl_sync(0xffffffffu, list_window, 0);
    int page = PagedKV::lane_page(kp, t, block, lane);
    for (int k = 0; k < t.count; ++k) {
      const int stage = k % kStages;
      MBarrier::wait(&empty[stage], ((k / kStages) & 1) ^ 1);
      PagedKV::load_kv_block(kp, t, src, stage, block, page, &full[stage], cache_warp,
                             warps_per_cache, lane);
      const int next = k + 1;
      if ((next & 31) == 0 && next < t.count) {
        list_window = next + lane < t.count ? list[next + lane] : 0;
      }
      block = next < t.count ? __shfl_sync(0xffffffffu, list_window, next & 31) : -1;
      page = PagedKV::lane_page(kp, t, block, lane);
    }
    // Stay resident until this thread's copies have landed.
    cp_async_wait_all();
  }

  // ---------------------------------------------------------------- consumers (warpgroups 1, 2)

  // This thread's entries of S = Q K^T computed again, one fp32 dot product each, from the Q tile
  // and the K stage in shared memory (`k_tile`), for a row whose exponentials, taken before its
  // maximum was known, may have overflowed: a scaled logit about 87 or more above every earlier
  // block's (kOverflowLog2 powers of two). `warp` is 0..7 over both consumer warpgroups.
  template <class FragS>
  __device__ static void recompute_scores(FragS& tSrS, const Element* q_tile, const Element* k_tile,
                                          int warp, int lane) {
    using Chunk = cutlass::Array<Element, 8>;  // one 16-byte chunk of a row
    // A rolled loop over the entries, each result shifted in at the top of tSrS: registers indexed
    // at compile time (no local memory), and few values live beside O (unrolled, the entries'
    // addresses stayed live and made ptxas spill on the common path).
#pragma unroll 1
    for (int v = 0; v < kScoresPerThread; ++v) {
      const int row = AccumulatorLayout::tile_row(warp, lane, AccumulatorLayout::row_half(v));
      const int key = AccumulatorLayout::column(v, lane);
      float dot = 0.f;
#pragma unroll 1
      for (int chunk = 0; chunk < kChunksPerRow; ++chunk) {
        const Chunk q = *reinterpret_cast<const Chunk*>(q_tile + Traits::swizzled_offset(row, chunk));
        const Chunk k = *reinterpret_cast<const Chunk*>(k_tile + Traits::swizzled_offset(key, chunk));
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) { dot = fmaf(float(q[e]), float(k[e]), dot); }
      }
      CUTE_UNROLL
      for (int u = 0; u + 1 < kScoresPerThread; ++u) { tSrS(u) = tSrS(u + 1); }
      tSrS(kScoresPerThread - 1) = dot;
    }
  }

  // The tile's list in order: S = Q K^T, mask, row max, vote, online softmax, O += P V. Leaves O
  // unnormalised in tOrO, the row state in `softmax` and this warpgroup's count of skipped blocks
  // in `skipped`.
  template <bool kSkip, class FragO>
  __device__ static void mma(const OskKernelParams& kp, const OskTile& t, Storage& storage,
                             FragO& tOrO, OnlineSoftmax& softmax, int& skipped) {
    using TiledMmaQK = typename Traits::TiledMmaQK;
    using TiledMmaPV = typename Traits::TiledMmaPV;
    const OskParams& args = kp.args;
    const PagedLayout& layout = args.layout;
    const int thread = threadIdx.x - Traits::kNumProducerThreads;  // 0..255
    const int lane = thread % 32;
    const int warp = thread / 32;  // 0..7 over both consumer warpgroups
    const int warpgroup = warp / 4;

    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    // The wgmma operand descriptors depend only on the warpgroup and the stage. ptxas takes a value
    // broadcast from lane 0 as warp-uniform, and builds descriptors from such values in uniform
    // registers; from the thread index or the loop's stage it built them in ordinary registers
    // and moved them into uniform ones before every wgmma (48 R2UR per list entry, the step 804
    // instructions long instead of 761, the 16 wgmmas of a step issued between those moves).
    auto warp_uniform = [](int x) { return __shfl_sync(0xffffffffu, x, 0); };
    const int warpgroup_first_thread = warp_uniform(warpgroup) * 128;
    auto thread_qk = mma_qk.get_thread_slice(warpgroup_first_thread);
    auto thread_pv = mma_pv.get_thread_slice(warpgroup_first_thread);
    Tensor sQ = make_tensor(make_smem_ptr(storage.q), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(storage.k), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(storage.v), typename Traits::SmemLayoutVt{});
    Tensor tSrQ = thread_qk.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thread_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
    Tensor tOrV = thread_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<Traits::kBlockM>, Int<kBlockN>>{});
    static_assert(decltype(size(tSrS))::value == kScoresPerThread);
    // P as the A operand of the RS MMA: the accumulator's register order is already the
    // A-fragment order (pairs of 8-column groups form one k16 slice).
    using LayoutP = Layout<Shape<Shape<_2, _2, _2>, _1, Int<kBlockN / 16>>>;
    Tensor tOrP = make_tensor<Element>(LayoutP{});

    TileMask mask;
    mask.seqlen_k = t.seqlen_k;
    mask.first_diagonal = t.first_diagonal;
    bool row_live[2];
    CUTE_UNROLL
    for (int rh = 0; rh < 2; ++rh) {
      const int row_in_seq =
          t.block_in_seq * Traits::kBlockM + AccumulatorLayout::tile_row(warp, lane, rh);
      row_live[rh] = row_in_seq < t.seqlen_q;
      mask.query_pos[rh] = t.seqlen_k - t.seqlen_q + row_in_seq;
    }

    // tau = ln(delta / N) in scaled-logit units; compared here on raw logits. delta <= 0 or
    // delta >= N switches the skip off for this sequence (spec section 3); a launch with delta <= 0
    // compiles the vote out (kSkip).
    const bool skip_enabled = kSkip && args.delta > 0.f && args.delta < float(t.seqlen_k);
    const float tau_raw =
        skip_enabled ? logf(args.delta / float(t.seqlen_k)) / layout.softmax_scale : 0.f;
    // exp_against_max's headroom in raw-logit units; finite, so that a row whose running max is
    // still -inf compares against -inf (not NaN) even where a tiny softmax scale makes it overflow.
    const float headroom_raw = fminf(OnlineSoftmax::kHeadroomLog2 / kp.scale_log2, FLT_MAX);
    const SkipVote vote(args.vote, warpgroup);
    const GemmTurns turns(warpgroup);

    const int32_t* list = args.order + (static_cast<int64_t>(t.head) * layout.num_q_blocks +
                                        t.row) * layout.max_k_blocks;
    if (t.count == 0) { return; }  // nothing was loaded; the epilogue writes zeros and -inf
    turns.start();
    MBarrier::wait(&storage.q_full, 0);

    // Intra-warpgroup overlap (as FlashAttention-3): the P V product of the last computed block
    // is issued right after S = Q K^T of the next one and runs while that block's mask, max and
    // vote execute (ptxas places the wait for it among the first exponentials; forcing it after
    // them measured no faster, docs/journal.md). `pv_pending` says P (in tOrP) and its V stage
    // still await that product.
    //
    // One step per list entry, compiled four times: with a P V product to issue (kPvPending) or
    // without, and for a block that needs the mask (kMasked) or not. Within each version every
    // wgmma issued is waited for on every path, so ptxas can prove that no accumulator is read
    // while a wgmma writing it may be in flight; a runtime flag tested around the issue and around
    // the wait instead makes it serialise every wgmma of the kernel (ptxas C7514), which costs the
    // overlap. The common step (a P V pending, no mask) runs in a loop of its own, with no branch
    // to another version and no mask test between S and the row max.
    int pv_stage = 0;
    uint32_t pv_parity = 0;
    auto finish_pv = [&]() {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
      warpgroup_fence_operand(tOrP);
      __syncwarp();
      if (lane == 0) { MBarrier::arrive(&storage.v_empty[pv_stage]); }
    };
    // The list entry of the next step is read one step ahead: which version runs depends on it.
    int next_block = warp_uniform(t.first_entries);
    // Returns whether the step left a P awaiting its P V product (false when the block was skipped).
    auto step = [&](int k, int block, auto pv_pending_tag, auto masked_tag) -> bool {
      constexpr bool kPvPending = decltype(pv_pending_tag)::value;
      constexpr bool kMasked = decltype(masked_tag)::value;
      const int stage = warp_uniform(k % kStages);
      const uint32_t parity = (k / kStages) & 1;

      MBarrier::wait(&storage.k_full[stage], parity);
      turns.wait_mine();
      warpgroup_gemm_issue</*kZeroInit=*/true>(mma_qk, tSrQ, tSrK(_, _, _, stage), tSrS);
      // The skip kernel loads the next list entry here, after S's issue: loaded at the step's start,
      // ptxas moved it into a uniform register at once, and the step waited for the load before its
      // K wait (with the load here, 0.971-0.988x the time side by side). The kernel without the
      // skip loads it at the step's start: here, its step took 1.03-1.055x the time.
      if constexpr (kSkip) {
        if (k + 1 < t.count) { next_block = load_list_entry(list + k + 1); }
      }
      if constexpr (kPvPending) {
        MBarrier::wait(&storage.v_full[pv_stage], pv_parity);
        warpgroup_gemm_issue</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, warp_uniform(pv_stage)),
                                                  tOrO);
        turns.pass();
        warpgroup_wait<1>();  // S is ready; the P V product may still run
      } else {
        turns.pass();
        warpgroup_wait<0>();
      }
      warpgroup_fence_operand(tSrS);
      // A later block of the kernel without the skip takes its exponentials before its row maxima
      // are known (OnlineSoftmax::exp_against_max): they run at once, and the maxima's tree fills
      // the issue slots between them. It releases the K stage after its overflow test, since a
      // row that far above its running max needs S again.
      constexpr bool kSpeculative = !kSkip && kPvPending;
      if constexpr (!kSpeculative) {
        __syncwarp();
        if (lane == 0) { MBarrier::arrive(&storage.k_empty[stage]); }
      }

      // Rows past Lq are not masked: they never vote and are never stored.
      if constexpr (kMasked) { mask.apply(tSrS, block, kBlockN, lane); }
      // The vote needs no row maximum: a row skips iff m_loc - max(m_old, m_loc) < tau, and that
      // holds iff it holds for each thread's maximum over its own columns in place of m_loc (the
      // thread holding m_loc decides it; the others' maxima are no larger, and the subtraction is
      // monotone). The barrier ANDs the threads' verdicts.
      float thread_maxima[2];
      OnlineSoftmax::thread_max(tSrS, thread_maxima);
      // The row maxima (the quad's shuffles) come before the vote all the same: a computed block
      // then finds them done when the barrier releases it (nothing skipped 0.987x the time with them
      // after the vote), and a skipped block pays them (every later block skipped 1.030x).
      float block_max[2];
      if constexpr (!kSpeculative) { OnlineSoftmax::quad_max(thread_maxima, block_max); }

      // The vote: skip iff every live row of the voters says m_loc - m_new < tau. The barrier runs
      // on every step of the skip kernel, the list's first block and a sequence whose delta
      // switches the skip off included (they vote not to skip): behind a branch, its answer did not
      // reach the code after it as uniform, and ptxas kept divergence checks there.
      if constexpr (kSkip) {
        // Bitwise, not short-circuit: each row's test is a few compares, cheaper than the
        // branches that `&&` and `||` would put on the step's path.
        bool rows_skip = skip_enabled & (k > 0);
        CUTE_UNROLL
        for (int rh = 0; rh < 2; ++rh) {
          const float p = thread_maxima[rh];
          rows_skip &= !row_live[rh] | (p == -INFINITY) | (p - fmaxf(softmax.max[rh], p) < tau_raw);
        }
        // The barrier gives every thread the same answer; said again through a warp vote, ptxas
        // sees it uniform and drops the divergence checks after the branch.
        if (__all_sync(0xffffffffu, vote.decide(rows_skip))) {
          // No exp, no row sum, no rescale, no P V; the V stage is still waited for and released
          // so that the pipeline's phases stay in step with the producer.
          ++skipped;
          if constexpr (kPvPending) { finish_pv(); }
          MBarrier::wait(&storage.v_full[stage], parity);
          __syncwarp();
          if (lane == 0) { MBarrier::arrive(&storage.v_empty[stage]); }
          return false;
        }
      }

      float rescale[2];
      // The exact step: the row maxima, then the exponentials against the new running max.
      auto update_exactly = [&]() {
        float new_max[2];
        CUTE_UNROLL
        for (int rh = 0; rh < 2; ++rh) { new_max[rh] = fmaxf(softmax.max[rh], block_max[rh]); }
        softmax.update(tSrS, new_max, kp.scale_log2, rescale);
      };
      if constexpr (kSpeculative) {
        float block_sums[2];
        softmax.exp_against_max(tSrS, kp.scale_log2, block_sums);
        bool beyond_headroom = false;
        bool may_overflow = false;
        CUTE_UNROLL
        for (int rh = 0; rh < 2; ++rh) {
          // +inf for a row whose running max is still -inf: it took its exponentials against 0,
          // where they may have underflowed, and needs S again too (only -inf logits leave a
          // computed block's rows at -inf).
          const float above = softmax.exponent_above_max(thread_maxima[rh], rh, kp.scale_log2);
          may_overflow |= above > OnlineSoftmax::kOverflowLog2;
          beyond_headroom |= thread_maxima[rh] > softmax.max[rh] + headroom_raw;
        }
        // Warp-wide, so that the branches below are uniform.
        const bool recompute = __any_sync(0xffffffffu, may_overflow);
        if (lane == 0 && !recompute) { MBarrier::arrive(&storage.k_empty[stage]); }
        finish_pv();
        // A row that needs S again takes the exact step, which releases the K stage after the
        // recomputation: `above` is the rounding error of the running max's exponent where that
        // max reaches 2^31 / sigma', and can pass the overflow bound with no block max above m.
        if (recompute || __any_sync(0xffffffffu, beyond_headroom)) {
          if (recompute) {
            recompute_scores(tSrS, storage.q, storage.k + stage * Traits::kTileElems, warp, lane);
            __syncwarp();
            if (lane == 0) { MBarrier::arrive(&storage.k_empty[stage]); }
            if constexpr (kMasked) { mask.apply(tSrS, block, kBlockN, lane); }
            OnlineSoftmax::thread_max(tSrS, thread_maxima);
            OnlineSoftmax::quad_max(thread_maxima, block_max);
            update_exactly();
          } else {
            OnlineSoftmax::quad_max(thread_maxima, block_max);
            softmax.rebase(tSrS, block_max, block_sums, kp.scale_log2, rescale);
          }
          OnlineSoftmax::rescale_o(tOrO, rescale);
        } else {
          CUTE_UNROLL
          for (int rh = 0; rh < 2; ++rh) { softmax.sum[rh] += block_sums[rh]; }
        }
      } else {
        update_exactly();
        // O and P are free once the previous P V product is done.
        if constexpr (kPvPending) { finish_pv(); }
        OnlineSoftmax::rescale_o(tOrO, rescale);
      }
      {
        using Converter = cutlass::NumericArrayConverter<Element, float, kScoresPerThread>;
        auto const& src =
            *reinterpret_cast<cutlass::Array<float, kScoresPerThread> const*>(tSrS.data());
        auto& dst = *reinterpret_cast<cutlass::Array<Element, kScoresPerThread>*>(
            raw_pointer_cast(tOrP.data()));
        dst = Converter{}(src);
      }
      pv_stage = stage;
      pv_parity = parity;
      return true;
    };
    auto run_step = [&](int k, auto pv_pending_tag) -> bool {
      const int block = next_block;
      if constexpr (!kSkip) {
        if (k + 1 < t.count) { next_block = __ldg(list + k + 1); }
      }
      return mask.needed(block, kBlockN) ? step(k, block, pv_pending_tag, cute::true_type{})
                                         : step(k, block, pv_pending_tag, cute::false_type{});
    };
    bool pv_pending = false;
    int k = 0;
    while (k < t.count) {
      pv_pending = run_step(k++, cute::false_type{});  // until a block is computed
      while (pv_pending && k < t.count) { pv_pending = run_step(k++, cute::true_type{}); }
    }
    if (pv_pending) {
      MBarrier::wait(&storage.v_full[pv_stage], pv_parity);
      warpgroup_gemm_issue</*kZeroInit=*/false>(mma_pv, tOrP, tOrV(_, _, _, warp_uniform(pv_stage)),
                                                tOrO);
      finish_pv();
    }
  }
};

}  // namespace cosa::osk
