// Our FlashAttention's launch plans replayed from C++: the autograd node and the kernel launches of a repeat
// call, with no Python between `flash_attention` and cuLaunchKernelEx (see native_launch.py for why).
//
// A plan is registered from Python once per input signature (launch_plan.py captured its kernels): for each
// kernel, the CUfunction Triton loaded, the grid, the launch configuration Triton's own launcher would use
// (warps, CTAs per cluster, shared memory, cooperative / PDL flags, global scratch per program) and one entry
// per non-constexpr parameter: a tensor slot (filled per call with that tensor's address), a host tensor descriptor
// over a slot's tensor (encoded per call at that address) or a scalar. The parameters are packed as Triton's
// generated launcher packs them (backends/nvidia/driver.py, make_launcher): each value in its own storage (a
// descriptor's 128-byte CUtensorMap by value), then the global and profile scratch pointers.
//
// It builds against torch's CPU headers and Triton's bundled cuda.h: the driver is opened with dlopen and the
// current stream comes through c10's device-generic interface, so nothing links against CUDA here.

#include <torch/extension.h>

#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "cuda.h"

namespace {

// Tensor slots, in the order native_launch.SLOTS names them.
enum Slot : int64_t {
  kQ, kK, kV, kOut, kLse, kGradOut, kDelta, kDk, kDv, kDq, kDqAccum, kRowMax, kRowInvSum, kNumSlots
};

// Parameter kinds, in the order native_launch.ARG_KINDS names them.
enum ArgKind : int64_t {
  kTensor, kNullPointer, kI1, kI8, kI16, kI32, kI64, kU8, kU16, kU32, kU64, kF32, kF64, kTensorMap
};

struct Arg {
  int64_t kind;
  int64_t integer;  // the slot for kTensor, the index into Kernel::maps for kTensorMap, the value for integer kinds
  double real;      // the value for kF32 / kF64
};

// A host tensor descriptor, as Triton's fill_tma_descriptor encodes it (backends/nvidia/driver.c): everything but
// the address is fixed by the plan's signature. Dimensions innermost first, strides in bytes (rank - 1 of them).
struct TensorMapSpec {
  int64_t slot, data_type, swizzle, fill;
  uint32_t rank;
  std::array<cuuint64_t, 5> dims{}, byte_strides{};
  std::array<cuuint32_t, 5> box{};
};

struct Kernel {
  CUfunction function;
  std::array<uint32_t, 3> grid;
  int64_t num_warps, num_ctas, shared_memory, cooperative, pdl, global_scratch;
  std::vector<Arg> args;
  std::vector<TensorMapSpec> maps;
};

enum Accum : int64_t { kNoAccum, kGluonAccum, kTlAccum };

struct Plan {
  std::vector<Kernel> forward, backward;
  int64_t accum;  // where dQ goes: dq (two passes) or an fp32 accumulator (one pass)
  double accum_scale;  // applied to the tl accumulator; unused otherwise
  int64_t accum_rows, accum_cols;
  bool row_stats;  // fp32-accurate dots: the row statistics pass writes each row's max and inverse sum too
};

// Driver entry points, looked up once in libcuda (nothing links against CUDA at build time).
template <typename Function>
Function driver_symbol(const char* name) {
  static void* library = dlopen("libcuda.so.1", RTLD_LAZY);
  TORCH_CHECK(library != nullptr, "cs336 native attention: cannot open libcuda.so.1");
  auto symbol = reinterpret_cast<Function>(dlsym(library, name));
  TORCH_CHECK(symbol != nullptr, "cs336 native attention: libcuda.so.1 has no ", name);
  return symbol;
}

using LaunchEx = CUresult (*)(const CUlaunchConfig*, CUfunction, void**, void**);
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

LaunchEx launch_ex() {
  static LaunchEx function = driver_symbol<LaunchEx>("cuLaunchKernelEx");
  return function;
}

// The driver API launches into the calling thread's current context, and autograd's device thread may have
// none yet. On the H200, a process's first backward through a native plan crashed (SIGSEGV on that thread)
// unless some ATen kernel had run on the thread before. c10::cuda::SetDevice (c10/cuda/CUDAFunctions.cpp) skips
// cudaSetDevice when cudaGetDevice already returns the device, as it does (0) on a fresh thread, and
// cudaGetDevice binds no context. As Triton's own launcher does, bind the device's primary context where none
// is current (not yet run on a GPU; test_native_first_backward_in_a_fresh_process checks it).
void ensure_context(const c10::Device& device) {
  using GetCurrent = CUresult (*)(CUcontext*);
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using PrimaryRetain = CUresult (*)(CUcontext*, CUdevice);
  using SetCurrent = CUresult (*)(CUcontext);
  static auto get_current = driver_symbol<GetCurrent>("cuCtxGetCurrent");
  static auto device_get = driver_symbol<DeviceGet>("cuDeviceGet");
  static auto primary_retain = driver_symbol<PrimaryRetain>("cuDevicePrimaryCtxRetain");
  static auto set_current = driver_symbol<SetCurrent>("cuCtxSetCurrent");
  CUcontext context = nullptr;
  TORCH_CHECK(get_current(&context) == CUDA_SUCCESS, "cs336 native attention: cuCtxGetCurrent failed");
  if (context != nullptr) return;
  CUdevice handle;
  TORCH_CHECK(device_get(&handle, device.index()) == CUDA_SUCCESS, "cs336 native attention: cuDeviceGet failed");
  TORCH_CHECK(primary_retain(&context, handle) == CUDA_SUCCESS,
              "cs336 native attention: cuDevicePrimaryCtxRetain failed");
  TORCH_CHECK(set_current(context) == CUDA_SUCCESS, "cs336 native attention: cuCtxSetCurrent failed");
}

// A descriptor over `address` with the spec's shape, strides and tiles (no element strides, no interleave, 128-byte
// L2 promotion: Triton's choices).
CUtensorMap encode(const TensorMapSpec& spec, uint64_t address) {
  static EncodeTiled encode_tiled = driver_symbol<EncodeTiled>("cuTensorMapEncodeTiled");
  const std::array<cuuint32_t, 5> element_strides{1, 1, 1, 1, 1};
  CUtensorMap map;
  CUresult result = encode_tiled(&map, static_cast<CUtensorMapDataType>(spec.data_type), spec.rank,
                                 reinterpret_cast<void*>(address), spec.dims.data(), spec.byte_strides.data(),
                                 spec.box.data(), element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE,
                                 static_cast<CUtensorMapSwizzle>(spec.swizzle), CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                 static_cast<CUtensorMapFloatOOBfill>(spec.fill));
  TORCH_CHECK(result == CUDA_SUCCESS, "cs336 native attention: cuTensorMapEncodeTiled failed with CUresult ",
              int(result));
  return map;
}

// Each parameter in 8 bytes of its own, written as its C type: the launcher passes pointers to these (a descriptor's
// entry holds its tensor's address; `launch` passes the encoded CUtensorMap in its place).
std::vector<uint64_t> pack(const Kernel& kernel, const std::array<uint64_t, kNumSlots>& addresses,
                           uint64_t global_scratch) {
  std::vector<uint64_t> storage(kernel.args.size() + 2, 0);
  for (size_t i = 0; i < kernel.args.size(); ++i) {
    const Arg& arg = kernel.args[i];
    void* slot = &storage[i];
    switch (arg.kind) {
      case kTensor: storage[i] = addresses.at(arg.integer); break;
      case kTensorMap: storage[i] = addresses.at(kernel.maps.at(arg.integer).slot); break;
      case kNullPointer: storage[i] = 0; break;
      case kI1: case kI8: { int8_t v = static_cast<int8_t>(arg.integer); std::memcpy(slot, &v, sizeof v); break; }
      case kI16: { int16_t v = static_cast<int16_t>(arg.integer); std::memcpy(slot, &v, sizeof v); break; }
      case kI32: { int32_t v = static_cast<int32_t>(arg.integer); std::memcpy(slot, &v, sizeof v); break; }
      case kI64: { int64_t v = arg.integer; std::memcpy(slot, &v, sizeof v); break; }
      case kU8: { uint8_t v = static_cast<uint8_t>(arg.integer); std::memcpy(slot, &v, sizeof v); break; }
      case kU16: { uint16_t v = static_cast<uint16_t>(arg.integer); std::memcpy(slot, &v, sizeof v); break; }
      case kU32: { uint32_t v = static_cast<uint32_t>(arg.integer); std::memcpy(slot, &v, sizeof v); break; }
      case kU64: { uint64_t v = static_cast<uint64_t>(arg.integer); std::memcpy(slot, &v, sizeof v); break; }
      case kF32: { float v = static_cast<float>(arg.real); std::memcpy(slot, &v, sizeof v); break; }
      case kF64: { double v = arg.real; std::memcpy(slot, &v, sizeof v); break; }
      default: TORCH_CHECK(false, "cs336 native attention: unknown parameter kind ", arg.kind);
    }
  }
  storage[kernel.args.size()] = global_scratch;  // then profile scratch: 0 (plans refuse kernels that need it)
  return storage;
}

// Dry runs: with recording on, launches append their packed parameters here instead of running (tests check
// the C++ autograd node's allocations and slot addresses on CPU tensors this way).
std::mutex record_mutex;
bool recording = false;
std::vector<std::vector<uint64_t>> recorded;

void launch(const Kernel& kernel, const std::array<uint64_t, kNumSlots>& addresses, const c10::Device& device) {
  at::Tensor scratch;  // Triton's per-program global scratch (in-kernel tensor descriptors), stream-ordered
  uint64_t scratch_address = 0;
  if (kernel.global_scratch > 0) {
    int64_t bytes = int64_t(kernel.grid[0]) * kernel.grid[1] * kernel.grid[2] * kernel.num_ctas * kernel.global_scratch;
    scratch = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    scratch_address = reinterpret_cast<uint64_t>(scratch.data_ptr());
  }
  std::vector<uint64_t> storage = pack(kernel, addresses, scratch_address);
  {
    std::lock_guard<std::mutex> lock(record_mutex);
    if (recording) {
      recorded.push_back(storage);
      return;
    }
  }
  std::vector<void*> params(storage.size());
  for (size_t i = 0; i < storage.size(); ++i) params[i] = &storage[i];
  std::vector<CUtensorMap> maps(kernel.maps.size());  // (CUtensorMap is 64-byte aligned: so is each entry)
  for (size_t i = 0; i < kernel.args.size(); ++i) {
    if (kernel.args[i].kind != kTensorMap) continue;
    size_t index = size_t(kernel.args[i].integer);
    maps[index] = encode(kernel.maps[index], storage[i]);
    params[i] = &maps[index];
  }

  c10::Stream stream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device);
  CUlaunchAttribute attributes[4];
  CUlaunchConfig config{};
  config.gridDimX = kernel.grid[0] * kernel.num_ctas;
  config.gridDimY = kernel.grid[1];
  config.gridDimZ = kernel.grid[2];
  config.blockDimX = 32 * kernel.num_warps;
  config.blockDimY = 1;
  config.blockDimZ = 1;
  config.sharedMemBytes = kernel.shared_memory;
  config.hStream = reinterpret_cast<CUstream>(stream.native_handle());
  config.attrs = attributes;
  unsigned int count = 0;
  if (kernel.pdl) {
    attributes[count].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attributes[count++].value.programmaticStreamSerializationAllowed = 1;
  }
  if (kernel.cooperative) {
    attributes[count].id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attributes[count++].value.cooperative = 1;
  }
  if (kernel.num_ctas != 1) {
    attributes[count].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attributes[count].value.clusterDim.x = kernel.num_ctas;
    attributes[count].value.clusterDim.y = 1;
    attributes[count++].value.clusterDim.z = 1;
    attributes[count].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE;
    attributes[count++].value.clusterSchedulingPolicyPreference = CU_CLUSTER_SCHEDULING_POLICY_SPREAD;
  }
  config.numAttrs = count;
  if (config.gridDimX * config.gridDimY * config.gridDimZ == 0) return;
  ensure_context(device);
  CUresult result = launch_ex()(&config, kernel.function, params.data(), nullptr);
  TORCH_CHECK(result == CUDA_SUCCESS, "cs336 native attention: cuLaunchKernelEx failed with CUresult ", int(result));
}

uint64_t address(const at::Tensor& t) { return t.defined() ? reinterpret_cast<uint64_t>(t.data_ptr()) : 0; }

// The signature a plan was made for: everything the Python launch path decided on and Triton specialised on
// (launch_plan.tensor_signature, plus the flags).
std::vector<int64_t> signature(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                               int64_t backward) {
  std::vector<int64_t> key{causal, backward, at::globalContext().allowTF32CuBLAS()};
  for (const at::Tensor* t : {&q, &k, &v}) {
    key.push_back(t->dim());
    for (int64_t size : t->sizes()) key.push_back(size);
    for (int64_t stride : t->strides()) key.push_back(stride);
    key.push_back(static_cast<int64_t>(t->scalar_type()));
    key.push_back(static_cast<int64_t>(t->device().type()));
    key.push_back(t->device().index());
    key.push_back(address(*t) % 16 == 0);
  }
  return key;
}

std::mutex registry_mutex;
std::map<std::vector<int64_t>, std::unique_ptr<Plan>> registry;  // plans live as long as the process

Plan* find(const std::vector<int64_t>& key) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto found = registry.find(key);
  return found == registry.end() ? nullptr : found->second.get();
}

std::vector<int64_t> shape_without_last(const at::Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end() - 1);
}

// A plan's forward: fresh O (q's layout, as the Python launcher's torch.empty_like) and L (fp32, q.shape[:-1]).
std::tuple<at::Tensor, at::Tensor> run_forward(const Plan& plan, const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v) {
  c10::DeviceGuard guard(q.device());
  at::Tensor out = at::empty_like(q);
  at::Tensor lse = at::empty(shape_without_last(q), q.options().dtype(at::kFloat));
  std::array<uint64_t, kNumSlots> addresses{};
  addresses[kQ] = address(q), addresses[kK] = address(k), addresses[kV] = address(v);
  addresses[kOut] = address(out), addresses[kLse] = address(lse);
  for (const Kernel& kernel : plan.forward) launch(kernel, addresses, q.device());
  return {out, lse};
}

// A plan's backward: (dQ, dK, dV) like (q, k, v), from the forward's O and L and the gradient of O.
std::tuple<at::Tensor, at::Tensor, at::Tensor> run_backward(const Plan& plan, const at::Tensor& q,
                                                            const at::Tensor& k, const at::Tensor& v,
                                                            const at::Tensor& out, const at::Tensor& lse,
                                                            at::Tensor grad_out) {
  c10::DeviceGuard guard(q.device());
  // The plan was made for a gradient in O's layout (16-byte aligned); anything else is copied into one.
  if (grad_out.strides() != out.strides() || address(grad_out) % 16 != 0) {
    at::Tensor copy = at::empty_like(out);
    copy.copy_(grad_out);
    grad_out = copy;
  }
  at::Tensor delta = at::empty_like(lse), dk = at::empty_like(k), dv = at::empty_like(v), dq, dq_accum;
  if (plan.accum == kNoAccum) {
    dq = at::empty_like(q);
  } else {
    dq_accum = at::empty({lse.numel() / q.size(-2), plan.accum_rows, plan.accum_cols},
                         q.options().dtype(at::kFloat));
  }
  std::array<uint64_t, kNumSlots> addresses{};
  addresses[kQ] = address(q), addresses[kK] = address(k), addresses[kV] = address(v);
  addresses[kOut] = address(out), addresses[kLse] = address(lse), addresses[kGradOut] = address(grad_out);
  addresses[kDelta] = address(delta), addresses[kDk] = address(dk), addresses[kDv] = address(dv);
  addresses[kDq] = address(dq), addresses[kDqAccum] = address(dq_accum);
  at::Tensor row_max, row_inv_sum;  // as buffers.backward_buffers makes them
  if (plan.row_stats) row_max = at::empty_like(lse), row_inv_sum = at::empty_like(lse);
  addresses[kRowMax] = address(row_max), addresses[kRowInvSum] = address(row_inv_sum);
  for (const Kernel& kernel : plan.backward) launch(kernel, addresses, q.device());
  if (plan.accum != kNoAccum) {  // (batch*heads, rows, cols) fp32 -> q's dims and dtype
    at::Tensor accum = dq_accum.narrow(1, 0, q.size(-2)).narrow(2, 0, q.size(-1));
    if (plan.accum == kTlAccum) accum.mul_(plan.accum_scale);
    dq = at::empty_like(q);
    dq.copy_(accum.view(q.sizes()));
  }
  return {dq, dk, dv};
}

struct FlashAttentionNative : public torch::autograd::Function<FlashAttentionNative> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, int64_t plan_address) {
    const Plan& plan = *reinterpret_cast<const Plan*>(plan_address);
    auto [out, lse] = run_forward(plan, q, k, v);
    // Saved as the Python Function saves them (L, Q, K, V, O): a checkpointed region's recompute may take the other
    // path (under a dispatch mode), and torch.utils.checkpoint matches saved tensors by position.
    ctx->save_for_backward({lse, q, k, v, out});
    ctx->saved_data["plan"] = plan_address;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Plan& plan = *reinterpret_cast<const Plan*>(ctx->saved_data["plan"].toInt());
    auto [dq, dk, dv] = run_backward(plan, saved[1], saved[2], saved[3], saved[4], saved[0], grads[0]);
    return {dq, dk, dv, at::Tensor()};
  }
};

// [slot, data type, swizzle, fill, rank, dims (innermost first), byte strides (rank - 1), box dims] -> a spec
TensorMapSpec tensor_map_from(const std::vector<int64_t>& entries) {
  TORCH_CHECK(entries.size() >= 5, "cs336 native attention: a tensor map has at least 5 entries");
  TensorMapSpec spec;
  spec.slot = entries[0], spec.data_type = entries[1], spec.swizzle = entries[2], spec.fill = entries[3];
  spec.rank = uint32_t(entries[4]);
  TORCH_CHECK(spec.rank >= 1 && spec.rank <= 5 && entries.size() == 5 + 3 * spec.rank - 1,
              "cs336 native attention: a tensor map of rank ", spec.rank, " has ", 3 * spec.rank + 4, " entries, got ",
              entries.size());
  TORCH_CHECK(spec.slot >= 0 && spec.slot < kNumSlots, "cs336 native attention: tensor slot ", spec.slot,
              " out of range");
  size_t at = 5;
  for (uint32_t d = 0; d < spec.rank; ++d) spec.dims[d] = cuuint64_t(entries[at++]);
  for (uint32_t d = 0; d + 1 < spec.rank; ++d) spec.byte_strides[d] = cuuint64_t(entries[at++]);
  for (uint32_t d = 0; d < spec.rank; ++d) spec.box[d] = cuuint32_t(entries[at++]);
  return spec;
}

Kernel kernel_from(int64_t function, const std::vector<int64_t>& config, const std::vector<int64_t>& kinds,
                   const std::vector<int64_t>& integers, const std::vector<double>& reals,
                   const std::vector<std::vector<int64_t>>& maps) {
  TORCH_CHECK(config.size() == 9, "cs336 native attention: a kernel's config has 9 entries, got ", config.size());
  TORCH_CHECK(kinds.size() == integers.size() && kinds.size() == reals.size(),
              "cs336 native attention: kinds, integers and reals must have one entry per parameter");
  Kernel kernel;
  kernel.function = reinterpret_cast<CUfunction>(function);
  kernel.grid = {uint32_t(config[0]), uint32_t(config[1]), uint32_t(config[2])};
  kernel.num_warps = config[3], kernel.num_ctas = config[4], kernel.shared_memory = config[5];
  kernel.cooperative = config[6], kernel.pdl = config[7], kernel.global_scratch = config[8];
  for (const auto& entries : maps) kernel.maps.push_back(tensor_map_from(entries));
  for (size_t i = 0; i < kinds.size(); ++i) {
    TORCH_CHECK(kinds[i] >= kTensor && kinds[i] <= kTensorMap, "cs336 native attention: unknown parameter kind ",
                kinds[i]);
    TORCH_CHECK(kinds[i] != kTensor || (integers[i] >= 0 && integers[i] < kNumSlots),
                "cs336 native attention: tensor slot ", integers[i], " out of range");
    TORCH_CHECK(kinds[i] != kTensorMap || (integers[i] >= 0 && size_t(integers[i]) < kernel.maps.size()),
                "cs336 native attention: tensor map ", integers[i], " out of range");
    kernel.args.push_back({kinds[i], integers[i], reals[i]});
  }
  return kernel;
}

// (function, config, kinds, integers, reals, tensor maps)
using KernelSpec = std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                              std::vector<double>, std::vector<std::vector<int64_t>>>;

std::vector<Kernel> kernels_from(const std::vector<KernelSpec>& specs) {
  std::vector<Kernel> kernels;
  for (const auto& [function, config, kinds, integers, reals, maps] : specs) {
    kernels.push_back(kernel_from(function, config, kinds, integers, reals, maps));
  }
  return kernels;
}

void register_plan(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, int64_t backward,
                   const std::vector<KernelSpec>& forward, const std::vector<KernelSpec>& backward_kernels,
                   int64_t accum, double accum_scale, int64_t accum_rows, int64_t accum_cols, bool row_stats) {
  TORCH_CHECK(accum >= kNoAccum && accum <= kTlAccum, "cs336 native attention: accum must be 0, 1 or 2, got ", accum);
  auto plan = std::make_unique<Plan>();
  plan->forward = kernels_from(forward);
  plan->backward = kernels_from(backward_kernels);
  plan->accum = accum, plan->accum_scale = accum_scale, plan->accum_rows = accum_rows, plan->accum_cols = accum_cols;
  plan->row_stats = row_stats;
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry[signature(q, k, v, causal, backward)] = std::move(plan);
}

// Attention through a registered plan, or None where there is none for these inputs (the caller makes one).
std::optional<at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                    int64_t backward) {
  Plan* plan = find(signature(q, k, v, causal, backward));
  if (plan == nullptr) return std::nullopt;
  return FlashAttentionNative::apply(q, k, v, reinterpret_cast<int64_t>(plan));
}

// The registered operators' implementations (torch.compile calls those, below autograd): the plan's forward or
// backward alone, or None where there is no plan for these inputs.
std::optional<std::tuple<at::Tensor, at::Tensor>> forward(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, bool causal, int64_t backward) {
  Plan* plan = find(signature(q, k, v, causal, backward));
  if (plan == nullptr) return std::nullopt;
  return run_forward(*plan, q, k, v);
}

std::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>> backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
    const at::Tensor& grad_out, bool causal, int64_t backward_code) {
  Plan* plan = find(signature(q, k, v, causal, backward_code));
  if (plan == nullptr) return std::nullopt;
  return run_backward(*plan, q, k, v, out, lse, grad_out);
}

// The parameter bytes a kernel spec would be launched with (tests compare them with Triton's packing rules).
py::bytes packed_parameters(const KernelSpec& spec, const std::vector<int64_t>& slot_addresses,
                            int64_t global_scratch) {
  const auto& [function, config, kinds, integers, reals, maps] = spec;
  Kernel kernel = kernel_from(function, config, kinds, integers, reals, maps);
  std::array<uint64_t, kNumSlots> addresses{};
  TORCH_CHECK(slot_addresses.size() <= addresses.size(), "cs336 native attention: too many slot addresses");
  std::copy(slot_addresses.begin(), slot_addresses.end(), addresses.begin());
  std::vector<uint64_t> storage = pack(kernel, addresses, uint64_t(global_scratch));
  return py::bytes(reinterpret_cast<const char*>(storage.data()), storage.size() * sizeof(uint64_t));
}

void set_recording(bool on) {
  std::lock_guard<std::mutex> lock(record_mutex);
  recording = on;
  recorded.clear();
}

std::vector<std::vector<uint64_t>> recorded_launches() {
  std::lock_guard<std::mutex> lock(record_mutex);
  return recorded;
}

// The stream launches go to: the caller's current stream on that device (tests compare it with torch's).
int64_t current_stream(int64_t device_index) {
  c10::Device device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device_index));
  return reinterpret_cast<int64_t>(c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(device).native_handle());
}

size_t plan_count() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  return registry.size();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_plan", &register_plan, "register a launch plan for inputs like (q, k, v)");
  m.def("attention", &attention, "attention through a registered plan, or None");
  m.def("forward", &forward, "(O, L) through a registered plan's forward, or None");
  m.def("backward", &backward, "(dQ, dK, dV) through a registered plan's backward, or None");
  m.def("packed_parameters", &packed_parameters, "a kernel spec's parameter bytes (for tests)");
  m.def("plan_count", &plan_count, "registered plans");
  m.def("current_stream", &current_stream, "the CUDA stream launches on this device go to");
  m.def("set_recording", &set_recording, "dry runs: record launches' packed parameters instead of running them");
  m.def("recorded_launches", &recorded_launches, "the packed parameters recorded since set_recording");
}
