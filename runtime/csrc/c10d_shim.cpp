// The collectives of the sharded trainer: libtorch's own c10d, reached from Rust through this
// small C ABI. A TCPStore does the rendezvous; ProcessGroupGloo moves CPU tensors and, when moult
// is built with the `cuda` feature and CUDA's headers, ProcessGroupNCCL moves CUDA tensors: each
// call goes to the backend of its tensor's device, as torch.distributed's "cpu:gloo,cuda:nccl"
// does. Tensors are tch's (`at::Tensor*`). Every function catches C++ exceptions and returns
// them as a message (docs/distributed.md).
#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#ifdef MOULT_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> gloo;
  // Null without a CUDA device (or without NCCL in this build).
  c10::intrusive_ptr<c10d::Backend> nccl;

  // The backend that moves `t`.
  c10d::Backend& on(const at::Tensor& t) {
    if (!t.is_cuda()) {
      return *gloo;
    }
    if (!nccl) {
      throw std::runtime_error(
          "a CUDA tensor, but this rank joined without a CUDA device (or moult was built without NCCL)");
    }
    return *nccl;
  }
};

char* message(const char* what) {
  return strdup(what);
}

template <typename F>
int guarded(char** err, F&& f) {
  try {
    f();
    return 0;
  } catch (const c10::Error& e) {
    // Without the C++ backtrace c10 appends to what().
    *err = message(e.what_without_backtrace());
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

void moult_c10d_free_message(char* err) {
  free(err);
}

// Rank 0 listens on `port` (the store), every rank connects to `host:port`; all wait for the
// others up to `timeout_ms`, which also bounds every collective after. With `cuda_device` >= 0
// the rank also joins an NCCL group on that device (CUDA tensors' collectives), whose waits block
// and throw on timeout like Gloo's.
void* moult_c10d_new(
    const char* host, int port, int rank, int world, int timeout_ms, int cuda_device, char** err) {
  Group* group = nullptr;
  guarded(err, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(port);
    opts.isServer = rank == 0;
    opts.numWorkers = world;
    opts.waitWorkers = true;
    opts.timeout = timeout;
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", store), rank, world, options);
    c10::intrusive_ptr<c10d::Backend> nccl;
    if (cuda_device >= 0) {
#ifdef MOULT_NCCL
      c10::cuda::set_device(static_cast<c10::DeviceIndex>(cuda_device));
      // Errors and timeouts surface as exceptions from wait(), not as a killed process.
      setenv("TORCH_NCCL_BLOCKING_WAIT", "1", 0);
      auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
      nccl_options->timeout = timeout;
      auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(
          c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, world, nccl_options);
      pg->eagerConnectSingleDevice(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(cuda_device)));
      nccl = pg;
#else
      throw std::runtime_error(
          "this moult was built without NCCL (the cargo feature `cuda` and CUDA's headers; docs/distributed.md)");
#endif
    }
    group = new Group{store, gloo, nccl};
  });
  return group;
}

void moult_c10d_drop(void* handle) {
  delete static_cast<Group*>(handle);
}

// `out` = the ranks' `input`s one after another (`[world * n]`).
int moult_c10d_all_gather(void* handle, at::Tensor* out, at::Tensor* input, char** err) {
  return guarded(err, [&] {
    auto* g = static_cast<Group*>(handle);
    g->on(*input)._allgather_base(*out, *input)->wait();
  });
}

// `out` (`[n]`) = this rank's chunk of the sum of the ranks' `input`s (`[world * n]`).
int moult_c10d_reduce_scatter(void* handle, at::Tensor* out, at::Tensor* input, char** err) {
  return guarded(err, [&] {
    auto* g = static_cast<Group*>(handle);
    g->on(*input)._reduce_scatter_base(*out, *input)->wait();
  });
}

// In place: op 0 sums, 1 takes the maximum.
int moult_c10d_all_reduce(void* handle, at::Tensor* tensor, int op, char** err) {
  return guarded(err, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    static_cast<Group*>(handle)->on(*tensor).allreduce(tensors, opts)->wait();
  });
}

int moult_c10d_broadcast(void* handle, at::Tensor* tensor, int root, char** err) {
  return guarded(err, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    static_cast<Group*>(handle)->on(*tensor).broadcast(tensors, opts)->wait();
  });
}

int moult_c10d_set_timeout(void* handle, int64_t ms, char** err) {
  return guarded(err, [&] {
    auto* g = static_cast<Group*>(handle);
    g->gloo->setTimeout(std::chrono::milliseconds(ms));
    if (g->nccl) {
      g->nccl->setTimeout(std::chrono::milliseconds(ms));
    }
  });
}

int moult_c10d_barrier(void* handle, char** err) {
  return guarded(err, [&] { static_cast<Group*>(handle)->gloo->barrier()->wait(); });
}

// Adds `delta` to the store's counter `key` (created at 0) and returns it in `out`: ranks'
// heartbeats, read back with delta 0. Safe beside a collective in progress (the store has its
// own connection and lock).
int moult_c10d_store_add(void* handle, const char* key, int64_t delta, int64_t* out, char** err) {
  return guarded(err, [&] {
    *out = static_cast<Group*>(handle)->store->add(std::string(key), delta);
  });
}

}  // extern "C"
