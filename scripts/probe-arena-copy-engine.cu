// Would the GPU's copy engine, placing a slot's checked blocks into registered arena memory
// with one batched call, take the installers' copy off the host's CPU, and at what pace?
// (scripts/probe-arena-copy-engine builds and runs this; results: docs/bench/gpu-runs.md.)
// The copy engine writes only the ranges the host names, so a kernel bug could still spoil
// only a slot's own results; a kernel storing into registered memory (run 268) could not be
// held to that. Measures, with the objects of run 268 (200-3,000 bytes plus a 4-byte
// checksum, rounded to 8; 128 slots of 2,048, a GiB of pages):
//   (1) the installers' way: the CPU copying each object from a pinned buffer the GPU
//       filled into its arena place (1 thread), CPU-s per GiB of pages;
//   (2) cudaMemcpyBatchAsync, one call a slot (device results -> registered arena places),
//       4 streams: the CPU the calls take, the pace, and whether every object landed;
//   (3) the same with one cudaMemcpyAsync an object, for scale;
//   (4) one slot's copies alone (a copy an object, and a copy a run), call to sync: what
//       they add to a slot's cycle.
#include <cuda_runtime.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/shm.h>
#include <time.h>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1);} } while (0)

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// The whole process's CPU (the driver's own threads included).
static double process_cpu() {
  struct rusage u; getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec * 1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec * 1e-6;
}
// This thread's CPU alone.
static double thread_cpu() {
  struct timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint8_t *shm_region(size_t size) {
  int id = shmget(IPC_PRIVATE, size, IPC_CREAT | 0600);
  if (id < 0) { perror("shmget"); exit(1); }
  void *p = shmat(id, nullptr, 0);
  if (p == (void *)-1) { perror("shmat"); exit(1); }
  shmctl(id, IPC_RMID, nullptr);
  if (mlock(p, size) != 0) perror("mlock");
  memset(p, 1, size);
  return (uint8_t *)p;
}

// Object i's words carry i in their high half and the word's index in the low half, so a
// landed object says whose it is.
__global__ void fill(uint64_t *src, const uint64_t *start, const uint32_t *words, int n) {
  int obj = blockIdx.x;
  if (obj >= n) return;
  for (uint32_t w = threadIdx.x; w < words[obj]; w += blockDim.x)
    src[start[obj] + w] = ((uint64_t)obj << 32) | w;
}

static cudaError_t batch(const void **dsts, const void **srcs, const size_t *sizes, size_t count,
                         cudaStream_t stream) {
  cudaMemcpyAttributes attr;
  memset(&attr, 0, sizeof attr);
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t idx = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attr, &idx, 1, stream);
#else
  size_t fail = 0;
  return cudaMemcpyBatchAsync((void **)dsts, (void **)srcs, (size_t *)sizes, count, &attr, &idx, 1,
                              &fail, stream);
#endif
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  const int SLOT = 2048, SLOTS = 128, N = SLOT * SLOTS, STREAMS = 4, REPS = 5;
  const size_t ARENA = 1ull << 30;
  CK(cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync));  // waits sleep, as the ring's do
  CK(cudaSetDevice(0));
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt); cudaDriverGetVersion(&drv);
  printf("runtime %d driver %d\n", rt, drv);

  std::mt19937_64 rng(45);
  std::uniform_int_distribution<int> len_d(200, 3000);
  std::vector<uint32_t> words(N);
  std::vector<uint64_t> start(N);
  uint64_t total = 0;
  for (int i = 0; i < N; i++) { words[i] = (len_d(rng) + 4 + 7) / 8; start[i] = total; total += words[i]; }
  printf("objects %d, payload %.3f GiB (mean %.0f B)\n", N, total * 8.0 / (1ull << 30), total * 8.0 / N);

  // Places: bump order in 64 KiB segments (the frontier), and one at a random 4 KiB place
  // each (holes reused all over; these collide, so a later object overwrites an earlier
  // one there, and the check counts those as wrong for every way of copying alike).
  const uint64_t SEG = 65536 / 8;
  std::vector<uint64_t> bump(N), scattered(N);
  for (uint64_t at = 0, i = 0; i < (uint64_t)N; i++) {
    if ((at % SEG) + words[i] > SEG) at = (at / SEG + 1) * SEG;
    bump[i] = at; at += words[i];
  }
  std::uniform_int_distribution<uint64_t> pick(0, ARENA / 4096 - 2);
  for (int i = 0; i < N; i++) scattered[i] = pick(rng) * 512 + (rng() % 4) * 8;

  uint64_t *arena = (uint64_t *)shm_region(ARENA);
  double t0 = now();
  CK(cudaHostRegister(arena, ARENA, cudaHostRegisterDefault));
  printf("arena 1 GiB registered in %.1f ms\n", (now() - t0) * 1e3);

  uint64_t *src_d, *start_d; uint32_t *words_d;
  CK(cudaMalloc(&src_d, total * 8)); CK(cudaMalloc(&start_d, N * 8)); CK(cudaMalloc(&words_d, N * 4));
  CK(cudaMemcpy(start_d, start.data(), N * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(words_d, words.data(), N * 4, cudaMemcpyHostToDevice));
  fill<<<N, 128>>>(src_d, start_d, words_d, N);
  CK(cudaDeviceSynchronize());
  cudaStream_t st[STREAMS];
  for (auto &s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  auto check = [&](const std::vector<uint64_t> &place) {
    int bad = 0, seen = 0;
    for (int i = 0; i < N; i += 61, seen++) {
      const uint64_t *p = arena + place[i];
      for (uint32_t w = 0; w < words[i]; w++)
        if (p[w] != (((uint64_t)i << 32) | w)) { bad++; break; }
    }
    printf("    checked %d objects: %d wrong\n", seen, bad);
  };
  auto clear = [&]() { memset(arena, 0, ARENA); };
  // One slot's copies alone (slot s's are first[s]..first[s + 1] of the lists), call to
  // sync, 200 times: what they add to a slot's cycle.
  auto slot_latency = [&](const char *what, std::vector<const void *> &d,
                          std::vector<const void *> &sv, const std::vector<size_t> &z,
                          const std::vector<size_t> &first) {
    std::vector<double> lat, cpu;
    for (int rep = 0; rep < 200; rep++) {
      int s = rep % SLOTS;
      size_t at = first[s], n = first[s + 1] - at;
      double c = process_cpu(), a = now();
      CK(batch(&d[at], &sv[at], &z[at], n, st[0]));
      CK(cudaStreamSynchronize(st[0]));
      lat.push_back(now() - a); cpu.push_back(process_cpu() - c);
    }
    std::sort(lat.begin(), lat.end());
    printf("%s, call to sync: p50 %.1f us, p90 %.1f us; process CPU %.1f us a slot (median)\n",
           what, lat[100] * 1e6, lat[180] * 1e6, median(cpu) * 1e6);
  };

  // (1) the installers' way.
  uint8_t *pinned; CK(cudaHostAlloc((void **)&pinned, total * 8, cudaHostAllocDefault));
  for (int layout = 0; layout < 2; layout++) {
    const auto &place = layout ? scattered : bump;
    std::vector<double> cpu, wall;
    for (int rep = 0; rep < REPS; rep++) {
      clear();
      CK(cudaMemcpy(pinned, src_d, total * 8, cudaMemcpyDeviceToHost));
      double c = thread_cpu(), a = now();
      for (int i = 0; i < N; i++) memcpy(arena + place[i], pinned + start[i] * 8, words[i] * 8);
      wall.push_back(now() - a); cpu.push_back(thread_cpu() - c);
    }
    printf("cpu copy pinned->arena (%s): %.2f GB/s, %.4f CPU-s per GiB of pages (median of %d)\n",
           layout ? "scattered" : "bump", total * 8.0 / median(wall) / 1e9, median(cpu), REPS);
    check(place);
  }

  // (2) one batched call a slot, and (3) one call an object.
  std::vector<const void *> dsts(N), srcs(N);
  std::vector<size_t> sizes(N);
  for (int mode = 0; mode < 2; mode++) {
    for (int layout = 0; layout < 2; layout++) {
      const auto &place = layout ? scattered : bump;
      std::vector<double> call_cpu, proc_cpu, wall;
      for (int rep = 0; rep < REPS; rep++) {
        clear();
        CK(cudaDeviceSynchronize());
        double pc = process_cpu(), a = now(), calls = 0;
        for (int s = 0; s < SLOTS; s++) {
          cudaStream_t stream = st[s % STREAMS];
          double c = thread_cpu();
          // Building the slot's lists is the host's work too.
          for (int j = 0; j < SLOT; j++) {
            int i = s * SLOT + j;
            dsts[i] = arena + place[i]; srcs[i] = src_d + start[i]; sizes[i] = words[i] * 8;
          }
          if (mode == 0) {
            cudaError_t e = batch(&dsts[s * SLOT], &srcs[s * SLOT], &sizes[s * SLOT], SLOT, stream);
            if (e != cudaSuccess) { printf("cudaMemcpyBatchAsync: %s\n", cudaGetErrorString(e)); exit(1); }
          } else {
            for (int j = 0; j < SLOT; j++) {
              int i = s * SLOT + j;
              CK(cudaMemcpyAsync((void *)dsts[i], srcs[i], sizes[i], cudaMemcpyDeviceToHost, stream));
            }
          }
          calls += thread_cpu() - c;
        }
        CK(cudaDeviceSynchronize());
        wall.push_back(now() - a); call_cpu.push_back(calls); proc_cpu.push_back(process_cpu() - pc);
      }
      printf("%s (%s): %.2f GB/s of payload, calls %.4f CPU-s, process %.4f CPU-s per GiB of pages (median of %d, %d streams)\n",
             mode ? "cudaMemcpyAsync an object" : "cudaMemcpyBatchAsync a slot", layout ? "scattered" : "bump",
             total * 8.0 / median(wall) / 1e9, median(call_cpu), median(proc_cpu), REPS, STREAMS);
      check(place);
    }
  }

  // (2b) bump places as runs: a slot's objects lie at the frontier one after another, and
  // the device's results are packed in the same order, so each stretch that does not cross
  // a 64 KiB segment is one copy (about 52 a slot instead of 2,048).
  {
    std::vector<const void *> rd; std::vector<const void *> rs; std::vector<size_t> rz;
    std::vector<size_t> slot_first(SLOTS + 1, 0);
    for (int s = 0; s < SLOTS; s++) {
      slot_first[s] = rd.size();
      for (int j = 0; j < SLOT; j++) {
        int i = s * SLOT + j;
        bool joins = j > 0 && bump[i] == bump[i - 1] + words[i - 1] && start[i] == start[i - 1] + words[i - 1];
        if (joins) { rz.back() += words[i] * 8; continue; }
        rd.push_back(arena + bump[i]); rs.push_back(src_d + start[i]); rz.push_back(words[i] * 8);
      }
    }
    slot_first[SLOTS] = rd.size();
    printf("runs: %zu copies for %d objects (%.1f a slot)\n", rd.size(), N, (double)rd.size() / SLOTS);
    std::vector<double> call_cpu, proc_cpu, wall;
    for (int rep = 0; rep < REPS; rep++) {
      clear();
      CK(cudaDeviceSynchronize());
      double pc = process_cpu(), a = now(), calls = 0;
      for (int s = 0; s < SLOTS; s++) {
        double c = thread_cpu();
        size_t at = slot_first[s], n = slot_first[s + 1] - at;
        cudaError_t e = batch(&rd[at], &rs[at], &rz[at], n, st[s % STREAMS]);
        if (e != cudaSuccess) { printf("cudaMemcpyBatchAsync (runs): %s\n", cudaGetErrorString(e)); exit(1); }
        calls += thread_cpu() - c;
      }
      CK(cudaDeviceSynchronize());
      wall.push_back(now() - a); call_cpu.push_back(calls); proc_cpu.push_back(process_cpu() - pc);
    }
    printf("cudaMemcpyBatchAsync a slot, runs (bump): %.2f GB/s of payload, calls %.4f CPU-s, process %.4f CPU-s per GiB of pages (median of %d, %d streams)\n",
           total * 8.0 / median(wall) / 1e9, median(call_cpu), median(proc_cpu), REPS, STREAMS);
    check(bump);
    slot_latency("one slot's runs", rd, rs, rz, slot_first);
  }

  // (4) one slot's batch of a copy an object alone.
  {
    std::vector<size_t> first(SLOTS + 1);
    for (int s = 0; s <= SLOTS; s++) first[s] = (size_t)s * SLOT;
    slot_latency("one slot's batch", dsts, srcs, sizes, first);
  }
  CK(cudaHostUnregister(arena));
  printf("done\n");
  return 0;
}
