// Names of the threads jax_moe starts and keeps (Linux allows 15 characters). They show in
// top, gdb and /proc/<pid>/task/*/comm, and the tests find a communicator's threads by them
// (jax_moe.build_info()["thread_names"]): gRPC and XLA start and reap threads of their own
// at any time, so counting the process's threads cannot tell whether close() ended ours.
#pragma once

#include <pthread.h>

#include <thread>

namespace jax_moe {

inline constexpr char kTransferEngineThreadName[] = "jaxmoe-fabric";  // progress, one per engine
inline constexpr char kHostProxyThreadName[] = "jaxmoe-proxy";        // one per proxied GPU

// Names `thread` from the thread that started it, so the name is set before the constructor
// that started it returns (a check that reads names right after cannot race the new thread).
// A name the system refuses leaves the thread unnamed, nothing else.
inline void name_thread(std::thread& thread, const char* name) {
  pthread_setname_np(thread.native_handle(), name);
}

}  // namespace jax_moe
