// XLA's way into our kernels: pyhipa2a.jax's dispatch and combine inside jax.jit.
//
// One handler serves both legs. pyhipa2a.jax registers a site for each leg and shape it traces: the
// driver's launch entry (cuLaunchKernel or hipModuleLaunchKernel, whose arguments are the same), the
// kernel, its geometry, its fixed arguments (A2AArgs, kept by the Python object), the object's status
// words, and its call arguments (DispatchCall or CombineCall) packed once, with the place of each
// operand's and result's address in them. A call patches those addresses into a copy of the packed
// arguments and launches on XLA's stream: the kernels read XLA's operands and write XLA's results
// directly. Operands and results with no place (the order words that chain an object's calls) are
// not touched. An object whose kernels reported an error refuses the call, as its eager calls do.
//
// Sites are numbered from 1 in the order they are registered, so a compiled program names a site by
// its number, never by an address of this process. Where a process's ranks are its devices (one object,
// its calls inside shard_map), the program names the first rank's site, each site names the next rank's,
// and a call runs the site on the GPU XLA runs it on. A closed object retires its sites: a program
// compiled while it lived, called after, is refused instead of launching on memory that is gone. Built
// by `python -m pyhipa2a.build` against jaxlib's own headers where jaxlib is installed.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxPlaces = 8;
constexpr int kMaxCallBytes = 128;

struct Site {  // pyhipa2a/jax.py: FfiSite
  uint64_t launch;      // cuLaunchKernel / hipModuleLaunchKernel
  uint64_t function;    // the leg's kernel
  uint64_t fixed;       // its first argument (A2AArgs), in host memory the object keeps
  uint64_t status;      // the object's status words (host memory); a nonzero first word is an error
  int64_t next;         // the same call's site for the next rank of this process (0: none), on another GPU
  uint32_t grid, block;
  uint32_t call_bytes;  // its second argument's size
  int32_t device;       // the GPU (its ordinal, XLA's and the driver's alike) whose memory the object holds
  int32_t operand_at[kMaxPlaces];  // where operand i's address goes in `call` (-1: nowhere)
  int32_t result_at[kMaxPlaces];   // where result i's goes
  uint8_t call[kMaxCallBytes];     // the second argument as packed (token count, scale); addresses patched
};

using LaunchFn = int (*)(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, unsigned shared_bytes, void* stream, void** params, void** extra);

std::mutex sites_lock;
std::vector<Site> sites;     // site n is sites[n - 1]
std::vector<bool> retired;  // of the same numbers

ffi::Error failed(const std::string& why) { return ffi::Error(ffi::ErrorCode::kInternal, "pyhipa2a: " + why); }

// Why a call on GPU `device` finds no site of call `number` there (sites_lock held).
std::string elsewhere(int64_t number, int32_t device) {
  std::string gpus;
  for (int64_t n = number; n != 0; n = sites[n - 1].next)
    gpus += (gpus.empty() ? "" : ", ") + std::to_string(sites[n - 1].device);
  return "this program runs on GPU " + std::to_string(device) + ", but the object's memory is on GPU " + gpus +
         ": place the program's arguments there (jax.device_put, or shard_map over a2a.mesh)";
}

// The number of call `number`'s site on GPU `device`, following the chain of the process's ranks: > 0; else
// 0, no such site; -1, its object is closed; -2, no rank of the call is on that GPU (sites_lock held).
int64_t site_on(int64_t number, int32_t device) {
  for (int64_t n = number;; n = sites[n - 1].next) {
    if (n < 1 || n > static_cast<int64_t>(sites.size())) return 0;
    if (retired[n - 1]) return -1;
    if (sites[n - 1].device == device) return n;
    if (sites[n - 1].next == 0) return -2;
  }
}

void place(uint8_t* call, int32_t at, void* address) {
  if (at < 0) return;
  const uint64_t value = reinterpret_cast<uint64_t>(address);
  std::memcpy(call + at, &value, sizeof value);
}

ffi::Error launch(void* stream, int32_t device, ffi::RemainingArgs operands, ffi::RemainingRets results,
                  int64_t number) {
  Site site;  // the rank's on this GPU (the kernel, heap and peers' mappings are its)
  {
    std::lock_guard<std::mutex> hold(sites_lock);
    const int64_t n = site_on(number, device);
    if (n == 0) return failed("unknown site");
    if (n == -1) return failed("this call's object is closed");
    if (n == -2) return failed(elsewhere(number, device));
    site = sites[n - 1];
  }
  if (*reinterpret_cast<volatile uint32_t*>(site.status) != 0)
    return failed("an earlier call of this object failed; its synchronize() says why, and it takes no more calls");
  if (operands.size() > kMaxPlaces || results.size() > kMaxPlaces) return failed("too many operands");
  uint8_t call[kMaxCallBytes];
  std::memcpy(call, site.call, site.call_bytes);
  for (size_t i = 0; i < operands.size(); ++i) {
    auto operand = operands.get<ffi::AnyBuffer>(i);
    if (operand.has_error()) return operand.error();
    place(call, site.operand_at[i], operand.value().untyped_data());
  }
  for (size_t i = 0; i < results.size(); ++i) {
    auto result = results.get<ffi::AnyBuffer>(i);
    if (result.has_error()) return result.error();
    place(call, site.result_at[i], (*result)->untyped_data());
  }
  void* params[2] = {reinterpret_cast<void*>(site.fixed), call};  // (the driver copies them at the launch)
  const int code = reinterpret_cast<LaunchFn>(site.launch)(reinterpret_cast<void*>(site.function), site.grid, 1, 1,
                                                           site.block, 1, 1, 0, stream, params, nullptr);
  if (code != 0) return failed("the kernel launch failed with error " + std::to_string(code));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(pyhipa2a_ffi_launch, launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("site"));

extern "C" {

// The number of a new site, a copy of *site (0: refused, its call arguments too large).
int64_t pyhipa2a_ffi_site(const Site* site) {
  if (site->call_bytes > kMaxCallBytes) return 0;
  std::lock_guard<std::mutex> hold(sites_lock);
  sites.push_back(*site);
  retired.push_back(false);
  return static_cast<int64_t>(sites.size());
}

// Site `number` refuses every later call (its object is closed); 0 where there is no such site.
int pyhipa2a_ffi_retire(int64_t number) {
  std::lock_guard<std::mutex> hold(sites_lock);
  if (number < 1 || number > static_cast<int64_t>(sites.size())) return 0;
  retired[number - 1] = true;
  return 1;
}

// site_on, for tests/test_build.py: the site a call of site `number` runs on GPU `device`, or 0, -1, -2.
int64_t pyhipa2a_ffi_site_on(int64_t number, int32_t device) {
  std::lock_guard<std::mutex> hold(sites_lock);
  return site_on(number, device);
}

// sizeof(Site): pyhipa2a.jax loads no handler built for another layout.
uint64_t pyhipa2a_ffi_site_bytes() { return sizeof(Site); }

// Where each of Site's members lies, in order (tests/test_build.py checks pyhipa2a.jax's FfiSite).
void pyhipa2a_ffi_site_layout(uint64_t* at) {
  const uint64_t places[] = {offsetof(Site, launch),     offsetof(Site, function),   offsetof(Site, fixed),
                             offsetof(Site, status),     offsetof(Site, next),       offsetof(Site, grid),
                             offsetof(Site, block),      offsetof(Site, call_bytes), offsetof(Site, device),
                             offsetof(Site, operand_at), offsetof(Site, result_at),  offsetof(Site, call)};
  std::memcpy(at, places, sizeof places);
}

}  // extern "C"
