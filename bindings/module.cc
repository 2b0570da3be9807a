// jax_cake_gdn._cuda: the one nanobind module. It owns no logic; it hands XLA the FFI handlers.
//
// Convention (one for the whole project):
//   * Handler bodies live next to their kernels, in cuda/<family>.cu, defined with
//     JCG_FFI_HANDLER(<name>, impl) (the binding read from impl's typed parameters; see
//     cuda/common.cuh and cuda/handler.cuh). nvcc compiles those files into the static
//     library jcg_kernels; this file is plain host C++ and never sees a kernel.
//   * bindings/handlers.inc lists every handler by name, one JCG_HANDLER(name) line each. This
//     file expands that list twice: extern "C" declarations, then the {target_name: capsule} table.
//   * Python (jax_cake_gdn/primitives/cuda.py) calls registrations() and registers each capsule
//     with jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

#define JCG_HANDLER(name) extern "C" XLA_FFI_Error* jax_cake_gdn_##name(XLA_FFI_CallFrame*);
#include "handlers.inc"
#undef JCG_HANDLER

namespace {

struct Handler {
  const char* target;
  XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*);
};

constexpr Handler kHandlers[] = {
#define JCG_HANDLER(name) {"jax_cake_gdn_" #name, &jax_cake_gdn_##name},
#include "handlers.inc"
#undef JCG_HANDLER
};

// XLA takes a PyCapsule wrapping the handler's address (as jax.ffi.pycapsule makes).
nb::capsule to_capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jax-cake-gdn CUDA kernels as XLA FFI handlers (sm_90a).";
  m.def(
      "registrations",
      [] {
        nb::dict d;
        for (const Handler& h : kHandlers) d[h.target] = to_capsule(h.fn);
        return d;
      },
      "{target_name: PyCapsule} for every FFI handler; register with platform='CUDA'.");
  m.attr("cuda_arch") = "sm_90a";
}
