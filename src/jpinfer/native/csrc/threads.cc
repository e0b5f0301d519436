// jpinfer's helper threads: the second to n-th workers of ParallelFor (common.h says why they are not XLA's
// pool). Each helper has one slot: a caller claims a free slot (free -> claimed), puts the loop in and marks
// it ready; the helper runs it, frees the slot, and spins on it for kLinger before it sleeps on its
// condition variable. The caller and a helper going to sleep meet Dekker-style (each stores its flag, then
// reads the other's, sequentially consistent), so a loop is never left in a slot whose helper sleeps.
// The helpers and their slots are never destroyed: a detached thread may still be waiting at exit.
#include <condition_variable>
#include <mutex>

#include "common.h"

namespace jpn {
namespace {

constexpr int kMaxHelpers = 63;
constexpr auto kLinger = std::chrono::microseconds(2000);  // a decode step's products are microseconds apart
constexpr int kSpinsPerYield = 256;

enum : int { kFree = 0, kClaimed = 1, kReady = 2 };

struct Slot {
  std::atomic<int> state{kFree};
  std::atomic<bool> asleep{false};
  std::shared_ptr<Loop> loop;  // written by the claiming caller, read once ready
  std::mutex mutex;
  std::condition_variable wakeup;
};

struct Helpers {
  std::mutex starting;
  std::atomic<int> started{0};
  Slot slots[kMaxHelpers];
};

Helpers& All() {
  static Helpers* helpers = new Helpers;
  return *helpers;
}

void Serve(Slot* slot) {
  for (;;) {
    const auto idle_since = std::chrono::steady_clock::now();
    for (int spins = 1; slot->state.load(std::memory_order_acquire) != kReady; ++spins) {
      if (spins % kSpinsPerYield != 0) {
        _mm_pause();
        continue;
      }
      if (std::chrono::steady_clock::now() - idle_since < kLinger) {
        std::this_thread::yield();  // let a thread that needs this core have it
        continue;
      }
      std::unique_lock<std::mutex> lock(slot->mutex);
      slot->asleep.store(true);
      slot->wakeup.wait(lock, [slot] { return slot->state.load() == kReady; });
      slot->asleep.store(false);
    }
    std::shared_ptr<Loop> loop = std::move(slot->loop);
    loop->Work();
    loop.reset();
    slot->state.store(kFree, std::memory_order_release);
  }
}

int Start(int wanted) {
  Helpers& all = All();
  wanted = std::min(wanted, kMaxHelpers);
  if (all.started.load(std::memory_order_acquire) < wanted) {
    std::lock_guard<std::mutex> lock(all.starting);
    for (int i = all.started.load(); i < wanted; ++i) {
      std::thread(Serve, &all.slots[i]).detach();
      all.started.store(i + 1, std::memory_order_release);
    }
  }
  return wanted;
}

}  // namespace

void OfferToHelpers(int wanted, const std::shared_ptr<Loop>& loop, bool wake) {
  Helpers& all = All();
  const int n = Start(wanted);
  for (int i = 0; i < n; ++i) {
    Slot& slot = all.slots[i];
    int expected = kFree;
    if (!slot.state.compare_exchange_strong(expected, kClaimed, std::memory_order_acquire)) continue;
    if (!wake && slot.asleep.load()) {
      slot.state.store(kFree, std::memory_order_release);
      continue;
    }
    slot.loop = loop;
    slot.state.store(kReady);
    if (slot.asleep.load()) {
      std::lock_guard<std::mutex> lock(slot.mutex);
      slot.wakeup.notify_one();
    }
  }
}

}  // namespace jpn
