// CPU thread count for every kernel. See Note [CPU threads].
#include <omp.h>

#include <atomic>
#include <cstdlib>

#include "pyasync/common.h"

namespace pyasync {

// Note [CPU threads]
// The engine runs kernels on its own thread while the training thread keeps computing, so the
// kernels must not grab every core by default when the user says otherwise. Precedence: a per-call
// `num_threads` > set_num_threads() > the PYASYNC_NUM_THREADS environment variable > OpenMP's
// default (OMP_NUM_THREADS or the core count).

namespace {
std::atomic<int32_t> g_num_threads{0};

int env_threads() {
  static const int v = [] {
    const char* s = std::getenv("PYASYNC_NUM_THREADS");
    if (s == nullptr || *s == '\0') return 0;
    const int n = std::atoi(s);
    return n > 0 ? n : 0;
  }();
  return v;
}
}  // namespace

void set_num_threads(int32_t n) {
  PYASYNC_CHECK_ARG(n >= 0, "num_threads must be >= 0 (0 restores the default)");
  g_num_threads.store(n);
}

int get_num_threads() { return resolve_num_threads(0); }

int resolve_num_threads(int32_t requested) {
  if (requested > 0) return requested;
  const int32_t g = g_num_threads.load();
  if (g > 0) return g;
  const int e = env_threads();
  if (e > 0) return e;
  return omp_get_max_threads();
}

}  // namespace pyasync
