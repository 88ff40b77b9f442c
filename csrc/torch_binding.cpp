// The torch binding of the CoSA ops: the op schemas (TORCH_LIBRARY). The binding is the only code of
// the project that includes torch: this file and csrc/binding/, where each implementation is
// registered (TORCH_LIBRARY_IMPL) beside its code:
//   messages.*       the errors' wording (Python's spellings of dtypes, shapes and floats);
//   contract.*       the ops' argument contract, which every path runs: the op cosa::check_args;
//   device_checks.*  the device-checks setting (the ops set_device_checks, device_checks_enabled)
//                    and the device pass over the index tensors;
//   cuda_limits.*    what the kernels need beyond the contract (CUDA build);
//   launchers.cpp    the CUDA implementations of kap, osk and prefill (CUDA build).
// The CPU implementations (the Python reference) and the fake kernels are registered from Python
// (cosa/ops.py); they run the same checks through the op cosa::check_args.

// Python.h comes first, as CPython asks. The extension is built against the stable ABI
// (Py_LIMITED_API); its module has no methods: importing it runs the registrations.
#include <Python.h>

#include <torch/library.h>

// The defaults of the tuning arguments come from cosa/defaults.py, their one source, through the
// macros of cosa_tuning.h (which cosa/tuning.py writes); the schemas below spell them.
#include "cosa_tuning.h"
#define COSA_SPELL_(value) #value
#define COSA_SPELL(value) COSA_SPELL_(value)
#define COSA_STRIDE_ARG "int stride=" COSA_SPELL(COSA_DEFAULT_STRIDE)
#define COSA_TOP_P_ARG "float top_p=" COSA_SPELL(COSA_DEFAULT_TOP_P)
#define COSA_SOFTMAX_SCALE_ARG "float? softmax_scale=" COSA_SPELL(COSA_DEFAULT_SOFTMAX_SCALE)
#define COSA_DELTA_ARG "float delta=" COSA_SPELL(COSA_DEFAULT_DELTA)
#define COSA_VOTE_ARG "str vote=\"" COSA_SPELL(COSA_DEFAULT_VOTE) "\""
#define COSA_PROXY_PRECISION_ARG "str proxy_precision=\"" COSA_SPELL(COSA_DEFAULT_PROXY_PRECISION) "\""

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(cosa, m) {
  m.def("kap(Tensor q, Tensor k_cache, Tensor page_table, Tensor cu_seqlens_q, Tensor seqused_k, "
        "int max_seqlen_q, int max_seqlen_k, " COSA_STRIDE_ARG ", " COSA_TOP_P_ARG ", " COSA_SOFTMAX_SCALE_ARG
        ", " COSA_PROXY_PRECISION_ARG ") -> (Tensor order, Tensor counts)");
  m.def("osk(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
        "Tensor seqused_k, Tensor order, Tensor counts, int max_seqlen_q, " COSA_SOFTMAX_SCALE_ARG ", "
        COSA_DELTA_ARG ", " COSA_VOTE_ARG ") -> (Tensor out, Tensor lse, Tensor skipped)");
  m.def("prefill(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
        "Tensor seqused_k, int max_seqlen_q, int max_seqlen_k, " COSA_STRIDE_ARG ", " COSA_TOP_P_ARG ", "
        COSA_SOFTMAX_SCALE_ARG ", " COSA_DELTA_ARG ", " COSA_VOTE_ARG ", " COSA_PROXY_PRECISION_ARG
        ") -> (Tensor out, Tensor lse, Tensor order, Tensor counts, Tensor skipped)");
  // The argument contract of the op named `op` (kap, osk or prefill), for any device: the arguments
  // that op lacks are None. A max length left None is derived from the lengths (read on the host);
  // returns (max_seqlen_q, max_seqlen_k). The contents of the index tensors are checked wherever
  // they can be read: always on the CPU, on CUDA while the device checks are on (or a length must
  // be derived) and no CUDA graph is being captured, never on 'meta'.
  m.def("check_args(str op, Tensor q, Tensor k_cache, Tensor page_table, Tensor cu_seqlens_q, Tensor seqused_k, "
        "Tensor? v_cache=None, Tensor? order=None, Tensor? counts=None, int? max_seqlen_q=None, "
        "int? max_seqlen_k=None, int? stride=None, float? top_p=None, float? softmax_scale=None, "
        "float? delta=None, str? vote=None, str? proxy_precision=None) -> (int max_seqlen_q, int max_seqlen_k)");
  // This thread's device-checks setting (binding/device_checks.h); set_ returns the previous one.
  m.def("set_device_checks(bool enabled) -> bool");
  m.def("device_checks_enabled() -> bool");
}
