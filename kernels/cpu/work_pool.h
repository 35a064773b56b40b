// The thread pool shared by the CPU kernels (every translation unit uses the same instance).
#pragma once

#include <immintrin.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace specdec_cpu {

// Work handed to the pool's worker to run while the caller goes on (WorkPool::start_background),
// finished with WorkPool::finish_background. `error` holds what the work threw, if it threw.
struct BackgroundTask {
  std::function<void()> fn;
  std::atomic<int> state{0};  // 0 queued, 1 running, 2 done
  std::string error;
};

// A tiny pool for the parallel loops of these kernels. Unlike an OpenMP parallel region, a loop
// never waits for a worker that has not started: the caller claims chunks itself, and workers
// that wake up late find nothing left. On a busy machine (another process on the other core) an
// OpenMP barrier would wait a whole scheduler time slice for the descheduled thread, every call.
class WorkPool {
 public:
  struct Job {
    const std::function<void(int64_t)>* fn;
    int64_t total;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };

  static WorkPool& get() {  // inline: one pool for the whole library
    static WorkPool pool;
    return pool;
  }

  // Threads that run a loop: the workers and the caller.
  int64_t threads() const { return static_cast<int64_t>(workers_.size()) + 1; }

  // Runs fn(0) .. fn(chunks - 1), in any order, on the caller and the workers.
  void parallel_for(int64_t chunks, const std::function<void(int64_t)>& fn) {
    if (workers_.empty() || chunks <= 1) {
      for (int64_t i = 0; i < chunks; ++i) fn(i);
      return;
    }
    Job job;
    job.fn = &fn;
    job.total = chunks;
    // One loop at a time is shared: a loop begun while another thread's holds the slot (the
    // caller's, while the worker runs a background task) runs on its own thread alone.
    Job* none = nullptr;
    if (!current_.compare_exchange_strong(none, &job, std::memory_order_seq_cst)) {
      for (int64_t i = 0; i < chunks; ++i) fn(i);
      return;
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    work(job);
    while (job.done.load(std::memory_order_acquire) < job.total) _mm_pause();
    // A worker may have picked up the job pointer just before it was cleared: wait it out. The
    // store and the loads are sequentially consistent (as are the worker's increment and load),
    // so either the worker sees nullptr or this loop sees the worker (Dekker's handshake).
    current_.store(nullptr, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) > 0) _mm_pause();
  }

  // Queues `task` for a worker, which runs it between helping with loops (its own loops run on
  // it alone until the caller waits for it, and then on both). One task at a time: the caller
  // finishes one before it starts the next.
  void start_background(BackgroundTask* task) {
    background_.store(task, std::memory_order_release);
    if (sleeping_.load(std::memory_order_acquire) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
  }

  // Returns once `task` has run: on the caller, with the worker helping its loops, if no worker
  // has taken it yet; otherwise the caller helps the worker's loops until it has finished.
  void finish_background(BackgroundTask* task) {
    BackgroundTask* queued = task;
    if (background_.compare_exchange_strong(queued, nullptr, std::memory_order_acq_rel)) {
      run_task(*task);
      return;
    }
    while (task->state.load(std::memory_order_acquire) != 2) {
      // As a worker does (loop()): announce, then look, so the loop's owner waits for us.
      active_.fetch_add(1, std::memory_order_seq_cst);
      Job* job = current_.load(std::memory_order_seq_cst);
      if (job != nullptr) work(*job);
      active_.fetch_sub(1, std::memory_order_acq_rel);
      _mm_pause();
    }
  }

  ~WorkPool() {
    stop_.store(true);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    for (auto& t : workers_) t.join();
  }

 private:
  WorkPool() {
    int threads = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("SPECDEC_NUM_THREADS")) threads = std::atoi(env);
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }

  static void run_task(BackgroundTask& task) {
    task.state.store(1, std::memory_order_relaxed);
    try {
      task.fn();
    } catch (const std::exception& e) {
      task.error = e.what();
      if (task.error.empty()) task.error = "background task failed";
    } catch (...) {
      task.error = "background task failed";
    }
    task.state.store(2, std::memory_order_release);
  }

  // Takes the queued background task, if any, and runs it with serial loops.
  bool run_background() {
    BackgroundTask* task = background_.load(std::memory_order_acquire);
    if (task == nullptr || !background_.compare_exchange_strong(task, nullptr, std::memory_order_acq_rel))
      return false;
    run_task(*task);
    return true;
  }

  static void work(Job& job) {
    int64_t i;
    while ((i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.total) {
      (*job.fn)(i);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    while (!stop_.load(std::memory_order_relaxed)) {
      if (run_background()) continue;
      active_.fetch_add(1, std::memory_order_seq_cst);
      Job* job = current_.load(std::memory_order_seq_cst);
      if (job != nullptr) work(*job);
      active_.fetch_sub(1, std::memory_order_acq_rel);
      if (job != nullptr) {
        _mm_pause();  // all its chunks are claimed; look again shortly
        continue;
      }
      // Spin a little (the next kernel call is usually microseconds away), then sleep.
      bool found = false;
      for (int spin = 0; spin < 20000 && !found; ++spin) {
        _mm_pause();
        found = current_.load(std::memory_order_acquire) != nullptr ||
                background_.load(std::memory_order_acquire) != nullptr;
      }
      if (found) continue;
      std::unique_lock<std::mutex> lock(mutex_);
      sleeping_.fetch_add(1);
      wake_.wait(lock, [this] { return current_.load() != nullptr || background_.load() != nullptr || stop_.load(); });
      sleeping_.fetch_sub(1);
    }
  }

  std::vector<std::thread> workers_;
  std::atomic<Job*> current_{nullptr};
  std::atomic<BackgroundTask*> background_{nullptr};
  std::atomic<int> active_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::condition_variable wake_;
};

}  // namespace specdec_cpu
