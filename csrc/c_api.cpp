// C wrappers around the launchers of cosa_params.h (see cosa_c_api.h).
#include "cosa_c_api.h"

#include <cstddef>
#include <cstring>
#include <type_traits>

#include "cosa_params.h"

namespace {

// The C structs of cosa_c_api.h are the C++ ones of cosa_params.h field for field: the same size,
// and each field at the same offset with the same size. A field added to one side and not the
// other fails to compile here, or changes the struct's size.
#define COSA_SAME_FIELD(c_struct, cxx_struct, field)                                           \
  static_assert(offsetof(c_struct, field) == offsetof(cxx_struct, field) &&                  \
                    sizeof(c_struct::field) == sizeof(cxx_struct::field),                    \
                #c_struct "::" #field " is not where " #cxx_struct "::" #field " is")

static_assert(std::is_standard_layout_v<cosa::PagedLayout> && std::is_standard_layout_v<cosa::KapParams> &&
              std::is_standard_layout_v<cosa::OskParams>);
static_assert(sizeof(cosa_paged_layout) == sizeof(cosa::PagedLayout));
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, q);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, q_row_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, q_head_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, k_cache);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, k_page_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, k_row_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, k_head_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, v_cache);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, v_page_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, v_row_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, v_head_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, page_table);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, page_table_stride);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, cu_seqlens_q);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, seqused_k);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, batch);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, num_heads_q);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, num_heads_kv);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, head_dim);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, page_size);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, num_pages);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, max_pages_per_seq);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, total_q);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, max_seqlen_q);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, max_seqlen_k);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, num_q_blocks);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, max_k_blocks);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, dtype);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, softmax_scale);
COSA_SAME_FIELD(cosa_paged_layout, cosa::PagedLayout, input_report);

static_assert(sizeof(cosa_kap_params) == sizeof(cosa::KapParams));
COSA_SAME_FIELD(cosa_kap_params, cosa::KapParams, layout);
COSA_SAME_FIELD(cosa_kap_params, cosa::KapParams, stride);
COSA_SAME_FIELD(cosa_kap_params, cosa::KapParams, top_p);
COSA_SAME_FIELD(cosa_kap_params, cosa::KapParams, precision);
COSA_SAME_FIELD(cosa_kap_params, cosa::KapParams, order);
COSA_SAME_FIELD(cosa_kap_params, cosa::KapParams, counts);
COSA_SAME_FIELD(cosa_kap_params, cosa::KapParams, workspace);

static_assert(sizeof(cosa_osk_params) == sizeof(cosa::OskParams));
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, layout);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, order);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, counts);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, delta);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, vote);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, out);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, out_row_stride);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, out_head_stride);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, lse);
COSA_SAME_FIELD(cosa_osk_params, cosa::OskParams, skipped);
#undef COSA_SAME_FIELD

// The enumerators' values, which the C side spells as integer constants.
static_assert(COSA_DTYPE_BFLOAT16 == int(cosa::DType::kBFloat16) && COSA_DTYPE_FLOAT16 == int(cosa::DType::kFloat16));
static_assert(COSA_PROXY_NATIVE == int(cosa::ProxyPrecision::kNative) &&
              COSA_PROXY_E4M3 == int(cosa::ProxyPrecision::kE4M3) &&
              COSA_PROXY_AUTO == int(cosa::ProxyPrecision::kAuto));
static_assert(COSA_VOTE_TILE == int(cosa::VoteScope::kTile) && COSA_VOTE_WARPGROUP == int(cosa::VoteScope::kWarpgroup));

// The C struct's bytes as the C++ struct (a copy: no aliasing of unrelated types).
template <class Cxx, class C>
Cxx to_cxx(const C& c) {
  static_assert(sizeof(Cxx) == sizeof(C) && std::is_trivially_copyable_v<Cxx>);
  Cxx cxx;
  std::memcpy(static_cast<void*>(&cxx), &c, sizeof(Cxx));
  return cxx;
}

template <class C, class Cxx>
void from_cxx(C* c, const Cxx& cxx) {
  static_assert(sizeof(Cxx) == sizeof(C) && std::is_trivially_copyable_v<Cxx>);
  std::memcpy(static_cast<void*>(c), &cxx, sizeof(Cxx));
}

}  // namespace

extern "C" {

size_t cosa_kap_params_size(void) { return sizeof(cosa_kap_params); }

size_t cosa_osk_params_size(void) { return sizeof(cosa_osk_params); }

void cosa_kap_params_init(cosa_kap_params* params) {
  if (params) from_cxx(params, cosa::KapParams{});
}

void cosa_osk_params_init(cosa_osk_params* params) {
  if (params) from_cxx(params, cosa::OskParams{});
}

size_t cosa_kap_workspace_bytes(const cosa_kap_params* params) {
  return params ? cosa::kap_workspace_bytes(to_cxx<cosa::KapParams>(*params)) : 0;
}

int cosa_run_kap(const cosa_kap_params* params, size_t workspace_bytes, void* stream) {
  if (!params) return cudaErrorInvalidValue;
  const cosa::KapParams kap = to_cxx<cosa::KapParams>(*params);
  const size_t needed = cosa::kap_workspace_bytes(kap);
  if (needed > 0 && (!kap.workspace || workspace_bytes < needed)) return cudaErrorInvalidValue;
  return cosa::run_kap(kap, static_cast<cudaStream_t>(stream));
}

int cosa_run_osk(const cosa_osk_params* params, void* stream) {
  if (!params) return cudaErrorInvalidValue;
  return cosa::run_osk(to_cxx<cosa::OskParams>(*params), static_cast<cudaStream_t>(stream));
}

const char* cosa_error_string(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // extern "C"
