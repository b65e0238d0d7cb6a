// The collectives of the sharded trainer on CPU: libtorch's own c10d (TCPStore for the
// rendezvous, ProcessGroupGloo for the collectives), reached from Rust through this small C ABI.
// Tensors are tch's (`at::Tensor*`). Every function catches C++ exceptions and returns them as
// a message (docs/distributed.md).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
};

char* message(const char* what) {
  return strdup(what);
}

template <typename F>
int guarded(char** err, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    *err = message(e.what());
  } catch (...) {
    *err = message("unknown C++ exception");
  }
  return 1;
}

c10d::ReduceOp reduce_op(int op) {
  return op == 1 ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
}

}  // namespace

extern "C" {

void moult_gloo_free_message(char* err) {
  free(err);
}

// Rank 0 listens on `port` (the store), every rank connects to `host:port`; all wait for the
// others up to `timeout_ms`, which also bounds every collective after.
void* moult_gloo_new(const char* host, int port, int rank, int world, int timeout_ms, char** err) {
  Group* group = nullptr;
  guarded(err, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(port);
    opts.isServer = rank == 0;
    opts.numWorkers = world;
    opts.waitWorkers = true;
    opts.timeout = timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, options);
    group = new Group{store, pg};
  });
  return group;
}

void moult_gloo_drop(void* handle) {
  delete static_cast<Group*>(handle);
}

// `out` = the ranks' `input`s one after another (`[world * n]`).
int moult_gloo_all_gather(void* handle, at::Tensor* out, at::Tensor* input, char** err) {
  return guarded(err, [&] {
    static_cast<Group*>(handle)->pg->_allgather_base(*out, *input)->wait();
  });
}

// `out` (`[n]`) = this rank's chunk of the sum of the ranks' `input`s (`[world * n]`).
int moult_gloo_reduce_scatter(void* handle, at::Tensor* out, at::Tensor* input, char** err) {
  return guarded(err, [&] {
    static_cast<Group*>(handle)->pg->_reduce_scatter_base(*out, *input)->wait();
  });
}

// In place: op 0 sums, 1 takes the maximum.
int moult_gloo_all_reduce(void* handle, at::Tensor* tensor, int op, char** err) {
  return guarded(err, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    static_cast<Group*>(handle)->pg->allreduce(tensors, opts)->wait();
  });
}

int moult_gloo_broadcast(void* handle, at::Tensor* tensor, int root, char** err) {
  return guarded(err, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    static_cast<Group*>(handle)->pg->broadcast(tensors, opts)->wait();
  });
}

int moult_gloo_set_timeout(void* handle, int64_t ms, char** err) {
  return guarded(err, [&] {
    static_cast<Group*>(handle)->pg->setTimeout(std::chrono::milliseconds(ms));
  });
}

int moult_gloo_barrier(void* handle, char** err) {
  return guarded(err, [&] { static_cast<Group*>(handle)->pg->barrier()->wait(); });
}

// Adds `delta` to the store's counter `key` (created at 0) and returns it in `out`: ranks'
// heartbeats, read back with delta 0. Safe beside a collective in progress (the store has its
// own connection and lock).
int moult_gloo_store_add(void* handle, const char* key, int64_t delta, int64_t* out, char** err) {
  return guarded(err, [&] {
    *out = static_cast<Group*>(handle)->store->add(std::string(key), delta);
  });
}

}  // extern "C"
